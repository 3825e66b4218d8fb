"""``DistributedDataParallel``: one process per device, a full model replica in each, gradients all-reduced
in buckets during the backward pass. Gradient accumulation skips the all-reduce (``no_sync``) on every
micro-step but the last, so accumulating costs no extra communication.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from stratbench.measuring.comm import replicated_grads
from stratbench.strategies.base import CostModel, Strategy, register


@dataclass(kw_only=True)
class DDPOptions:
    """Options of DistributedDataParallel."""

    sync_bn: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (batch statistics over all ranks; needs CUDA)."""
    bucket_cap_mb: float = 25.0
    """Size in MiB of the gradient buckets DDP all-reduces while the backward pass runs."""
    static_graph: bool = False
    """Tell DDP the set of used parameters never changes between steps (enables some optimisations)."""
    find_unused_parameters: bool = False
    """Search the autograd graph for parameters that got no gradient (needed when some are unused)."""


class DDPCost(CostModel):
    """A full replica per rank plus the reducer's buckets; the gradients all-reduced once per step."""

    @classmethod
    def memory_model(cls, ctx, rank):
        return ctx.replicated(buckets=True)  # the reducer's buckets are a second copy of the gradients

    @classmethod
    def comm_model(cls, ctx):
        return replicated_grads(ctx)


@register
class DDPStrategy(Strategy):
    name = "ddp"
    takes_moe = True
    comm_reference = True
    takes_float8 = True
    description = "DistributedDataParallel: one process per device, gradients all-reduced"
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA); SyncBatchNorm needs CUDA"
    launcher = "torchrun"
    needs_process_group = True
    Options = DDPOptions

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if why := cls.quantize_refusal(cfg):
            return why
        options = cls.parse_options(cfg.strategy_options)
        if options.sync_bn and device.type != "cuda":
            return (
                f"--sync-bn needs CUDA (SyncBatchNorm only runs on GPU modules); the device is {device.type}"
            )
        if options.bucket_cap_mb <= 0:
            return f"--bucket-cap-mb must be > 0, got {options.bucket_cap_mb}"
        return None

    cost = DDPCost

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        if self.options.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # device_ids only for a single CUDA device per process; CPU modules must not pass it.
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.options.bucket_cap_mb,
            static_graph=self.options.static_graph,
            find_unused_parameters=self.options.find_unused_parameters,
        )

    def _ddp(self) -> nn.Module:
        """The DistributedDataParallel wrapper (under torch.compile's wrapper, if any)."""
        from torch.nn.parallel import DistributedDataParallel

        model = self.model
        while model is not None and not isinstance(model, DistributedDataParallel):
            model = getattr(model, "_orig_mod", None)
        if model is None:
            raise RuntimeError("ddp: setup() has not wrapped a model yet")
        return model

    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on every micro-step but the last (gradients accumulate locally)."""
        return contextlib.nullcontext() if is_last_micro_step else self._ddp().no_sync()
