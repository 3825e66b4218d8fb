"""The optimizer and learning-rate schedule a run's config asks for: ``OptimizerSpec`` (a class and keyword
arguments) the loop calls on the wrapped model's parameters, strategies that build the optimizer themselves read,
and the memory estimate traces on fake tensors; ``lr_lambda`` (warm-up, then constant or cosine)."""

from __future__ import annotations

import math
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
        """The optimizer over the parameters that train: a frozen one (``requires_grad=False``: LoRA's base)
        gets no optimizer state, and a library that sizes its buffers from the optimizer's parameters (DeepSpeed's
        ZeRO partitions) never counts it."""
        return self.cls(trainable(params), **self.kwargs)


def trainable(params) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` that require gradients (all of them unless a transform froze some)."""
    return [p for p in params if p.requires_grad]


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    if cfg.optimizer == "sgd":
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}
        return OptimizerSpec(torch.optim.SGD, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    return OptimizerSpec(torch.optim.AdamW, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warm = cfg.lr_warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f
