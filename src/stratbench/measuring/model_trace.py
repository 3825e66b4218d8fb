"""The model as the estimate and the strategies' cost models see it, read without allocating any memory: its
parameter shapes and wrapping units (``model_info``, built under ``FakeTensorMode``), and the live bytes of one
forward/backward (``trace_step``) and of one optimizer step (``cpu_step_scratch``) traced op by op on fake tensors.

Below the strategies and the estimate: it imports nothing of either (docs/memory.md explains the traces).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.optim import optimizer_spec
from stratbench.core.precision import SPECS
from stratbench.data.datasets import default_image_size, split_batch
from stratbench.models.zoo import (
    apply_activation_checkpointing,
    build_model,
    has_lazy_parameters,
    residual_block_types,
)

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes; traced sizes are rounded alike.
ROUND_BYTES = {"cuda": 512, "cpu": 1}


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
        return build_model(
            self.model,
            self.num_classes,
            cifar_stem=self.cifar_stem,
            norm=self.norm,
            width=self.width,
            sample_shape=(3, self.image_size, self.image_size),
        )


@functools.cache
def _has_lazy_modules(spec: ModelSpec) -> bool:
    """Whether the user's model holds lazy modules (built once on the meta device, outside any fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        return has_lazy_parameters(
            build_model(spec.model, spec.num_classes, width=spec.width, norm=spec.norm)
        )


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


def micro_batch(cfg: TrainConfig, world_size: int) -> int:
    """Per-device micro-batch: the global batch split over data-parallel ranks and accumulation steps."""
    return split_batch(cfg.batch_size, world_size, cfg.grad_accum)
