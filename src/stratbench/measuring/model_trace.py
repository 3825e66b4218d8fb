"""The model as the estimate and the strategies' cost models see it, read without allocating any memory: its
parameter shapes and wrapping units (``model_info``, built under ``FakeTensorMode``), and the live bytes of one
forward/backward (``trace_step``) and of one optimizer step (``cpu_step_scratch``) traced op by op on fake tensors.

Below the strategies and the estimate: it imports nothing of either (docs/memory.md explains the traces).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.optim import QuantizedStates, optimizer_spec
from stratbench.core.precision import SPECS, spec_of
from stratbench.data.datasets import (
    SampleShape,
    default_image_size,
    is_user_data,
    split_batch,
    user_data_shape,
)
from stratbench.data.text import ByteCodec, build_text_data, is_ft_data, is_text_data, load_tokenizer
from stratbench.models.blocks import describe_units, find_blocks, why_no_blocks, wrap_units
from stratbench.models.flops import OpCost, op_cost, storage_of
from stratbench.models.split import piece_module, pieces_of
from stratbench.models.transforms import Transform, apply_traced
from stratbench.models.transforms.lora import linear_layers
from stratbench.models.zoo import build_model, has_lazy_parameters

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes; traced sizes are rounded alike.
ROUND_BYTES = {"cuda": 512, "cpu": 1}


# ------------------------------------------------------------------------------------------------
# The model: parameter shapes and the units each method wraps, from a model built on fake tensors.


@dataclass(frozen=True)
class ModelSpec(SampleShape):
    """What identifies a model build (hashable, so traces are cached per model): an image classifier with
    ``num_classes`` outputs on ``image_size`` pixels, or, with ``seq_len``, a language model whose inputs are
    ``seq_len`` token ids (int64) per sample and whose output width ``num_classes`` is its vocabulary."""

    model: str
    num_classes: int
    image_size: int
    cifar_stem: bool = False
    norm: str = "group"
    width: int = 32
    seq_len: int | None = None
    """Text data: tokens per sample (None: an image model)."""
    input_shape: tuple[int, ...] | None = None
    """A user's data whose input is no square image (a row of features): its shape (``SampleShape``)."""
    moe_top_k: int | None = None
    """A mixture of experts' routing where the run overrides its size's (``--moe-top-k``, ``--capacity-factor``)."""
    capacity_factor: float | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> ModelSpec:
        if is_text_data(cfg.data):  # the image-only fields keep their defaults: one cache entry per LM build
            return cls(cfg.model, text_vocab(cfg), 0, seq_len=cfg.seq_len, moe_top_k=cfg.moe_top_k,
                       capacity_factor=cfg.capacity_factor)  # fmt: skip
        if is_user_data(cfg.data):  # a builder or a table: its items' shape and classes
            shape = user_data_shape(cfg)
            if shape.multi_input:
                raise ConfigError(f"data {cfg.data!r} gives the model several input tensors; the estimate traces "
                                  "a model of one input (the run itself takes it)")  # fmt: skip
            return cls(cfg.model, shape.classes, shape.image_size, cfg.cifar_stem, cfg.norm, cfg.width,
                       input_shape=shape.input_shape)  # fmt: skip
        classes = cfg.num_classes if cfg.data in ("synthetic", "imagefolder") else 10
        return cls(cfg.model, classes, default_image_size(cfg), cfg.cifar_stem, cfg.norm, cfg.width)

    def example_batch(self, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one micro-batch as the loop feeds them: int64 token ids and the next token per
        position, or pixels in the weights' dtype (``Precision.convert_input``) and one class per sample."""
        if self.seq_len is not None:
            tokens = torch.zeros(batch, self.seq_len, dtype=torch.long)
            return tokens, torch.zeros(batch, self.seq_len, dtype=torch.long)
        x = torch.empty(batch, *self.sample_shape, dtype=dtype)
        return x, torch.zeros(batch, dtype=torch.long)

    def build(self) -> nn.Module:
        """The model; under a FakeTensorMode, a language model or a user model with lazy modules (which that
        mode cannot construct: Llama's ``trunc_normal_`` init tests a mask, a data-dependent branch; a lazy
        module needs a dry forward) is built on the meta device and given fake parameters of the same shapes; a
        model whose constructor computes from tensor values (RegNet) is built on the CPU and given them."""
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if detect_fake_mode() is None:
            return self._build()
        if self.is_text or ":" in self.model and _has_lazy_modules(self):
            with unset_fake_temporarily(), torch.device("meta"):
                model = self._build()
            return _with_fake_tensors(model)
        try:
            return self._build()
        except ConfigError as exc:
            if "DataDependentOutput" not in str(exc):
                raise
        with unset_fake_temporarily():  # a constructor that computes from tensor values (RegNet's widths): on
            model = self._build()  # the CPU, then the same fake tensors
        return _with_fake_tensors(model)

    def _build(self, materialize: bool = True) -> nn.Module:
        """``materialize``: give lazy modules their parameters (a dry forward on one sample)."""
        return build_model(
            self.model,
            self.num_classes,
            cifar_stem=self.cifar_stem,
            norm=self.norm,
            width=self.width,
            sample_shape=self.sample_shape if materialize else None,
            seq_len=self.seq_len,
            moe_top_k=self.moe_top_k,
            capacity_factor=self.capacity_factor,
        )


def text_vocab(cfg: TrainConfig) -> int:
    """The vocabulary a run of ``cfg`` gives its language model, decided by the data as ``data.text`` decides it:
    ``vocab_size`` where given (at least the tokenizer's, or 256 for byte-level text), else the tokenizer's,
    256 for byte-level text and synthetic tokens, and of token files without either their largest id + 1 (read
    from the files, as a run reads them)."""
    if cfg.data == "synthetic-tokens":
        return cfg.vocab_size or ByteCodec.vocab_size
    least = _tokenizer_vocab(cfg.tokenizer) if cfg.tokenizer else None
    if least is None and (cfg.data == "text" or is_ft_data(cfg.data)):
        least = ByteCodec.vocab_size
    if cfg.vocab_size is not None:
        if least is not None and cfg.vocab_size < least:
            what = f"tokenizer {cfg.tokenizer!r}" if cfg.tokenizer else "byte-level text"
            raise ConfigError(f"vocab_size {cfg.vocab_size} is smaller than the {least} tokens of {what}")
        return cfg.vocab_size
    if least is not None:
        return least
    return _token_file_vocab(cfg.data, cfg.data_dir, cfg.seq_len, cfg.val_fraction, cfg.token_dtype)


@functools.cache
def _tokenizer_vocab(path: str) -> int:
    return load_tokenizer(path).vocab_size


@functools.cache
def _token_file_vocab(
    data: str, data_dir: str | None, seq_len: int, val_fraction: float, token_dtype: str
) -> int:
    text = build_text_data(
        data, seq_len, data_dir=data_dir, val_fraction=val_fraction, token_dtype=token_dtype
    )
    return text.vocab_size


@functools.cache
def _has_lazy_modules(spec: ModelSpec) -> bool:
    """Whether the user's model holds lazy modules (built once on the meta device, outside any fake mode; on the
    CPU where its constructor reads tensor values, which meta tensors have not: RegNet's widths)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        try:
            with torch.device("meta"):
                return has_lazy_parameters(spec._build(materialize=False))
        except Exception:  # "Cannot copy out of meta tensor; no data!"; a real error comes again below
            return has_lazy_parameters(spec._build(materialize=False))


def _with_fake_tensors(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device) with every parameter and buffer replaced by an empty tensor of the same
    shape and dtype made in the active fake mode (fake CPU tensors: no memory, usable by the traces). A tensor
    shared by two modules (a head tied to the embedding) stays one tensor."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=t.dtype)
            made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = fake(t)
    return model


@dataclass
class ModelInfo:
    """Parameter numels in ``model.parameters()`` order and the wrapping units of FSDP2 / FSDP1."""

    numels: list[int]
    dim0: list[int]
    block_units: list[list[int]]
    """FSDP2 wrapping: one unit per block (``models.blocks``' rule; indices into numels), the root unit last (the
    only one where the model has no blocks)."""
    layer_units: list[list[int]]
    """FSDP1 as the source wraps it: one unit per Linear/Conv2d, the root unit (the rest) last."""
    buffer_bytes: int
    linear_names: tuple[str, ...] = ()
    """Qualified names of the nn.Linear modules (a CPU's 16-bit matrix products keep oneDNN buffers)."""
    linear_features: tuple[tuple[int, int], ...] = ()
    """(in, out) features of each of ``linear_names`` (LoRA's adapters are sized from them)."""
    blocks: str | None = None
    """The block units in words (``describe_units``); None where the model has none (``no_blocks`` says why)."""
    no_blocks: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Parameter shapes in ``numels``' order, as built (the lean optimizers' state depends on them)."""
    linear_weights: tuple[int, ...] = ()
    """Index into ``numels`` of each of ``linear_names``' weight (a quantised base stores these in 4 bits)."""

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """``shapes`` where they still describe ``numels``; one flat dimension each where a view replaced the
        numels (a tensor-parallel rank's slices: ``dataclasses.replace(info, numels=...)``)."""
        if len(self.shapes) == len(self.numels) and all(
            math.prod(s) == n for s, n in zip(self.shapes, self.numels, strict=True)
        ):
            return list(self.shapes)
        return [(n,) for n in self.numels]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def largest_layer(self) -> int:
        return max((sum(self.numels[i] for i in u) for u in self.layer_units), default=0)


def _values_unread(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An initialiser under FakeTensorMode, where values are never read: the tensor as it is."""
    return tensor


@contextlib.contextmanager
def fake_mode() -> Iterator[None]:
    """FakeTensorMode for building and tracing a model: shapes, no memory. torch's truncated normal initialiser
    (ViT, ConvNeXt) samples until its values fall in bounds, which reads values a fake tensor does not have: it
    leaves the tensor as it is here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), \
            mock.patch.object(torch.nn.init, "_no_grad_trunc_normal_", _values_unread):  # fmt: skip
        yield


def _fake_model(spec: ModelSpec) -> nn.Module:
    """The model built under ``fake_mode``: its shapes, no memory (any size)."""
    with fake_mode():
        return spec.build()


def _unit_indices(model: nn.Module, units: list[nn.Module]) -> list[list[int]]:
    """``units`` (children before parents) as indices into ``model.parameters()``: each unit's parameters not in
    a unit before it, then the root's (the rest) last."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    taken: set[int] = set()
    out: list[list[int]] = []
    for m in units:
        ids = [index[id(p)] for p in m.parameters() if index[id(p)] not in taken]
        taken.update(ids)
        if ids:
            out.append(ids)
    out.append([i for i in range(len(index)) if i not in taken])
    return out


def _linear_weight_indices(model: nn.Module, params: list[nn.Parameter]) -> tuple[int, ...]:
    """Where each nn.Linear's weight is in ``params`` (``linear_layers``' order)."""
    index = {id(p): i for i, p in enumerate(params)}
    return tuple(index[id(m.weight)] for m in model.modules() if isinstance(m, nn.Linear))


@functools.cache
def model_info(spec: ModelSpec) -> ModelInfo:
    """Shapes of the real model, built under FakeTensorMode so that even a huge model costs no memory."""
    model = _fake_model(spec)
    params = list(model.parameters())
    has_blocks = find_blocks(model) is not None
    blocks = wrap_units(model, "block", 0) if has_blocks else []
    layers = [m for m in model.modules() if m is not model and isinstance(m, (nn.Linear, nn.Conv2d))]
    linear_names, linear_features = linear_layers(model)
    return ModelInfo(
        numels=[p.numel() for p in params],
        dim0=[p.shape[0] if p.dim() else 1 for p in params],
        block_units=_unit_indices(model, blocks),
        layer_units=_unit_indices(model, layers),  # Linear/Conv2d do not nest
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        linear_names=linear_names,
        linear_features=linear_features,
        blocks=describe_units(model, "block", 0, blocks) if has_blocks else None,
        no_blocks="" if has_blocks else why_no_blocks(model),
        shapes=tuple(tuple(p.shape) for p in params),
        linear_weights=_linear_weight_indices(model, params),
    )


@dataclass(frozen=True)
class Units:
    """FSDP units as ``--wrap`` builds them: parameter indices per unit (the root last) and the line saying so."""

    indices: list[list[int]]
    note: str


@functools.cache
def wrap_units_of(spec: ModelSpec, wrap: str, min_params: int) -> Units:
    """The units fsdp's ``--wrap`` gives the model (``models.blocks.wrap_units``, as a run wraps it); a model
    without blocks under ``--wrap block`` is refused in the line a run refuses it with."""
    info = model_info(spec)
    if wrap in ("auto", "block") and info.blocks is not None:  # the usual case: no second build
        return Units(info.block_units, info.blocks)
    model = _fake_model(spec)
    units = wrap_units(model, wrap, min_params)
    return Units(_unit_indices(model, units), describe_units(model, wrap, min_params, units))


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
    products: int = 0
    """Distinct 16-bit matrix products the step runs (``_Kernels``)."""
    attentions: int = 0
    """Distinct 16-bit fused attention calls the step runs."""
    convolutions: int = 0
    """Distinct 16-bit convolutions the step's forward runs."""

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


