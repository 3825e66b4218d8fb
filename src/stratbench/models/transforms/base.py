"""What a model transform is: a small object with a name, a phase (where in the method's set-up it runs), the
test of whether a run asks for it, what it does to the model, and what it changes in the cost model.

The order of the registered transforms is in ``stratbench.models.transforms`` (``ORDER``); this module holds
only the types, so that each transform's file imports them without importing the others.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.precision import Precision

FORWARD_SHARE = 1.0 / 3.0
"""Forward FLOPs as a share of forward+backward (backward computes two products per forward one)."""


class Phase(enum.IntEnum):
    """Where in ``Strategy.setup`` a transform runs, relative to the method's own move and wrap."""

    BEFORE_WRAP = 0
    """On the whole, unwrapped model, before the method moves it to its devices and wraps it (DDP, FSDP's
    shards, a tensor-parallel plan, a pipeline's stages, DeepSpeed's engine): what the method then wraps."""
    AFTER_WRAP = 1
    """On the wrapped model and after the optimizer is built: what the loop runs. The method's own reference
    (``Strategy.model``, what its checkpoint I/O saves) stays the unwrapped result of its wrap."""


@dataclass(frozen=True)
class Cost:
    """What a transform adds to or removes from one rank's step, quantity by quantity, as the estimate and
    the projection model it ("": unchanged); ``flops_factor`` multiplies the step's FLOPs (projection)."""

    parameters: str = ""
    gradients: str = ""
    optimizer_state: str = ""
    activations: str = ""
    flops: str = ""
    flops_factor: float = 1.0
    note: str = ""
    """Anything the quantities above leave out (what is not modelled, and why)."""


class Transform:
    """One model transform. Subclasses set the class attributes and define ``applies_to`` and ``apply``; an
    instance is listed once in ``ORDER`` (``stratbench.models.transforms``)."""

    name: ClassVar[str]
    """What ``result.json``'s ``transforms`` says (``label`` may add the variant: ``precision:bf16``)."""
    phase: ClassVar[Phase]
    cost: ClassVar[Cost]
    traced: ClassVar[bool] = False
    """The estimate applies it to the model it traces (``measuring.model_trace.trace_step``): it changes what
    one forward/backward keeps alive. False where the trace already sees its effect or it changes none."""

    def applies_to(self, cfg: TrainConfig) -> bool:
        """Whether a run of ``cfg`` applies it (the config alone: the estimate asks before any model)."""
        raise NotImplementedError

    def label(self, cfg: TrainConfig) -> str:
        """The entry of ``result.json``'s ``transforms`` for a run of ``cfg``."""
        return self.name

    def configured(self, cfg: TrainConfig) -> Transform:
        """This transform with the options of ``cfg`` its ``apply`` reads (LoRA's rank and targets); hashable,
        since the estimate's cached trace takes it. Most read none: itself."""
        return self

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        """``model`` transformed (in place where it can be; the module the next step takes is returned).
        ``precision`` is the method's precision plug-in (None in the estimate's trace, which builds the model
        in the weights' dtype); a model it cannot apply to is a ConfigError naming why."""
        raise NotImplementedError
