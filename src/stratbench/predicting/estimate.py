"""Memory estimate per device, before training: model states from the method's sharding rules, activations
measured by tracing one forward/backward of the real model on fake tensors (no memory is allocated).

What is predicted, per device (see docs/memory.md for every formula and why the textbook ones are corrected):

* model states: parameters, gradients, optimizer states (SGD, momentum SGD, AdamW), fp32 master copies where a
  method keeps them (DeepSpeed with half precision), DDP gradient buckets -- each divided the way the method
  shards it (ZeroRedundancyOptimizer's greedy whole-parameter partition, FSDP2's dim-0 chunks, FSDP1's padded
  flat parameters, DeepSpeed's flat partitions) and moved to the host by CPU offload;
* the forward/backward working set: every tensor the real model allocates during one forward and backward at
  the per-device micro-batch, traced op by op under ``FakeTensorMode`` with a dispatch mode that keeps the live
  bytes (activations saved for backward, temporaries, gradients as they appear). Precision (autocast, half
  weights) and activation checkpointing are traced, not modelled;
* optimizer-step temporaries (the foreach kernels' one parameter-sized scratch list);
* a stated per-process overhead per device type (CUDA context and allocator slack; 0 on CPU).

``predicted peak`` is the allocator-level peak (what ``torch.cuda.max_memory_allocated`` reports);
``device total`` adds the per-process overhead (what ``nvidia-smi`` shows) and is what must fit the device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from stratbench.core.config import TrainConfig, ac_budget, from_dict
from stratbench.core.errors import ConfigError, StratbenchError
from stratbench.core.precision import SPECS, cpu_native_16bit, spec_of
from stratbench.core.user_code import one_line
from stratbench.measuring.model_trace import (
    ModelInfo,
    ModelSpec,
    Trace,
    cpu_step_scratch,
    micro_batch,
    model_info,
    trace_step,
)
from stratbench.models.hf import is_hf_name
from stratbench.models.transforms import traced as traced_transforms
from stratbench.models.transforms.lora import adapter_shapes
from stratbench.models.transforms.quantize_base import quantized_names, working_bytes
from stratbench.models.zoo import decoder_shape
from stratbench.predicting.activation_formula import formula_activations
from stratbench.strategies.base import get_strategy
from stratbench.strategies.costs import MemoryContext, NoMemoryModel, RankMemory, opt_slots, optimizer_note

GiB = 1024**3
MiB = 1024**2
MAX_WORLD = 4096
"""The largest world size an estimate takes: ``rank_states`` is O(world x parameters), 4096 answers in ~15 s."""

# Per-process memory outside the tensors the allocator hands out, by device type. CUDA: the context (driver,
# kernels of torch/cuDNN/cuBLAS loaded lazily) measured by nvidia-smi for a process that has run a ResNet
# step is 0.4-0.6 GiB on recent drivers (the source quotes 0.3-0.5 GB); the caching allocator reserves more
# than it hands out (block rounding, fragmentation), typically a few percent at steady state.
OVERHEAD: dict[str, dict[str, float]] = {
    "cuda": {"context_bytes": 512 * MiB, "allocator_slack": 0.05},
    "cpu": {"context_bytes": 0, "allocator_slack": 0.0},
}
# CPU: memory the math libraries keep across steps, outside the traced tensors (oneDNN's primitive cache and
# JIT-compiled kernels, MKL's GEMM buffers). How much depends on which kernels torch picks for the compute dtype
# on this CPU: oneDNN for fp32 convolutions (MKL for fp32 matrix products), and for bf16/fp16 only where the CPU
# runs them natively (torch's own reference kernels otherwise, which keep next to nothing). Measured with
# stratbench.measuring.memprobe's malloc reading (bytes in use at the start of step 2 or 3 above the baseline,
# minus the model states; imports left out) on tinynet width 8 and 32, ResNet-18, a 3-Linear MLP and gpt-tiny, 1
# and 2 ranks of 1 thread, AMD EPYC with AVX512-BF16 (torch 2.13.0+cpu, oneDNN v3.12.0), 2026-11-23 and
# 2026-11-25 (docs/memory.md, "CPU runtime rows": the commands and every number). With native 16 bit oneDNN
# builds a primitive per distinct matrix-product problem (shapes and which operand is a transposed view),
# JIT-compiles 2-3 kernels for it (~0.23 MiB of code buffer each: ONEDNN_JIT_DUMP counted 7 for one Linear's
# forward and backward, 36 for gpt-tiny) and keeps them for the process: a cost per distinct problem the traced
# step runs (measuring.model_trace._Kernels), whatever the batch, the sequence or the number of layers that
# repeat it.
CPU_LIBRARY_BYTES: dict[str, int] = {
    # oneDNN + MKL: 1.79-2.86 MiB (also the base of native 16-bit where the step runs a convolution: 1.93 on a
    # pipeline stage with no Linear)
    "fp32": 2 * MiB,
    # MKL (oneDNN has no fp64) and im2col: 0.85-3.68 MiB (tinynet 16 px to ResNet-18 32 px)
    "fp64": 2 * MiB,
    # torch's own kernels, no native 16-bit (oneDNN off): 0.03-0.36 MiB; the base of native 16 bit without a
    # convolution (gpt-tiny bf16 with oneDNN off: 0.36 MiB)
    "16-bit reference": MiB // 4,
    # per distinct native 16-bit matrix product (mm/addmm/bmm above torch's oneDNN threshold): 0.51-0.54 MiB
    # (one Linear's 3 products 1.60-1.63 MiB, a 3-Linear MLP's 8 products 4.39 - 0.25, gpt-tiny's 12 + attention
    # 8.36 - 0.36)
    "16-bit product": MiB // 2,
    # per distinct native 16-bit fused attention (CPU flash kernel: its brgemm kernels and its backward's oneDNN
    # products): 1.79-1.86 MiB at 64 tokens, 2.05 at 256, 2.77 at 1024
    "16-bit attention": 7 * MiB // 4,
}


BUDGET_NOTE = (
    "budget:F: at most F of no checkpointing's saved bytes (the partitioner's knapsack keeps at most F of what its "
    "default keeps, which is less than eager's); working peak midway between no and full checkpointing's traces, "
    "since the compiler recomputes across the whole graph in backward (no block boundaries), so its peak does not "
    "fall with F: measured 0.36-0.66 of the way from full's to none's for F 0.1-0.9 (docs/memory.md)"
)
"""The estimate's basis for ``--ac-mode budget:F`` (docs/memory.md, "Activation checkpointing modes": the runs)."""


