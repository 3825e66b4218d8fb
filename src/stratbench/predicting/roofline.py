"""The roofline basis of the step-time projection: one training step's compute time as the sum over its traced aten
ops (``measuring.model_trace.trace_ops``) of each op's roofline time on the target GPU,

    max(FLOPs / (dtype peak x the op class's compute fraction x wave efficiency),
        bytes / (memory bandwidth x the op class's bandwidth fraction)) + one kernel launch,

where a matrix product's or convolution's output, cut into the GPU's GEMM tiles, runs in waves of one tile per
SM: wave efficiency = tiles / (waves x SMs) (a GEMM of fewer tiles than SMs leaves SMs idle). The fractions,
tile and launch cost are the GPU generation's (hardware.yaml ``roofline``). Eager: one kernel per op; a compiled
step (``fused``): library kernels as eager, the ops between them fused into regions that move only their boundary
(``fused_regions``). What cuDNN fuses is not modelled. docs/projection.md has the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import Gpu, Roofline
from stratbench.models.flops import OpCost

BASIS = "roofline with published fractions"
"""The basis' name in a projection (``MethodProjection.basis``)."""
MEASURED_BASIS = "roofline with measured fractions"
"""The basis' name where the GPU's profile has fractions `stratbench calibrate-hw` measured on the device."""

_TENSOR_CORE = ("large_gemm", "small_gemm", "convolution", "attention")
"""The classes whose FLOPs run at the operands' dtype peak (tensor cores); the rest run on the CUDA cores."""
_DTYPE_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def wave_efficiency(op: OpCost, gpu: Gpu) -> float:
    """The share of the SMs a product's tiles keep busy over its waves: tiles / (waves x SMs); 1 where the op is
    no product or convolution, or the GPU's SM count or tile is unknown."""
    if op.output_tiles is None or not gpu.sms or gpu.roofline is None:
        return 1.0
    batch, rows, cols = op.output_tiles
    tile_rows, tile_cols = gpu.roofline.tile
    tiles = batch * math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
    if tiles <= 0:
        return 1.0
    waves = math.ceil(tiles / gpu.sms)
    return tiles / (waves * gpu.sms)


def basis_of(gpu: Gpu) -> str:
    """The roofline basis' name on ``gpu``: measured fractions where its profile has them, else published."""
    return MEASURED_BASIS if gpu.roofline is not None and gpu.roofline.measured else BASIS


def peak_key(op: OpCost, gpu: Gpu, key: str) -> str:
    """The precision key of the dense peak an op's FLOPs run at: a product's, convolution's or attention's
    operands' dtype on the tensor cores (fp32 operands at the run's key: tf32 where it runs TF32), every other op
    the CUDA cores' fp32; the run's own key where the GPU lists no peak for that."""
    if op.op_class in _TENSOR_CORE:
        want = _DTYPE_KEYS.get(op.dtype, key if key in ("fp32", "tf32") else "fp32")
    else:
        want = "fp32"
    if gpu.peak(want):
        return want
    if not gpu.peak(key):
        raise ConfigError(f"{gpu.name} has no {want} or {key} peak in the hardware profiles")
    return key


def op_peak(op: OpCost, gpu: Gpu, key: str) -> float:
    """The dense peak an op's FLOPs run at (``peak_key``'s)."""
    return gpu.peak(peak_key(op, gpu, key))


def roofline_of(gpu: Gpu) -> Roofline:
    """``gpu``'s roofline fractions, tile and launch cost; one line where its profile has none."""
    if gpu.roofline is None:
        raise ConfigError(f"{gpu.name} ({gpu.key}) has no roofline fractions (hardware.yaml: generation)")
    return gpu.roofline


def op_terms(op: OpCost, gpu: Gpu, key: str) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one op on ``gpu``: its FLOPs over the peak x the class's compute
    fraction (measured in that peak's precision where it was) x the wave efficiency, its bytes over the bandwidth x
    the class's bandwidth fraction."""
    roof = roofline_of(gpu)
    want = peak_key(op, gpu, key)
    bandwidth_fraction = roof.fractions[op.op_class][1]
    rate = gpu.peak(want) * roof.compute_fraction(op.op_class, want) * wave_efficiency(op, gpu)
    compute = op.flops / rate if op.flops else 0.0
    return compute, op.bytes / (gpu.memory_bandwidth * bandwidth_fraction)


def op_seconds(op: OpCost, gpu: Gpu, key: str) -> float:
    """One op's roofline time on ``gpu`` (the module's formula), its launch included."""
    compute, memory = op_terms(op, gpu, key)
    return max(compute, memory) + gpu.roofline.launch


@dataclass
class RooflineTime:
    """A step's compute seconds on the roofline basis and what makes them up, per op class."""

    seconds: float = 0.0
    flops: float = 0.0
    launches: int = 0
    by_class: dict[str, dict[str, float]] = field(default_factory=dict)
    """Op class -> ops, FLOPs, bytes, seconds and how many of its ops were bandwidth-bound."""
    source: str = ""

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "flops": self.flops, "launches": self.launches,
                "by_class": self.by_class, "source": self.source}  # fmt: skip


