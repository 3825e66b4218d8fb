"""stratbench bench-infer: inference latency (p50/p95/p99) and throughput per batch size for PyTorch eager
(fp32, bf16, fp16 where the device has them), torch.compile and onnxruntime (CPU, and CUDA when present).

Each (backend, batch size) case runs ``--warmup`` untimed iterations first (torch.compile compiles there),
then timed iterations until ``--iters`` are done or ``--max-seconds`` have passed (at least ``--min-iters``).
Each iteration is timed on its own with the device synchronised before and after, input already on the
device; throughput is samples / total timed seconds. A backend that cannot run here is a row that says why.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NAME = "bench-infer"
HELP = "inference latency p50/p95/p99 and throughput per batch size: eager fp32/bf16/fp16, torch.compile, onnxruntime"
ORDER = 63
BACKENDS = ("eager-fp32", "eager-bf16", "eager-fp16", "compile", "onnxruntime-cpu", "onnxruntime-cuda")
CSV_FIELDS = (
    "model", "image_size", "backend", "dtype", "device", "batch_size", "status", "iterations", "warmup",
    "warmup_s", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "throughput_samples_per_s", "threads", "reason",
)  # fmt: skip


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stratbench.checkpoints.checkpoint import add_trust_argument

    add_trust_argument(parser)
    from stratbench.models.zoo import MODELS

    src = parser.add_argument_group("model (a checkpoint, or a model with random weights)")
    src.add_argument("--checkpoint", help="checkpoint file or sharded folder of any method")
    src.add_argument(
        "--model",
        help=f"model with random weights when there is no checkpoint: {', '.join(MODELS)} or a builder "
        "'package.module:function' (found from the working directory)",
    )
    src.add_argument(
        "--image-size", type=int, default=224, help="input size without a checkpoint (default 224)"
    )
    src.add_argument(
        "--num-classes", type=int, default=1000, help="classes without a checkpoint (default 1000)"
    )
    src.add_argument("--width", type=int, default=16, help="tinynet width without a checkpoint")
    parser.add_argument(
        "--batch-sizes", type=_int_list, default=[1, 8, 32, 128], help="comma-separated (default 1,8,32,128)"
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS),
        help=f"comma-separated subset of {', '.join(BACKENDS)} (default: all; those that cannot run here say why)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per case (default 3)")
    parser.add_argument(
        "--iters", type=int, default=30, help="timed iterations per case at most (default 30)"
    )
    parser.add_argument(
        "--min-iters", type=int, default=5, help="timed iterations per case at least (default 5)"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="time budget per case once --min-iters are done"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch and onnxruntime (default: all cores)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="device (default: cuda when present)",
    )
    parser.add_argument("--output", help="CSV file for the results (one row per backend and batch size)")


@dataclass
class Row:
    model: str
    image_size: int
    backend: str
    dtype: str
    device: str
    batch_size: int | str
    status: str = "ok"
    iterations: int = 0
    warmup: int = 0
    warmup_s: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    throughput_samples_per_s: float | None = None
    threads: int | None = None
    reason: str = ""
    times: list[float] = field(default_factory=list, repr=False)


def measure(
    fn: Callable[[], Any],
    sync: Callable[[], None],
    warmup: int,
    iters: int,
    min_iters: int,
    max_seconds: float,
):
    """(warm-up seconds, per-iteration seconds): warm-up excluded, each iteration between two synchronisations."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync()
    warm = time.perf_counter() - t0
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iters and (len(times) < min_iters or time.perf_counter() - start < max_seconds):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return warm, times


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:240]}" if text else type(exc).__name__