# torch hands a 16-bit matrix product to oneDNN only above this many multiply-adds (m x k x n, batch included:
# ``checksize`` in aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones run torch's own kernel.
ONEDNN_MIN_PRODUCT = 16 * 16 * 16
_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
_ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)
_CONVOLUTION = ("aten::convolution",)


class _Kernels:
    """The distinct 16-bit matrix products, fused attentions and convolutions of a step. Where a CPU runs 16 bit
    natively, oneDNN builds one primitive per distinct problem (shapes, which operand is a transposed view, the
    op), JIT-compiles its kernels and keeps them for the process (the estimate's CPU math-library row)."""

    def __init__(self) -> None:
        self.products: set[tuple] = set()
        self.attentions: set[tuple] = set()
        self.convolutions: set[tuple] = set()

    def see(self, func, args: tuple) -> None:
        name = func._schema.name
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or tensors[-1].dtype not in (torch.bfloat16, torch.float16):
            return
        if name in _PRODUCTS and tensors[-2].numel() * tensors[-1].shape[-1] > ONEDNN_MIN_PRODUCT:
            self.products.add((name, *(_layout(t) for t in tensors[-2:])))
        elif name in _ATTENTION:
            self.attentions.add(tuple(_layout(t) for t in tensors[:3]))
        elif name in _CONVOLUTION:
            self.convolutions.add((*(_layout(t) for t in tensors[:2]), repr(args[3:])))