EXTERN = frozenset({"large_gemm", "small_gemm", "convolution", "depthwise_convolution", "attention"})
"""Classes torch.compile leaves to library kernels (cuBLAS, cuDNN, flash attention); the others it fuses."""
FUSED_AS = {"batch_norm": "reduction"}
"""A fused region's op priced at another class's bandwidth: batch norm decomposes into reductions and pointwise
ops (torch's NCHW kernel, the batch_norm class's reason, does not run)."""


@dataclass
class Region:
    """A compiled step's fused kernel group: a run of non-``EXTERN`` ops, and the storages read after it."""

    ops: list[OpCost]
    later: frozenset[int] = frozenset()


def step_seconds(ops: Iterable[OpCost], gpu: Gpu, key: str, fused: bool = False) -> RooflineTime:
    """The roofline time of ``ops`` (one traced step) on ``gpu`` in precision ``key``, summed per class; ``fused``
    (a compiled step): every run of consecutive non-``EXTERN`` ops is one region (``fused_regions``)."""
    roof = roofline_of(gpu)
    out = RooflineTime()
    for unit in fused_regions(list(ops)) if fused else ops:
        terms = region_terms if isinstance(unit, Region) else _op_unit_terms
        compute, memory, cls, flops, moved, kernels, count = terms(unit, gpu, key)
        t = max(compute, memory) + roof.launch * kernels
        row = out.by_class.setdefault(cls, {"ops": 0, "flops": 0.0, "bytes": 0.0, "seconds": 0.0,
                                            "bandwidth_bound": 0})  # fmt: skip
        row["ops"] += count
        row["flops"] += flops
        row["bytes"] += moved
        row["seconds"] += t
        row["bandwidth_bound"] += int(memory >= compute)
        out.seconds += t
        out.flops += flops
        out.launches += kernels
    what = "kernels of a compiled step (fused regions)" if fused else "eager kernels"
    out.source = (f"{basis_of(gpu)}: {out.launches} {what} on {gpu.name} ({gpu.sms or '?'} SMs, "
                  f"{roof.generation} fractions, {roof.tile[0]}x{roof.tile[1]} tiles; {roof.source})")  # fmt: skip
    return out


def _op_unit_terms(op: OpCost, gpu: Gpu, key: str) -> tuple[float, float, str, float, float, int, int]:
    """``region_terms``' tuple for one op priced on its own (``op_terms``): one kernel, one op."""
    return (*op_terms(op, gpu, key), op.op_class, op.flops, op.bytes, 1, 1)


def fused_regions(ops: list[OpCost]) -> list[OpCost | Region]:
    """A compiled step's kernels: each ``EXTERN`` op alone, each maximal run of other ops between them one
    ``Region`` with the storages read after it. The model of what inductor fuses, by program order rather than its
    scheduler's dependency graph: assumption (docs/projection.md)."""
    units: list[OpCost | Region] = []
    for op in ops:
        if op.op_class in EXTERN:
            units.append(op)
        elif units and isinstance(units[-1], Region):
            units[-1].ops.append(op)
        else:
            units.append(Region([op]))
    later: set[int] = set()
    for unit in reversed(units):
        if isinstance(unit, Region):
            unit.later = frozenset(later)
        for op in unit.ops if isinstance(unit, Region) else [unit]:
            later.update(k for k, _ in op.reads)
    return units


def region_bytes(region: Region) -> int:
    """What a fused region moves: each storage it reads before writing it, once; each storage it writes that is
    read after it, or read nowhere in it (a gradient, the loss: the step's outputs). A tensor made and used only
    inside it stays in registers."""
    written: dict[int, int] = {}
    inputs: dict[int, int] = {}
    inside: set[int] = set()
    for op in region.ops:
        for k, n in op.reads:
            inside.add(k)
            if k not in written:
                inputs[k] = max(n, inputs.get(k, 0))
        written.update(op.writes)
    return sum(inputs.values()) + sum(n for k, n in written.items() if k in region.later or k not in inside)


def region_terms(region: Region, gpu: Gpu, key: str) -> tuple[float, float, str, float, float, int, int]:
    """(compute s, memory s, class, FLOPs, bytes, kernels, ops) of one fused region (``region_bytes``): its bandwidth
    fraction the lowest of its ops' classes (batch norm as a reduction), its kernels one plus one per reduction
    (inductor splits a region at a reduction: assumption)."""
    roof = roofline_of(gpu)
    moved = region_bytes(region)
    cls = min({FUSED_AS.get(op.op_class, op.op_class) for op in region.ops}, key=lambda c: roof.fractions[c][1])
    flops = sum(op.flops for op in region.ops)
    compute = flops / (gpu.peak(key) * roof.fractions[cls][0]) if flops else 0.0
    kernels = 1 + sum(op.op_class in ("reduction", "batch_norm") for op in region.ops)
    memory = moved / (gpu.memory_bandwidth * roof.fractions[cls][1])
    return compute, memory, cls, flops, float(moved), kernels, len(region.ops)
