"""Honest measurement: synchronised step timers, per-phase memory peaks (CUDA allocator, NVML, CPU RSS),
an NVML utilisation sampler, FLOPs per sample and MFU, and the environment written into every result."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.core.precision import cpu_native_16bit

# Dense peak FLOP/s per device (no sparsity) come from the hardware profiles (src/stratbench/predicting/hardware.yaml: one
# source of truth with the projection, every figure cited there). Each GPU entry's regular expression is searched
# in torch.cuda.get_device_name(), so that "NVIDIA L40" does not take the L4's figures, "RTX A1000" not the
# A100's, nor an NVL part the SXM's. MFU is reported only for the GPUs listed there.


def peak_flops_for_name(name: str, key: str) -> float | None:
    """The table's dense peak for a device name and a compute key (fp32, tf32, bf16, fp16); None if unknown."""
    from stratbench.predicting.hardware import peak_flops_for_name as lookup

    return lookup(name, key)


def __getattr__(name: str) -> Any:
    if name == "PEAK_FLOPS":  # (pattern, {precision: FLOP/s}) per GPU, read from the hardware profiles
        from stratbench.predicting.hardware import builtin

        return [(g.match, dict(g.peak_flops)) for g in builtin().gpus.values() if g.kind == "cuda"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """Peak dense FLOP/s of this device for the precision's compute dtype; None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    key = (
        "fp64"
        if precision == "fp64"
        else "bf16"
        if "bf16" in precision
        else "fp16"
        if "fp16" in precision
        else ("tf32" if tf32 else "fp32")
    )
    return peak_flops_for_name(torch.cuda.get_device_name(device), key)


def flop_counter():
    """The FLOP counter of every count stratbench makes (``torch.utils.flop_counter``, silent): the whole
    model's here (``flops_per_sample``: MFU) and each pipeline piece's (``pipeline_split.piece_costs``: the
    ``--balance flops`` split), so that the pieces' FLOPs add up to the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def flops_per_sample(
    build: Callable[[], nn.Module], sample_shape: tuple[int, ...], num_classes: int
) -> float | None:
    """Forward+backward FLOPs of one sample, counted by ``flop_counter`` on the meta device (nothing is
    allocated, so this works for any model size)."""
    try:
        with torch.device("meta"):
            model = build()
            x = torch.empty(2, *sample_shape)
            y = torch.zeros(2, dtype=torch.long)
        counter = flop_counter()
        with counter:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        return counter.get_total_flops() / 2
    except Exception:  # a user model the meta device cannot trace: no MFU rather than a wrong one
        return None


class StepTimer:
    """Per-step wall time read after ``sync()``; the first ``warmup`` steps are excluded from statistics."""

    def __init__(self, sync: Callable[[], None], warmup: int) -> None:
        self.sync = sync
        self.warmup = warmup
        self.times: list[float] = []
        self.seen = 0
        self._t0 = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self.sync()
        dt = time.perf_counter() - self._t0
        self.seen += 1
        if self.seen > self.warmup:
            self.times.append(dt)
        return dt

    def summary(self) -> dict[str, float | None]:
        t = self.times
        if not t:
            return {
                "step_time_mean_s": None,
                "step_time_median_s": None,
                "step_time_p90_s": None,
                "measured_steps": 0,
            }
        q = statistics.quantiles(t, n=10)[-1] if len(t) >= 2 else t[0]
        return {
            "step_time_mean_s": statistics.fmean(t),
            "step_time_median_s": statistics.median(t),
            "step_time_p90_s": q,
            "measured_steps": len(t),
        }


def _read_status_kb(key: str) -> int | None:
    with suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def reset_cpu_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def current_memory_bytes(device: torch.device) -> int | None:
    """Memory in use now: allocated by the CUDA caching allocator, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    kb = _read_status_kb("VmRSS")
    return kb * 1024 if kb is not None else None


def cpu_peak_rss_bytes() -> int:
    kb = _read_status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


class _Nvml:
    """Thin wrapper over nvidia-ml-py; ``available`` is False where there is no NVIDIA driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.available = True
        except Exception:
            self.nvml = None

    def handle(self, device: torch.device):
        # NVML numbers GPUs physically; map through CUDA_VISIBLE_DEVICES when it is set.
        index = device.index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            parts = [p.strip() for p in visible.split(",") if p.strip()]
            if index < len(parts) and parts[index].isdigit():
                index = int(parts[index])
            elif index < len(parts):
                return self.nvml.nvmlDeviceGetHandleByUUID(parts[index])
        return self.nvml.nvmlDeviceGetHandleByIndex(index)