def _layout(t: torch.Tensor) -> tuple:
    """A tensor's shape and whether its last two dimensions are a transposed view (another oneDNN primitive)."""
    return tuple(t.shape), t.dim() >= 2 and t.stride(-2) == 1 and t.shape[-1] > 1


def _dispatch_mode(live: _LiveBytes, kernels: _Kernels | None = None):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytesMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if kernels is not None:
                kernels.see(func, args)
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
    transforms: tuple[Transform | str, ...] = (),
    device_type: str = "cuda",
    transform: Callable[[nn.Module], None] | None = None,
) -> Trace:
    """Trace one forward+backward at ``batch`` on fake tensors (CPU kernels' shapes, CUDA's block rounding);
    ``transform`` (hashable) changes the model in place first (a tensor-parallel rank's slice of it), then the
    model transforms in ``transforms`` apply (``models.transforms.traced``: activation checkpointing, LoRA's
    adapters), as the method's set-up applies them to the model it trains."""
    pspec = spec_of(precision)
    live, kernels = _LiveBytes(ROUND_BYTES.get(device_type, 1)), _Kernels()
    with fake_mode():
        model = _build_in(spec, pspec.param_dtype)
        if transform is not None:
            transform(model)
        model = apply_traced(model, transforms)
        for t in (*model.parameters(), *model.buffers()):
            live.exclude(t)
        for p in model.parameters():
            if p.requires_grad:  # a frozen one (LoRA's base) gets no gradient
                p.register_post_accumulate_grad_hook(lambda p: live.mark_grad(p.grad))
        saved = _SavedBytes(model)
        with _dispatch_mode(live, kernels):
            x, y = spec.example_batch(batch, pspec.param_dtype)
            live.track(x)
            live.track(y)
            with saved.hooks(), _autocast(pspec):
                # the logits stay alive through backward, as the loop keeps them (Strategy.forward_loss returns
                # them): a language model's are (batch, seq_len, vocab), often the largest tensor of the step
                logits = model(x)
                loss = _loss(logits, y)
            loss.backward()
            del logits
        grad_bytes = sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        )
    counts = map(len, (kernels.products, kernels.attentions, kernels.convolutions))
    return Trace(batch, live.nongrad_t, live.grad_t, saved.total, grad_bytes, *counts)


