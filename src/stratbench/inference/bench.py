"""Inference latency per backend and batch size: the measuring loop of `stratbench bench-infer`.

Each (backend, batch size) case runs ``warmup`` untimed iterations first (torch.compile compiles there), then
timed iterations until ``iters`` are done or ``max_seconds`` have passed (at least ``min_iters``). Each iteration
is timed on its own with the device synchronised before and after, input already on the device; throughput is
samples / total timed seconds. A backend that cannot run here is a row that says why.

A language model's input is ``batch`` sequences of ``seq_len`` random token ids, one forward over all of them (the
prefill of generation), and its rows add tokens / s; generating token by token with a KV cache is not measured.
"""

from __future__ import annotations

import copy
import csv
import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.inference.onnx_export import OrtModel, export_onnx, is_language
from stratbench.inference.predictor import build_from_meta, percentile

BACKENDS = ("eager-fp32", "eager-bf16", "eager-fp16", "compile", "onnxruntime-cpu", "onnxruntime-cuda")
CSV_FIELDS = (
    "model", "image_size", "backend", "dtype", "device", "batch_size", "status", "iterations", "warmup",
    "warmup_s", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "throughput_samples_per_s", "threads", "reason",
    "seq_len", "throughput_tokens_per_s",
)  # fmt: skip
LM_LIMIT = (
    "a language model's iteration is one forward over batch x seq-len tokens (the prefill); token-by-token "
    "generation with a KV cache is not measured"
)


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
    seq_len: int | None = None
    """A language model's tokens per sequence (None: an image model)."""
    throughput_tokens_per_s: float | None = None
    times: list[float] = field(default_factory=list, repr=False)

    def summarise(self) -> None:
        """Latency percentiles, mean and throughput from the timed iterations (none: left unset)."""
        if not self.times:
            return
        ms = [t * 1e3 for t in self.times]
        self.iterations = len(ms)
        self.p50_ms, self.p95_ms, self.p99_ms = (percentile(ms, q) for q in (50, 95, 99))
        self.mean_ms = sum(ms) / len(ms)
        self.throughput_samples_per_s = int(self.batch_size) * len(ms) / sum(self.times)
        if self.seq_len:
            self.throughput_tokens_per_s = self.throughput_samples_per_s * self.seq_len


@dataclass(frozen=True)
class BenchSettings:
    """How each case is measured."""

    batch_sizes: list[int]
    warmup: int = 3
    iters: int = 30
    min_iters: int = 5
    max_seconds: float = 20.0
    threads: int | None = None
    """onnxruntime's threads (None: its default); PyTorch's are set by the caller."""
    seq_len: int | None = None
    """A language model's tokens per sequence (the caller checks it against the model's context)."""


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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:240]}" if text else type(exc).__name__


