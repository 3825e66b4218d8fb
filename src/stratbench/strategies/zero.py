"""DDP + ``ZeroRedundancyOptimizer`` (ZeRO stage 1): gradients all-reduced as in DDP, but each rank keeps
and updates the optimizer state of only its share of the parameters, then broadcasts the updated
parameters. ZeRO shards by whole parameters, so the shares are only roughly equal.

Checkpoints (``--checkpoint-format``): ``full`` (default) is one file holding the full optimizer state keyed by
parameter names (the layout every other method writes), consolidated on rank 0 with ``consolidate_state_dict``;
``sharded`` is a ``torch.distributed.checkpoint`` folder (``stratbench.checkpoints.sharded``) where each rank writes the
optimizer state of its own parameters, with no consolidation. Either loads into any method; loading hands each
rank its own share.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import sharded
from stratbench.measuring.comm import Collective
from stratbench.strategies.base import CheckpointIO, OptimizerFactory, local_bytes, register
from stratbench.strategies.costs import zero_partition
from stratbench.strategies.ddp import DDPCost, DDPOptions, DDPStrategy

CHECKPOINT_FORMATS = ("full", "sharded")

# Wrapper prefixes that never appear in a portable parameter name (activation checkpointing, compile, DDP).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(kw_only=True)
class ZeroOptions(DDPOptions):
    """Options of DDP + ZeroRedundancyOptimizer."""

    checkpoint_format: str = "full"
    """full (one file, optimizer state consolidated on rank 0) or sharded (a torch.distributed.checkpoint folder, each rank writes its shard)."""


class ZeroCost(DDPCost):
    """DDP's replicas, buckets and all-reduce; optimizer state for this rank's share of whole parameters only,
    and the updated parameters broadcast from their owners."""

    @classmethod
    def memory_model(cls, ctx, rank):
        """DDP's replicas and buckets; optimizer state only for this rank's share of whole parameters."""
        n = ctx.info.numels
        mine = zero_partition(n, ctx.world)[rank]
        m = super().memory_model(ctx, rank)
        m.optim = ctx.optim_bytes([ctx.info.param_shapes[i] for i in mine])
        m.step_scalars = 4 * len(mine) if ctx.adam else 0
        m.sharding_note = "optimizer state sharded by whole parameters"
        return m

    @classmethod
    def comm_model(cls, ctx):
        """DDP's all-reduce, then after the step every parameter broadcast from the rank that stepped it (one
        call per parameter): Φ more per step."""
        rows = super().comm_model(ctx)
        if ctx.world > 1:
            params = ctx.info.numels
            note = "updated parameters broadcast from their owner rank"
            rows.append(
                Collective(
                    "broadcast", sum(params) * ctx.param_bytes, len(params), "optimizer", ctx.world, note
                )
            )
        return rows


class ZeroCheckpointIO(CheckpointIO):
    """Optimizer state keyed by portable parameter names: consolidated on rank 0 (``full``) or each rank's own
    shard in a ``torch.distributed.checkpoint`` folder (``sharded``); loading hands each rank its share."""

    def _index_names(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Portable name of each parameter in ZeRO's global index order (the order of its param_groups)."""
        names = {id(p): _clean_name(n) for n, p in self.strategy.unwrap(model).named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise RuntimeError(
                f"ddp-zero: optimizer parameters {missing[:5]} are not parameters of the model"
            )
        return [names[id(p)] for p in params]

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Gather every rank's shard on rank 0 (a collective) and key it by parameter name; {} on other ranks."""
        optimizer.consolidate_state_dict(to=0)
        if not self.strategy.env.is_main:
            return {}
        names = self._index_names(model, optimizer)
        state = optimizer.state_dict()
        return {
            "state": {names[i]: _to_cpu(v) for i, v in state["state"].items() if v is not None},
            "param_groups": [
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [names[i] for i in group["params"]],
                }
                for group in state["param_groups"]
            ],
        }

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load a name-keyed full optimizer state (from any method): each rank keeps its own parameters' share."""
        names = self._index_names(model, optimizer)
        index = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(state["state"]) - set(index))
        if unknown:
            raise RuntimeError(f"ddp-zero: checkpoint optimizer state names unknown parameters {unknown[:5]}")
        groups = state["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise RuntimeError(
                f"ddp-zero: checkpoint has {len(groups)} optimizer param groups, this optimizer {len(optimizer.param_groups)}"
            )
        indexed = {
            # ZeroRedundancyOptimizer.load_state_dict overwrites entries it does not own: give it copies.
            "state": {index[n]: copy.copy(v) for n, v in state["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                for g in groups
            ],
        }
        optimizer.load_state_dict(indexed)

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        """Full file (consolidated on rank 0) or sharded folder (each rank writes its own optimizer shard)."""
        path = Path(path)
        if self.strategy.options.checkpoint_format == "full":
            # An earlier sharded folder at ``path`` is swapped out only once the new file is complete.
            return super().save_checkpoint(path, model, optimizer, extra)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # Replicated model tensors are written once (DCP de-duplicates equal keys); optimizer keys are disjoint.
        state = {
            "model": get_model_state_dict(model),
            "optimizer": self._local_optimizer_state(model, optimizer),
        }
        return sharded.save_sharded(path, None, None, extra, is_main=self.strategy.env.is_main, state=state)

    def _local_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shard of the optimizer state, keyed by parameter names, plus the (replicated) groups."""
        names = {id(p): _clean_name(n) for n, p in self.strategy.unwrap(model).named_parameters()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        return {
            "state": {names[id(p)]: dict(s) for p, s in optimizer.optim.state.items()},
            "param_groups": groups,
        }


@register
class DDPZeroStrategy(DDPStrategy):
    name = "ddp-zero"
    description = "DDP + ZeroRedundancyOptimizer: optimizer state sharded over ranks (ZeRO-1)"
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA)"
    Options = ZeroOptions
    comm_reference = False  # DDP's subclass; the reference is DDP itself

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with ddp-zero is not supported: its memory model and optimizer-state partition count every parameter; use ddp or deepspeed"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        options = cls.parse_options(cfg.strategy_options)
        if why := cls.lora_refusal(cfg):
            return why
        if options.checkpoint_format not in CHECKPOINT_FORMATS:
            return f"--checkpoint-format {options.checkpoint_format!r} is not one of: {', '.join(CHECKPOINT_FORMATS)}"
        return super().check_supported(cfg, device, world_size)

    cost = ZeroCost
    checkpoint_io_class = ZeroCheckpointIO

    def build_optimizer(self, model: nn.Module, make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer the engine asked for, sharded over the ranks (each steps its own share)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return make_optimizer.prepare(
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=make_optimizer.cls, **make_optimizer.kwargs)
        )

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameters and gradients are replicated; optimizer state is counted from this rank's local shard."""
        # Not super().state_bytes: ZeroRedundancyOptimizer.state (the exposed one) is not the live state (after
        # a load it even holds None for other ranks' parameters); the local optimizer's state is.
        counts = {
            "param_bytes": sum(local_bytes(p) for p in model.parameters()),
            "trainable_param_bytes": sum(local_bytes(p) for p in model.parameters() if p.requires_grad),
            "grad_bytes": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        }
        counts["optimizer_state_bytes"] = sum(
            local_bytes(v)
            for s in optimizer.optim.state.values()
            if isinstance(s, dict)
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return counts


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