@functools.cache
def trace_ops(spec: ModelSpec, batch: int, precision: str) -> tuple[OpCost, ...]:
    """Every aten op of one forward+backward at ``batch`` (no optimizer step), traced on fake tensors as
    ``trace_step`` traces it (the run's precision and autocast, the loop's loss), each with its FLOPs, bytes moved
    and class (``models.flops.op_cost``): the roofline basis of the step-time projection. Eager: one kernel per
    op, nothing fused."""
    pspec = spec_of(precision)
    ops: list[OpCost] = []
    with fake_mode():
        model = _build_in(spec, pspec.param_dtype)
        with ops_recorder(ops):
            x, y = spec.example_batch(batch, pspec.param_dtype)
            with _autocast(pspec):
                loss = _loss(model(x), y)
            loss.backward()
    return tuple(ops)


def ops_recorder(ops: list[OpCost]):
    """A dispatch mode that appends each aten op it sees to ``ops`` with its ``op_cost`` (views and allocations
    left out): on fake tensors for a traced step, on real ones for `calibrate-hw`'s cases."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    alive: list = []  # every storage seen, so that no key is reused while recording (storages, not tensors:
    # a tensor held here would make autograd copy each gradient it would otherwise take over)

    class OpsMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            cost = op_cost(func, args, kwargs or {}, out)
            if cost is not None:
                ops.append(cost)
                alive.extend(storage_of(t) for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor))
            return out

    return OpsMode()


class _SavedBytes:
    """``saved_tensors_hooks``' pack: the bytes of each storage autograd saves for backward, counted once (views
    of one tensor are one storage), the model's own parameters and buffers excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.own = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        self.sizes: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in self.own:
            self.sizes[id(st)] = st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _autocast(pspec):
    """The loop's autocast for a precision (off where it runs the weights' dtype), on the traces' CPU tensors."""
    if pspec.autocast:
        return torch.autocast("cpu", dtype=pspec.compute_dtype)
    return torch.autocast("cpu", enabled=False)


