"""Activation checkpointing, full per block: each residual block's activations are recomputed in the backward
pass, so that only the blocks' inputs stay alive between forward and backward."""

from __future__ import annotations

from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import FORWARD_SHARE, Cost, Phase, Transform
from stratbench.models.zoo import apply_activation_checkpointing


class ActivationCheckpointing(Transform):
    """``--activation-checkpointing``: each block (``models.blocks``) under a non-reentrant checkpoint
    wrapper."""

    name = "activation_checkpointing"
    phase = Phase.BEFORE_WRAP
    traced = True
    cost = Cost(
        activations="only each block's input kept through backward (the estimate traces it checkpointed)",
        flops="each block's forward runs again in backward",
        flops_factor=1.0 + FORWARD_SHARE,
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return bool(cfg.activation_checkpointing)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        apply_activation_checkpointing(model)
        return model