_NVML: _Nvml | None = None


def nvml() -> _Nvml:
    global _NVML
    if _NVML is None:
        _NVML = _Nvml()
    return _NVML


class UtilisationSampler:
    """Background thread sampling NVML GPU utilisation and used memory every ``interval`` seconds."""

    def __init__(self, devices: list[torch.device], interval: float = 0.1) -> None:
        self.devices = [d for d in devices if d.type == "cuda"]
        self.interval = interval
        self.nv = nvml() if self.devices else None
        self.util: list[list[int]] = [[] for _ in self.devices]
        self.used_peak: list[int] = [0 for _ in self.devices]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return bool(self.nv and self.nv.available and self.devices)

    def start(self) -> None:
        if not self.active:
            return
        self.handles = [self.nv.handle(d) for d in self.devices]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="nvml-sampler")
        self._thread.start()

    def _run(self) -> None:
        nv = self.nv.nvml
        while not self._stop.is_set():
            for i, h in enumerate(self.handles):
                with suppress(Exception):
                    self.util[i].append(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                    self.used_peak[i] = max(self.used_peak[i], nv.nvmlDeviceGetMemoryInfo(h).used)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None

    def latest(self) -> float | None:
        """The most recent utilisation sample of the first device (for per-step logs); None without NVML."""
        return self.util[0][-1] if self.active and self.util and self.util[0] else None

    def summary(self) -> dict[str, list[float | None]]:
        if not self.active:
            return {"gpu_util_mean_pct": [], "gpu_util_peak_pct": [], "nvml_used_peak_bytes": []}
        return {
            "gpu_util_mean_pct": [statistics.fmean(u) if u else None for u in self.util],
            "gpu_util_peak_pct": [max(u) if u else None for u in self.util],
            "nvml_used_peak_bytes": list(self.used_peak),
        }


@dataclass
class MemoryPhase:
    """Peak memory of one phase (training, evaluation) on each reported device; reset at phase start."""

    devices: list[torch.device]
    peak_allocated: list[int] = field(default_factory=list)
    peak_reserved: list[int] = field(default_factory=list)
    cpu_peak_rss: int = 0
    cpu_reset_ok: bool = False

    def start(self) -> None:
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        self.cpu_reset_ok = reset_cpu_peak_rss()

    def stop(self) -> None:
        self.peak_allocated = [torch.cuda.max_memory_allocated(d) for d in self.devices if d.type == "cuda"]
        self.peak_reserved = [torch.cuda.max_memory_reserved(d) for d in self.devices if d.type == "cuda"]
        self.cpu_peak_rss = cpu_peak_rss_bytes()

    def peak_bytes(self) -> list[int]:
        """The headline figure: allocator peak on GPUs, process peak RSS on CPU."""
        return self.peak_allocated if self.peak_allocated else [self.cpu_peak_rss]


def environment(world_size: int, device: torch.device) -> dict[str, Any]:
    """Versions, hardware and world size, written into every result."""
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        # Which kernels ran: the CPU's vector ISA as torch sees it, and any cap the user put on oneDNN / MKL.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {
            k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if k in os.environ
        },
        # Whether bf16/fp16 ran in oneDNN on this CPU: the memory estimate of a re-rendered report depends on it.
        "cpu_native_16bit": {"bf16": cpu_native_16bit(torch.bfloat16), "fp16": cpu_native_16bit(torch.float16)},
        "world_size": world_size,
        "device_type": device.type,
        "packages": {
            p: version(p) for p in ("torchvision", "accelerate", "deepspeed", "onnx", "onnxruntime", "numpy")
        },
    }
    if device.type == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_memory_bytes"] = [
            torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
        ]
        with suppress(Exception):
            env["nvidia_driver"] = nvml().nvml.nvmlSystemGetDriverVersion() if nvml().available else None
    return env


def _cpu_name() -> str:
    with suppress(OSError), Path("/proc/cpuinfo").open() as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


