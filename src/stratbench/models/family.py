"""A model's family, convnet or transformer, decided from what the model computes (not from its name): the
projection's default compute efficiency differs by family (hardware.yaml ``default_efficiency``), since
convolutions and attention/matmul stacks reach different shares of a GPU's tensor-core peak.

The rule, on the FLOPs ``torch.utils.flop_counter`` counts for one forward+backward on the meta device (the
same count as ``flops.flops_per_sample``):

* **transformer**: the model has an attention module (``nn.MultiheadAttention``, ``nn.Transformer*Layer``) or
  its counted FLOPs include attention (``scaled_dot_product_attention`` kernels, batched matmuls ``bmm``), and
  convolutions are less than half of its FLOPs (a ViT's patch-embedding convolution does not make it a convnet);
* **convnet**: convolutions are at least half of its FLOPs;
* neither (an MLP, a model the meta device cannot trace): ``None``, and the projection uses the per-precision
  assumption, saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from stratbench.models.flops import flops_by_op

ATTENTION_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""Modules that make a model a transformer wherever they appear."""


def _is_attention(op: str) -> bool:
    return "scaled_dot_product" in op or "attention" in op or op.split(".")[-1] in ("bmm", "baddbmm")


def family_from_counts(op_flops: Mapping[str, float], has_attention_module: bool = False) -> str | None:
    """The family of a model whose counted FLOPs per op name (e.g. ``aten.convolution``, ``aten.mm``) are
    ``op_flops``: the module docstring's rule."""
    total = sum(op_flops.values())
    conv = sum(v for k, v in op_flops.items() if "convolution" in k)
    attention = has_attention_module or any(v > 0 and _is_attention(k) for k, v in op_flops.items())
    if total <= 0:
        return "transformer" if has_attention_module else None
    if conv >= 0.5 * total:
        return "convnet"
    return "transformer" if attention else None


def family_of(counted: tuple[Mapping[str, float], set[type[nn.Module]]] | None) -> str | None:
    """The family from ``flops.flops_by_op``'s answer (None where the model could not be counted)."""
    if counted is None:
        return None
    op_flops, modules = counted
    return family_from_counts(op_flops, any(issubclass(m, ATTENTION_MODULES) for m in modules))


def model_family(
    build: Callable[[], nn.Module], sample_shape: tuple[int, ...], num_classes: int
) -> str | None:
    """convnet, transformer or None for the model ``build`` makes (counted on the meta device)."""
    return family_of(flops_by_op(build, sample_shape, num_classes))
