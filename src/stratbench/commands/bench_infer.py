"""stratbench bench-infer: inference latency (p50/p90/p99) and throughput per batch size for PyTorch eager
(fp32, bf16, fp16 where the device has them), torch.compile, torchao int8 (weight-only, dynamic), onnxruntime
(fp32, fp16, int8 dynamic and static; its CUDA and TensorRT providers on a GPU) and torch-tensorrt (on a GPU,
where installed); a language model's batches are sequences of ``--seq-len`` tokens, and its throughput is also in
tokens/s. Each row also gives the cell's peak memory, the size of the file the backend loads, its start-up (a
compiled backend's compile included) and, for a checkpoint, its quality against eager fp32 on the checkpoint's
validation set (top-1 and its change, or perplexity and its change; argmax agreement, max |delta logit|).
It opens with the answer (stratbench.inference.bench_report): the fastest backend within --max-quality-loss, the
one with the most throughput, the smallest; --report writes it with the table and a latency-vs-quality chart.
How each case is timed: stratbench.inference.bench.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from stratbench.checkpoints.checkpoint import add_trust_argument, atomic_write, trusted
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, did_you_mean
from stratbench.core.tables import fmt_bytes
from stratbench.inference.bench import (
    BACKENDS,
    LM_LIMIT,
    BenchSettings,
    InferenceBench,
    QualityData,
    Row,
    quality_data,
    random_model,
    write_csv,
)
from stratbench.inference.bench_report import (
    DEFAULT_MAX_LOSS,
    Answer,
    answer,
    chart,
    check_max_loss,
    markdown,
    peak_memory,
)
from stratbench.inference.onnx_export import context_length, is_language
from stratbench.inference.predictor import load_model
from stratbench.inference.quality import IMAGE_BATCH, TOKEN_BATCH
from stratbench.measuring.environment import cpu_name
from stratbench.models.transformer import SIZES
from stratbench.models.zoo import MODELS, check_model, is_language_model

NAME = "bench-infer"
HELP = (
    "the fastest and smallest inference backend within a quality loss: latency p50/p90/p99, throughput, peak "
    "memory, size, start-up and quality vs eager fp32 per backend: eager fp32/bf16/fp16, torch.compile, torchao "
    "int8, onnxruntime fp32/fp16/int8 (CUDA, TensorRT), torch-tensorrt"
)
ORDER = 63
DEFAULT_CLASSES = 1000
DEFAULT_SEQ_LEN = 128
"""A language model's tokens per sequence with --model (random weights), capped at its context."""


