"""Inference latency per backend and batch size: the measuring loop of `stratbench bench-infer`.

Each (backend, batch size) case runs ``warmup`` untimed iterations first (torch.compile compiles there), then
timed iterations until ``iters`` are done or ``max_seconds`` have passed (at least ``min_iters``). Each iteration
is timed on its own with the device synchronised before and after, input already on the device; throughput is
samples / total timed seconds. A backend that cannot run here is a row that says why.

A language model's input is ``batch`` sequences of ``seq_len`` random token ids, one forward over all of them (the
prefill of generation), and its rows add tokens / s; generating token by token with a KV cache is
``stratbench bench-generate``'s (``inference.generation_bench``).

Besides the time, each backend's rows say what it costs: the size of the file it loads, its start-up (export,
quantisation, session), and, given the checkpoint's validation batches, its quality against eager fp32
(``inference.quality``: top-1 and its change, or perplexity and its change, argmax agreement, max |delta logit|).
The quantised rows are onnxruntime's int8-dynamic / int8-static / fp16 rewrites of the fp32 export and torchao's
int8 weight-only and dynamic configs (``inference.quantize``).
"""

from __future__ import annotations

import copy
import csv
import gc
import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.core.errors import StratbenchError
from stratbench.inference.onnx_export import OrtModel, export_onnx, is_language
from stratbench.inference.predictor import LoadedModel, build_from_meta, percentile
from stratbench.inference.quality import Quality, Reference, validation_batches
from stratbench.inference.quantize import missing_tool, quantize_onnx, torchao_int8, torchao_reason
from stratbench.measuring.memory import cpu_peak_rss_bytes, current_memory_bytes, reset_cpu_peak_rss