# ------------------------------------------------------------------------------------------------
# The estimate.


@dataclass
class Row:
    component: str
    device_bytes: int
    host_bytes: int = 0
    note: str = ""


@dataclass
class Estimate:
    """Per-device breakdown (the most loaded rank) with the peak and the total that must fit."""

    strategy: str
    precision: str
    world_size: int
    micro_batch: int
    device_type: str
    rows: list[Row] = field(default_factory=list)
    peak_fwd_bwd: int = 0
    peak_step: int = 0
    peak_bytes: int = 0
    """Predicted allocator peak (compare with torch.cuda.max_memory_allocated)."""
    overhead_bytes: int = 0
    total_bytes: int = 0
    """Peak plus per-process overhead: what must fit in the device's memory."""
    host_bytes: int = 0
    num_parameters: int = 0
    per_rank_states: list[dict[str, int]] = field(default_factory=list)
    seq_len: int | None = None
    """A language model: tokens per sample (None: an image model)."""
    vocab_size: int | None = None
    activation_formula: dict[str, Any] | None = None
    """A built-in transformer: the published formula's activations (``activation_formula``) beside the traced
    ones (``traced_bytes``) and its ``difference`` from them; a stated cross-check, not part of the total."""
    units: str | None = None
    """The units the method gathers one at a time, in words (FSDP: the blocks ``--wrap`` gave); None where none."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rank_states(
    cfg: TrainConfig, world_size: int, rank: int, info: ModelInfo | None = None, device_type: str = "cuda"
) -> RankMemory:
    """Bytes of parameters, gradients, optimizer state (and master copies, buckets) that ``rank`` holds, from
    the strategy's own ``memory_model``."""
    cls = get_strategy(cfg.strategy)
    info = info or model_info(ModelSpec.from_config(cfg))
    ctx = MemoryContext(cfg, world_size, info, cls.parse_options(cfg.strategy_options), device_type)
    states = cls.cost.memory_model(ctx, rank)
    if states is None:
        raise NoMemoryModel(f"strategy {cfg.strategy!r} has no memory model (Strategy.cost.memory_model)")
    return states


