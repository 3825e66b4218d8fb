"""What `stratbench calibrate-hw` measures: the roofline's achievable fractions per op class on the device at hand.

Each case is one kernel of one roofline class (``models.flops.OP_CLASSES``) at a compute-bound or a bandwidth-bound
size: a large and a small matrix product, a thin product (inner dimension 8: its output's bytes bind), a 3x3 and a
1x1 convolution, a depthwise convolution, scaled-dot-product attention, an add, a row sum, a layer norm and an
embedding gather. A case runs once under the op recorder (its aten ops with their FLOPs and bytes as the trace of a
training step counts them: ``models.flops.op_cost``), once more untimed, then ``repeats`` times in batches of
calls between two synchronisations; its time per call is the median. Its achieved fraction inverts the roofline's
formula (``predicting.roofline``): compute = FLOPs / ((t - launches) x peak x wave efficiency), bandwidth =
bytes / ((t - launches) x memory bandwidth), against the profile's peak of the operands' precision and its
bandwidth, so that the roofline gives the case back its measured time. The launch cost is the time per call of
200 one-element adds in a row. A class's term is the median of its cases'; a term no case measures keeps the GPU
generation's published fraction (1 on a CPU, which has none: a class with no counted FLOPs never uses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stratbench.core.errors import ConfigError
from stratbench.core.files import atomic_output
from stratbench.measuring.hardware import (
    MEASURED_MAX,
    ROOFLINE_CLASSES,
    Catalogue,
    Gpu,
    System,
    dump,
    fmt_rate,
    load,
)
from stratbench.measuring.model_trace import ops_recorder
from stratbench.measuring.probe import SLOW_MM_S, SLOW_MM_SIZE, timed
from stratbench.models.flops import OpCost
from stratbench.predicting.roofline import peak_key, wave_efficiency

SCALES = ("tiny", "cpu", "gpu")
"""Case sizes: tiny (tests, seconds), cpu (under a minute on a 2-core VM), gpu (large enough for an H100's SMs)."""
_SIZES: dict[str, dict[str, tuple[int, ...]]] = {
    # name: shape (matrix products: m, k, n; convolutions: batch, channels, height, width; attention: batch,
    # heads, sequence, head dim; the rest: rows, columns)
    "tiny": {"mm_large": (128, 128, 128), "mm_small": (32, 64, 32), "mm_thin": (512, 8, 512),
             "conv3x3": (1, 16, 16, 16), "conv1x1": (1, 32, 32, 32), "depthwise": (1, 16, 64, 64),
             "batch_norm": (2, 16, 16, 16),
             "sdpa": (1, 2, 64, 32), "add": (1024, 1024), "sum": (1024, 1024), "layer_norm": (1024, 1024),
             "embedding": (16384, 64)},
    "cpu": {"mm_large": (512, 512, 512), "mm_small": (64, 256, 64), "mm_thin": (2048, 8, 2048),
            "conv3x3": (8, 64, 28, 28), "conv1x1": (8, 64, 56, 56), "depthwise": (8, 64, 56, 56),
            "batch_norm": (8, 64, 56, 56),
            "sdpa": (1, 4, 512, 64), "add": (4096, 2048), "sum": (4096, 2048), "layer_norm": (4096, 2048),
            "embedding": (262144, 64)},
    "gpu": {"mm_large": (8192, 8192, 8192), "mm_small": (256, 1024, 256), "mm_thin": (16384, 8, 16384),
            "conv3x3": (64, 256, 28, 28), "conv1x1": (64, 256, 56, 56), "depthwise": (64, 256, 112, 112),
            "batch_norm": (64, 256, 56, 56),
            "sdpa": (8, 16, 2048, 128), "add": (16384, 8192), "sum": (16384, 8192),
            "layer_norm": (16384, 8192), "embedding": (1048576, 256)},
}  # fmt: skip
_BATCH_S = {"tiny": 1e-3, "cpu": 5e-3, "gpu": 5e-3}
"""Calls are timed in batches of at least this long between two synchronisations (a GPU kernel of microseconds
is timed over many)."""

CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "mm_large": (("large_gemm", "compute"),),
    "mm_small": (("small_gemm", "compute"),),
    "mm_thin": (("large_gemm", "bandwidth"), ("small_gemm", "bandwidth")),
    "conv3x3": (("convolution", "compute"),),
    "conv1x1": (("convolution", "bandwidth"),),
    "depthwise": (("depthwise_convolution", "bandwidth"),),
    "batch_norm": (("batch_norm", "bandwidth"),),
    "sdpa": (("attention", "compute"),),
    "add": (("elementwise", "bandwidth"),),
    "sum": (("reduction", "bandwidth"),),
    "layer_norm": (("reduction", "bandwidth"),),
    "embedding": (("other", "bandwidth"),),
}
"""Case -> the (class, term) pairs it measures: compute-bound cases the compute fraction, the others the bandwidth
fraction. Compute cases run in every precision measured, bandwidth cases in the first."""
TRAINING = frozenset({"conv1x1", "depthwise", "batch_norm"})
"""Cases timed forward and backward, as training runs them: their backward kernels (a depthwise convolution's
weight gradient, batch norm's backward) run far slower than their forward (H200 traces, 2026-11-28); the others
forward only."""