def run(args: argparse.Namespace) -> int:
    from stratbench.checkpoints.checkpoint import trusted

    with trusted(args.trust_checkpoint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from stratbench.core.dist import resolve_device
    from stratbench.core.errors import ConfigError
    from stratbench.inference.predictor import build_from_meta, load_model, percentile

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend(s) {', '.join(unknown)}; choose from: {', '.join(BACKENDS)}")
    for name in ("warmup", "iters", "min_iters"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(
                f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else '>= 1'}, got {getattr(args, name)}"
            )
    if args.threads is not None and not 1 <= args.threads <= 4096:
        raise ConfigError(f"--threads must be between 1 and 4096, got {args.threads}")
    if not 0 < args.max_seconds < float("inf"):
        raise ConfigError(f"--max-seconds must be a positive number, got {args.max_seconds}")
    if not 8 <= args.image_size <= 4096:
        raise ConfigError(f"--image-size must be between 8 and 4096, got {args.image_size}")
    for flag, value in (("--num-classes", args.num_classes), ("--width", args.width)):
        if not 1 <= value <= 1_000_000:
            raise ConfigError(f"{flag} must be between 1 and 1000000, got {value}")
    if any(not 1 <= b <= 1_000_000 for b in args.batch_sizes):
        raise ConfigError(f"--batch-sizes must each be between 1 and 1000000, got {args.batch_sizes}")
    if args.output:
        out = Path(args.output)
        if out.is_dir():
            raise ConfigError(f"--output {out} is a folder; name the CSV file to write")
        parent = out.parent if str(out.parent) else Path(".")
        existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"--output {out}: {existing} is not writable")
    if args.checkpoint and args.model:
        raise ConfigError("give --checkpoint or --model, not both")
    if not args.checkpoint and not args.model:
        raise ConfigError("give --checkpoint CKPT, or --model NAME (random weights) with --image-size")
    if args.model:
        from stratbench.models.zoo import check_model

        check_model(args.model)  # a built-in name or a user's 'package.module:function'
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = resolve_device(args.device)
    if args.checkpoint:
        loaded = load_model(args.checkpoint, "cpu")
        model, meta = loaded.model, loaded.meta
        print(f"model: {loaded.describe()}", file=sys.stderr)
    else:
        meta = {
            "model": args.model,
            "num_classes": args.num_classes,
            "image_size": args.image_size,
            "width": args.width,
        }
        torch.manual_seed(0)
        model = build_from_meta(meta).eval()
    size = int(meta["image_size"])
    name = str(meta["model"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[Row] = []
    _print_header(name, size, device, threads)

    def case(backend: str, dtype: str, dev: str, make: Callable[[int], Callable[[], Any]]) -> None:
        for bs in args.batch_sizes:
            row = Row(name, size, backend, dtype, dev, bs, warmup=args.warmup, threads=threads)
            try:
                fn = make(bs)
                row.warmup_s, row.times = measure(
                    fn, sync, args.warmup, args.iters, args.min_iters, args.max_seconds
                )
            except torch.OutOfMemoryError as exc:
                row.status, row.reason = "oom", _first_line(exc)
            except Exception as exc:  # one failing backend must not stop the others
                row.status, row.reason = "failed", _first_line(exc)
            if row.times:
                ms = [t * 1e3 for t in row.times]
                row.iterations = len(ms)
                row.p50_ms, row.p95_ms, row.p99_ms = (percentile(ms, q) for q in (50, 95, 99))
                row.mean_ms = sum(ms) / len(ms)
                row.throughput_samples_per_s = bs * len(ms) / sum(row.times)
            rows.append(row)
            _print_row(row)
            if row.status == "failed" and backend == "compile":
                # Compilation failures do not depend on the batch size: say it once, skip the rest.
                for rest in args.batch_sizes[args.batch_sizes.index(bs) + 1 :]:
                    rows.append(
                        Row(
                            name,
                            size,
                            backend,
                            dtype,
                            dev,
                            rest,
                            status="skipped",
                            reason="torch.compile failed above",
                            threads=threads,
                        )
                    )
                return

    def skipped(backend: str, dtype: str, dev: str, reason: str) -> None:
        row = Row(name, size, backend, dtype, dev, "-", status="skipped", reason=reason, threads=threads)
        rows.append(row)
        _print_row(row)

    def eager(dtype: torch.dtype, compiled: bool = False) -> Callable[[int], Callable[[], Any]]:
        import copy

        m = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
        runner = torch.compile(m) if compiled else m

        def make(bs: int) -> Callable[[], Any]:
            x = torch.randn(bs, 3, size, size, device=device, dtype=dtype)

            def fn() -> Any:
                with torch.inference_mode():
                    return runner(x)

            return fn

        return make

    dev_name = str(device.type)
    for backend in backends:
        if backend == "eager-fp32":
            case(backend, "float32", dev_name, eager(torch.float32))
        elif backend in ("eager-bf16", "eager-fp16"):
            dtype = torch.bfloat16 if backend == "eager-bf16" else torch.float16
            reason = _low_precision_reason(dtype, device)
            if reason:
                skipped(backend, str(dtype).removeprefix("torch."), dev_name, reason)
            else:
                case(backend, str(dtype).removeprefix("torch."), dev_name, eager(dtype))
        elif backend == "compile":
            case(backend, "float32", dev_name, eager(torch.float32, compiled=True))
        else:
            ort_device = "cuda" if backend == "onnxruntime-cuda" else "cpu"
            reason = _ort_reason(ort_device, device)
            if reason:
                skipped(backend, "float32", ort_device, reason)
                continue
            with tempfile.TemporaryDirectory(prefix="stratbench-bench-") as tmp:
                from stratbench.inference.onnx_export import OrtModel, export_onnx

                try:
                    exported = export_onnx(model, meta, Path(tmp) / "model.onnx")
                    session = OrtModel(exported.path, device=ort_device, threads=args.threads)
                except Exception as exc:
                    skipped(backend, "float32", ort_device, f"ONNX export/session failed: {_first_line(exc)}")
                    continue

                def make_ort(bs: int, session=session) -> Callable[[], Any]:
                    import numpy as np

                    x = np.random.default_rng(0).standard_normal((bs, 3, size, size), dtype=np.float32)
                    return lambda: session.run(x)

                case(backend, "float32", ort_device, make_ort)
    _print_table(rows, name, size, device, threads)
    if args.output:
        import io

        from stratbench.checkpoints.checkpoint import atomic_write

        out = Path(args.output)
        with io.StringIO(newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for r in rows:
                d = asdict(r)
                writer.writerow(
                    {
                        k: ("" if d[k] is None else (f"{d[k]:.4f}" if isinstance(d[k], float) else d[k]))
                        for k in CSV_FIELDS
                    }
                )
            atomic_write(out, fh.getvalue())  # a stopped or failed run leaves an earlier CSV intact
        print(f"wrote {out}", file=sys.stderr)
    return 0 if any(r.status == "ok" for r in rows) else 1


def _low_precision_reason(dtype, device) -> str | None:
    """Why eager bf16/fp16 inference is not measured on ``device`` (None: it is)."""
    import torch

    if device.type == "cuda":
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(device)} has no bf16 support (needs Ampere or newer)"
        return None
    mkldnn = torch.ops.mkldnn
    if dtype is torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no native bf16 (needs AVX512-BF16 or AMX); emulated bf16 would only measure emulation"
    if dtype is torch.float16 and not mkldnn._is_mkldnn_fp16_supported():
        return "this CPU has no native fp16 (needs AVX512-FP16 or AMX-FP16); PyTorch's fp16 CPU kernels are slow fallbacks"
    return None


def _ort_reason(ort_device: str, device) -> str | None:
    import onnxruntime as ort

    if ort_device == "cuda":
        if device.type != "cuda":
            return "no CUDA GPU here"
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return f"onnxruntime has no CUDA provider (available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"
    return None


def _print_header(name: str, size: int, device, threads: int) -> None:
    import torch

    from stratbench.measuring.environment import cpu_name

    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {threads} threads"
    )
    print(f"bench-infer: {name} {size}x{size} on {device.type} ({where})", file=sys.stderr)


def _print_row(r: Row) -> None:
    if r.status == "ok":
        print(
            f"  {r.backend:<16} bs {r.batch_size:<4} p50 {r.p50_ms:9.2f} ms  {r.throughput_samples_per_s:9.1f} samples/s "
            f"({r.iterations} iters, warm-up {r.warmup_s:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"  {r.backend:<16} bs {r.batch_size:<4} {r.status}: {r.reason}", file=sys.stderr, flush=True)


def _print_table(rows: list[Row], name: str, size: int, device, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"inference: {name} {size}x{size}, {device.type}, {threads} threads (latency per batch)"
    )
    for col, justify in (
        ("backend", "left"), ("dtype", "left"), ("batch", "right"), ("p50 ms", "right"), ("p95 ms", "right"),
        ("p99 ms", "right"), ("samples/s", "right"), ("iters", "right"), ("note", "left"),
    ):  # fmt: skip
        table.add_column(col, justify=justify)

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else f"{x:{spec}}"

    for r in rows:
        table.add_row(
            r.backend, r.dtype, str(r.batch_size), f(r.p50_ms), f(r.p95_ms), f(r.p99_ms),
            f(r.throughput_samples_per_s, ".1f"), str(r.iterations or "-"),
            "" if r.status == "ok" else f"{r.status}: {r.reason}",
        )  # fmt: skip
    Console(width=200).print(table)