def model_state_bytes(cfg: TrainConfig, world_size: int) -> list[dict[str, int]]:
    """Per rank: bytes of parameters, gradients and optimizer state held (device and host together), counted
    the way ``Strategy.state_bytes`` counts them (AdamW's step counters included, master copies apart)."""
    out = []
    info = model_info(ModelSpec.from_config(cfg))
    for r in range(world_size):
        s = rank_states(cfg, world_size, r, info)
        out.append(
            {
                "param_bytes": s.params + s.host_params,
                "grad_bytes": s.grads + s.host_grads,
                "optimizer_state_bytes": s.optim + s.host_optim + s.step_scalars,
                "master_bytes": s.master + s.host_master,
            }
        )
    return out


def estimate(
    cfg: TrainConfig, world_size: int, device_type: str = "cuda", native_16bit: dict[str, bool] | None = None
) -> Estimate:
    """The per-device breakdown for one method, on its most loaded rank (``native_16bit``: see
    ``cpu_library_bytes``)."""
    if device_type not in OVERHEAD:
        raise ConfigError(f"unknown device type {device_type!r}; choose one of: {', '.join(OVERHEAD)}")
    spec = ModelSpec.from_config(cfg)
    info = model_info(spec)
    spec_of(cfg.precision)
    states = [rank_states(cfg, world_size, r, info, device_type) for r in range(world_size)]
    s = max(states, key=_held_bytes)
    mb = micro_batch(cfg, s.data_ranks or world_size)
    resident = s.params + s.optim + s.master + s.buckets
    if s.activations is not None:  # the method's own count (pipeline stages); gradients as they appear
        saved, saved_note, fwd_bwd_traced, check = s.activations, s.activation_note, s.activations + s.grads, None
    else:
        saved, saved_note, fwd_bwd_traced, check = _traced(cfg, spec, s, mb, device_type)
    if s.saved_extra:  # activations the method saves beyond the traced model's
        saved, fwd_bwd_traced = saved + s.saved_extra, fwd_bwd_traced + s.saved_extra
        saved_note += f"; {s.saved_extra_note}"
    dequant, dequant_note = dequant_working_bytes(cfg, info)
    peak_fwd_bwd = resident + s.gathered + fwd_bwd_traced + dequant
    step_temp = _step_scratch(cfg, s, info, device_type)
    library, library_note = _cpu_library(cfg, spec, s, mb, native_16bit) if device_type == "cpu" else (0, "")
    runtime = s.cpu_runtime if device_type == "cpu" else 0
    peak_fwd_bwd += library + runtime
    peak_step = resident + s.grads + step_temp + library + runtime
    peak = max(peak_fwd_bwd, peak_step)
    ov = OVERHEAD[device_type]
    overhead = int(ov["context_bytes"] + ov["allocator_slack"] * peak)
    rows = _state_rows(cfg, s, saved, saved_note, fwd_bwd_traced, step_temp)
    if dequant:
        rows.append(Row("dequantised base weight", int(dequant), 0, dequant_note))
    if device_type == "cpu":
        rows.append(Row("CPU math-library buffers", int(library), 0, library_note))
    if runtime:
        rows.append(Row("method runtime (CPU)", int(runtime), 0, s.cpu_runtime_note))
    return Estimate(
        strategy=cfg.strategy,
        precision=cfg.precision,
        world_size=world_size,
        micro_batch=mb,
        device_type=device_type,
        rows=rows,
        peak_fwd_bwd=int(peak_fwd_bwd),
        peak_step=int(peak_step),
        peak_bytes=int(peak),
        overhead_bytes=overhead,
        total_bytes=int(peak + overhead),
        host_bytes=int(s.host_params + s.host_grads + s.host_optim + s.host_master),
        num_parameters=info.total + sum(n for n, _ in adapter_shapes(info.linear_names, info.linear_features, cfg)),
        per_rank_states=model_state_bytes(cfg, world_size),
        seq_len=spec.seq_len,
        vocab_size=spec.num_classes if spec.is_text else None,
        activation_formula=check,
        units=s.units_note or None,
    )