def positive_ints(what: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated positive integers (``what`` names them in the error)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{what} must be positive integers, got {text!r}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
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
        "--num-classes", type=int, default=None,
        help=f"classes without a checkpoint (default {DEFAULT_CLASSES}; a language model: its vocabulary, default "
        "its size's own)",
    )  # fmt: skip
    src.add_argument(
        "--seq-len", type=int, default=None,
        help="a language model's tokens per sequence (default: the checkpoint's training window; with --model "
        f"{DEFAULT_SEQ_LEN}, or its context if shorter); at most the model's context",
    )  # fmt: skip
    src.add_argument("--width", type=int, default=16, help="tinynet width without a checkpoint")
    parser.add_argument(
        "--batch-sizes", type=positive_ints("batch sizes"), default=[1, 8, 32, 128], help="comma-separated (default 1,8,32,128)"
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
    parser.add_argument(
        "--quality-batches", type=int, default=8,
        help=f"validation batches of the checkpoint's data each backend is scored on against eager fp32 ({IMAGE_BATCH} "
        f"images or {TOKEN_BATCH} token windows each; default 8; 0: no quality columns)",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-batches", type=int, default=8,
        help="validation batches onnxruntime-int8-static calibrates its activation ranges on (default 8)",
    )  # fmt: skip
    parser.add_argument("--output", help="CSV file for the results (one row per backend and batch size)")
    parser.add_argument(
        "--max-quality-loss", type=float, default=None,
        help="the quality a pick may lose against eager fp32: points of top-1 accuracy for a classifier (default "
        f"{DEFAULT_MAX_LOSS[False]:g}), percent of perplexity for a language model (default {DEFAULT_MAX_LOSS[True]:g}); "
        "0 to 100",
    )  # fmt: skip
    parser.add_argument(
        "--report", help="Markdown report to write: the answer, the table, and beside it FILE's name with "
        "_latency_quality.png, the latency-vs-quality chart",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        backends = check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        threads = torch.get_num_threads()
        device = resolve_device(args.device)
        model, meta, seq_len, data = _model(args)
        what = _shape(meta, seq_len)
        _print_header(what, device, threads)
        settings = BenchSettings(
            args.batch_sizes, args.warmup, args.iters, args.min_iters, args.max_seconds, args.threads, seq_len
        )
        bench = InferenceBench(model, meta, device, settings, threads, on_row=_print_row, data=data)
        rows = bench.run(backends)
        language = seq_len is not None
        limit = DEFAULT_MAX_LOSS[language] if args.max_quality_loss is None else args.max_quality_loss
        ans = answer(rows, limit, language, data.reason)
        for label, text in ans.lines:
            print(f"{label}: {text}")
        _print_table(rows, what, device, threads)
        _print_quality_note(data, language)
        if seq_len:
            print(f"note: {LM_LIMIT}", file=sys.stderr)
        if args.output:
            write_csv(rows, Path(args.output))
            print(f"wrote {Path(args.output)}", file=sys.stderr)
        if args.report:
            _write_report(Path(args.report), rows, ans, language, _about(what, device, threads, args, data))
        return 0 if any(r.status == "ok" for r in rows) else 1


def _about(what: str, device, threads: int, args: argparse.Namespace, data: QualityData) -> list[str]:
    """The report's "How it was measured" lines: the model, the machine and threads, the timing, memory and
    quality rules."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    samples = sum(len(x) for x, _ in data.batches)
    return [
        f"{what}; `stratbench bench-infer {' '.join(sys.argv[2:])}`" if sys.argv[1:2] == [NAME] else what,
        f"{device.type} ({where}), {threads} threads for PyTorch and onnxruntime; torch {torch.__version__}",
        f"per cell {args.warmup} untimed warm-up iterations, then {args.min_iters}-{args.iters} timed ones (at most "
        f"{args.max_seconds:g} s); latency per batch, nearest-rank percentiles",
        "peak mem: per cell (preparation, warm-up, timed iterations), the process's RSS high-water mark reset at "
        "the cell's start (rss-hwm: includes the Python runtime, the fp32 model and what earlier backends left "
        "mapped), or on a GPU a PyTorch backend's allocator peak (cuda-alloc-peak); in brackets what the cell "
        "added over its start; the CSV's memory_kind says which",
        f"quality against eager fp32 on {samples} validation samples ({len(data.batches)} batches)"
        if data.batches else f"quality not measured ({data.reason})",
    ]  # fmt: skip


def _write_report(out: Path, rows: list[Row], ans: Answer, language: bool, about: list[str]) -> None:
    """The Markdown report and, beside it, its chart (where rows were scored)."""
    png = out.with_name(f"{out.stem}_latency_quality.png")
    drawn = chart(rows, ans, language, png)
    title = f"Inference: {about[0].split(';')[0]}"
    atomic_write(out, markdown(rows, ans, title, about, png.name if drawn else None))
    print(f"wrote {out}" + (f" and {png}" if drawn else ""), file=sys.stderr)


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, dict, int | None, QualityData]:
    """The model (a checkpoint's, or random weights), its meta, a language model's tokens per sequence (checked
    against its context: one line, before any measuring), and the validation batches quality is measured on."""
    if args.model:
        text = is_language_model(args.model)
        seq_len = (args.seq_len or min(DEFAULT_SEQ_LEN, SIZES[args.model].max_seq_len)) if text else None
        vocab = SIZES[args.model].vocab_size if text else DEFAULT_CLASSES
        model, meta = random_model(
            args.model, args.num_classes or vocab, args.image_size, args.width, seq_len
        )
        return (
            model,
            meta,
            seq_len,
            QualityData(reason=f"--model {args.model} has random weights and no data"),
        )
    loaded = load_model(args.checkpoint, "cpu")
    meta, seq_len = loaded.meta, None
    if not is_language(meta) and args.seq_len is not None:
        raise ConfigError(f"--seq-len is for language models; {meta['model']} classifies images")
    if is_language(meta):
        seq_len, context = args.seq_len or int(meta["seq_len"]), context_length(loaded.model, meta)
        if seq_len > context:
            raise ConfigError(
                f"--seq-len {seq_len} is longer than {meta['model']}'s context of {context} tokens; choose "
                f"--seq-len at most {context}"
            )
    print(f"model: {loaded.describe()}", file=sys.stderr)
    return loaded.model, meta, seq_len, quality_data(loaded, args.quality_batches, args.calibration_batches)


def _shape(meta: dict, seq_len: int | None) -> str:
    """``gpt-tiny, 64-token sequences`` or ``resnet18 224x224``: what one sample is."""
    size = int(meta["image_size"])
    return f"{meta['model']}, {seq_len}-token sequences" if seq_len else f"{meta['model']} {size}x{size}"


def check_args(args: argparse.Namespace) -> list[str]:
    """The backends to measure; every value checked first, one line for the first bad one."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(
            f"unknown backend(s) {', '.join(unknown)}{did_you_mean(unknown[0], BACKENDS)}; choose from: "
            f"{', '.join(BACKENDS)}"
        )
    for name in ("quality_batches", "calibration_batches"):
        if not 0 <= getattr(args, name) <= 100_000:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be between 0 and 100000, got {getattr(args, name)}"
            )
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
        if value is not None and not 1 <= value <= 1_000_000:
            raise ConfigError(f"{flag} must be between 1 and 1000000, got {value}")
    if any(not 1 <= b <= 1_000_000 for b in args.batch_sizes):
        raise ConfigError(f"--batch-sizes must each be between 1 and 1000000, got {args.batch_sizes}")
    check_max_loss(args.max_quality_loss)
    for out in (args.output, args.report):
        if out:
            check_output(Path(out))
    if args.checkpoint and args.model:
        raise ConfigError("give --checkpoint or --model, not both")
    if not args.checkpoint and not args.model:
        raise ConfigError("give --checkpoint CKPT, or --model NAME (random weights) with --image-size")
    if args.seq_len is not None and not 1 <= args.seq_len <= 1_000_000:
        raise ConfigError(f"--seq-len must be between 1 and 1000000, got {args.seq_len}")
    if args.model:
        check_model(args.model)  # a built-in name or a user's 'package.module:function'
        if args.seq_len is not None and not is_language_model(args.model):
            raise ConfigError(
                f"--seq-len is for language models ({', '.join(SIZES)}); {args.model} takes images"
            )
        if is_language_model(args.model):
            check_model(args.model, text=True, seq_len=args.seq_len)  # no longer than the model's context
    return backends


def check_output(out: Path) -> None:
    """A CSV file that can be written: not a folder, and its nearest existing folder writable."""
    if out.is_dir():
        raise ConfigError(f"--output {out} is a folder; name the CSV file to write")
    parent = out.parent if str(out.parent) else Path(".")
    existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {out}: {existing} is not writable")


def _print_header(what: str, device, threads: int) -> None:
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {threads} threads"
    )
    print(f"bench-infer: {what} on {device.type} ({where})", file=sys.stderr)


