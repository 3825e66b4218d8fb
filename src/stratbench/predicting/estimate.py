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
import functools
import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import ConfigError
from stratbench.core.precision import cpu_native_16bit

GiB = 1024**3
MiB = 1024**2

# Per-process memory outside the tensors the allocator hands out, by device type. CUDA: the context (driver,
# kernels of torch/cuDNN/cuBLAS loaded lazily) measured by nvidia-smi for a process that has run a ResNet
# step is 0.4-0.6 GiB on recent drivers (the source quotes 0.3-0.5 GB); the caching allocator reserves more
# than it hands out (block rounding, fragmentation), typically a few percent at steady state.
OVERHEAD: dict[str, dict[str, float]] = {
    "cuda": {"context_bytes": 512 * MiB, "allocator_slack": 0.05},
    "cpu": {"context_bytes": 0, "allocator_slack": 0.0},
}
# CPU: memory the math libraries keep across steps, outside the traced tensors (oneDNN's primitive cache and
# scratch, MKL's GEMM buffers). How much depends on which kernels torch picks for the compute dtype on this CPU:
# oneDNN for fp32, and for bf16/fp16 only where the CPU runs them natively (torch's own reference kernels
# otherwise, which keep next to nothing); with native 16-bit, oneDNN's 16-bit matrix products (a Linear layer)
# add a second block once per process, whatever their number. Measured with stratbench.measuring.memprobe (bytes in use at
# the start of step 2 above the baseline, minus the model states) on tinynet width 8 and 32, ResNet-18 and a
# 3-Linear MLP, 1 and 2 ranks, AMD EPYC with AVX512-BF16, 2026-11-23 (docs/memory.md, "CPU runtime rows").
CPU_LIBRARY_BYTES: dict[str, int] = {
    "fp32": 2 * MiB,  # oneDNN + MKL: 1.79-2.86 MiB (also the base of native 16-bit: 1.93 on a stage with no Linear)
    "fp64": 2 * MiB,  # MKL (oneDNN has no fp64) and im2col: 0.85-3.68 MiB (tinynet 16 px to ResNet-18 32 px)
    "16-bit matmul": 5 * MiB // 4,  # + oneDNN's bf16 matrix products: +1.23-1.50 MiB over fp32, 1 or 3 Linears
    "16-bit reference": MiB // 4,  # torch's own kernels, no native 16-bit (oneDNN off): 0.03-0.35 MiB
}
# FSDP2 on CPU: DTensor's sharding propagation runs each new op on fake tensors, which record their stack; the
# source lines of those frames stay in Python's linecache, and its cache of op schemas stays too. Not tensor
# memory (on a GPU it is host memory), but malloc's on a CPU: 0.31-0.34 MiB above the other methods, measured
# at 2 ranks (tinynet, fp32 and bf16-mixed; tracemalloc names linecache and torch/distributed/tensor).
CPU_FSDP2_RUNTIME_BYTES = MiB // 3

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes; traced sizes are rounded alike.
ROUND_BYTES = {"cuda": 512, "cpu": 1}

# DeepSpeed defaults that size its buffers (elements), from deepspeed/runtime/zero/config.py.
DS_REDUCE_BUCKET = 500_000_000
DS_PARAM_PERSISTENCE = 100_000
DS_PREFETCH_BUCKET = 50_000_000


# ------------------------------------------------------------------------------------------------
# The model: parameter shapes and the units each method wraps, from a model built on fake tensors.


@dataclass(frozen=True)
class ModelSpec:
    """What identifies a model build (hashable, so traces are cached per model)."""

    model: str
    num_classes: int
    image_size: int
    cifar_stem: bool = False
    norm: str = "group"
    width: int = 32

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> ModelSpec:
        from stratbench.data.datasets import default_image_size

        classes = cfg.num_classes if cfg.data in ("synthetic", "imagefolder") else 10
        return cls(cfg.model, classes, default_image_size(cfg), cfg.cifar_stem, cfg.norm, cfg.width)

    def build(self) -> nn.Module:
        """The model; under a FakeTensorMode, a user model with lazy modules (which that mode cannot construct)
        is built on the meta device and given fake parameters of the shapes its dry forward created."""
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode()
        if mode is not None and ":" in self.model and _has_lazy_modules(self):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily(), torch.device("meta"):
                model = self._build()
            return _with_fake_tensors(model)
        return self._build()

    def _build(self) -> nn.Module:
        from stratbench.models.zoo import build_model

        return build_model(
            self.model, self.num_classes, cifar_stem=self.cifar_stem, norm=self.norm, width=self.width,
            sample_shape=(3, self.image_size, self.image_size),
        )