class RunMetrics:
    """The loop's one measurement object. The loop feeds it once per step (``step_start``/``step_end``) and per
    phase (``train_phase``, ``eval_phase``); it keeps the per-rank numbers, streams per-step rows to the sinks,
    and ``summary`` aggregates over ranks at the end (the only collectives it makes)."""

    def __init__(self, strategy: Any, cfg: Any, sinks: list[Any]) -> None:
        self.strategy = strategy
        self.cfg = cfg
        self.sinks = sinks
        self.devices = strategy.memory_devices()
        self.timer = StepTimer(strategy.synchronize, cfg.timing_warmup_steps)
        self.util = UtilisationSampler(self.devices)
        self.losses: list[float] = []
        self.epoch_times: list[float] = []
        self.train_peaks: list[list[int]] = []
        self.reserved_peaks: list[list[int]] = []
        self.eval_peaks: list[list[int]] = []
        self.evaluations: list[dict[str, float]] = []
        self.state_bytes: dict[str, int] | None = None
        self._epoch_time = 0.0
        self.comm = CommWindow(strategy.env.world_size) if getattr(cfg, "comm_volume", False) else None
        self.trace = TraceWindow(cfg, strategy.env) if getattr(cfg, "profile", 0) else None
        self.alloc = AllocWindow() if getattr(cfg, "measure_alloc", False) else None
        self.phases: PhaseClock | None = None
        if getattr(cfg, "breakdown", False) or self.trace is not None:
            self.phases = PhaseClock(strategy.synchronize)
            strategy.phase = self.phase

    # ---- phases --------------------------------------------------------------------------------
    @contextmanager
    def train_phase(self) -> Iterator[None]:
        """One stretch of training steps (an epoch, or its remainder): memory peak reset, utilisation sampled."""
        phase = MemoryPhase(self.devices)
        phase.start()
        self.util.start()
        self._epoch_time = 0.0
        try:
            yield
        finally:
            self.util.stop()
            phase.stop()
            self.epoch_times.append(self._epoch_time)
            self.train_peaks.append(phase.peak_bytes())
            self.reserved_peaks.append(phase.peak_reserved)

    @contextmanager
    def eval_phase(self) -> Iterator[None]:
        phase = MemoryPhase(self.devices)
        phase.start()
        try:
            yield
        finally:
            phase.stop()
            self.eval_peaks.append(phase.peak_bytes())

    # ---- steps ---------------------------------------------------------------------------------
    def before_model(self, build: Callable[[], nn.Module]) -> None:
        """The engine calls this just before it builds the model: the baseline of --measure-alloc, read after a
        throw-away build on the meta device, so that the modules the builder imports lazily (torchvision,
        a user's package: ~10 MiB of Python objects) are not counted as the model's memory."""
        if self.alloc is not None and self.strategy.env.device.type == "cpu":
            with torch.device("meta"):
                build()
            self.alloc.start_baseline()

    def phase(self, name: str):
        """``with metrics.phase("forward"):`` -- one part of the step (a no-op without --breakdown/--profile)."""
        return self.phases.phase(name) if self.phases is not None else nullcontext()

    def step_start(self) -> None:
        if self.comm is not None:
            self.comm.before_step(self.timer.seen)
        if self.trace is not None:
            self.trace.before_step(self.timer.seen)
        if self.alloc is not None:
            self.alloc.before_step(self.timer.seen)
        self.timer.start()

    def step_end(self, step: int, epoch: int, loss: torch.Tensor, lr: float) -> float:
        """Stop the step clock (synchronised), record the loss and send one row to the sinks; returns the
        step's time in seconds. The loss is read after the clock stops, so that reading it adds no wait."""
        dt = self.timer.stop()
        if self.alloc is not None:
            self.alloc.after_step()
        traced = self.trace is not None and self.trace.recorder is not None
        if traced and self.timer.seen > self.timer.warmup:
            self.timer.times.pop()  # a traced step is slower: kept out of the step-time statistics
        if self.phases is not None:
            self.phases.end_step(dt, measured=self.timer.seen > self.timer.warmup and not traced)
        if self.comm is not None:
            self.comm.after_step(self.timer.seen, self.cfg.timing_warmup_steps)
        if self.trace is not None:
            self.trace.after_step(self.timer.seen)
        self._epoch_time += dt
        loss = float(loss)
        self.losses.append(loss)
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "step_time_s": dt,
            "samples_per_s": self.cfg.batch_size / dt if dt > 0 else None,
            "memory_bytes": current_memory_bytes(self.devices[0]),
            "gpu_util_pct": self.util.latest(),
        }
        for sink in self.sinks:
            sink.log_step(row)
        return dt

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        self.evaluations.append(evaluation)
        for sink in self.sinks:
            sink.log_eval(step, evaluation)

    def record_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Bytes of model states this rank holds, taken once (after the first step has created them)."""
        if self.state_bytes is None:
            self.state_bytes = self.strategy.state_bytes(model, optimizer)

    # ---- the end -------------------------------------------------------------------------------
    def summary(self, flops: float | None) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """Aggregate over ranks (collectives): the ``metrics`` block of result.json and the ``sharding`` block."""
        cfg, strategy = self.cfg, self.strategy
        env = strategy.env
        # Per-step loss averaged over ranks (each rank's micro-batches are the same size): one collective.
        losses = torch.tensor(self.losses, dtype=torch.float64, device=env.device)
        strategy.all_reduce(losses, "sum")
        losses /= env.world_size
        local = {
            "timer": self.timer.summary(),
            "peak": _column_max(self.train_peaks),
            "reserved": _column_max(self.reserved_peaks),
            "eval_peak": self.eval_peaks[-1] if self.eval_peaks else [],
            "util": self.util.summary(),
            "state_bytes": self.state_bytes or {},
            "comm": self.comm.finish() if self.comm is not None else None,
            "phases": self.phases.summary() if self.phases is not None else None,
            "alloc": self.alloc.summary() if self.alloc is not None else None,
        }
        if self.trace is not None:
            self.trace.finish()
        ranks = strategy.all_gather_object(local)
        mean_steps = [
            r["timer"]["step_time_mean_s"] for r in ranks if r["timer"]["step_time_mean_s"] is not None
        ]
        # Ranks step in lock-step; the slowest rank's step time is the method's step time.
        step_time = max(mean_steps) if mean_steps else None
        throughput = cfg.batch_size / step_time if step_time else None

        def per_rank(key: str, sub: str | None = None) -> list[Any]:
            return [v for r in ranks for v in (r[key][sub] if sub else r[key])]

        evals = self.evaluations
        metrics: dict[str, Any] = {
            "train_time_s": sum(self.epoch_times),
            "epoch_time_s": self.epoch_times,
            "steps": len(self.losses),
            "measured_steps": local["timer"]["measured_steps"],
            "step_time_mean_s": step_time,
            "step_time_mean_per_rank_s": [r["timer"]["step_time_mean_s"] for r in ranks],
            "step_time_median_s": local["timer"]["step_time_median_s"],
            "step_time_p90_s": local["timer"]["step_time_p90_s"],
            "step_time_rank_mean_s": (sum(mean_steps) / len(mean_steps)) if mean_steps else None,
            "throughput_samples_per_s": throughput,
            "peak_memory_bytes": per_rank("peak"),
            "peak_memory_kind": "cuda_max_allocated" if env.device.type == "cuda" else "cpu_peak_rss",
            "peak_reserved_bytes": per_rank("reserved"),
            "eval_peak_memory_bytes": per_rank("eval_peak"),
            "nvml_used_peak_bytes": per_rank("util", "nvml_used_peak_bytes"),
            "gpu_util_mean_pct": per_rank("util", "gpu_util_mean_pct"),
            "gpu_util_peak_pct": per_rank("util", "gpu_util_peak_pct"),
            "loss_curve": losses.tolist(),
            "final_loss": losses[-1].item() if len(losses) else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_accuracy": evals[-1]["val_accuracy"] if evals else None,
            "evaluations": evals,
            "skipped_steps": strategy.precision.skipped_steps,
            "flops_per_sample": flops,
            "mfu": None,
        }
        if flops and throughput:
            achieved = flops * throughput / max(1, strategy.data_parallel_size(cfg, env.world_size))
            metrics["achieved_flops_per_device"] = achieved
            peak = peak_flops(env.device, cfg.precision, cfg.tf32)
            metrics["mfu"] = achieved / peak if peak else None
        if self.alloc is not None:
            metrics["cpu_alloc_peak_bytes"] = [r["alloc"]["peak"] for r in ranks]
            metrics["cpu_alloc_resident_bytes"] = [r["alloc"]["resident"] for r in ranks]
            metrics["cpu_alloc_import_bytes"] = [r["alloc"]["imports"] for r in ranks]
        if getattr(cfg, "breakdown", False):
            metrics["breakdown"] = breakdown_report([r["phases"] for r in ranks])
        if self.comm is not None:
            from stratbench.measuring.commvol import comm_report

            predicted = strategy.cost.predicted_comm(cfg, env.world_size, strategy.options)
            metrics["comm"] = comm_report([r["comm"] for r in ranks], predicted)
        sharding = {k: [r["state_bytes"].get(k) for r in ranks] for k in local["state_bytes"]}
        return metrics, sharding


PHASES = ("data", "forward", "backward", "optimizer", "other")
"""The parts of a step: waiting for the batch, forward, backward (with the communication overlapped with it),
the optimizer step (with ZeRO's gathers after it), and the rest (loss bookkeeping, the LR schedule, the
state-bytes count): each timed as its own spans."""
COMPUTE_PHASES = ("forward", "backward", "optimizer")


class PhaseClock:
    """Times the named spans of each step on the step timer's synchronised clock, each phase on its own clock
    reads (nothing is derived from the step time), so that the phases adding up to the step time the
    ``StepTimer`` measured is a check: a part of the step no span covers, or spans timed twice (nested), show as
    ``unattributed`` (step - sum of phases). Warm-up and traced steps are left out. Each span is also a
    ``record_function`` range, so it shows by name in a profiler trace."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def phase(self, name: str) -> _Span:
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}; allowed: {', '.join(PHASES)}")
        return _Span(self, name)

    def end_step(self, step_s: float, measured: bool) -> None:
        row = {p: self.current.get(p, 0.0) for p in PHASES}
        row["step"] = step_s
        row["unattributed"] = step_s - sum(row[p] for p in PHASES)
        if measured:
            self.steps.append(row)
        self.current = {}

    def summary(self) -> dict[str, Any] | None:
        if not self.steps:
            return None
        return {k: statistics.fmean(r[k] for r in self.steps) for k in (*PHASES, "step", "unattributed")} | {
            "measured_steps": len(self.steps)
        }


