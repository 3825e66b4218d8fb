"""The model transforms and their one order: what changes the model between its build and the step it runs.

Every method gets them at the same point, ``Strategy.setup`` (``strategies.base``), in ``ORDER``:

1. ``float8``                    before the wrap   the Linears as torchao Float8Linear (float8 products)
2. ``lora``                      before the wrap   PEFT's LoRA adapters in the targeted Linears, the base frozen
3. ``activation_checkpointing``  before the wrap   each block recomputed in backward
4. ``precision``                 before the wrap   the weights cast to fp64 / fp16 / bf16 (-true precisions)
5. ``quantize_base``             before the wrap   QLoRA: the adapted Linears' frozen weights as torchao NF4
                                                   or bitsandbytes int8 layers
   -- the method's move (to its devices), channels-last, its wrap (DDP, FSDP's shards, a tensor-parallel plan,
      a pipeline's stages, DeepSpeed's engine) and the optimizer on the wrapped parameters --
6. ``compile``                   after the wrap    ``torch.compile`` over the wrapped model

torchtitan's order is quantize/convert -> tensor parallel -> activation checkpointing -> compile -> FSDP; here
tensor parallelism and FSDP are both the method's wrap, so activation checkpointing comes before any wrap (the
tensor-parallel plan and FSDP's units find the blocks under their checkpoint wrappers), and a weight
conversion that swaps modules (float8 linears) goes first, before activation checkpointing. QLoRA's quantised
base comes after the precision's cast, which would dequantise an NF4 weight: NF4 swaps no module (the weight
stays the Linear's); int8 swaps the base layer inside PEFT's adapter layer (after LoRA's injection, so PEFT
wraps a plain Linear and calls whatever base layer it holds; quantize_base's docstring says why). A transform's place
in ``ORDER`` must agree with its phase (``Phase.BEFORE_WRAP`` ones first); a test checks it, and that each has
a cost.

Adding one: a file here with a ``Transform`` subclass (``name``, ``phase``, ``cost``, ``applies_to``,
``apply``), one line in ``ORDER`` and its line in the list above.
"""

from __future__ import annotations

from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.precision import Precision
from stratbench.models.transforms.activation_checkpointing import ActivationCheckpointing
from stratbench.models.transforms.base import FORWARD_SHARE, Cost, Phase, Transform
from stratbench.models.transforms.float8 import Float8
from stratbench.models.transforms.lora import Lora
from stratbench.models.transforms.precision_cast import PrecisionCast
from stratbench.models.transforms.quantize_base import QuantizeBase
from stratbench.models.transforms.torch_compile import Compile

__all__ = [
    "FORWARD_SHARE", "ORDER", "Cost", "Phase", "Pipeline", "Transform", "apply_traced", "chosen",
    "flops_factor", "traced",
]  # fmt: skip

ORDER: tuple[Transform, ...] = (
    Float8(),
    Lora(),
    ActivationCheckpointing(),
    PrecisionCast(),
    QuantizeBase(),
    Compile(),
)
"""Every registered transform, in the order a run applies them."""


def chosen(cfg: TrainConfig) -> tuple[Transform, ...]:
    """The transforms a run of ``cfg`` applies, in ``ORDER``."""
    return tuple(t for t in ORDER if t.applies_to(cfg))


def flops_factor(cfg: TrainConfig) -> float:
    """What the transforms of ``cfg`` multiply a training step's FLOPs by (activation checkpointing: 1 + the
    forward's share); the projection's compute time reads it."""
    factor = 1.0
    for t in chosen(cfg):
        factor *= t.configured(cfg).cost.flops_factor
    return factor


def traced(cfg: TrainConfig) -> tuple[Transform, ...]:
    """The transforms of ``cfg`` the estimate's trace applies, configured for it (hashable: the trace is
    cached)."""
    return tuple(t.configured(cfg) for t in chosen(cfg) if t.traced)


def apply_traced(model: nn.Module, transforms: tuple[Transform | str, ...]) -> nn.Module:
    """``model`` (built on fake tensors in the weights' dtype) with the given trace-time transforms (configured
    ones, or names of ones that read no option), in ``ORDER``."""
    given = {(t if isinstance(t, str) else t.name): t for t in transforms}
    for t in ORDER:
        if t.name in given:
            if not t.traced:
                raise ValueError(f"model transform {t.name!r} is not applied when tracing")
            entry = given[t.name]
            model = (t if isinstance(entry, str) else entry).apply(model, None)
    return model


class Pipeline:
    """The transforms of one run, applied phase by phase by ``Strategy.setup``; ``applied`` lists what was
    applied, in order, as ``result.json``'s ``transforms`` records it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.applied: list[str] = []

    def apply(self, model: nn.Module, phase: Phase, precision: Precision | None) -> nn.Module:
        """``model`` with this run's transforms of ``phase``, in ``ORDER`` (the config is read at set-up)."""
        for t in chosen(self.cfg):
            if t.phase is phase:
                model = t.configured(self.cfg).apply(model, precision)
                self.applied.append(t.label(self.cfg))
        return model
