"""``--compile``: ``torch.compile`` over the method's wrapped model (Dynamo traces through DDP and FSDP's
hooks; a method that calls its stage modules directly refuses --compile in its ``check_supported``)."""

from __future__ import annotations

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import Cost, Phase, Transform


class Compile(Transform):
    """The wrapped model under ``torch.compile`` (default mode): the module the loop calls."""

    name = "compile"
    phase = Phase.AFTER_WRAP
    cost = Cost(
        note="none modelled: the fused kernels' speed-up shows in a calibrated run, not in the estimate"
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return bool(cfg.compile)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        return torch.compile(model)