@functools.cache
def _has_lazy_modules(spec: ModelSpec) -> bool:
    """Whether the user's model holds lazy modules (built once on the meta device, outside any fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from stratbench.models.zoo import build_model, has_lazy_parameters

    with unset_fake_temporarily(), torch.device("meta"):
        return has_lazy_parameters(build_model(spec.model, spec.num_classes, width=spec.width, norm=spec.norm))


def _with_fake_tensors(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device) with every parameter and buffer replaced by an empty tensor of the same
    shape and dtype made in the active fake mode (fake CPU tensors: no memory, usable by the traces)."""
    for module in model.modules():
        for name, t in module._parameters.items():
            if t is not None:
                module._parameters[name] = nn.Parameter(torch.empty(t.shape, dtype=t.dtype), t.requires_grad)
        for name, t in module._buffers.items():
            if t is not None:
                module._buffers[name] = torch.empty(t.shape, dtype=t.dtype)
    return model


@dataclass
class ModelInfo:
    """Parameter numels in ``model.parameters()`` order and the wrapping units of FSDP2 / FSDP1."""

    numels: list[int]
    dim0: list[int]
    block_units: list[list[int]]
    """FSDP2 wrapping: one unit per residual block (indices into numels), the root unit last."""
    layer_units: list[list[int]]
    """FSDP1 as the source wraps it: one unit per Linear/Conv2d, the root unit (the rest) last."""
    buffer_bytes: int
    linear_names: tuple[str, ...] = ()
    """Qualified names of the nn.Linear modules (a CPU's 16-bit matrix products keep oneDNN buffers)."""

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def largest_layer(self) -> int:
        return max((sum(self.numels[i] for i in u) for u in self.layer_units), default=0)


@functools.cache
def model_info(spec: ModelSpec) -> ModelInfo:
    """Shapes of the real model, built under FakeTensorMode so that even a huge model costs no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stratbench.models.zoo import residual_block_types

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = spec.build()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}

    def units(is_unit) -> list[list[int]]:
        taken: set[int] = set()
        out: list[list[int]] = []
        for m in model.modules():
            if m is not model and is_unit(m):
                ids = [index[id(p)] for p in m.parameters() if index[id(p)] not in taken]
                taken.update(ids)
                if ids:
                    out.append(ids)
        out.append([i for i in range(len(params)) if i not in taken])
        return out

    block_types = residual_block_types(model)
    return ModelInfo(
        numels=[p.numel() for p in params],
        dim0=[p.shape[0] if p.dim() else 1 for p in params],
        block_units=units(lambda m: bool(block_types) and isinstance(m, block_types)),
        layer_units=units(lambda m: isinstance(m, (nn.Linear, nn.Conv2d))),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        linear_names=tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear)),
    )


# ------------------------------------------------------------------------------------------------
# Activations: one forward/backward traced on fake tensors, live bytes recorded after every op.


@dataclass
class Trace:
    """Live bytes after each op of one forward+backward; gradients kept apart so sharding can scale them."""

    batch: int
    nongrad: list[int]
    grad: list[int]
    saved_bytes: int
    """Bytes of the tensors autograd saved for backward (activations), parameters excluded."""
    grad_bytes: int
    """Bytes of all gradients at the end of backward."""

    def peak(self, grad_fraction: float = 1.0) -> int:
        """Peak of (activations + temporaries + the kept fraction of gradients) over the step."""
        return int(
            max((a + grad_fraction * g for a, g in zip(self.nongrad, self.grad, strict=True)), default=0)
        )


class _LiveBytes:
    """TorchDispatchMode body: counts each new storage once, frees it when the storage object dies."""

    def __init__(self, round_to: int) -> None:
        self.round_to = round_to
        self.sizes: dict[int, int] = {}
        self.grad_keys: set[int] = set()
        self.nongrad = 0
        self.grad = 0
        self.nongrad_t: list[int] = []
        self.grad_t: list[int] = []

    def _size(self, nbytes: int) -> int:
        r = self.round_to
        return max(r, -(-nbytes // r) * r) if r > 1 else nbytes

    def exclude(self, t: torch.Tensor) -> None:
        """Storage counted elsewhere (the parameters and buffers the model states already hold): their views
        and aliases (``detach``, ``aten.t``, FSDP's unsharded views) must not be counted again as new memory."""
        self.sizes[id(t.untyped_storage())] = 0

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.sizes:
            return
        size = self._size(st.nbytes())
        self.sizes[key] = size
        self.nongrad += size
        weakref.finalize(st, self._free, key)

    def mark_grad(self, t: torch.Tensor) -> None:
        self.track(t)
        key = id(t.untyped_storage())
        if key not in self.grad_keys:
            self.grad_keys.add(key)
            self.nongrad -= self.sizes[key]
            self.grad += self.sizes[key]
        self.sample()

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key, 0)
        if key in self.grad_keys:
            self.grad_keys.discard(key)
            self.grad -= size
        else:
            self.nongrad -= size

    def sample(self) -> None:
        self.nongrad_t.append(self.nongrad)
        self.grad_t.append(self.grad)


