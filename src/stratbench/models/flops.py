"""FLOPs of a model: forward+backward per sample, counted by torch's FLOP counter on the meta device (MFU in
the run record, the pipeline split's ``--balance flops``, the model's family in ``family``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def flop_counter():
    """The FLOP counter of every count stratbench makes (``torch.utils.flop_counter``, silent): the whole
    model's here (``flops_per_sample``: MFU) and each pipeline piece's (``split.piece_costs``: the
    ``--balance flops`` split), so that the pieces' FLOPs add up to the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward}
    )


def _conv_backward(*args, out_val=None, **kwargs) -> int:
    """The FLOPs of ``aten.convolution_backward`` (tensors in): a grouped one's as ``_grouped_conv_backward_flops``
    counts them, the rest by torch's rule."""
    from torch.utils.flop_counter import flop_registry

    if int(args[9]) > 1 and not args[7]:  # groups, transposed
        return int(_grouped_conv_backward_flops(args))
    return flop_registry[torch.ops.aten.convolution_backward](*args, out_val=out_val, **kwargs)


_conv_backward._get_raw = True  # FlopCounterMode passes it the tensors, not their shapes


def example_input(n: int, sample_shape: tuple[int, ...], tokens: bool | None = None) -> torch.Tensor:
    """``n`` zero samples of ``sample_shape`` (on the current default device): token ids where ``tokens``
    (None: a 1-d shape (seq_len,) is token ids), else floating point (pixels (C, H, W), a row of features)."""
    ids = len(sample_shape) == 1 if tokens is None else tokens
    return torch.zeros(n, *sample_shape, dtype=torch.long if ids else torch.float32)


def _meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device; where its constructor computes from tensor values, which meta tensors have
    not (RegNet's widths), built on the CPU and moved there."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # "Cannot copy out of meta tensor; no data!"; a real error comes again below
        return build().to("meta")


def flops_by_op(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    num_classes: int,
    tokens: bool | None = None,
) -> tuple[dict[str, float], set[type[nn.Module]]] | None:
    """(forward+backward FLOPs of one sample per op name, e.g. ``aten.convolution``; the model's module classes),
    counted on the meta device (nothing is allocated, so this works for any model size); None where the model
    cannot be traced there."""
    try:
        model = _meta_model(build)
        with torch.device("meta"):
            x = example_input(2, sample_shape, tokens)
        counter = flop_counter()
        with counter:
            logits = model(x)
            y = torch.zeros(
                logits.shape[:-1], dtype=torch.long, device="meta"
            )  # a class, or a token per position
            loss = nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())
            loss.backward()
        counts = counter.get_flop_counts().get("Global", {})
        return {str(op): n / 2 for op, n in counts.items()}, {type(m) for m in model.modules()}
    except Exception:  # a user model the meta device cannot trace: no MFU rather than a wrong one
        return None


def flops_per_sample(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    num_classes: int,
    tokens: bool | None = None,
) -> float | None:
    """Forward+backward FLOPs of one sample, counted by ``flop_counter`` on the meta device."""
    counted = flops_by_op(build, sample_shape, num_classes, tokens)
    return None if counted is None else sum(counted[0].values())


def linear_flops(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    select: Callable[[nn.Module], list[str]],
    tokens: bool | None = None,
) -> float | None:
    """Forward+backward FLOPs of one sample in the ``nn.Linear`` layers ``select(model)`` names (``--float8``'s
    converted ones, ``transforms.float8.convertible``): each forward product of ``rows x in`` by ``in x out`` is
    ``2 x rows x in x out`` FLOPs and backward makes two more of the same size (the input's gradient and the
    weight's), as ``flop_counter`` counts them. Counted on the meta device (the rows each layer sees, by a
    forward hook); None where it cannot trace."""
    rows: dict[str, int] = {}

    def seen(name: str) -> Callable[..., None]:
        def hook(module: nn.Linear, args: object, out: torch.Tensor) -> None:
            rows[name] = rows.get(name, 0) + out.numel() // module.out_features

        return hook

    try:
        model = _meta_model(build)
        with torch.device("meta"):
            x = example_input(2, sample_shape, tokens)
        names = set(select(model))
        hooks = [
            m.register_forward_hook(seen(n))
            for n, m in model.named_modules()
            if n in names and isinstance(m, nn.Linear)
        ]
        with torch.no_grad():
            model(x)
        for h in hooks:
            h.remove()
    except Exception:  # as flops_by_op: a model the meta device cannot trace has no count
        return None
    layers = dict(model.named_modules())
    forward = sum(2 * r * layers[n].in_features * layers[n].out_features for n, r in rows.items())
    return 3 * forward / 2


# ------------------------------------------------------------------------------------------------
# Per-operation costs (the roofline basis of the step-time projection): each aten op of a traced step with its
# FLOPs (torch's counter rules), the bytes it reads and writes, and its class.

OP_CLASSES = ("large_gemm", "small_gemm", "convolution", "depthwise_convolution", "attention", "elementwise",
              "reduction", "batch_norm", "other")  # fmt: skip
"""The op classes the roofline prices apart (hardware.yaml ``roofline``: an achievable fraction each)."""

SMALL_GEMM = 512**3
"""A matrix product of fewer multiply-adds than this (batch included) is a small GEMM: cuBLAS picks small tiles
for it and it does not reach the large products' rate (assumption: the threshold; docs/projection.md)."""