BACKENDS = (
    "eager-fp32", "eager-bf16", "eager-fp16", "compile", "torchao-int8-weight", "torchao-int8-dynamic",
    "onnxruntime-cpu", "onnxruntime-fp16", "onnxruntime-int8-dynamic", "onnxruntime-int8-static", "onnxruntime-cuda",
    "onnxruntime-tensorrt", "torch-tensorrt",
)  # fmt: skip
GPU_ONLY = {"onnxruntime-cuda": "cuda", "onnxruntime-tensorrt": "tensorrt", "torch-tensorrt": "tensorrt"}
"""The backends that run on a CUDA GPU only; for an onnxruntime one, the value is the device ``OrtModel`` takes."""
CSV_FIELDS = (
    "model", "image_size", "backend", "dtype", "device", "batch_size", "status", "iterations", "warmup",
    "warmup_s", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "throughput_samples_per_s", "threads", "reason",
    "seq_len", "throughput_tokens_per_s", "size_bytes", "startup_s", "quality_samples", "top1", "top1_delta_pts",
    "perplexity", "perplexity_delta_pct", "argmax_agreement", "max_abs_delta_logit", "p90_ms", "peak_memory_bytes",
    "memory_kind", "memory_start_bytes",
)  # fmt: skip
LM_LIMIT = (
    "a language model's iteration is one forward over batch x seq-len tokens (the prefill); token-by-token "
    "generation with a KV cache is bench-generate's"
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
    size_bytes: int | None = None
    """The file the backend loads: the ONNX file, or a PyTorch backend's ``torch.save``'d state dict."""
    startup_s: float | None = None
    """From the model in memory to a backend ready to run; a compiled one (torch.compile, torch-tensorrt) includes
    its first call, which compiles, at the first batch size (other batch sizes recompile in their warm-up)."""
    quality_samples: int | None = None
    """Validation samples (a language model: windows) the quality columns below were measured on."""
    top1: float | None = None
    top1_delta_pts: float | None = None
    perplexity: float | None = None
    perplexity_delta_pct: float | None = None
    argmax_agreement: float | None = None
    max_abs_delta_logit: float | None = None
    p90_ms: float | None = None
    peak_memory_bytes: int | None = None
    """The cell's peak memory (``CellMemory``): what ``memory_kind`` names."""
    memory_kind: str = ""
    memory_start_bytes: int | None = None
    """The same measure at the cell's start: the cell itself added ``peak_memory_bytes`` minus this."""
    times: list[float] = field(default_factory=list, repr=False)

    def summarise(self) -> None:
        """Latency percentiles, mean and throughput from the timed iterations (none: left unset)."""
        if not self.times:
            return
        ms = [t * 1e3 for t in self.times]
        self.iterations = len(ms)
        self.p50_ms, self.p90_ms, self.p95_ms, self.p99_ms = (percentile(ms, q) for q in (50, 90, 95, 99))
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


class CellMemory:
    """The peak memory of one cell (its batch's preparation, warm-up and timed iterations), isolated per cell:
    a PyTorch backend on a CUDA GPU gives the caching allocator's peak (``cuda-alloc-peak``, reset at the cell's
    start); every other row this process's resident-set high-water mark (``rss-hwm``: VmHWM, reset to the
    current RSS at the cell's start by writing 5 to /proc/self/clear_refs), which also holds the Python runtime,
    the fp32 model and the reference logits, and for onnxruntime on a GPU the host side only. Garbage is
    collected first, so an earlier backend's freed objects do not count; the RSS or allocated bytes at the
    start are kept too, so that what the cell itself added is the difference (the RSS of a long run grows with
    what earlier backends left mapped: compiled code, onnxruntime's arenas). Where the mark cannot be reset the
    peak is left empty rather than given for the whole process."""

    def __init__(self, cuda_alloc: bool) -> None:
        gc.collect()
        self.kind = "cuda-alloc-peak" if cuda_alloc else "rss-hwm"
        if cuda_alloc:
            torch.cuda.reset_peak_memory_stats()
            self.ok = True
        else:
            self.ok = reset_cpu_peak_rss()
        device = torch.device("cuda" if cuda_alloc else "cpu")
        self.start = current_memory_bytes(device) if self.ok else None

    def fields(self) -> dict[str, Any]:
        """The row's memory fields: the peak since the start, its kind and the start; none where the peak could not
        be isolated."""
        if not self.ok:
            return {}
        peak = torch.cuda.max_memory_allocated() if self.kind == "cuda-alloc-peak" else cpu_peak_rss_bytes()
        return {"peak_memory_bytes": peak, "memory_kind": self.kind, "memory_start_bytes": self.start}


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


@dataclass
class Runner:
    """One backend ready to run: ``prepare`` turns a CPU batch into its input (on its device, in its dtype, or a
    numpy array), ``call`` runs it; the bytes of the file it loads (the ONNX file, or its ``torch.save``'d state
    dict) and the seconds it took to get ready (copy and cast; torchao's quantisation; ONNX export, quantisation
    and session)."""

    dtype: str
    device: str
    prepare: Callable[[torch.Tensor], Any]
    call: Callable[[Any], Any]
    size_bytes: int | None = None
    startup_s: float | None = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.call(self.prepare(x))
        return (torch.from_numpy(out) if isinstance(out, np.ndarray) else out).float().cpu()


def state_bytes(model: nn.Module) -> int:
    """The size of ``torch.save(model.state_dict())``: a PyTorch backend's file (torchao's int8 tensors too)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


@dataclass
class QualityData:
    """The validation batches bench-infer scores each backend on, the input batches int8-static calibrates on,
    and why either is empty."""

    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    calibration: list[np.ndarray] = field(default_factory=list)
    reason: str = ""


def quality_data(loaded: LoadedModel, quality_batches: int, calibration_batches: int) -> QualityData:
    """The checkpoint's validation batches: the first ``quality_batches`` to score on, the first
    ``calibration_batches``' inputs to calibrate on; where its data cannot be built here, none and why."""
    try:
        batches = validation_batches(loaded, max(quality_batches, calibration_batches))
    except StratbenchError as exc:
        return QualityData(reason=f"validation data unavailable: {exc}")
    calibration = [x.numpy() for x, _ in batches[:calibration_batches]]
    zero = [f"--{name} 0" for name, n in (("quality-batches", quality_batches),
                                           ("calibration-batches", calibration_batches)) if not n]  # fmt: skip
    return QualityData(batches[:quality_batches], calibration, ", ".join(zero))


ONNX_MODES = {"onnxruntime-int8-dynamic": "int8-dynamic", "onnxruntime-int8-static": "int8-static",
              "onnxruntime-fp16": "fp16"}  # fmt: skip
TORCHAO = {"torchao-int8-weight": "int8-weight", "torchao-int8-dynamic": "int8-dynamic"}
ORT_GPU = {"onnxruntime-cuda": "CUDAExecutionProvider", "onnxruntime-tensorrt": "TensorrtExecutionProvider"}
EAGER = {"eager-fp32": torch.float32, "eager-bf16": torch.bfloat16, "eager-fp16": torch.float16,
         "compile": torch.float32}  # fmt: skip
"""PyTorch's backends by the dtype they run in."""


class InferenceBench:
    """Measures one model under each backend; ``on_row`` sees each row as it is measured (progress). With
    validation batches (``data``) each backend is also scored against eager fp32 (``inference.quality``)."""

    def __init__(self, model: nn.Module, meta: dict[str, Any], device: torch.device, settings: BenchSettings,
                 threads: int, on_row: Callable[[Row], None] = lambda row: None,
                 data: QualityData | None = None) -> None:  # fmt: skip
        self.model, self.device, self.settings = model, device, settings
        self.threads, self.on_row = threads, on_row
        self.size = int(meta["image_size"])
        self.name = str(meta["model"])
        self.meta = meta
        self.seq_len = settings.seq_len if is_language(meta) else None
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.rows: list[Row] = []
        self.data = data or QualityData(reason="no validation data")
        self.reference = Reference(model, self.data.batches, is_language(meta)) if self.data.batches else None
        self.tmp: Path | None = None
        self._fp32_onnx: tuple[Path, float] | None = None

    def run(self, backends: list[str]) -> list[Row]:
        """Every row of every backend in ``backends``, in order (ONNX files in a temporary folder)."""
        with tempfile.TemporaryDirectory(prefix="stratbench-bench-") as tmp:
            self.tmp = Path(tmp)
            for backend in backends:
                self.backend(backend)
        return self.rows

    def backend(self, backend: str) -> None:
        """The backend's rows: skipped (one line why), or its runner scored and timed at each batch size."""
        dtype, dev = backend_dtype(backend), backend_device(backend, self.device)
        reason = self.reason(backend)
        if reason:
            self.skipped(backend, dtype, dev, reason)
            return
        try:
            runner = self.runner(backend)
        except Exception as exc:  # an export or quantiser failure is this backend's row, not the run's end
            what = "ONNX export/session" if backend.startswith("onnxruntime") else "set-up"
            self.skipped(backend, dtype, dev, f"{what} failed: {first_line(exc)}")
            return
        extra: dict[str, Any] = {"size_bytes": runner.size_bytes, "startup_s": runner.startup_s}
        if self.reference is not None:
            try:
                extra |= quality_fields(self.reference.score(runner.logits))
            except Exception as exc:  # a backend that cannot take real inputs fails like one that cannot run
                for bs in self.settings.batch_sizes:
                    self.add(
                        self.row(
                            backend, dtype, dev, bs, status="failed", reason=f"quality: {first_line(exc)}"
                        )
                    )
                return
        self.case(backend, runner, extra)

    def reason(self, backend: str) -> str | None:
        """Why ``backend`` cannot run here (None: it can)."""
        if backend in ("eager-bf16", "eager-fp16"):
            return low_precision_reason(EAGER[backend], self.device)
        if backend in GPU_ONLY and self.device.type != "cuda":
            return "needs a CUDA GPU"
        if backend == "torch-tensorrt":
            return tensorrt_reason()
        if backend.startswith("onnxruntime"):
            reason = ort_reason(backend)
            if reason or backend not in ONNX_MODES:
                return reason
            if ONNX_MODES[backend] == "int8-static" and not self.data.calibration:
                return (
                    f"int8-static calibrates on validation batches, and there are none ({self.data.reason})"
                )
            return missing_tool(ONNX_MODES[backend])
        if backend in TORCHAO:
            return torchao_reason()  # measured on the CPU whatever the device (backend_device)
        return None

    def runner(self, backend: str) -> Runner:
        if backend in EAGER:
            return self.eager(EAGER[backend], compiler="inductor" if backend == "compile" else None)
        if backend == "torch-tensorrt":
            return self.eager(torch.float32, compiler="torch_tensorrt", label="float16")
        if backend in TORCHAO:
            t0 = time.perf_counter()
            m = torchao_int8(self.model, TORCHAO[backend])
            return torch_runner(m, torch.device("cpu"), torch.float32, time.perf_counter() - t0, "int8")
        return self.onnxruntime(backend)

    def case(self, backend: str, runner: Runner, extra: dict[str, Any]) -> None:
        """One row per batch size; a failed torch.compile is said once, the other batch sizes skipped."""
        s = self.settings
        for bs in s.batch_sizes:
            row = self.row(backend, runner.dtype, runner.device, bs, warmup=s.warmup, **extra)
            memory = CellMemory(runner.device == "cuda" and backend not in ORT_GPU)
            try:
                x = runner.prepare(self.sample(bs))
                row.warmup_s, row.times = measure(
                    lambda x=x: runner.call(x), self.sync, s.warmup, s.iters, s.min_iters, s.max_seconds
                )
                for key, value in memory.fields().items():
                    setattr(row, key, value)
            except torch.OutOfMemoryError as exc:
                row.status, row.reason = "oom", first_line(exc)
            except Exception as exc:  # one failing backend must not stop the others
                row.status, row.reason = "failed", first_line(exc)
            row.summarise()
            self.add(row)
            if row.status == "failed" and backend == "compile":
                # Compilation failures do not depend on the batch size: say it once, skip the rest.
                for rest in s.batch_sizes[s.batch_sizes.index(bs) + 1 :]:
                    self.rows.append(self.row(backend, runner.dtype, runner.device, rest, status="skipped",
                                              reason="torch.compile failed above"))  # fmt: skip
                return

    def row(self, backend: str, dtype: str, dev: str, batch_size: int | str, **fields: Any) -> Row:
        """A row of this model (its input size or sequence length, the threads) for one case."""
        return Row(self.name, self.size, backend, dtype, dev, batch_size, threads=self.threads,
                   seq_len=self.seq_len, **fields)  # fmt: skip

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.on_row(row)

    def skipped(self, backend: str, dtype: str, dev: str, reason: str) -> None:
        self.add(self.row(backend, dtype, dev, "-", status="skipped", reason=reason))

    def sample(self, bs: int) -> torch.Tensor:
        """A random CPU batch of ``bs`` inputs (seed 0): float32 images, or a language model's token ids."""
        g = torch.Generator().manual_seed(0)
        if self.seq_len:
            return torch.randint(0, int(self.meta["num_classes"]), (bs, self.seq_len), generator=g)
        return torch.randn(bs, 3, self.size, self.size, generator=g)

    def eager(self, dtype: torch.dtype, compiler: str | None = None, label: str | None = None) -> Runner:
        """PyTorch on the device in ``dtype`` (a copy of the model), through torch.compile's ``compiler`` backend
        where given (inductor, or torch-tensorrt's with fp16 kernels allowed), whose first call - the compile, at
        the first batch size - counts in the start-up."""
        t0 = time.perf_counter()
        m = copy.deepcopy(self.model).to(device=self.device, dtype=dtype).eval()
        runner = torch_runner(m, self.device, dtype, 0.0, label)
        if compiler:
            trt = compiler == "torch_tensorrt"
            options = {"enabled_precisions": {torch.float32, torch.float16}} if trt else None
            compiled_model = torch.compile(m, backend=compiler, options=options)
            runner.call = lambda x: _no_grad(compiled_model, x)
            runner.call(runner.prepare(self.sample(self.settings.batch_sizes[0])))
            self.sync()
        runner.startup_s = time.perf_counter() - t0
        return runner

    def onnxruntime(self, backend: str) -> Runner:
        """The model exported to ONNX (once; fp32) and, for a quantised backend, rewritten by onnxruntime's
        quantiser (``inference.quantize``), run by onnxruntime; start-up is export + rewrite + session."""
        assert self.tmp is not None
        if self._fp32_onnx is None:
            t0 = time.perf_counter()
            exported = export_onnx(self.model, self.meta, self.tmp / "model.onnx")
            self._fp32_onnx = exported.path, time.perf_counter() - t0
        path, seconds = self._fp32_onnx
        t0 = time.perf_counter()
        mode = ONNX_MODES.get(backend)
        if mode:
            path = quantize_onnx(path, self.tmp / f"model-{mode}.onnx", mode, self.data.calibration).path
        session = OrtModel(path, device=GPU_ONLY.get(backend, "cpu"), threads=self.settings.threads)
        startup = seconds + time.perf_counter() - t0
        return Runner(backend_dtype(backend), backend_device(backend, self.device), lambda x: x.numpy(), session.run,
                      path.stat().st_size, startup)  # fmt: skip


def _no_grad(model: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
    with torch.inference_mode():
        return model(x)


def torch_runner(model: nn.Module, device: torch.device, dtype: torch.dtype, startup: float,
                 label: str | None = None) -> Runner:  # fmt: skip
    """A PyTorch model as a runner: images cast to ``dtype`` (token ids stay integers), on ``device``."""

    def prepare(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)

    name = label or str(dtype).removeprefix("torch.")
    return Runner(name, device.type, prepare, lambda x: _no_grad(model, x), state_bytes(model), startup)


def backend_dtype(backend: str) -> str:
    """The dtype a backend's row names: its weights' (int8 for the quantised ones; float16 for TensorRT's, which
    is allowed fp16 kernels and picks fp16 or fp32 per layer)."""
    if backend in ("eager-bf16", "eager-fp16", "onnxruntime-fp16", "onnxruntime-tensorrt", "torch-tensorrt"):
        return "bfloat16" if backend == "eager-bf16" else "float16"
    return "int8" if "int8" in backend else "float32"


def backend_device(backend: str, device: torch.device) -> str:
    """Where a backend runs: onnxruntime and torchao rows on the CPU (the GPU_ONLY ones on CUDA), PyTorch's on
    ``device``."""
    if backend in GPU_ONLY:
        return "cuda"
    return "cpu" if backend.startswith(("onnxruntime", "torchao")) else device.type


def quality_fields(q: Quality) -> dict[str, Any]:
    """A row's quality columns from ``q``."""
    return {k: v for k, v in asdict(q).items() if k != "samples"} | {"quality_samples": q.samples}


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


def ort_reason(backend: str) -> str | None:
    """Why an onnxruntime backend on a GPU is not measured where there is one (None: it is, or it runs on the
    CPU): the execution provider it needs is missing."""
    import onnxruntime as ort

    provider = ORT_GPU.get(backend)
    available = ort.get_available_providers()
    if provider and provider not in available:
        return (f"onnxruntime has no {provider} (available: {', '.join(available)}); install onnxruntime-gpu"
                + (" and TensorRT" if "Tensorrt" in provider else ""))  # fmt: skip
    return None


def tensorrt_reason() -> str | None:
    """Why torch-tensorrt is not measured on a CUDA GPU (None: it is): it is not installed (not a stratbench
    dependency: its wheels are built for one torch and CUDA version)."""
    try:
        import torch_tensorrt  # noqa: F401  (registers torch.compile's "torch_tensorrt" backend)
    except Exception as exc:  # ImportError, or a build for another torch failing to load
        return f"torch-tensorrt cannot be imported ({first_line(exc)}); pip install the torch-tensorrt built for torch {torch.__version__}"
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