def _dispatch_mode(live: _LiveBytes):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytesMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    live.track(t)
            live.sample()
            return out

    return LiveBytesMode()


@functools.cache
def trace_step(
    spec: ModelSpec,
    batch: int,
    precision: str,
    activation_checkpointing: bool = False,
    device_type: str = "cuda",
) -> Trace:
    """Trace one forward+backward at ``batch`` on fake tensors (CPU kernels' shapes, CUDA's block rounding)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stratbench.core.precision import SPECS

    if precision not in SPECS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of: {', '.join(SPECS)}")
    pspec = SPECS[precision]
    live = _LiveBytes(ROUND_BYTES.get(device_type, 1))
    with FakeTensorMode(allow_non_fake_inputs=True):
        # Built in the weights' dtype: converting fake parameters afterwards (module.to) fails in torch 2.13
        # ("Couldn't swap Conv2d.weight"), which broke every fp16-true/bf16-true/fp64 estimate.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(pspec.param_dtype)
        try:
            model = spec.build()
        finally:
            torch.set_default_dtype(default_dtype)
        if activation_checkpointing:
            from stratbench.models.zoo import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        own = {id(p.untyped_storage()) for p in model.parameters()} | {
            id(b.untyped_storage()) for b in model.buffers()
        }
        for t in (*model.parameters(), *model.buffers()):
            live.exclude(t)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: live.mark_grad(p.grad))
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if id(st) not in own:
                saved[id(st)] = st.nbytes()
            return t

        autocast = (
            torch.autocast("cpu", dtype=pspec.compute_dtype)
            if pspec.autocast
            else torch.autocast("cpu", enabled=False)
        )
        with _dispatch_mode(live):
            x = torch.empty(batch, 3, spec.image_size, spec.image_size, dtype=pspec.param_dtype)
            y = torch.zeros(batch, dtype=torch.long)
            live.track(x)
            live.track(y)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        grad_bytes = sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        )
    return Trace(batch, live.nongrad_t, live.grad_t, sum(saved.values()), grad_bytes)


def cpu_step_scratch(cfg: TrainConfig) -> int:
    """Bytes the optimizer step allocates beyond the model states on a CPU: traced, like the forward/backward,
    by running two steps of the real optimizer on fake parameters (the first creates the state) and keeping
    the live bytes of the second. On a CPU torch's optimizers take the per-parameter loop, so this is the
    temporaries of the largest parameter (e.g. weight decay's ``grad + wd * param``, AdamW's denominator)."""
    from stratbench.core.optim import optimizer_spec
    from stratbench.core.precision import SPECS

    opt = optimizer_spec(cfg)
    try:
        key = tuple(sorted(opt.kwargs.items()))
        hash(key)
    except TypeError:  # an unhashable option: trace without the cache
        return _trace_step_scratch.__wrapped__(
            ModelSpec.from_config(cfg), SPECS[cfg.precision].param_dtype, opt.cls, tuple(opt.kwargs.items())
        )
    return _trace_step_scratch(ModelSpec.from_config(cfg), SPECS[cfg.precision].param_dtype, opt.cls, key)


@functools.cache
def _trace_step_scratch(spec: ModelSpec, dtype: torch.dtype, cls: type, kwargs: tuple) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    live = _LiveBytes(1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = spec.build()
        finally:
            torch.set_default_dtype(default_dtype)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = cls(params, **dict(kwargs))
        optimizer.step()
        for p in params:
            live.exclude(p)
            live.exclude(p.grad)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    live.exclude(v)
        with _dispatch_mode(live):
            optimizer.step()
    return max(live.nongrad_t, default=0)


# ------------------------------------------------------------------------------------------------
# Sharding arithmetic the strategies' memory models share.


def zero_partition(numels: list[int], world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition (torch/distributed/optim/zero_redundancy_optimizer.py): parameters
    sorted by size, largest first, each given to the rank with the fewest elements so far (first on ties)."""
    sizes = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):  # stable, like torch's sorted
        r = sizes.index(min(sizes))
        owned[r].append(i)
        sizes[r] += numels[i]
    return owned


