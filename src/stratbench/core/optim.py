"""The optimizer a run's config asks for, as a class and keyword arguments (``OptimizerSpec``): the loop calls it
on the wrapped model's parameters, strategies that build the optimizer themselves read its parts, and the
memory estimate traces its step on fake tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stratbench.core.config import TrainConfig, optimizer_impl_kwargs


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer class and keyword arguments; callable on parameters. Strategies that build the optimizer
    themselves (ZeroRedundancyOptimizer, DeepSpeed) read ``cls`` and ``kwargs``."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    if cfg.optimizer == "sgd":
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}
        return OptimizerSpec(torch.optim.SGD, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    return OptimizerSpec(torch.optim.AdamW, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))
