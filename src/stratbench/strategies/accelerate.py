"""Hugging Face accelerate: the same training through ``accelerate.Accelerator`` and its plugins.

Four methods share ``AccelerateStrategy`` (this file): ``accelerate-ddp`` (DDP; runs on CPU with gloo, here),
``accelerate-fsdp`` (``FullyShardedDataParallelPlugin``, FSDP2: ``accelerate_fsdp.py``), ``accelerate-deepspeed``
(``DeepSpeedPlugin`` with the config stratbench generates for the ``deepspeed`` strategy: ``accelerate_deepspeed.py``)
and ``accelerate-tp`` (``ParallelismConfig(tp_size=N)`` on tp's plan; GPU only: accelerate refuses it on CPU
processes: ``accelerate_tp.py``). The run directory gets the equivalent ``accelerate launch`` config
(accelerate_config.yaml, today's key names: ``parallel.accelerate_config``), so the same training can be started
with ``accelerate launch --config_file OUTPUT/accelerate_config.yaml -m stratbench train ...``.

accelerate's documented CPU flags (``--cpu --num_processes 2``, ``distributed_type: MULTI_CPU``) silently start
ONE process; stratbench refuses to run when the world size accelerate sees differs from the one launched.
``accelerate`` is imported lazily: this module is imported by ``stratbench list`` and at CLI start-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, UnsupportedError
from stratbench.measuring.comm import replicated_grads
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, get_strategy, register
from stratbench.strategies.parallel.accelerate_config import MIXED_PRECISION, accelerate_config_text

ACCELERATE_DIR = "accelerate"
"""Sub-folder of a stratbench checkpoint folder that holds accelerate's save_state files."""


def inner_optimizer(optimizer):
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def single_process_launch_reason(world_size: int) -> str | None:
    """Why accelerate's simple launcher (one process) was used where several were asked for, else None.

    ``accelerate launch --cpu --num_processes N`` (and ``distributed_type: MULTI_CPU`` without MPI) runs the
    script once with MASTER_ADDR/MASTER_PORT set but no RANK/WORLD_SIZE: one process pretending to be N.
    """
    env = os.environ
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_USE_CPU" in env
    if (
        launched_by_accelerate
        and "MASTER_ADDR" in env
        and "WORLD_SIZE" not in env
        and "RANK" not in env
        and world_size == 1
    ):
        return (
            "accelerate launch started ONE process although several were asked for (its --cpu / MULTI_CPU path "
            "ignores --num_processes); use `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N` "
            "or `stratbench train --nproc N`"
        )
    return None


