"""``nn.DataParallel``: one process, the batch split over every visible GPU, gradients summed on GPU 0.

The model returns logits; DataParallel gathers them on GPU 0 and the loss is computed there, outside the
replicas (the default ``forward_loss``), so a scalar loss is never gathered from the replicas. GPU 0 holds
the parameters, the optimizer state, the gathered outputs and the loss: its memory is higher than the
others', which is why memory is reported for every GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class DataParallelCost(CostModel):
    """GPU 0 holds every state (no communication model: the scatter/gather inside one process is not modelled)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        # One process: GPU 0 holds the parameters, gradients and optimizer state; replicas are transient.
        return ctx.replicated(buckets=False)


class DataParallelCheckpointIO(CheckpointIO):
    """torch.distributed.checkpoint.state_dict strips DDP's ``module.`` but not DataParallel's: the inner
    module is passed so that checkpoints keep the plain names every other method uses."""

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return super().model_state_dict(self.strategy.unwrap(model))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return super().optimizer_state_dict(self.strategy.unwrap(model), optimizer)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        super().load_model_state_dict(self.strategy.unwrap(model), state)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        super().load_optimizer_state_dict(self.strategy.unwrap(model), optimizer, state)


@register
class DataParallelStrategy(Strategy):
    name = "dp"
    description = "nn.DataParallel: one process splits each batch over all visible GPUs (legacy)"
    requirements = ">= 2 CUDA GPUs, one process"
    launcher = "python"

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with dp is not supported (untested: it needs 2 CUDA GPUs); use ddp"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        # Without GPUs nn.DataParallel silently runs the plain module: refuse instead of pretending.
        found = _cuda_count()
        if found < 2:
            return f"needs >= 2 CUDA GPUs, found {found}"
        if why := cls.lora_refusal(cfg):
            return why
        if device.type != "cuda":
            return f"needs the cuda device; --device is {cfg.device!r}"
        if world_size != 1:
            return (
                f"dp runs in one process that drives every GPU; it was started with world size {world_size}"
            )
        return None

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        """The batch is split over the visible GPUs inside the one process."""
        return max(1, _cuda_count())

    cost = DataParallelCost
    checkpoint_io_class = DataParallelCheckpointIO

    def wrap(self, model: nn.Module) -> nn.Module:
        # The parameters live on GPU 0 (the process's device); replicas are broadcast each forward.
        return nn.DataParallel(model, device_ids=list(range(_cuda_count())), output_device=self.env.device)

    def memory_devices(self) -> list[torch.device]:
        """Every GPU DataParallel uses: GPU 0 holds more than the others, which is the point of measuring."""
        return [torch.device("cuda", i) for i in range(_cuda_count())] or [self.env.device]

    def synchronize(self) -> None:
        for device in self.memory_devices():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
