"""``accelerate-deepspeed``: accelerate's ``DeepSpeedPlugin`` with the config the ``deepspeed`` method generates
(``parallel.deepspeed_config``; the torch optimizer), DeepSpeed's engine checkpoint (``parallel.deepspeed_engine``)
and ZeRO's cost model (``parallel.zero``). GPU only: accelerate's DeepSpeed path needs one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import torch

from stratbench.core.errors import CheckpointError
from stratbench.strategies.accelerate import AccelerateCheckpointIO, AccelerateStrategy
from stratbench.strategies.base import CostModel, register
from stratbench.strategies.costs import lean_refusal
from stratbench.strategies.op_builds import prepare_op_builds
from stratbench.strategies.parallel.deepspeed_config import build_ds_config
from stratbench.strategies.parallel.deepspeed_engine import (
    avoid_shm_op_build,
    deepspeed_state_bytes,
    nvme_unavailable,
    save_engine_checkpoint,
)
from stratbench.strategies.parallel.zero import (
    DeepSpeedEngineOptions,
    DeepSpeedZeroOptions,
    deepspeed_comm,
    deepspeed_memory,
    deepspeed_overlap,
)


@dataclasses.dataclass(kw_only=True)
class AccelerateDeepSpeedOptions(DeepSpeedZeroOptions):
    """Options of accelerate-deepspeed: DeepSpeed's ZeRO options (the optimizer is always the torch one)."""


class AccelerateDeepSpeedCost(CostModel):
    """DeepSpeed's cost model for the config accelerate's DeepSpeedPlugin gets (the torch optimizer)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        ds = build_ds_config(
            ctx.cfg,
            DeepSpeedEngineOptions(**dataclasses.asdict(ctx.options)),
            ctx.world,
            config_optimizer=False,
        )
        return deepspeed_memory(ctx, ds["zero_optimization"])

    @classmethod
    def comm_model(cls, ctx):
        ds = build_ds_config(ctx.cfg, DeepSpeedEngineOptions(**dataclasses.asdict(ctx.options)), ctx.world)
        return deepspeed_comm(ctx, ds["zero_optimization"])

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        ds = build_ds_config(ctx.cfg, DeepSpeedEngineOptions(**dataclasses.asdict(ctx.options)), ctx.world)
        return deepspeed_overlap(ds["zero_optimization"])


class AccelerateDeepSpeedCheckpointIO(AccelerateCheckpointIO):
    """DeepSpeed's engine checkpoint (the prepared model is the engine); no resume."""

    def save_checkpoint(self, path, model, optimizer, extra):
        return save_engine_checkpoint(self.strategy, model, Path(path), self.strategy.ds_config, extra)

    def load_checkpoint(self, path, model, optimizer):
        raise CheckpointError(
            "accelerate-deepspeed resumes are not supported; start from the weights with --init-from"
        )


@register
class AccelerateDeepSpeed(AccelerateStrategy):
    name = "accelerate-deepspeed"
    description = "accelerate.Accelerator with DeepSpeedPlugin (the config the deepspeed strategy generates)"
    requirements = "pip install accelerate deepspeed; NVIDIA GPUs (accelerate's DeepSpeed path needs one)"
    Options = AccelerateDeepSpeedOptions
    distributed_type = "DEEPSPEED"

    def _ds_options(self):
        return DeepSpeedEngineOptions(**dataclasses.asdict(self.options))

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with accelerate-deepspeed is not supported (untested: it needs CUDA); use deepspeed"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type != "cuda":
            return "accelerate's DeepSpeed plugin needs a CUDA GPU; use the deepspeed strategy on CPU"
        if why := cls.lora_refusal(cfg):
            return why
        if importlib.util.find_spec("deepspeed") is None:
            return "needs the deepspeed package (pip install deepspeed)"
        if why := lean_refusal(cfg, "DeepSpeed steps flat fp32 partitions"):
            return why
        opts = cls.parse_options(cfg.strategy_options)
        ds = build_ds_config(
            cfg, DeepSpeedEngineOptions(**dataclasses.asdict(opts)), world_size, config_optimizer=False
        )  # conflicts -> ConfigError
        return nvme_unavailable(ds["zero_optimization"]) or super().check_supported(cfg, device, world_size)

    cost = AccelerateDeepSpeedCost
    checkpoint_io_class = AccelerateDeepSpeedCheckpointIO

    def plugins(self) -> dict[str, Any]:
        from accelerate import DeepSpeedPlugin

        avoid_shm_op_build()
        prepare_op_builds()  # the ops DeepSpeed builds under accelerate go to the same keyed, guarded cache
        ds = build_ds_config(self.cfg, self._ds_options(), self.env.world_size, config_optimizer=False)
        self.ds_config = ds
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds)}

    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # accelerate hands sync_gradients to DeepSpeed's set_gradient_accumulation_boundary in backward.
        assert self.accelerator is not None
        self.accelerator.gradient_state._set_sync_gradients(is_last_micro_step)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # accelerate's DeepSpeed backward runs engine.backward and, on the boundary, engine.step(); the loop
        # already divided the loss by grad_accum, so DeepSpeed must not divide it again.
        assert self.accelerator is not None
        self.accelerator.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, optimizer, clip) -> bool:
        # engine.step() already ran in backward (clipping from the config); accelerate's wrapper step is a no-op.
        engine = self.model
        return bool(engine.was_step_applied())

    def state_bytes(self, model, optimizer):
        return deepspeed_state_bytes(model, int(self.ds_config["zero_optimization"]["stage"]))

    @classmethod
    def yaml_blocks(cls, cfg, world_size: int) -> dict[str, Any]:
        return {
            "deepspeed_config": {
                "deepspeed_config_file": str(Path(cfg.output) / "deepspeed_config.json"),
                "zero3_init_flag": False,
            }
        }