class AccelerateCheckpointIO(CheckpointIO):
    """accelerator.save_state in a folder (layout "accelerate") plus stratbench's header; a resume of the same
    method and world size through accelerator.load_state, anything else through the full state dicts (the
    torch optimizer under accelerate's wrapper)."""

    def optimizer_state_dict(self, model, optimizer):
        return super().optimizer_state_dict(model, inner_optimizer(optimizer))

    def load_optimizer_state_dict(self, model, optimizer, state):
        super().load_optimizer_state_dict(model, inner_optimizer(optimizer), state)

    def save_checkpoint(self, path: Path, model: nn.Module, optimizer, extra: dict) -> Path:
        """accelerator.save_state into a folder (layout "accelerate") plus stratbench's header; atomic swap."""
        strategy = self.strategy
        assert strategy.accelerator is not None
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        if strategy.env.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            # Made before the barrier: save_state creates it on the main process only, and the other ranks may
            # write their RNG files into it before the main process gets there.
            (tmp / ACCELERATE_DIR).mkdir(parents=True)
        strategy.barrier()
        strategy.accelerator.save_state(str(tmp / ACCELERATE_DIR))  # a collective for sharded plugins
        # Every rank writes its own files (RNG states) into tmp: the main process must not move it into place
        # before they have all finished (seen: rank 1 writing into a folder rank 0 had already renamed).
        strategy.barrier()
        if strategy.env.is_main:
            names = [n for n, _ in strategy.unwrap(model).named_parameters()]
            header = {
                "format": checkpoint.FORMAT,
                "version": checkpoint.VERSION,
                "layout": "accelerate",
                "accelerate_strategy": strategy.name,
                "param_names": names,
            }
            checkpoint.atomic_save(header | extra, tmp / checkpoint.META_FILE)
            checkpoint.replace_path(tmp, path)
        strategy.barrier()
        return path

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Own layout, same method and world size: accelerator.load_state. Anything else: the full state."""
        strategy = self.strategy
        assert strategy.accelerator is not None
        path = Path(path)
        meta = checkpoint.read_meta(path)
        same = (
            meta.get("layout") == "accelerate"
            and meta.get("accelerate_strategy") == strategy.name
            and meta.get("world_size") == strategy.env.world_size
        )
        if same and optimizer is not None:
            checkpoint.check_folder(path)  # accelerate unpickles its RNG and custom states weights_only=False
            strategy.accelerator.load_state(str(path / ACCELERATE_DIR))
            return meta
        return super().load_checkpoint(path, model, optimizer)


class AccelerateStrategy(Strategy):
    """Shared implementation; subclasses pick the plugin."""

    needs_process_group = True
    launcher = "accelerate"
    checkpoint_io_class = AccelerateCheckpointIO
    distributed_type = "MULTI_GPU"
    """accelerate's distributed_type in the YAML stratbench writes (MULTI_GPU with use_cpu is the combination
    that starts N CPU processes; MULTI_CPU starts one)."""

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            return "needs the accelerate package (pip install accelerate)"
        if why := cls.quantize_refusal(cfg):
            return why
        if cfg.precision not in MIXED_PRECISION:
            return (
                f"accelerate has no {cfg.precision} mode (its mixed_precision is no, fp16 or bf16 with fp32 weights); "
                f"use {', '.join(MIXED_PRECISION)}"
            )
        return single_process_launch_reason(world_size)

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, precision, options)
        # accelerate autocasts inside the prepared model's forward and owns the GradScaler: stratbench's
        # precision keeps only the evaluation autocast (same dtype, so nesting is harmless).
        self.precision.scaler = torch.amp.GradScaler(env.device.type, enabled=False)
        self.accelerator = None

    # ---- set-up -------------------------------------------------------------------------------
    def plugins(self) -> dict[str, Any]:
        """The Accelerator's plugin arguments for this method (fsdp_plugin, deepspeed_plugin, ...): none here."""
        return {}

    def wrap(self, model: nn.Module) -> nn.Module:
        """Create the Accelerator; FSDP1 shards the model here, before the optimizer is built on its shards."""
        from accelerate import Accelerator

        kwargs = self.plugins()
        self.accelerator = Accelerator(
            cpu=self.env.device.type == "cpu",
            mixed_precision=MIXED_PRECISION[self.cfg.precision],
            # 1 unless DeepSpeed: the loop already divides the loss by grad_accum, and accelerate's backward
            # would divide it again; accumulation is accelerator.no_sync on all but the last micro-step.
            gradient_accumulation_steps=self.cfg.grad_accum if "deepspeed_plugin" in kwargs else 1,
            **kwargs,
        )
        acc = self.accelerator
        if acc.num_processes != self.env.world_size:
            raise UnsupportedError(
                f"accelerate sees {acc.num_processes} process(es) but {self.env.world_size} were launched "
                f"(distributed_type {acc.distributed_type}); refusing to run a different method than {self.name}"
            )
        # FSDP1 wraps the model before the optimizer is built on its flat parameters; accelerate's FSDP2 takes
        # model and optimizer in one prepare call (it swaps the optimizer's parameters for the sharded ones,
        # and refuses a model alone: "a model and optimizer must be passed together", seen on an H200)
        fsdp_version = getattr(kwargs.get("fsdp_plugin"), "fsdp_version", None)
        self._prepare_model_first = fsdp_version == 1
        return acc.prepare(model) if self._prepare_model_first else model

    def build_optimizer(self, model: nn.Module, make_optimizer) -> torch.optim.Optimizer:
        acc = self.accelerator
        if self._prepare_model_first:
            return acc.prepare(make_optimizer(model.parameters()))
        self.model, optimizer = acc.prepare(model, make_optimizer(model.parameters()))
        return optimizer

    # ---- one step -----------------------------------------------------------------------------
    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        assert self.accelerator is not None
        self.accelerator.gradient_state._set_sync_gradients(is_last_micro_step)
        if is_last_micro_step:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        assert self.accelerator is not None
        self.accelerator.backward(loss)

    def optimizer_step(self, optimizer, clip) -> bool:
        assert self.accelerator is not None
        if clip:
            self.accelerator.clip_grad_norm_(self.model.parameters(), clip)  # unscales fp16 gradients first
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipped = bool(self.accelerator.optimizer_step_was_skipped)
        self.precision.skipped_steps += int(skipped)
        return not skipped

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        assert self.accelerator is not None
        return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def run_files(self) -> dict[str, str]:
        return {"accelerate_config.yaml": self.config_text(self.cfg, self.env.world_size)}

    @classmethod
    def yaml_blocks(cls, cfg: TrainConfig, world_size: int) -> dict[str, Any]:
        """The method's own blocks of the accelerate YAML (fsdp_config, deepspeed_config, ...): none here."""
        return {}

    @classmethod
    def config_text(cls, cfg: TrainConfig, world_size: int) -> str:
        """The `accelerate launch --config_file` equivalent of this run of the method."""
        return accelerate_config_text(cfg, world_size, cls.distributed_type, cls.yaml_blocks(cfg, world_size))

    # ---- state ----------------------------------------------------------------------------------
    def optimizer_report(self, optimizer) -> dict[str, Any]:
        report = super().optimizer_report(inner_optimizer(optimizer))
        report["optimizer"]["wrapper"] = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        return report

    def state_bytes(self, model, optimizer):
        return super().state_bytes(model, inner_optimizer(optimizer))


