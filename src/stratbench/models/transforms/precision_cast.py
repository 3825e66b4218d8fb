"""The precision's cast of the weights: fp64 / fp16-true / bf16-true hold the model in that dtype (the mixed
precisions keep fp32 weights and autocast at run time, which is no transform of the model)."""

from __future__ import annotations

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.precision import Precision, spec_of
from stratbench.models.transforms.base import Cost, Phase, Transform

_SHORT = {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}


class PrecisionCast(Transform):
    """The weights (and buffers) converted to the precision's weight dtype, through the method's precision
    plug-in (``Precision.convert_module``: a method whose library casts the module itself, as DeepSpeed's
    16-bit block does, gives a plug-in whose conversion leaves the module as it is)."""

    name = "precision"
    phase = Phase.BEFORE_WRAP
    cost = Cost(
        parameters="bytes per element of the weights' dtype (MemoryContext.param_bytes)",
        gradients="in the weights' dtype",
        activations="in the weights' dtype (the estimate traces the model built in it)",
        note="the trace builds the model in the weights' dtype instead of casting it (same tensors)",
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return spec_of(cfg.precision).param_dtype is not torch.float32

    def label(self, cfg: TrainConfig) -> str:
        return f"{self.name}:{_SHORT[spec_of(cfg.precision).param_dtype]}"

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        if precision is None:
            raise ValueError("the precision cast needs the method's precision plug-in")
        return precision.convert_module(model)