def _traced(cfg: TrainConfig, spec: ModelSpec, s: RankMemory, mb: int, device_type: str) -> tuple:
    """(saved activations, their note, the forward/backward working peak, the formula's cross-check) of one
    forward/backward of the model (or the method's slice of it) traced at the micro-batch ``mb``."""
    # traced in the precision the method's forward/backward really runs (DeepSpeed's 16-bit model: no autocast)
    run_as = s.trace_precision or cfg.precision
    spec = rank_spec(spec, s)
    trace = _trace(spec, mb, run_as, traced_transforms(cfg), device_type, s.trace_transform)
    # Fraction of the traced (full) gradients that stays on the device through the backward pass.
    held = s.grads_in_backward if s.grads_in_backward is not None else s.grads
    grad_fraction = 1.0 if s.grads_whole_in_backward else min(1.0, held / (trace.grad_bytes or 1))
    fwd_bwd = _working_peak(trace, grad_fraction, s.grads if cfg.grad_accum > 1 else 0)
    budget = ac_budget(cfg.ac_mode) if cfg.activation_checkpointing else None
    if budget is not None:  # the trace above wraps no block: no checkpointing's
        full_ac = traced_transforms(cfg.replace(ac_mode="full"))
        full = _trace(spec, mb, run_as, full_ac, device_type, s.trace_transform)
        fwd_bwd = (fwd_bwd + _working_peak(full, grad_fraction, s.grads if cfg.grad_accum > 1 else 0)) // 2
        return int(budget * trace.saved_bytes), f"traced at micro-batch {mb}; {BUDGET_NOTE}", fwd_bwd, None
    # the published formula knows no checkpointing or full checkpointing (selective and every:N: no cross-check)
    partial = cfg.activation_checkpointing and cfg.ac_mode != "full"
    check = None if partial else formula_check(spec, mb, run_as, cfg.activation_checkpointing, trace.saved_bytes)
    note = f"traced at micro-batch {mb}"
    if cfg.activation_checkpointing and cfg.ac_mode == "selective":  # kept by the policy's cache, not autograd
        note += "; the outputs the selective policy keeps are in the working peak, not here"
    return trace.saved_bytes, note, fwd_bwd, check


def rank_spec(spec: ModelSpec, s: RankMemory) -> ModelSpec:
    """The model as this rank traces it: on its chunk of the positions where the method splits the sequence."""
    return dataclasses.replace(spec, seq_len=s.trace_seq_len) if s.trace_seq_len else spec


def _trace(spec: ModelSpec, mb: int, *args: Any) -> Trace:
    """``trace_step``, where a user's model whose forward or backward raises on the fake micro-batch is one line
    naming it (a user's mistake, as train would meet it); a built-in model's failure keeps its traceback (a bug)."""
    try:
        return trace_step(spec, mb, *args)
    except StratbenchError:
        raise
    except Exception as exc:
        if ":" not in spec.model or is_hf_name(spec.model):
            raise
        x, _ = spec.example_batch(mb, torch.float32)
        raise ConfigError(
            f"model {spec.model!r}: one forward and backward on a micro-batch of shape {tuple(x.shape)} (fake "
            f"tensors) raised {one_line(exc)}"
        ) from None


def _cpu_library(
    cfg: TrainConfig, spec: ModelSpec, s: RankMemory, mb: int, native_16bit: dict[str, bool] | None
) -> tuple[int, str]:
    """The CPU math-library row (``cpu_library_bytes``) for the kernels this rank's traced step runs: a 16-bit one
    counts its distinct matrix products, attentions and convolutions. A pipeline stage (no step of its own is
    traced) takes the whole model's, its products and attentions only where it runs a Linear."""
    run_as = s.trace_precision or cfg.precision
    if SPECS[run_as].compute_dtype.itemsize >= 4:
        return cpu_library_bytes(cfg.precision, native_16bit=native_16bit)
    t = _trace(rank_spec(spec, s), mb, run_as, traced_transforms(cfg), "cpu", s.trace_transform)
    runs = s.runs_linear is not False
    return cpu_library_bytes(
        cfg.precision, t.products * runs, t.attentions * runs, t.convolutions, native_16bit=native_16bit
    )


def _working_peak(trace: Trace, grad_fraction: float, kept_grads: int) -> int:
    """The traced forward/backward peak with ``grad_fraction`` of the gradients as they appear; with
    accumulation (``kept_grads`` > 0) the micro-steps after the first start with the kept gradients whole."""
    return max(trace.peak(grad_fraction), max(trace.nongrad, default=0) + kept_grads)


def formula_check(
    spec: ModelSpec, micro_batch: int, precision: str, recompute: bool, traced: int
) -> dict[str, Any] | None:
    """A transformer's activations by the published formula (``activation_formula``) at this micro-batch, with
    the traced bytes and the formula's relative difference from them: a built-in size, or a Hugging Face config of
    that kind (``zoo.decoder_shape``); None for other models (no known shape to put into it)."""
    shape = decoder_shape(spec.model, spec.num_classes) if spec.is_text else None
    if shape is None:
        return None
    f = formula_activations(shape, micro_batch, spec.seq_len, precision, recompute)
    return {
        **f.to_dict(),
        "traced_bytes": traced,
        "difference": (f.bytes - traced) / traced if traced else None,
    }