@dataclass
class CaseResult:
    """One case in one precision: its kernels as the roofline counts them and its median time per call."""

    name: str
    precision: str
    shape: tuple[int, ...]
    seconds: float
    ops: list[OpCost]
    compute: float = 0.0
    """Achieved fraction of the peak (FLOPs over time less launches over peak and wave efficiency), at most
    ``MEASURED_MAX``: a small product that the library tiles finer than the roofline's tile can exceed 1."""
    bandwidth: float = 0.0
    peak_share: float = 0.0
    """FLOPs over time less launches over the peak, no wave efficiency: above ``MEASURED_MAX``, the peak is wrong."""

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.name, "precision": self.precision, "shape": list(self.shape),
                "seconds": float(f"{self.seconds:.6g}"), "ops": [o.op for o in self.ops],
                "flops": sum(o.flops for o in self.ops), "bytes": sum(o.bytes for o in self.ops),
                "compute": _sig(self.compute), "bandwidth": _sig(self.bandwidth)}  # fmt: skip


@dataclass
class Calibration:
    """What one `calibrate-hw` run measured: the launch cost, every case, and the fractions it gives."""

    device: str
    precisions: list[str]
    launch: float
    cases: list[CaseResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Precisions the device lists a peak for but does not run fast (said in the source)."""


def _dtype(key: str) -> torch.dtype:
    return {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key]


def build(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """Case ``name``'s call on fresh random tensors of ``shape``."""

    def t(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype)

    if name.startswith("mm_"):
        m, k, n = shape
        a, b = t(m, k), t(k, n)
        return lambda: torch.mm(a, b)
    if name in ("conv3x3", "conv1x1", "depthwise"):
        batch, c, h, w = shape
        x = t(batch, c, h, w)
        groups, k = (c, 3) if name == "depthwise" else (1, 3 if name == "conv3x3" else 1)
        weight = t(c, c // groups, k, k)
        return _trained(lambda x, w: F.conv2d(x, w, padding=k // 2, groups=groups), [x, weight], name)
    if name == "batch_norm":  # training mode, NCHW, fp32 affine parameters (as under autocast)
        x = t(*shape)
        affine = [torch.ones(shape[1], device=device), torch.zeros(shape[1], device=device)]
        return _trained(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [x, *affine], name)
    if name == "sdpa":
        q, k, v = t(*shape), t(*shape), t(*shape)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows, cols = shape
    if name == "embedding":
        table = t(rows, cols)
        index = torch.randint(0, rows, (rows,), device=device)
        return lambda: F.embedding(index, table)
    x, y = t(rows, cols), t(rows, cols)
    calls = {"add": lambda: x + y, "sum": lambda: x.sum(dim=-1),
             "layer_norm": lambda: F.layer_norm(x, (cols,))}  # fmt: skip
    return calls[name]


def _trained(op: Callable[..., torch.Tensor], inputs: list[torch.Tensor], name: str) -> Callable[[], Any]:
    """``op`` on ``inputs``; for a ``TRAINING`` case forward and backward (every input's gradient)."""
    if name not in TRAINING:
        return lambda: op(*inputs)
    inputs = [x.requires_grad_() for x in inputs]
    grad = op(*inputs).detach().clone()

    def step() -> None:
        torch.autograd.backward(op(*inputs), grad)
        for x in inputs:
            x.grad = None

    return step


def recorded(fn: Callable[[], Any]) -> list[OpCost]:
    """The aten ops one call of ``fn`` dispatches, each with its FLOPs, bytes and class (``op_cost``)."""
    ops: list[OpCost] = []
    with ops_recorder(ops):
        fn()
    return ops


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for cuBLAS matmuls and cuDNN convolutions on or off (as `train --tf32`), restored after: a "tf32"
    case runs its fp32 tensors with it, an "fp32" case without (cuDNN's default is on)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def per_call(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, batch_s: float) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` batches of calls (each at least ``batch_s`` long, between
    two synchronisations), after one untimed call; the batch's calls are counted from the fastest of three (one
    call that a busy machine's scheduler cut short would make every batch a single call)."""
    fn()
    once = min(timed(fn, sync) for _ in range(3))
    k = min(1000, max(1, math.ceil(batch_s / max(once, 1e-7))))
    return statistics.median(timed(lambda: [fn() for _ in range(k)], sync) / k for _ in range(repeats))


def launch_seconds(device: torch.device, sync: Callable[[], None], repeats: int) -> float:
    """Seconds per call of 200 one-element adds in a row: the fixed cost of one eager kernel."""
    x = torch.ones(1, device=device)

    def adds() -> None:
        for _ in range(200):
            torch.add(x, x)

    adds()
    return statistics.median(timed(adds, sync) for _ in range(repeats)) / 200


def fractions_of(case: CaseResult, gpu: Gpu, launch: float) -> None:
    """The case's achieved compute and bandwidth fractions: the roofline's formula solved for them at its time
    less its launches (at least a quarter of it), against the peak of its heaviest op's precision."""
    busy = max(case.seconds - launch * len(case.ops), case.seconds / 4)
    flops = sum(o.flops for o in case.ops)
    if flops:
        top = max(case.ops, key=lambda o: o.flops)
        peak = gpu.peak(peak_key(top, gpu, case.precision))
        case.peak_share = flops / (busy * peak)
        case.compute = min(case.peak_share / wave_efficiency(top, gpu), MEASURED_MAX)
    case.bandwidth = sum(o.bytes for o in case.ops) / (busy * gpu.memory_bandwidth)


def precisions(gpu: Gpu, device: torch.device, sync: Callable[[], None]) -> tuple[list[str], list[str]]:
    """(the precisions to measure, first the one bandwidth cases run in; those skipped): fp32, bf16, fp16 and on
    CUDA tf32 (fp32 tensors, TF32 on) where the profile has their peak; all but fp32 only where the device runs
    them fast (the fastest of three 256x256 matmuls within ``SLOW_MM_S``, as probe: a CPU without native bf16 runs
    a reference kernel ~100x slower)."""
    keep, skipped = [], []
    for key in ("bf16", "fp16", "tf32", "fp32") if device.type == "cuda" else ("fp32", "bf16", "fp16"):
        if not gpu.peak(key):
            continue
        a = torch.randn(SLOW_MM_SIZE, SLOW_MM_SIZE, device=device, dtype=_dtype(key))
        fast = key == "fp32" or min(timed(lambda a=a: torch.mm(a, a), sync) for _ in range(3)) <= SLOW_MM_S
        (keep if fast else skipped).append(key)
    if not keep:
        raise ConfigError(
            f"{gpu.name}: its profile has no fp32, bf16 or fp16 peak; nothing to measure against"
        )
    return keep, skipped


def measure(gpu: Gpu, device: torch.device, scale: str, repeats: int) -> Calibration:
    """Every case of ``CASES`` at ``scale``'s sizes on ``device``: compute cases in each precision measured,
    bandwidth cases in the first."""
    if scale not in SCALES:
        raise ConfigError(f"sizes {scale!r}; allowed: {', '.join(SCALES)}")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    keys, skipped = precisions(gpu, device, sync)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else gpu.name
    out = Calibration(name, keys, launch_seconds(device, sync, repeats), skipped=skipped)
    for case, terms in CASES.items():
        compute = any(term == "compute" for _, term in terms)
        for key in keys if compute else keys[:1]:
            shape = _SIZES[scale][case]
            fn = build(case, shape, device, _dtype(key))
            with tf32(key == "tf32"):
                ops = recorded(fn)
                result = CaseResult(case, key, shape, per_call(fn, sync, repeats, _BATCH_S[scale]), ops)
            fractions_of(result, gpu, out.launch)
            out.cases.append(result)
    return out


def section(cal: Calibration, gpu: Gpu, source: str) -> dict[str, Any]:
    """The profile's ``measured_roofline`` entry of ``gpu`` from ``cal``: per class and term the median of the
    cases that measure it in the first precision (the generation's where none does, or 1 without one), raised to
    what any case of the class reached (the roofline then gives no case more than its measured time); the compute
    fractions of every precision; which terms were measured; every case. One line where a fraction is above
    ``MEASURED_MAX`` (the profile's peak or bandwidth is below what the device does)."""
    for c in cal.cases:
        for term in ("peak_share", "bandwidth"):
            if getattr(c, term) > MEASURED_MAX:
                raise ConfigError(
                    f"case {c.name} ({c.precision}) reached {getattr(c, term):.2f} x the profile's "
                    f"{'peak' if term == 'peak_share' else 'memory bandwidth'} ({gpu.key}); a profile's figure below what "
                    f"the device does (at most {MEASURED_MAX:g}x is taken): measure it again (`stratbench probe`)"
                )
    measured: dict[tuple[str, str, str], list[float]] = {}
    achieved: dict[tuple[str, str, str], float] = {}
    for c in cal.cases:
        for cls in {cls for cls, _ in CASES[c.name]}:
            for term in ("compute", "bandwidth"):
                key = (cls, term, c.precision)
                achieved[key] = max(achieved.get(key, 0.0), getattr(c, term))
        for cls, term in CASES[c.name]:
            measured.setdefault((cls, term, c.precision), []).append(getattr(c, term))
    first, roof = cal.precisions[0], gpu.roofline
    fractions = {}
    for cls in ROOFLINE_CLASSES:
        pair = {}
        for i, term in enumerate(("compute", "bandwidth")):
            values = measured.get((cls, term, first))
            value = statistics.median(values) if values else (roof.fractions[cls][i] if roof else 1.0)
            pair[term] = _sig(max(value, achieved.get((cls, term, first), 0.0)))
        fractions[cls] = pair
    by_precision: dict[str, dict[str, float]] = {}
    for (cls, term, key), values in measured.items():
        if term == "compute":
            by_precision.setdefault(key, {})[cls] = _sig(statistics.median(values))
    return {
        "source": source, "device": cal.device, "precision": first, "launch": f"{cal.launch * 1e6:.3g} us",
        "tile": list(roof.tile) if roof else [128, 128], "fractions": fractions, "by_precision": by_precision,
        "measured": sorted({f"{cls}.{term}" for cls, term, _ in measured}),
        "cases": [c.to_dict() for c in cal.cases],
    }  # fmt: skip


def _sig(value: float) -> float:
    """``value`` to four significant digits (a tiny measured fraction stays above 0)."""
    return float(f"{value:.4g}")


def unmeasured_note(gpu: Gpu, skipped: list[str]) -> str:
    """What the terms no case measured hold, and the precisions skipped, for the source line."""
    roof = gpu.roofline
    rest = (f"other terms: the {roof.generation} generation's ({roof.source})" if roof
            else "other terms: 1 (no generation fractions for this device)")  # fmt: skip
    return rest + (f"; not measured (slow on this device): {', '.join(skipped)}" if skipped else "")


def describe_rate(gpu: Gpu, key: str) -> str:
    """The profile's peak of ``key`` and bandwidth, in words (what the fractions are of)."""
    return f"{fmt_rate(gpu.peak(key) or 0, 'FLOP/s')} {key} peak, {fmt_rate(gpu.memory_bandwidth, 'B/s')}"


def system_for(gpu: Gpu, cat: Catalogue) -> System:
    """The built-in system of ``gpu``; for a GPU with none (an H200), its ``like`` GPU's system with ``gpu`` in
    it, named ``<gpu>-calibrated`` (its links are the like GPU's node's, said in its source)."""
    for system in cat.systems.values():
        if system.gpu.key == gpu.key:
            return system
    like = [s for s in cat.systems.values() if gpu.like and s.gpu.key == gpu.like]
    if not like:
        raise ConfigError(
            f"{gpu.name} ({gpu.key}) has no built-in system; give --hardware FILE with a system"
        )
    source = (
        f"{like[0].key}'s node (links, GPUs per node) with the {gpu.key} in it: no built-in {gpu.key} system"
    )
    return dataclasses.replace(like[0], key=f"{gpu.key}-calibrated", gpu=gpu, source=source)


def system_mapping(system: System) -> dict[str, Any]:
    """``system`` as a profile's ``systems`` entry naming built-in links (what ``system_for`` borrows)."""
    out: dict[str, Any] = {"gpu": system.gpu.key, "gpus_per_node": system.gpus_per_node,
                           "intra_node": system.intra_node.key, "host": system.host.key,
                           "nics_per_node": system.nics_per_node}  # fmt: skip
    if system.inter_node is not None:
        out["inter_node"] = system.inter_node.key
    if system.host_memory_bandwidth:
        out["host_memory_bandwidth"] = fmt_rate(system.host_memory_bandwidth, "B/s")
    return out


def profile_text(
    base: Path | None, system: str, gpu: str, entry: dict[str, Any], header: str, systems: dict[str, Any]
) -> str:
    """The profile file with ``entry`` as its ``measured_roofline`` of ``gpu``: the hardware file ``base`` (its
    leading comment kept, an earlier entry of that GPU replaced) or, without one, a file that names ``system``
    as its default (with ``systems``: the entries it needs beyond the built-in ones); ``header`` (a comment)
    added."""
    import yaml

    data: dict[str, Any] = {"version": 1, "default_system": system}
    if systems:
        data["systems"] = systems
    comment = ""
    if base is not None:
        text = base.read_text()
        data = yaml.safe_load(text) or {}
        comment = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
        if not isinstance(data, dict):
            raise ConfigError(f"hardware file {base} is not a mapping of sections")
    data.setdefault("measured_roofline", {})[gpu] = entry
    return comment + header + dump(data)


def write_profile(out: Path, text: str) -> None:
    """``text`` to ``out`` through a temporary file read back first (what is written must load): a failed run
    keeps the file as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, ".yaml") as tmp:
        tmp.write_text(text)
        load(tmp)