_GEMMS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
"""The matrix products: their two operands' positions in the op's arguments."""
_CONVOLUTIONS = {"convolution": 8, "_convolution": 8, "convolution_backward": 9, "cudnn_convolution": 6}
"""The convolutions: the position of ``groups`` in the op's arguments."""
_ATTENTION_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}
"""The CPU's fused attention, which a trace on CPU fake tensors runs, counted by the rule of the CUDA flash kernel
it stands for (torch's counter has no rule for the CPU one; same leading arguments)."""
_REDUCTIONS = ("norm", "softmax", "sum", "mean", "amax", "amin", "max", "min", "nll_loss", "var", "std", "pool",
               "cumsum", "prod", "argmax", "argmin", "logsumexp", "any", "all")  # fmt: skip
_FREE = {"empty", "empty_strided", "empty_like", "_local_scalar_dense", "lift_fresh", "_unsafe_view", "alias",
         "detach", "set_", "resize_", "_reshape_alias"}  # fmt: skip
"""Ops that move no data (allocation, aliasing): priced at nothing, not even a launch."""
_WRITES = ("copy_", "_to_copy", "clone", "fill_", "zero_", "zeros", "ones", "zeros_like", "ones_like", "full",
           "full_like", "where", "arange", "stack", "cat")  # fmt: skip
"""Ops that read and write memory one element at a time without a pointwise tag: elementwise."""


@dataclass(frozen=True)
class OpCost:
    """One aten op of a traced step: its name and class, FLOPs (torch's counter rules), the bytes it reads and
    writes (each input and output tensor once; a broadcast input at its stored size), the dtype of its operands
    and, for a matrix product or convolution, its output's (batch, rows, columns) for tile quantisation."""

    op: str
    op_class: str
    flops: float
    bytes: float
    dtype: str
    output_tiles: tuple[int, int, int] | None = None
    reads: tuple[tuple[int, int], ...] = ()
    """(storage key, bytes) of each tensor it reads: the data flow a compiled step's fusion follows (a key is
    unique while the recording keeps the storage alive: ``models.flops.storage_key``)."""
    writes: tuple[tuple[int, int], ...] = ()
    """(storage key, bytes) of each tensor it writes."""


def storage_of(t: torch.Tensor) -> object:
    """``t``'s storage (views of one storage share it), or ``t`` where it has none."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return t


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage identity (``storage_of``'s); unique while the storage is alive."""
    return id(storage_of(t))


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, at most its storage (a broadcast view reads once)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta under some modes)
        return n


def op_cost(func, args: tuple, kwargs: dict, out: object) -> OpCost | None:
    """The ``OpCost`` of one dispatched aten op (None for a view, reshape or allocation: they move nothing)."""
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    space, _, name = func._schema.name.partition("::")
    if space != "aten" or func.is_view or name in _FREE:
        return None
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not ins and not outs:  # a query on dtypes or shapes (promote_types): no kernel
        return None
    moved = sum(map(_tensor_bytes, ins)) + sum(map(_tensor_bytes, outs))
    rule = _conv_backward if name == "convolution_backward" else flop_registry.get(func._overloadpacket)
    alias = _ATTENTION_ALIASES.get(name)
    if alias is not None:
        rule = flop_registry.get(getattr(torch.ops.aten, alias))
    flops = float(rule(*args, **kwargs, out_val=out)) if rule is not None else 0.0
    dtype = str((ins or outs)[0].dtype).removeprefix("torch.")
    cls, tiles = _classify(func, name, args, outs, flops)
    if name in _GEMMS or name in _CONVOLUTIONS:
        dtype = str(args[_GEMMS.get(name, (0,))[0]].dtype).removeprefix("torch.")
    reads = tuple((storage_key(t), _tensor_bytes(t)) for t in ins)
    writes = tuple((storage_key(t), _tensor_bytes(t)) for t in outs)
    return OpCost(name, cls, flops, float(moved), dtype, tiles, reads, writes)


def _grouped_conv_backward_flops(args: tuple) -> float:
    """A grouped convolution's backward FLOPs: each gradient it computes (input, weight: ``output_mask``) is one
    product of the forward's size, 2 x grad_out's elements x the weight's (in / groups) x kernel elements. torch's
    counter (``torch.utils.flop_counter.conv_backward_flop``) prices the weight gradient as an ungrouped
    convolution, ``groups`` times too many: 97x the forward for a 96-channel depthwise 3x3 where 2x is right."""
    grad_out, weight, mask = args[0], args[2], args[10]
    forward = 2.0 * grad_out.numel() * math.prod(weight.shape[1:])
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))


def _classify(func, name: str, args: tuple, outs: list[torch.Tensor], flops: float):
    """(op class, the output's (batch, rows, columns) for a product or convolution) of one op."""
    if name in _GEMMS:
        a, b = (args[i] for i in _GEMMS[name])
        batch = a.shape[0] if a.dim() == 3 else 1
        tiles = (batch, a.shape[-2], b.shape[-1])
        return ("small_gemm" if flops / 2 < SMALL_GEMM else "large_gemm"), tiles
    if name in _CONVOLUTIONS:
        groups = int(args[_CONVOLUTIONS[name]])
        backward = name == "convolution_backward"
        x = args[1] if backward else args[0]  # the convolution's input: its channels
        y = args[0] if backward else outs[0]  # its output (backward: its gradient): the product's shape
        tiles = (1, y.shape[0] * math.prod(y.shape[2:]), y.shape[1])
        return ("depthwise_convolution" if 1 < groups == x.shape[1] else "convolution"), tiles
    if "attention" in name:
        return "attention", None
    if "batch_norm" in name:  # its own class: eager NCHW batch norm runs far below a streaming reduction
        return "batch_norm", None
    if any(r in name for r in _REDUCTIONS):
        return "reduction", None
    if torch.Tag.pointwise in func.tags or name in _WRITES:
        return "elementwise", None
    return "other", None