class AccelerateDDPCost(CostModel):
    """DDP under accelerate: a replica and buckets per rank, the gradients all-reduced."""

    @classmethod
    def memory_model(cls, ctx, rank):
        return ctx.replicated(buckets=True)

    @classmethod
    def comm_model(cls, ctx):
        return replicated_grads(ctx, "gradient buckets (DDP under accelerate)")


@register
class AccelerateDDP(AccelerateStrategy):
    name = "accelerate-ddp"
    description = "accelerate.Accelerator, DDP (the source's default_DDP.yml)"
    requirements = "pip install accelerate; 1+ processes (CPU with gloo, or one GPU each)"

    cost = AccelerateDDPCost


def write_accelerate_config(cfg: TrainConfig, strategy: str, world_size: int, path: Path) -> None:
    """Write the accelerate YAML of a run of ``strategy`` (an accelerate-* method) to ``path``."""
    checkpoint.atomic_write(path, get_strategy(strategy).config_text(cfg, world_size))


def read_accelerate_checkpoint(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Full model (and, for DDP, optimizer keyed by parameter names) from an accelerate save_state folder."""
    checkpoint.check_folder(path)  # zero_to_fp32 (accelerate-deepspeed) unpickles weights_only=False
    folder = Path(path) / ACCELERATE_DIR
    model_file = folder / "model.safetensors"
    if model_file.exists():
        from safetensors.torch import load_file

        model = load_file(str(model_file))
    elif (folder / "pytorch_model.bin").exists():
        model = checkpoint.safe_torch_load(folder / "pytorch_model.bin")
    elif (folder / "pytorch_model").is_dir():  # accelerate-deepspeed: a DeepSpeed checkpoint
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        ds_dir = folder / "pytorch_model"
        latest = ds_dir / "latest"
        if not latest.is_file():
            raise CheckpointError(
                f"{ds_dir} has no 'latest' file naming its DeepSpeed tag (incomplete checkpoint?)"
            )
        # The tag names a folder inside this one (a crafted '../..' would make zero_to_fp32 read files elsewhere).
        tag = checkpoint.check_tag(ds_dir, latest.read_text().strip())
        return {"model": get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag), "optimizer": {}}
    else:
        raise CheckpointError(
            f"{folder} holds no model file accelerate's save_state writes (model.safetensors, ...)"
        )
    optimizer: dict[str, Any] = {}
    opt_file = folder / "optimizer.bin"
    names = meta.get("param_names")
    if opt_file.exists() and names:
        raw = checkpoint.safe_torch_load(opt_file)
        # torch's optimizer state_dict numbers parameters in the order they were given: model.parameters().
        optimizer = {
            "state": {names[i]: s for i, s in raw["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in raw["param_groups"]],
        }
    return {"model": model, "optimizer": optimizer}


def _register_layout() -> None:
    checkpoint.register_layout("accelerate", read_accelerate_checkpoint)


_register_layout()