class _Span:
    """One timed span of a phase. The clock reads are its first and last acts, the profiler range and the
    device synchronisations inside them, so that the time between two spans is only the caller's own code:
    what ``unattributed`` measures."""

    __slots__ = ("clock", "name", "range", "t0")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.range = torch.profiler.record_function(f"phase:{self.name}")
        self.range.__enter__()
        self.clock.sync()  # work queued before the span (none: the previous span ended synchronised)

    def __exit__(self, *exc: object) -> None:
        try:
            self.clock.sync()
            self.range.__exit__(*exc)
        finally:
            current = self.clock.current
            current[self.name] = current.get(self.name, 0.0) + time.perf_counter() - self.t0


def breakdown_report(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """``metrics.breakdown``: per rank the mean seconds of each phase per step and of the step itself; over
    ranks the mean share of each phase, of the part no phase covered (``unattributed``), and the share that is
    not compute (everything but forward, backward and the optimizer step)."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return None
    timed = [r for r in ranks if r["step"] > 0]
    share = {p: statistics.fmean(r[p] / r["step"] for r in timed) for p in PHASES} if timed else {}
    unattributed = statistics.fmean(r.get("unattributed", 0.0) / r["step"] for r in timed) if timed else 0.0
    return {
        "phases": list(PHASES),
        "per_rank_s": per_rank,
        "share": share,
        "unattributed_share": unattributed,
        "not_compute_share": 1.0 - sum(share.get(p, 0.0) for p in COMPUTE_PHASES) if share else None,
    }


class TraceWindow:
    """--profile N: a torch.profiler trace of N steps after the timing warm-up (and after the --comm-volume
    steps, which use the profiler too), written per rank to OUTPUT/traces/rank{r}.json atomically, and linked
    as OUTPUT/traces/plugins/profile/RUN/rank{r}.pt.trace.json (RUN: the output folder's name), where
    TensorBoard's PyTorch profiler plug-in finds it (``tensorboard --logdir OUTPUT/traces``: it takes every
    folder holding ``*.pt.trace.json`` files as a run, each file as a worker)."""

    def __init__(self, cfg: Any, env: Any) -> None:
        self.first = max(cfg.timing_warmup_steps, 3 if getattr(cfg, "comm_volume", False) else 0)
        self.steps = cfg.profile
        self.path = Path(cfg.output) / "traces" / f"rank{env.rank}.json"
        run = Path(cfg.output).resolve().name or "run"
        self.tensorboard_path = self.path.parent / "plugins" / "profile" / run / f"rank{env.rank}.pt.trace.json"
        self.cuda = env.device.type == "cuda"
        self.recorder: torch.profiler.profile | None = None
        self.done = False

    def before_step(self, steps_done: int) -> None:
        if steps_done == self.first and self.recorder is None and not self.done:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.recorder = torch.profiler.profile(activities=acts, record_shapes=True)
            self.recorder.__enter__()

    def after_step(self, steps_done: int) -> None:
        if self.recorder is not None and steps_done >= self.first + self.steps:
            self.finish()

    def finish(self) -> None:
        if self.recorder is None:
            return
        from stratbench.checkpoints.checkpoint import atomic_output

        prof, self.recorder, self.done = self.recorder, None, True
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(self.path, ".json") as tmp:
            prof.export_chrome_trace(str(tmp))
        link_or_copy(self.path, self.tensorboard_path)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` becomes the same file as ``source`` (a hard link: no second copy of a large trace; a copy
    where the file system has no hard links), swapped in with one rename."""
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


class AllocWindow:
    """--measure-alloc (CPU): glibc's bytes in use after every op of step 2, above the baseline read before the
    model was built (stratbench.measuring.memprobe): the allocator-level peak the memory estimate predicts, which the
    process RSS hides under ~0.4 GiB of libraries. None where glibc's mallinfo2 is missing. Step 2: the first
    with optimizer state, and not step 3, where --comm-volume's profiler would add its own buffers (and its
    dispatch would see each collective twice). Modules imported after the baseline (a method's own: 1-3 MiB
    of code objects for ZeroRedundancyOptimizer, FSDP2 or accelerate) are measured apart (``ImportMeter``)
    and left out: they are no part of the step's memory."""

    STEP = 1

    def __init__(self) -> None:
        self.baseline: int | None = None
        self.peak: int | None = None
        self.resident: int | None = None
        """Bytes in use when step 2 starts (model states, library caches): the part of the peak that stays."""
        self.imports: int | None = None
        self._meter = None
        self._mode = None
        self._readings: list[int] = []

    def start_baseline(self) -> None:
        from stratbench.measuring.memprobe import ImportMeter, malloc_in_use

        self._meter = ImportMeter().install()
        self.baseline = malloc_in_use()

    def _in_use(self) -> int:
        from stratbench.measuring.memprobe import malloc_in_use

        return (malloc_in_use() or 0) - (self._meter.bytes if self._meter is not None else 0)

    def before_step(self, steps_done: int) -> None:
        if self.baseline is None or steps_done != self.STEP:
            return
        from torch.utils._python_dispatch import TorchDispatchMode

        readings, in_use = self._readings, self._in_use
        self.resident = in_use() - self.baseline

        class Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                readings.append(in_use())
                return out

        self._mode = Sample()
        self._mode.__enter__()

    def after_step(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        if self._readings and self.baseline is not None:
            self.peak = max(self._readings) - self.baseline
        self.close()

    def close(self) -> None:
        """Stop metering imports (after step 2, or at the end of a run that had fewer steps)."""
        if self._meter is not None:
            self._meter.uninstall()
            self.imports, self._meter = self._meter.bytes, None

    def summary(self) -> dict[str, int | None]:
        self.close()
        return {"peak": self.peak, "resident": self.resident, "imports": self.imports}


class CommWindow:
    """Runs the collective recorder (``stratbench.measuring.commvol``) from the third step (DDP rebuilds its buckets at the
    start of the second and broadcasts the new layout once) to the end of the timing warm-up, at least one
    step, so that its cost stays out of the measured step times when the warm-up is 3 steps or more."""

    def __init__(self, group_size: int) -> None:
        from stratbench.measuring.commvol import CommRecorder

        self.recorder = CommRecorder(group_size)
        self.first = 2
        self.recorded = 0

    def before_step(self, steps_done: int) -> None:
        if steps_done == self.first and not self.recorder.active and self.recorder.result is None:
            self.recorder.start()

    def after_step(self, steps_done: int, warmup: int) -> None:
        if self.recorder.active:
            self.recorded += 1
            if steps_done >= max(self.first + 1, warmup):
                self.recorder.stop(self.recorded)

    def finish(self) -> dict[str, Any] | None:
        """This rank's measurement, or None when the run had too few steps (< 3) to record one."""
        if self.recorder.active:
            self.recorder.stop(max(1, self.recorded))
        return self.recorder.result.to_dict() if self.recorder.result is not None else None


def _column_max(rows: list[list[int]]) -> list[int]:
    """Per device, the largest value over the phases (each phase reports one value per device)."""
    return [max(col) for col in zip(*rows, strict=False)] if rows and rows[0] else []
