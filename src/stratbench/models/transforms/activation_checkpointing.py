"""Activation checkpointing (``--activation-checkpointing``, ``--ac-mode``): each residual block's activations
recomputed in the backward pass (full), one block in N (every:N), or inside every block only the cheap ops
(selective: torchtitan's op policy keeps the attention's output and every other matmul's), so that less than
the whole forward stays alive between forward and backward. budget:F wraps nothing: the compiler's min-cut
partitioner chooses what to recompute (``torch_compile.Compile`` scopes the budget to the run's compiled calls)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from stratbench.core.config import TrainConfig, ac_budget
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import FORWARD_SHARE, Cost, Phase, Transform
from stratbench.models.zoo import ac_every, apply_activation_checkpointing


def recomputed_share(mode: str) -> float:
    """The share of the forward's FLOPs run again in backward: all of it (full), one block in N (every:N; exact
    where N divides the blocks), every other matmul of each block (selective: ~1/2), 1 - F under budget:F (an
    upper bound: the partitioner's knapsack recomputes what is cheapest to run again first, the pointwise ops
    before the matmuls, so the FLOPs it repeats are fewer than the share of the bytes it does not keep)."""
    budget = ac_budget(mode)
    if budget is not None:
        return 1.0 - budget
    return 0.5 if mode == "selective" else 1.0 / ac_every(mode)


@dataclass(frozen=True)
class ActivationCheckpointing(Transform):
    """``--activation-checkpointing``: the blocks (``models.blocks``) under a non-reentrant checkpoint wrapper,
    as ``--ac-mode`` chooses (configured per run: the instance in ``ORDER`` is full)."""

    mode: str = "full"

    name = "activation_checkpointing"
    phase = Phase.BEFORE_WRAP
    traced = True

    @property
    def cost(self) -> Cost:  # type: ignore[override]
        share = recomputed_share(self.mode)
        traced = "the estimate traces it checkpointed"
        if ac_budget(self.mode) is not None:
            traced = "the estimate: between no and full checkpointing's traces, as measured (docs/memory.md)"
        return Cost(
            activations=f"what the mode keeps through backward ({traced})",
            flops=f"{share:g} of each block's forward runs again in backward ({self.mode})",
            flops_factor=1.0 + FORWARD_SHARE * share,
        )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return bool(cfg.activation_checkpointing)

    def label(self, cfg: TrainConfig) -> str:
        return self.name if cfg.ac_mode == "full" else f"{self.name}:{cfg.ac_mode}"

    def configured(self, cfg: TrainConfig) -> ActivationCheckpointing:
        return ActivationCheckpointing(cfg.ac_mode)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        if ac_budget(self.mode) is None:  # budget:F: the compiler recomputes, no block is wrapped
            apply_activation_checkpointing(model, self.mode)
        return model