def _print_row(r: Row) -> None:
    if r.status == "ok":
        tokens = f" {r.throughput_tokens_per_s:10.0f} tokens/s" if r.throughput_tokens_per_s else ""
        print(
            f"  {r.backend:<24} bs {r.batch_size:<4} p50 {r.p50_ms:9.2f} ms  {r.throughput_samples_per_s:9.1f} samples/s"
            f"{tokens} ({r.iterations} iters, warm-up {r.warmup_s:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"  {r.backend:<24} bs {r.batch_size:<4} {r.status}: {r.reason}", file=sys.stderr, flush=True)


def _quality_columns(rows: list[Row]) -> list[tuple[str, Callable[[Row], str]]]:
    """The cost columns (size, start-up) and, where rows were scored, the quality ones: top-1 and its change or
    perplexity and its change, argmax agreement and max |delta logit| against eager fp32."""

    def f(spec: str, key: str, scale: float = 1.0) -> Callable[[Row], str]:
        return lambda r: "-" if getattr(r, key) is None else f"{getattr(r, key) * scale:{spec}}"

    cols = [
        ("peak mem (cell +)", peak_memory),
        ("size", lambda r: "-" if r.size_bytes is None else fmt_bytes(r.size_bytes)),
        ("start s", f(".2f", "startup_s")),
    ]
    if any(r.top1 is not None for r in rows):
        cols += [("top-1 %", f(".2f", "top1", 100)), ("Δ pts", f("+.2f", "top1_delta_pts"))]
    if any(r.perplexity is not None for r in rows):
        cols += [("ppl", f(".3f", "perplexity")), ("Δ %", f("+.2f", "perplexity_delta_pct"))]
    if any(r.quality_samples for r in rows):
        cols += [
            ("agree %", f(".2f", "argmax_agreement", 100)),
            ("max |Δlogit|", f(".3g", "max_abs_delta_logit")),
        ]
    return cols


def _print_table(rows: list[Row], what: str, device, threads: int) -> None:
    table = Table(title=f"inference: {what}, {device.type}, {threads} threads (latency per batch)")
    tokens = any(r.seq_len for r in rows)
    extra = _quality_columns(rows)
    for col, justify in (
        ("backend", "left"), ("dtype", "left"), ("batch", "right"), ("p50 ms", "right"), ("p90 ms", "right"),
        ("p99 ms", "right"), ("samples/s", "right"), *([("tokens/s", "right")] if tokens else []),
        ("iters", "right"), *[(name, "right") for name, _ in extra], ("note", "left"),
    ):  # fmt: skip
        table.add_column(col, justify=justify)

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else f"{x:{spec}}"

    for r in rows:
        table.add_row(
            r.backend, r.dtype, str(r.batch_size), f(r.p50_ms), f(r.p90_ms), f(r.p99_ms),
            f(r.throughput_samples_per_s, ".1f"), *([f(r.throughput_tokens_per_s, ".0f")] if tokens else []),
            str(r.iterations or "-"), *[cell(r) for _, cell in extra],
            "" if r.status == "ok" else f"{r.status}: {r.reason}",
        )  # fmt: skip
    Console(width=240).print(table)


def _print_quality_note(data: QualityData, language: bool) -> None:
    """What the quality columns were measured on, or why there are none."""
    if not data.batches:
        print(f"note: quality not measured ({data.reason})", file=sys.stderr)
        return
    samples = sum(len(x) for x, _ in data.batches)
    unit = "token windows" if language else "samples"
    print(f"note: quality against eager fp32 on the first {samples} validation {unit} ({len(data.batches)} batches); "
          f"int8-static calibrated on the first {len(data.calibration)} batches", file=sys.stderr)  # fmt: skip
