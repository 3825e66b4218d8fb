"""``accelerate-tp``: accelerate's ``ParallelismConfig(tp_size=N)`` on tp's plan (blocks only). GPU only:
accelerate refuses tensor parallelism on CPU processes.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path
from typing import Any

from torch import nn

from stratbench.strategies.accelerate import AccelerateStrategy, inner_optimizer
from stratbench.strategies.base import register
from stratbench.strategies.costs import lean_refusal
from stratbench.strategies.parallel.tensor_parallel import TPCheckpointIO, apply_tp, reduce_partial_grads
from stratbench.strategies.parallel.tp_costs import TPCost
from stratbench.strategies.parallel.tp_plan import BLOCKS_ONLY
from stratbench.strategies.parallel.tp_plan import unsupported as tp_unsupported

ACCELERATE_TP_CPU = (
    "accelerate's tensor parallelism (ParallelismConfig(tp_size=N)) needs GPU processes: accelerate {version} "
    "accepts it under FSDP2, DeepSpeed or MULTI_GPU and refuses CPU processes (MULTI_CPU) in Accelerator()"
)


class AccelerateTPCost(TPCost):
    """tp's cost model on the blocks-only plan accelerate-tp applies (the embedding and the head whole)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        return super().memory_model(dataclasses.replace(ctx, options=BLOCKS_ONLY), rank)

    @classmethod
    def comm_model(cls, ctx):
        return super().comm_model(dataclasses.replace(ctx, options=BLOCKS_ONLY))


class AccelerateTPCheckpointIO(TPCheckpointIO):
    """tp's DCP folder of DTensor slices, written from the torch optimizer under accelerate's wrapper."""

    def save_checkpoint(self, path: Path, model: nn.Module, optimizer, extra: dict) -> Path:
        return super().save_checkpoint(path, model, inner_optimizer(optimizer), extra)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer) -> dict:
        return super().load_checkpoint(path, model, inner_optimizer(optimizer))


@register
class AccelerateTP(AccelerateStrategy):
    """Every rank one slice of each block's matrices (tp's plan, blocks only) under accelerate's
    ParallelismConfig(tp_size=world): accelerate builds the ("tp",) mesh and leaves the model unwrapped (no DDP)
    once it carries ``tp_size``, as a Transformers model loaded with tp_plan does."""

    splits_model = True

    name = "accelerate-tp"
    description = (
        "accelerate.Accelerator with ParallelismConfig(tp_size=N): Megatron tensor parallelism (GPU)"
    )
    requirements = (
        "pip install accelerate (1.10+); 2+ GPUs (accelerate refuses tensor parallelism on CPU processes)"
    )
    check_settings = {"model": "gpt-tiny", "data": "text"}  # the default image model has no tp plan
    cost = AccelerateTPCost
    checkpoint_io_class = AccelerateTPCheckpointIO

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with accelerate-tp is not supported: its plan shards nn.Linear modules, which LoRA replaces by PEFT's adapter layers"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        reason = super().check_supported(cfg, device, world_size)
        reason = reason or cls.lora_refusal(cfg)
        if reason is None and device.type != "cuda":
            reason = ACCELERATE_TP_CPU.format(version=importlib.metadata.version("accelerate"))
        reason = reason or lean_refusal(cfg, "tensor parallelism shards the weight matrices (DTensors)")
        return reason or tp_unsupported(cfg, world_size, "--nproc", BLOCKS_ONLY)

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        return 1  # every rank of the one tensor-parallel group computes the whole batch

    def data_shard(self) -> tuple[int, int]:
        return 0, 1

    def plugins(self) -> dict[str, Any]:
        from accelerate.parallelism_config import ParallelismConfig

        return {"parallelism_config": ParallelismConfig(tp_size=self.env.world_size)}

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)  # the Accelerator and its ("tp",) mesh
        apply_tp(model, self.accelerator.torch_device_mesh["tp"])
        model.tp_size = self.env.world_size  # what Accelerator.prepare checks before leaving it unwrapped
        return model

    def optimizer_step(self, optimizer, clip) -> bool:
        reduce_partial_grads(self.model)
        return super().optimizer_step(optimizer, clip)

    def report(self) -> dict[str, Any]:
        return {"mesh": {"tp": self.env.world_size}}

    @classmethod
    def yaml_blocks(cls, cfg, world_size: int) -> dict[str, Any]:
        return {"parallelism_config": {"parallelism_config_tp_size": world_size}}