def random_model(
    model: str, num_classes: int, image_size: int, width: int, seq_len: int | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """A model with random weights (seed 0) and the metadata a checkpoint would carry for it (``seq_len``: a
    language model's window, ``num_classes`` its vocabulary)."""
    meta = {"model": model, "num_classes": num_classes, "image_size": image_size, "width": width}
    if seq_len:
        meta |= {"image_size": 0, "seq_len": seq_len, "vocab_size": num_classes, "codec": None}
    torch.manual_seed(0)
    return build_from_meta(meta).eval(), meta


Maker = Callable[[int], Callable[[], Any]]
"""batch size -> one inference call on a batch of that size, input already on the device."""


class InferenceBench:
    """Measures one model under each backend; ``on_row`` sees each row as it is measured (progress)."""

    def __init__(self, model: nn.Module, meta: dict[str, Any], device: torch.device, settings: BenchSettings,
                 threads: int, on_row: Callable[[Row], None] = lambda row: None) -> None:  # fmt: skip
        self.model, self.device, self.settings, self.threads, self.on_row = (
            model,
            device,
            settings,
            threads,
            on_row,
        )
        self.size = int(meta["image_size"])
        self.name = str(meta["model"])
        self.meta = meta
        self.seq_len = settings.seq_len if is_language(meta) else None
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.rows: list[Row] = []

    def run(self, backends: list[str]) -> list[Row]:
        """Every row of every backend in ``backends``, in order."""
        for backend in backends:
            self.backend(backend)
        return self.rows

    def backend(self, backend: str) -> None:
        dev_name = str(self.device.type)
        if backend == "eager-fp32":
            self.case(backend, "float32", dev_name, self.eager(torch.float32))
        elif backend in ("eager-bf16", "eager-fp16"):
            dtype = torch.bfloat16 if backend == "eager-bf16" else torch.float16
            reason = low_precision_reason(dtype, self.device)
            if reason:
                self.skipped(backend, str(dtype).removeprefix("torch."), dev_name, reason)
            else:
                self.case(backend, str(dtype).removeprefix("torch."), dev_name, self.eager(dtype))
        elif backend == "compile":
            self.case(backend, "float32", dev_name, self.eager(torch.float32, compiled=True))
        else:
            self.onnxruntime(backend, "cuda" if backend == "onnxruntime-cuda" else "cpu")

    def case(self, backend: str, dtype: str, dev: str, make: Maker) -> None:
        """One row per batch size; a failed torch.compile is said once, the other batch sizes skipped."""
        s = self.settings
        for bs in s.batch_sizes:
            row = self.row(backend, dtype, dev, bs, warmup=s.warmup)
            try:
                fn = make(bs)
                row.warmup_s, row.times = measure(
                    fn, self.sync, s.warmup, s.iters, s.min_iters, s.max_seconds
                )
            except torch.OutOfMemoryError as exc:
                row.status, row.reason = "oom", first_line(exc)
            except Exception as exc:  # one failing backend must not stop the others
                row.status, row.reason = "failed", first_line(exc)
            row.summarise()
            self.rows.append(row)
            self.on_row(row)
            if row.status == "failed" and backend == "compile":
                # Compilation failures do not depend on the batch size: say it once, skip the rest.
                for rest in s.batch_sizes[s.batch_sizes.index(bs) + 1 :]:
                    self.rows.append(self.row(backend, dtype, dev, rest, status="skipped",
                                              reason="torch.compile failed above"))  # fmt: skip
                return

    def row(self, backend: str, dtype: str, dev: str, batch_size: int | str, **fields: Any) -> Row:
        """A row of this model (its input size or sequence length, the threads) for one case."""
        return Row(self.name, self.size, backend, dtype, dev, batch_size, threads=self.threads,
                   seq_len=self.seq_len, **fields)  # fmt: skip

    def skipped(self, backend: str, dtype: str, dev: str, reason: str) -> None:
        row = self.row(backend, dtype, dev, "-", status="skipped", reason=reason)
        self.rows.append(row)
        self.on_row(row)

    def sample(self, bs: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A random batch of ``bs`` inputs (seed 0): images in ``dtype``, or a language model's token ids."""
        g = torch.Generator().manual_seed(0)
        if self.seq_len:
            vocab = int(self.meta["num_classes"])
            return torch.randint(0, vocab, (bs, self.seq_len), generator=g).to(device)
        return torch.randn(bs, 3, self.size, self.size, generator=g).to(device=device, dtype=dtype)

    def eager(self, dtype: torch.dtype, compiled: bool = False) -> Maker:
        """PyTorch on the device in ``dtype`` (a copy of the model), through torch.compile with ``compiled``."""
        device = self.device
        m = copy.deepcopy(self.model).to(device=device, dtype=dtype).eval()
        runner = torch.compile(m) if compiled else m

        def make(bs: int) -> Callable[[], Any]:
            x = self.sample(bs, device, dtype)

            def fn() -> Any:
                with torch.inference_mode():
                    return runner(x)

            return fn

        return make

    def onnxruntime(self, backend: str, ort_device: str) -> None:
        """The model exported to ONNX in a temporary folder, run by onnxruntime on ``ort_device``."""
        reason = ort_reason(ort_device, self.device)
        if reason:
            self.skipped(backend, "float32", ort_device, reason)
            return
        with tempfile.TemporaryDirectory(prefix="stratbench-bench-") as tmp:
            try:
                exported = export_onnx(self.model, self.meta, Path(tmp) / "model.onnx")
                session = OrtModel(exported.path, device=ort_device, threads=self.settings.threads)
            except Exception as exc:
                self.skipped(backend, "float32", ort_device, f"ONNX export/session failed: {first_line(exc)}")
                return

            def make_ort(bs: int) -> Callable[[], Any]:
                x = self.sample(bs, torch.device("cpu"), torch.float32).numpy()
                return lambda: session.run(x)

            self.case(backend, "float32", ort_device, make_ort)


def low_precision_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why eager bf16/fp16 inference is not measured on ``device`` (None: it is)."""
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


def ort_reason(ort_device: str, device: torch.device) -> str | None:
    """Why onnxruntime is not measured on ``ort_device`` (None: it is)."""
    import onnxruntime as ort

    if ort_device == "cuda":
        if device.type != "cuda":
            return "no CUDA GPU here"
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return f"onnxruntime has no CUDA provider (available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"
    return None


def write_csv(rows: list[Row], out: Path) -> None:
    """One line per row (floats with 4 decimals, missing values empty), written atomically: a stopped or failed
    run leaves an earlier CSV intact."""
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
        atomic_write(out, fh.getvalue())