@dataclass(frozen=True)
class PieceTrace:
    """What autograd saves for one piece of the model's pipeline split (``models.split.pieces_of``)."""

    name: str
    saved_bytes: int
    """Bytes saved for the piece's backward at the traced batch (the last piece's: with the loss's), parameters
    and the piece's input excluded."""
    input_bytes: int
    """Bytes of the piece's input its backward keeps (counted where a stage begins with this piece)."""


@functools.cache
def trace_pieces(
    spec: ModelSpec, batch: int, precision: str, transform: Callable[[nn.Module], None] | None = None
) -> tuple[PieceTrace, ...]:
    """The bytes autograd saves for each piece of the split at ``batch`` (a pipeline stage's activations: the sum
    over its pieces), traced as ``trace_step`` traces the whole model: on fake CPU tensors, in the run's precision
    and autocast, so that each op is the kernel a real run picks. Attention through
    ``scaled_dot_product_attention`` picks a fused kernel (CPU: flash; CUDA: flash or memory-efficient) that saves
    its output and a log-sum-exp per query, not the seq x seq scores that its math path on the meta device saves
    (8 GiB per Llama-3-8B layer and 8192-token sequence in fp32). ``transform`` as in ``trace_step`` (a
    tensor-parallel rank's slice)."""
    pspec = spec_of(precision)
    out = []
    with fake_mode():
        model = _build_in(spec, pspec.param_dtype)
        if transform is not None:
            transform(model)
        pieces = pieces_of(model)
        x, y = spec.example_batch(batch, pspec.param_dtype)
        with _autocast(pspec):
            for i, piece in enumerate(pieces):
                x = x.detach().requires_grad_(i > 0)  # a stage after the first gets its input's gradient
                saved = _SavedBytes(model)
                with saved.hooks():
                    out_x = piece_module(model, piece)(x)
                    if i == len(pieces) - 1:  # the last stage computes the loss on its micro-batch
                        _loss(out_x, y)
                held = saved.sizes.pop(id(x.untyped_storage()), 0)
                out.append(PieceTrace(piece.name, saved.total, held))
                x = out_x
    return tuple(out)




def _build_in(spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    """The model built with ``dtype`` weights (inside the caller's fake mode). Built in the weights' dtype:
    converting fake parameters afterwards (module.to) fails in torch 2.13 ("Couldn't swap Conv2d.weight")."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return spec.build()
    finally:
        torch.set_default_dtype(default_dtype)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy as the loop computes it: half logits upcast to fp32 (``Precision.loss_input``), a language
    model's (batch, seq, vocab) flattened to one prediction per token (``losses.TokenCrossEntropy``)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


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
    live = _LiveBytes(1)
    with torch.compiler.set_stance("force_eager"):  # a compiled step (torchao's) is traced as a CPU runs it
        _first_step(cls, dict(kwargs))
        return _traced_step(spec, dtype, cls, kwargs, live)


def _first_step(cls: type, kwargs: dict) -> None:
    """One real step of the optimizer on a small parameter before the fake one: tables an optimizer builds once
    (torchao's quantisation maps, through ``.tolist()``) cannot be computed on fake tensors."""
    p = torch.zeros(QuantizedStates.MIN_NUMEL, requires_grad=True)
    p.grad = torch.zeros_like(p)
    cls([p], **kwargs).step()


def _scalars_mode():
    """A fake tensor has no value: a step's reads of one (Adafactor's step count and norms, through ``.item()``)
    answer 1, which sizes no tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarsMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return True if args[0].dtype is torch.bool else 1
            return func(*args, **(kwargs or {}))

    return ScalarsMode()


def _traced_step(spec: ModelSpec, dtype: torch.dtype, cls: type, kwargs: tuple, live: _LiveBytes) -> int:
    with fake_mode(), _scalars_mode():
        model = _build_in(spec, dtype)
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
