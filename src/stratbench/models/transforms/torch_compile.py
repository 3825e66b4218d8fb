"""``--compile``: ``torch.compile`` over the method's wrapped model (Dynamo traces through DDP and FSDP's
hooks; a method that calls its stage modules directly refuses --compile in its ``check_supported``). With
``--activation-checkpointing --ac-mode budget:F`` the compiler's activation memory budget
(``torch._functorch.config.activation_memory_budget``) is F while the compiled model runs, and only then: the
min-cut partitioner reads it when the first call traces and partitions the forward and backward, and a config
patch around every call (restored even when the call raises) leaves the process's setting as it found it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratbench.core.config import TrainConfig, ac_budget
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import Cost, Phase, Transform


@dataclass(frozen=True)
class Compile(Transform):
    """The wrapped model under ``torch.compile`` (default mode): the module the loop calls; ``budget``: the
    activation memory budget of budget:F (None: the compiler's own, 1)."""

    budget: float | None = None
    backend: Any = "inductor"
    """torch.compile's backend (inductor for runs; a test may take aot_eager, which runs the same min-cut
    partitioner without generating code)."""

    name = "compile"
    phase = Phase.AFTER_WRAP
    cost = Cost(
        note="none modelled: the fused kernels' speed-up shows in a calibrated run, not in the estimate"
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return bool(cfg.compile)

    def configured(self, cfg: TrainConfig) -> Compile:
        budget = ac_budget(cfg.ac_mode) if cfg.activation_checkpointing else None
        return Compile(budget, self.backend)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        compiled = torch.compile(model, backend=self.backend)
        if self.budget is not None:
            scope_memory_budget(compiled, self.budget)
        return compiled


def scope_memory_budget(module: nn.Module, budget: float) -> None:
    """Set the compiler's activation memory budget to ``budget`` for each call of ``module`` (a forward pre-hook
    enters ``torch._functorch.config.patch``, a forward hook that runs even when the call raises leaves it)."""
    patches: list = []

    def enter(mod: nn.Module, args: tuple) -> None:
        patch = torch._functorch.config.patch(activation_memory_budget=budget)
        patch.__enter__()
        patches.append(patch)

    def leave(mod: nn.Module, args: tuple, out: object) -> None:
        if patches:
            patches.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