def dequant_working_bytes(cfg: TrainConfig, info: ModelInfo) -> tuple[int, str]:
    """(bytes, note) of QLoRA's dequantisation of one NF4 or int8 weight at a time in forward and backward: the
    largest quantised Linear's (``quantize_base.working_bytes``; FSDP2 gathers whole layers, so the same on any
    rank); (0, "") without ``--quantize-base``."""
    names = set(quantized_names(info.linear_names, cfg))
    if not names:
        return 0, ""
    largest = max(i * o for n, (i, o) in zip(info.linear_names, info.linear_features, strict=True) if n in names)
    got = working_bytes(cfg.quantize_base, largest, SPECS[cfg.precision].param_dtype.itemsize)
    kind = cfg.quantize_base.upper()
    return got, f"the largest {kind} weight ({largest:,} elements) dequantised to compute, one layer at a time"


def _held_bytes(x: RankMemory) -> int:
    """A rank's device bytes of model states, buckets, gathered parameters and own activations (the busiest
    rank is the one the estimate reports)."""
    return x.params + x.grads + x.optim + x.master + x.buckets + x.gathered + (x.activations or 0)


def _step_scratch(cfg: TrainConfig, s: RankMemory, info: ModelInfo, device_type: str) -> int:
    """Optimizer-step temporaries: the method's own count where it gives one, else the foreach optimizer
    kernels' one parameter-sized list (their default on CUDA), else traced on a CPU for this rank's share."""
    if s.step_scratch is not None:
        return s.step_scratch
    if device_type == "cuda":  # LoRA: the kernels' list covers the parameters stepped, the adapters (s.grads)
        return max(s.optim // max(1, opt_slots(cfg)), s.grads if cfg.lora_rank > 0 else s.params)
    # traced; a sharded rank steps its share of each parameter
    share = s.params / max(1, info.total * SPECS[cfg.precision].param_dtype.itemsize)
    adapters = [n for n, _ in adapter_shapes(info.linear_names, info.linear_features, cfg)]
    if adapters:  # LoRA: the per-parameter loop's temporaries are the largest adapter's, not the base's
        share = max(adapters) / max(info.numels)
    return int(cpu_step_scratch(cfg) * min(1.0, share))


def _state_rows(
    cfg: TrainConfig, s: RankMemory, saved: int, saved_note: str, fwd_bwd_traced: int, step_temp: int
) -> list[Row]:
    """The breakdown's rows of model states, activations and step scratch (the CPU's rows come after)."""

    def r(name: str, dev: int, host: int = 0, note: str = "") -> Row:
        return Row(name, int(dev), int(host), note)

    return [
        r("parameters", s.params, s.host_params, s.sharding_note),
        r("gradients", s.grads, s.host_grads, "kept after backward"),
        r("optimizer states", s.optim, s.host_optim, optimizer_note(cfg)),
        r(
            "fp32 master weights",
            s.master,
            s.host_master,
            "DeepSpeed flat fp32 partition" if s.master or s.host_master else "none (weights are the master)",
        ),
        r("gradient buckets", s.buckets, 0, s.bucket_note),
        r("gathered parameters", s.gathered, 0, s.gather_note),
        r("activations saved for backward", saved, 0, saved_note),
        r(
            "forward/backward working peak",
            fwd_bwd_traced,
            0,
            "activations + temporaries + gradients as they appear (traced)",
        ),
        r("optimizer step scratch", step_temp, 0, "foreach kernels / fp32 gradient partition"),
    ]


def cpu_library_bytes(
    precision: str,
    products: int = 0,
    attentions: int = 0,
    convolutions: int = 0,
    native_16bit: dict[str, bool] | None = None,
) -> tuple[int, str]:
    """Bytes the CPU math libraries keep across steps for ``precision`` on this CPU (``CPU_LIBRARY_BYTES``) and a
    note naming the kernel path. torch runs bf16/fp16 convolutions and matrix products in oneDNN only where the
    CPU supports them natively (``torch.ops.mkldnn._is_mkldnn_bf16_supported``), in its own kernels otherwise;
    there oneDNN keeps JIT-compiled kernels for each distinct problem: ``products``, ``attentions`` and
    ``convolutions``, the distinct 16-bit ones a traced step runs (``Trace``). ``native_16bit``: {"bf16": ...,
    "fp16": ...} of the CPU the run used (``native_16bit_of`` its environment), this CPU's when None."""
    compute = SPECS[precision].compute_dtype
    if compute == torch.float64:
        return CPU_LIBRARY_BYTES["fp64"], "MKL buffers (fp64, no oneDNN), measured constant"
    if compute.itemsize >= 4:
        return CPU_LIBRARY_BYTES["fp32"], "oneDNN/MKL scratch and primitive cache, measured constant"
    name = str(compute).removeprefix("torch.")
    key = "bf16" if compute == torch.bfloat16 else "fp16"
    native = cpu_native_16bit(compute) if native_16bit is None else bool(native_16bit.get(key))
    if not native:
        return CPU_LIBRARY_BYTES["16-bit reference"], f"no native {name} on this CPU: torch's own kernels"
    c = CPU_LIBRARY_BYTES
    base = c["fp32"] if convolutions else c["16-bit reference"]
    total = base + products * c["16-bit product"] + attentions * c["16-bit attention"]
    kernels = f"{products} matrix products, {attentions} fused attentions" + ", convolutions" * bool(convolutions)
    return total, f"oneDNN {name}, native on this CPU: JIT kernels of {kernels}, measured per kernel"


def native_16bit_of(environment: dict | None) -> dict[str, bool] | None:
    """Whether the CPU a run's ``environment`` describes ran bf16/fp16 in oneDNN (written by the run since
    2026-11-24; for older records, torch's rule: bf16 where its CPU capability is AVX512, fp16 never); None
    when the environment says nothing (then the estimate asks this CPU)."""
    env = environment or {}
    if isinstance(env.get("cpu_native_16bit"), dict):
        return {k: bool(v) for k, v in env["cpu_native_16bit"].items()}
    if env.get("cpu_capability"):
        return {"bf16": env["cpu_capability"] == "AVX512", "fp16": False}
    return None


def _device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def predict_peak_bytes(
    config: dict, world_size: int, device_type: str | None = None, environment: dict | None = None
) -> int | None:
    """Predicted allocator peak per device for a run's config (``result["config"]``) on the CPU its
    ``environment`` names (a report re-rendered on another machine gives the same numbers); None when the
    config cannot be estimated (an unknown strategy, a model that cannot be built on fake tensors)."""
    try:
        cfg = from_dict(TrainConfig, dict(config))
        native = native_16bit_of(environment)
        return estimate(cfg, world_size, device_type or _device_type(cfg), native_16bit=native).peak_bytes
    except Exception:  # an estimate must never break the report it sits in
        return None


def max_batch(
    cfg: TrainConfig, world_size: int, device_memory: int, device_type: str = "cuda", limit: int = 1 << 20
) -> tuple[int, Estimate | None]:
    """Largest global batch (a multiple of world size x grad accumulation) whose device total fits.

    Memory grows about linearly with the batch, so the search starts at the linear solution through the
    first two multiples and brackets the answer around it with growing steps, then bisects: a few traces, each
    of which costs seconds for a billion-parameter model, rather than a doubling search from 1."""
    step = world_size * cfg.grad_accum
    seen: dict[int, Estimate] = {}

    def at(k: int) -> Estimate:
        if k not in seen:
            seen[k] = estimate(cfg.replace(batch_size=k * step), world_size, device_type)
        return seen[k]

    def fits(k: int) -> bool:
        return at(k).total_bytes <= device_memory

    if not fits(1):
        return 0, None
    if limit == 1:
        return step, at(1)
    per = max(1, at(2).total_bytes - at(1).total_bytes)
    guess = min(limit, max(1, 1 + (device_memory - at(1).total_bytes) // per))
    lo, hi = _bracket(fits, guess, limit)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step, at(lo)


def _bracket(fits, guess: int, limit: int) -> tuple[int, int]:
    """(lo, hi) with fits(lo) and not fits(hi), found from ``guess`` with steps that double (fits(1) holds);
    hi = limit + 1 when even ``limit`` fits."""
    gap = 1
    if fits(guess):
        lo = guess
        while lo < limit:
            hi = min(limit, lo + gap)
            if not fits(hi):
                return lo, hi
            lo, gap = hi, gap * 2
        return limit, limit + 1
    hi = guess
    while True:
        lo = max(1, hi - gap)
        if fits(lo):
            return lo, hi
        hi, gap = lo, gap * 2


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024**4}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'80GiB', '24GB', '512MiB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {text!r}; write e.g. 80GiB, 24GB, 512MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or not math.isfinite(value):
        raise ConfigError(f"memory size must be positive, got {text!r}")
    return int(value)