def chunk_rows(dim0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 torch.chunk that rank holds (FSDP2's sharding: the last ranks may get fewer or none)."""
    size = -(-dim0 // world)
    return max(0, min(dim0, (rank + 1) * size) - rank * size)


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RankMemory:
    """Model-state bytes of one rank, split by where they live, as a strategy's ``memory_model`` gives them."""

    params: int = 0
    grads: int = 0
    optim: int = 0
    master: int = 0
    buckets: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optim: int = 0
    host_master: int = 0
    step_scalars: int = 0
    """AdamW's per-parameter ``step`` counters (0-dim float32 tensors kept on the CPU)."""
    gathered: int = 0
    """Unsharded parameters held transiently around a unit's forward/backward (current + prefetched)."""
    gather_note: str = ""
    sharding_note: str = ""
    bucket_note: str = ""
    grads_whole_in_backward: bool = False
    """True where every gradient stays until a reduction at the end of backward (DeepSpeed ZeRO 0/1)."""
    step_scratch: int | None = None
    """Optimizer-step temporaries; None: the foreach kernels' rule (one parameter-sized list on CUDA)."""
    activations: int | None = None
    """Activations the method computes itself (a pipeline stage: its micro-batches in flight); None: the whole
    model traced at the per-device micro-batch."""
    activation_note: str = ""
    runs_linear: bool | None = None
    """Whether this rank runs an nn.Linear (a CPU's 16-bit matrix products keep buffers); None: the whole model
    runs on every rank, so it does if the model has one."""
    cpu_runtime: int = 0
    cpu_runtime_note: str = ""
    """Memory the method's own runtime keeps on a CPU outside tensors (FSDP2's DTensor caches)."""

    def offload_params_to_host(self, with_grads_and_optim: bool = False) -> None:
        self.host_params, self.params = self.host_params + self.params, 0
        if with_grads_and_optim:
            self.host_grads, self.grads = self.host_grads + self.grads, 0
            self.host_optim, self.optim = self.host_optim + self.optim, 0

    def offload_optimizer_to_host(self) -> None:
        self.host_optim, self.optim = self.host_optim + self.optim, 0
        self.host_master, self.master = self.host_master + self.master, 0


@dataclass
class MemoryContext:
    """What a strategy's memory model reads: the run config, world size, model shapes and parsed options."""

    cfg: TrainConfig
    world: int
    info: ModelInfo
    options: Any
    device_type: str = "cuda"

    @property
    def pspec(self):
        from stratbench.core.precision import SPECS

        return SPECS[self.cfg.precision]

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the weights the model holds."""
        return self.pspec.param_dtype.itemsize

    @property
    def half(self) -> bool:
        return self.pspec.compute_dtype.itemsize < 4

    @property
    def opt_slots(self) -> int:
        return opt_slots(self.cfg)

    @property
    def adam(self) -> bool:
        return self.cfg.optimizer == "adamw"

    def replicated(self, buckets: bool) -> RankMemory:
        """Every rank holds everything (single, DataParallel, DDP); DDP adds a bucket copy of the gradients."""
        n, pd = self.info.numels, self.param_bytes
        total = sum(n)
        with_buckets = buckets and self.world > 1
        return RankMemory(
            params=total * pd,
            grads=total * pd,
            optim=self.opt_slots * total * pd,
            step_scalars=4 * len(n) if self.adam else 0,
            buckets=total * pd if with_buckets else 0,
            bucket_note="DDP all-reduce buckets" if with_buckets else "",
            sharding_note="replicated" if self.world > 1 else "",
        )


def opt_slots(cfg: TrainConfig) -> int:
    """Optimizer state tensors per parameter: AdamW two, momentum SGD one, plain SGD none."""
    if cfg.optimizer == "adamw":
        return 2
    return 1 if cfg.momentum else 0


class NoMemoryModel(ConfigError):
    """The strategy has no memory model: the estimate says so instead of reporting 0."""


def rank_states(
    cfg: TrainConfig, world_size: int, rank: int, info: ModelInfo | None = None, device_type: str = "cuda"
) -> RankMemory:
    """Bytes of parameters, gradients, optimizer state (and master copies, buckets) that ``rank`` holds, from
    the strategy's own ``memory_model``."""
    from stratbench.strategies.base import get_strategy

    cls = get_strategy(cfg.strategy)
    info = info or model_info(ModelSpec.from_config(cfg))
    ctx = MemoryContext(cfg, world_size, info, cls.parse_options(cfg.strategy_options), device_type)
    states = cls.memory_model(ctx, rank)
    if states is None:
        raise NoMemoryModel(f"strategy {cfg.strategy!r} has no memory model (Strategy.memory_model)")
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


def micro_batch(cfg: TrainConfig, world_size: int) -> int:
    """Per-device micro-batch: the global batch split over data-parallel ranks and accumulation steps."""
    from stratbench.data.datasets import split_batch

    return split_batch(cfg.batch_size, world_size, cfg.grad_accum)


def estimate(
    cfg: TrainConfig, world_size: int, device_type: str = "cuda", native_16bit: dict[str, bool] | None = None
) -> Estimate:
    """The per-device breakdown for one method, on its most loaded rank (``native_16bit``: see
    ``cpu_library_bytes``)."""
    from stratbench.core.precision import SPECS

    if device_type not in OVERHEAD:
        raise ConfigError(f"unknown device type {device_type!r}; choose one of: {', '.join(OVERHEAD)}")
    spec = ModelSpec.from_config(cfg)
    info = model_info(spec)
    if cfg.precision not in SPECS:
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose one of: {', '.join(SPECS)}")
    world = world_size
    mb = micro_batch(cfg, world)
    states = [rank_states(cfg, world, r, info, device_type) for r in range(world)]
    s = max(
        states,
        key=lambda x: x.params + x.grads + x.optim + x.master + x.buckets + x.gathered + (x.activations or 0),
    )
    trace = trace_step(spec, mb, cfg.precision, cfg.activation_checkpointing, device_type)
    # Fraction of the traced (full) gradients that stays on the device through the backward pass.
    grad_fraction = 1.0 if s.grads_whole_in_backward else min(1.0, s.grads / (trace.grad_bytes or 1))
    resident = s.params + s.optim + s.master + s.buckets
    fwd_bwd_traced = trace.peak(grad_fraction)
    saved, saved_note = trace.saved_bytes, f"traced at micro-batch {mb}"
    if s.activations is not None:  # the method's own count (pipeline stages); gradients as they appear
        saved, saved_note, fwd_bwd_traced = s.activations, s.activation_note, s.activations + s.grads
    peak_fwd_bwd = resident + s.gathered + fwd_bwd_traced
    slots = opt_slots(cfg)
    step_temp = s.step_scratch
    if step_temp is None:  # the foreach optimizer kernels (default on CUDA) allocate one parameter-sized list
        if device_type == "cuda":
            step_temp = max(s.optim // max(1, slots), s.params)
        else:  # traced; a sharded rank steps its share of each parameter
            share = s.params / max(1, info.total * SPECS[cfg.precision].param_dtype.itemsize)
            step_temp = int(cpu_step_scratch(cfg) * min(1.0, share))
    linear = bool(info.linear_names) if s.runs_linear is None else s.runs_linear
    library, library_note = cpu_library_bytes(cfg.precision, linear, native_16bit) if device_type == "cpu" else (0, "")
    runtime = s.cpu_runtime if device_type == "cpu" else 0
    kernel = library + runtime
    peak_fwd_bwd += kernel
    peak_step = resident + s.grads + step_temp + kernel
    peak = max(peak_fwd_bwd, peak_step)
    ov = OVERHEAD[device_type]
    overhead = int(ov["context_bytes"] + ov["allocator_slack"] * peak)

    def r(name: str, dev: int, host: int = 0, note: str = "") -> Row:
        return Row(name, int(dev), int(host), note)

    rows = [
        r("parameters", s.params, s.host_params, s.sharding_note),
        r("gradients", s.grads, s.host_grads, "kept after backward"),
        r("optimizer states", s.optim, s.host_optim, f"{slots} per parameter ({cfg.optimizer})"),
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
    if device_type == "cpu":
        rows.append(r("CPU math-library buffers", library, 0, library_note))
    if runtime:
        rows.append(r("method runtime (CPU)", runtime, 0, s.cpu_runtime_note))
    return Estimate(
        strategy=cfg.strategy,
        precision=cfg.precision,
        world_size=world,
        micro_batch=mb,
        device_type=device_type,
        rows=rows,
        peak_fwd_bwd=int(peak_fwd_bwd),
        peak_step=int(peak_step),
        peak_bytes=int(peak),
        overhead_bytes=overhead,
        total_bytes=int(peak + overhead),
        host_bytes=int(s.host_params + s.host_grads + s.host_optim + s.host_master),
        num_parameters=info.total,
        per_rank_states=model_state_bytes(cfg, world),
    )


def cpu_library_bytes(
    precision: str, runs_linear: bool = True, native_16bit: dict[str, bool] | None = None
) -> tuple[int, str]:
    """Bytes the CPU math libraries keep across steps for ``precision`` on this CPU (``CPU_LIBRARY_BYTES``) and a
    note naming the kernel path. torch runs bf16/fp16 convolutions and matrix products in oneDNN only where the
    CPU supports them natively (``torch.ops.mkldnn._is_mkldnn_bf16_supported``), in its own kernels otherwise;
    ``runs_linear``: the process runs a matrix product (an nn.Linear); ``native_16bit``: {"bf16": ..., "fp16": ...}
    of the CPU the run used (``native_16bit_of`` its environment), this CPU's when None."""
    from stratbench.core.precision import SPECS

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
    extra = CPU_LIBRARY_BYTES["16-bit matmul"] if runs_linear else 0
    note = f"oneDNN {name}, native on this CPU" + (" (+ its matrix-product buffers)" if runs_linear else "")
    return CPU_LIBRARY_BYTES["fp32"] + extra, note + ", measured constant"


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
    """Largest global batch (a multiple of world size x grad accumulation) whose device total fits."""
    step = world_size * cfg.grad_accum

    def fits(b: int) -> Estimate | None:
        e = estimate(cfg.replace(batch_size=b), world_size, device_type)
        return e if e.total_bytes <= device_memory else None

    if fits(step) is None:
        return 0, None
    # Two small traces give the per-sample cost; start the search near the linear solution.
    lo, hi = 1, 2
    e1 = estimate(cfg.replace(batch_size=step), world_size, device_type)
    e2 = estimate(cfg.replace(batch_size=2 * step), world_size, device_type)
    per = max(1, e2.total_bytes - e1.total_bytes)
    guess = max(1, int((device_memory - e1.total_bytes) / per) + 1)
    lo, hi = 1, max(2, min(limit, guess))
    while fits(hi * step) is not None and hi < limit:
        lo, hi = hi, min(limit, hi * 2)
    if fits(hi * step) is not None:
        return hi * step, fits(hi * step)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid * step) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, fits(lo * step)


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
