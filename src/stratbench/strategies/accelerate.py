"""Hugging Face accelerate: the same training through ``accelerate.Accelerator`` and its plugins.

Four strategies share one class: ``accelerate-ddp`` (DDP; runs on CPU with gloo), ``accelerate-fsdp``
(``FullyShardedDataParallelPlugin``, FSDP2), ``accelerate-deepspeed`` (``DeepSpeedPlugin`` with the config
stratbench generates for the ``deepspeed`` strategy) and ``accelerate-tp`` (``ParallelismConfig(tp_size=N)`` on
tp's plan; GPU only: accelerate refuses it on CPU processes). The run directory gets the
equivalent ``accelerate launch`` config (accelerate_config.yaml, today's key names), so the same training can
be started with ``accelerate launch --config_file OUTPUT/accelerate_config.yaml -m stratbench train ...``.

accelerate's documented CPU flags (``--cpu --num_processes 2``, ``distributed_type: MULTI_CPU``) silently start
ONE process; stratbench refuses to run when the world size accelerate sees differs from the one launched.
``accelerate`` is imported lazily: this module is imported by ``stratbench list`` and at CLI start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError, UnsupportedError
from stratbench.measuring.comm import replicated_grads
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register
from stratbench.strategies.deepspeed import (
    DeepSpeedOptions,
    DeepSpeedZeroOptions,
    _avoid_shm_op_build,
    _deepspeed_state_bytes,
    _nvme_unavailable,
    build_ds_config,
    deepspeed_comm,
    deepspeed_memory,
    deepspeed_overlap,
    save_engine_checkpoint,
)
from stratbench.strategies.fsdp import fsdp2_comm, fsdp2_memory
from stratbench.strategies.op_builds import prepare_op_builds
from stratbench.strategies.tp import BLOCKS_ONLY, TPCheckpointIO, TPCost, apply_tp, reduce_partial_grads
from stratbench.strategies.tp import unsupported as tp_unsupported

MIXED_PRECISION = {"fp32": "no", "fp64": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""stratbench precision -> accelerate's mixed_precision (accelerate has no pure fp16/bf16 mode)."""
ACCELERATE_DIR = "accelerate"
"""Sub-folder of a stratbench checkpoint folder that holds accelerate's save_state files."""


FSDP_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""accelerate's sharding strategies, in torch's ShardingStrategy order (the source's YAML writes them as 1-5)."""
FSDP_WRAP = ("SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP", "NO_WRAP")
FSDP_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_STATE_DICT = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
FSDP1_ONLY = (
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
)
"""Knobs of FSDP1 that FSDP2 does not have (accelerate drops or refuses them under fsdp_version 2)."""


@dataclasses.dataclass(kw_only=True)
class AccelerateFsdpOptions:
    """The knobs of accelerate's fsdp_config (the source's default_FSDP.yml), under today's key names."""

    fsdp_version: int = 2
    """accelerate-fsdp: 1 (FullyShardedDataParallel) or 2 (fully_shard); accelerate's own default, used for a YAML without fsdp_version, is 1."""
    fsdp_sharding_strategy: str = "FULL_SHARD"
    """accelerate-fsdp: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2 (or 1-5, as the source writes it); FSDP2 takes the first two (reshard_after_forward true/false)."""
    fsdp_auto_wrap_policy: str = "SIZE_BASED_WRAP"
    """accelerate-fsdp: SIZE_BASED_WRAP (modules of >= --fsdp-min-num-params), TRANSFORMER_BASED_WRAP (the module classes in --fsdp-transformer-layer-cls-to-wrap) or NO_WRAP."""
    fsdp_min_num_params: int = 1_000_000
    """accelerate-fsdp: size-based auto-wrap threshold (parameters per FSDP unit), as in the source's default_FSDP.yml."""
    fsdp_transformer_layer_cls_to_wrap: str | None = None
    """accelerate-fsdp TRANSFORMER_BASED_WRAP: comma-separated module class names, each its own unit (e.g. Bottleneck)."""
    fsdp_backward_prefetch: str | None = None
    """accelerate-fsdp, FSDP1 only: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH."""
    fsdp_forward_prefetch: bool | None = None
    """accelerate-fsdp, FSDP1 only: prefetch the next unit's all-gather in forward."""
    fsdp_state_dict_type: str = "SHARDED_STATE_DICT"
    """accelerate-fsdp: how save_state writes the model: SHARDED_STATE_DICT or FULL_STATE_DICT."""
    fsdp_offload_params: bool = False
    """accelerate-fsdp: offload parameters (and the optimizer step) to the CPU."""
    fsdp_sync_module_states: bool | None = None
    """accelerate-fsdp, FSDP1 only: broadcast rank 0's weights to every rank at wrapping."""
    fsdp_use_orig_params: bool | None = None
    """accelerate-fsdp, FSDP1 only: the optimizer sees the original parameters (FSDP2 always does)."""
    fsdp_cpu_ram_efficient_loading: bool = False
    """accelerate-fsdp: only rank 0 materialises the weights (a Transformers loading path; with FSDP1 it turns on sync_module_states)."""

    def __post_init__(self) -> None:
        if self.fsdp_version not in (1, 2):
            raise ConfigError(f"fsdp_version must be 1 or 2, got {self.fsdp_version!r}")
        self.fsdp_sharding_strategy = _fsdp_choice(
            "fsdp_sharding_strategy", self.fsdp_sharding_strategy, FSDP_SHARDING
        )
        self.fsdp_auto_wrap_policy = _fsdp_choice(
            "fsdp_auto_wrap_policy", self.fsdp_auto_wrap_policy, FSDP_WRAP
        )
        self.fsdp_state_dict_type = _fsdp_choice(
            "fsdp_state_dict_type", self.fsdp_state_dict_type, FSDP_STATE_DICT
        )
        if self.fsdp_backward_prefetch is not None:
            self.fsdp_backward_prefetch = _fsdp_choice(
                "fsdp_backward_prefetch", self.fsdp_backward_prefetch, FSDP_BACKWARD_PREFETCH
            )
        if self.fsdp_min_num_params < 0:
            raise ConfigError(f"fsdp_min_num_params must be >= 0, got {self.fsdp_min_num_params}")
        if (
            self.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
            and not (self.fsdp_transformer_layer_cls_to_wrap or "").strip()
        ):
            raise ConfigError(
                "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP needs fsdp_transformer_layer_cls_to_wrap (module class names)"
            )
        if self.fsdp_version == 2:
            given = [k for k in FSDP1_ONLY if getattr(self, k) is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} exist(s) in FSDP1 only; set fsdp_version 1 or remove them (FSDP2 has no "
                    "prefetch knobs, always uses the original parameters and needs no state sync)"
                )
            if self.fsdp_sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                raise ConfigError(
                    f"fsdp_sharding_strategy {self.fsdp_sharding_strategy} needs fsdp_version 1; FSDP2 through "
                    "accelerate takes FULL_SHARD or SHARD_GRAD_OP (reshard_after_forward true/false)"
                )


def _fsdp_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """accelerate's spelling: case-insensitive names, or 1-based numbers (torch's enum values) as old YAMLs write."""
    text = str(value).strip().upper()
    if (
        text.isdigit()
        and 1 <= int(text) <= len(allowed)
        and name in ("fsdp_sharding_strategy", "fsdp_backward_prefetch")
    ):
        return allowed[int(text) - 1]
    if text not in allowed:
        raise ConfigError(f"{name} must be one of: {', '.join(allowed)}; got {value!r}")
    return text


@dataclasses.dataclass(kw_only=True)
class AccelerateDeepSpeedOptions(DeepSpeedZeroOptions):
    """Options of accelerate-deepspeed: DeepSpeed's ZeRO options (the optimizer is always the torch one)."""


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> the torch optimizer


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
        return super().optimizer_state_dict(model, _inner(optimizer))

    def load_optimizer_state_dict(self, model, optimizer, state):
        super().load_optimizer_state_dict(model, _inner(optimizer), state)

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


class _Accelerate(Strategy):
    """Shared implementation; subclasses pick the plugin."""

    needs_process_group = True
    launcher = "accelerate"
    checkpoint_io_class = AccelerateCheckpointIO

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            return "needs the accelerate package (pip install accelerate)"
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
    def _plugins(self) -> dict[str, Any]:
        return {}

    def wrap(self, model: nn.Module) -> nn.Module:
        """Create the Accelerator; FSDP1 shards the model here, before the optimizer is built on its shards."""
        from accelerate import Accelerator

        kwargs = self._plugins()
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
        return {"accelerate_config.yaml": accelerate_config_text(self.cfg, self.name, self.env.world_size)}

    # ---- state ----------------------------------------------------------------------------------
    def optimizer_report(self, optimizer) -> dict[str, Any]:
        report = super().optimizer_report(_inner(optimizer))
        report["optimizer"]["wrapper"] = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        return report

    def state_bytes(self, model, optimizer):
        return super().state_bytes(model, _inner(optimizer))


class AccelerateDDPCost(CostModel):
    """DDP under accelerate: a replica and buckets per rank, the gradients all-reduced."""

    @classmethod
    def memory_model(cls, ctx, rank):
        return ctx.replicated(buckets=True)

    @classmethod
    def comm_model(cls, ctx):
        return replicated_grads(ctx, "gradient buckets (DDP under accelerate)")


@register
class AccelerateDDP(_Accelerate):
    name = "accelerate-ddp"
    description = "accelerate.Accelerator, DDP (the source's default_DDP.yml)"
    requirements = "pip install accelerate; 1+ processes (CPU with gloo, or one GPU each)"

    cost = AccelerateDDPCost


class AccelerateFSDPCost(CostModel):
    """accelerate's FSDP plugin costed as FSDP2 (``fsdp2_memory``, ``fsdp2_comm``)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        # Per-parameter sharding (FSDP2's layout; FSDP1's flat units pad a little more); its size-based or
        # class-based units are approximated by blocks.
        opts = ctx.options
        sharding = {"FULL_SHARD": "full", "NO_SHARD": "none"}.get(opts.fsdp_sharding_strategy, "grad-op")
        return fsdp2_memory(ctx, rank, sharding, opts.fsdp_offload_params)

    @classmethod
    def comm_model(cls, ctx):
        return fsdp2_comm(ctx, "full")  # FSDP2, reshard_after_forward (FULL_SHARD); units do not change bytes


@register
class AccelerateFSDP(_Accelerate):
    name = "accelerate-fsdp"
    description = (
        "accelerate.Accelerator with FullyShardedDataParallelPlugin (FSDP2, the source's default_FSDP.yml)"
    )
    requirements = "pip install accelerate; NVIDIA GPUs (accelerate's FSDP does not run on CPU)"
    Options = AccelerateFsdpOptions

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type != "cuda":
            return "accelerate's FSDP plugin needs a CUDA GPU (on CPU it fails or silently becomes DDP); use fsdp on CPU"
        return super().check_supported(cfg, device, world_size)

    cost = AccelerateFSDPCost

    def _plugins(self) -> dict[str, Any]:
        from accelerate import FullyShardedDataParallelPlugin

        return {"fsdp_plugin": FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(self.options))}


def fsdp_plugin_kwargs(opts: AccelerateFsdpOptions) -> dict[str, Any]:
    """FullyShardedDataParallelPlugin's arguments for these options (accelerate validates them again)."""
    kw: dict[str, Any] = {
        "fsdp_version": opts.fsdp_version,
        "auto_wrap_policy": opts.fsdp_auto_wrap_policy.lower(),
        "cpu_offload": opts.fsdp_offload_params,
        "state_dict_type": opts.fsdp_state_dict_type,
        "cpu_ram_efficient_loading": opts.fsdp_cpu_ram_efficient_loading,
    }
    if opts.fsdp_auto_wrap_policy == "SIZE_BASED_WRAP":
        kw["min_num_params"] = opts.fsdp_min_num_params
    elif opts.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        kw["transformer_cls_names_to_wrap"] = [
            n.strip() for n in (opts.fsdp_transformer_layer_cls_to_wrap or "").split(",") if n.strip()
        ]
    if opts.fsdp_version == 2:
        kw["reshard_after_forward"] = opts.fsdp_sharding_strategy == "FULL_SHARD"
    else:
        kw["reshard_after_forward"] = opts.fsdp_sharding_strategy
        kw["backward_prefetch"] = opts.fsdp_backward_prefetch or "NO_PREFETCH"
        kw["forward_prefetch"] = bool(opts.fsdp_forward_prefetch)
        kw["sync_module_states"] = bool(opts.fsdp_sync_module_states)
        kw["use_orig_params"] = bool(opts.fsdp_use_orig_params)
    return kw


class AccelerateDeepSpeedCost(CostModel):
    """DeepSpeed's cost model for the config accelerate's DeepSpeedPlugin gets (the torch optimizer)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        ds = build_ds_config(
            ctx.cfg, DeepSpeedOptions(**dataclasses.asdict(ctx.options)), ctx.world, config_optimizer=False
        )
        return deepspeed_memory(ctx, ds["zero_optimization"])

    @classmethod
    def comm_model(cls, ctx):
        ds = build_ds_config(ctx.cfg, DeepSpeedOptions(**dataclasses.asdict(ctx.options)), ctx.world)
        return deepspeed_comm(ctx, ds["zero_optimization"])

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        ds = build_ds_config(ctx.cfg, DeepSpeedOptions(**dataclasses.asdict(ctx.options)), ctx.world)
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
class AccelerateDeepSpeed(_Accelerate):
    name = "accelerate-deepspeed"
    description = "accelerate.Accelerator with DeepSpeedPlugin (the config the deepspeed strategy generates)"
    requirements = "pip install accelerate deepspeed; NVIDIA GPUs (accelerate's DeepSpeed path needs one)"
    Options = AccelerateDeepSpeedOptions

    def _ds_options(self):
        return DeepSpeedOptions(**dataclasses.asdict(self.options))

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type != "cuda":
            return "accelerate's DeepSpeed plugin needs a CUDA GPU; use the deepspeed strategy on CPU"
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "needs the deepspeed package (pip install deepspeed)"
        opts = cls.parse_options(cfg.strategy_options)
        ds = build_ds_config(
            cfg, DeepSpeedOptions(**dataclasses.asdict(opts)), world_size, config_optimizer=False
        )  # conflicts -> ConfigError
        return _nvme_unavailable(ds["zero_optimization"]) or super().check_supported(cfg, device, world_size)

    cost = AccelerateDeepSpeedCost
    checkpoint_io_class = AccelerateDeepSpeedCheckpointIO

    def _plugins(self) -> dict[str, Any]:
        from accelerate import DeepSpeedPlugin

        _avoid_shm_op_build()
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
        return _deepspeed_state_bytes(model, int(self.ds_config["zero_optimization"]["stage"]))


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
        return super().save_checkpoint(path, model, _inner(optimizer), extra)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer) -> dict:
        return super().load_checkpoint(path, model, _inner(optimizer))


@register
class AccelerateTP(_Accelerate):
    """Every rank one slice of each block's matrices (tp's plan, blocks only) under accelerate's
    ParallelismConfig(tp_size=world): accelerate builds the ("tp",) mesh and leaves the model unwrapped (no DDP)
    once it carries ``tp_size``, as a Transformers model loaded with tp_plan does."""

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
    def check_supported(cls, cfg, device, world_size):
        import importlib.metadata

        reason = super().check_supported(cfg, device, world_size)
        if reason is None and device.type != "cuda":
            reason = ACCELERATE_TP_CPU.format(version=importlib.metadata.version("accelerate"))
        return reason or tp_unsupported(cfg, world_size, "--nproc", BLOCKS_ONLY)

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        return 1  # every rank of the one tensor-parallel group computes the whole batch

    def data_shard(self) -> tuple[int, int]:
        return 0, 1

    def _plugins(self) -> dict[str, Any]:
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


def write_accelerate_config(cfg: TrainConfig, strategy: str, world_size: int, path: Path) -> None:
    """Write ``accelerate_config_text`` to ``path``."""
    checkpoint.atomic_write(path, accelerate_config_text(cfg, strategy, world_size))


def accelerate_config_text(cfg: TrainConfig, strategy: str, world_size: int) -> str:
    """The `accelerate launch --config_file` equivalent of this run (the source's default_*.yml, today's keys)."""
    import yaml

    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    doc: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        # MULTI_GPU with use_cpu is the combination that starts N CPU processes; MULTI_CPU starts one.
        "distributed_type": {
            "accelerate-ddp": "MULTI_GPU",
            "accelerate-fsdp": "FSDP",
            "accelerate-deepspeed": "DEEPSPEED",
            "accelerate-tp": "MULTI_GPU",
        }[strategy],
        "downcast_bf16": "no",
        "machine_rank": cfg.node_rank,
        "main_training_function": "main",
        "mixed_precision": MIXED_PRECISION.get(cfg.precision, "no"),
        "num_machines": cfg.nnodes,
        "num_processes": world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": on_cpu,
    }
    if not on_cpu:
        doc["gpu_ids"] = "all"
    if cfg.nnodes > 1:
        doc["main_process_ip"] = cfg.master_addr
        doc["main_process_port"] = cfg.master_port or 29500
    if strategy == "accelerate-fsdp":
        doc["fsdp_config"] = _fsdp_yaml(cfg)
    if strategy == "accelerate-tp":
        doc["parallelism_config"] = {"parallelism_config_tp_size": world_size}
    if strategy == "accelerate-deepspeed":
        doc["deepspeed_config"] = {
            "deepspeed_config_file": str(Path(cfg.output) / "deepspeed_config.json"),
            "zero3_init_flag": False,
        }
    return (
        "# accelerate launch --config_file this.yaml -m stratbench train <same flags> (written by stratbench)\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )


def _fsdp_yaml(cfg: TrainConfig) -> dict[str, Any]:
    """The ``fsdp_config`` block of the accelerate YAML for this run's accelerate-fsdp options."""
    opts = AccelerateFSDP.parse_options(cfg.strategy_options)
    fsdp: dict[str, Any] = {
        "fsdp_version": opts.fsdp_version,
        "fsdp_auto_wrap_policy": opts.fsdp_auto_wrap_policy,
        "fsdp_offload_params": opts.fsdp_offload_params,
        # FSDP2: a bool; FSDP1: the sharding strategy's name (accelerate's key for both today).
        "fsdp_reshard_after_forward": (
            opts.fsdp_sharding_strategy == "FULL_SHARD"
            if opts.fsdp_version == 2
            else opts.fsdp_sharding_strategy
        ),
        "fsdp_state_dict_type": opts.fsdp_state_dict_type,
        "fsdp_cpu_ram_efficient_loading": opts.fsdp_cpu_ram_efficient_loading,
        "fsdp_activation_checkpointing": cfg.activation_checkpointing,
    }
    if opts.fsdp_auto_wrap_policy == "SIZE_BASED_WRAP":
        fsdp["fsdp_min_num_params"] = opts.fsdp_min_num_params
    if opts.fsdp_transformer_layer_cls_to_wrap:
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = opts.fsdp_transformer_layer_cls_to_wrap
    if opts.fsdp_version == 1:
        fsdp["fsdp_backward_prefetch"] = opts.fsdp_backward_prefetch or "NO_PREFETCH"
        fsdp["fsdp_forward_prefetch"] = bool(opts.fsdp_forward_prefetch)
        fsdp["fsdp_sync_module_states"] = bool(opts.fsdp_sync_module_states)
        fsdp["fsdp_use_orig_params"] = bool(opts.fsdp_use_orig_params)
    return fsdp


ACCELERATE_STRATEGY = {
    "MULTI_GPU": "accelerate-ddp",
    "MULTI_CPU": "accelerate-ddp",
    "NO": "accelerate-ddp",
    "FSDP": "accelerate-fsdp",
    "DEEPSPEED": "accelerate-deepspeed",
}
"""accelerate's distributed_type -> the stratbench method that runs it (MULTI_CPU and NO: stratbench starts the
num_processes processes itself, where accelerate's CPU launcher would start one)."""
ACCELERATE_PRECISION = {"no": None, "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
ACCELERATE_IGNORED = {
    "compute_environment", "debug", "downcast_bf16", "dynamo_config", "enable_cpu_affinity", "gpu_ids",
    "main_training_function", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "tpu_name", "tpu_zone", "tpu_vm", "command_file", "commands", "use_cpu", "distributed_type", "mixed_precision",
    "num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "fsdp_config",
    "deepspeed_config", "parallelism_config",
}  # fmt: skip
"""Top-level keys `accelerate config` writes: the ones above ``use_cpu`` concern accelerate's own launcher
(GPU ids, rendezvous, dynamo, TPU) and do not change the training; the rest are read."""
FSDP_KEYS = {
    "fsdp_version": "fsdp_version",
    "fsdp_sharding_strategy": "fsdp_sharding_strategy",
    "fsdp_auto_wrap_policy": "fsdp_auto_wrap_policy",
    "fsdp_min_num_params": "fsdp_min_num_params",
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_backward_prefetch": "fsdp_backward_prefetch",
    "fsdp_backward_prefetch_policy": "fsdp_backward_prefetch",  # the source's (older) key
    "fsdp_forward_prefetch": "fsdp_forward_prefetch",
    "fsdp_state_dict_type": "fsdp_state_dict_type",
    "fsdp_offload_params": "fsdp_offload_params",
    "fsdp_sync_module_states": "fsdp_sync_module_states",
    "fsdp_use_orig_params": "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
}
"""fsdp_config keys -> accelerate-fsdp options (fsdp_reshard_after_forward and fsdp_activation_checkpointing are
read separately)."""
DEEPSPEED_KEYS = {
    "deepspeed_config_file": "deepspeed_config",
    "zero_stage": "zero_stage",
    "offload_optimizer_device": "offload_optimizer",
    "offload_param_device": "offload_params",
}
DEEPSPEED_IGNORED = {"zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher"}


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    """A user's accelerate YAML (what `accelerate config` writes, or the source's default_*.yml) as stratbench
    train values: the method, precision, processes, nodes and the plugin's knobs. Unknown keys are an error
    naming the known ones; launcher-only keys (gpu_ids, rdzv_backend, ...) are accepted and change nothing."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--accelerate-config: file not found: {p}")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--accelerate-config {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--accelerate-config {p} must hold a mapping, got {type(doc).__name__}")
    src = f"--accelerate-config {p}"
    unknown = sorted(set(doc) - ACCELERATE_IGNORED)
    if unknown:
        raise ConfigError(
            f"{src}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(ACCELERATE_IGNORED))}"
        )
    kind = str(doc.get("distributed_type", "NO")).upper()
    if kind not in ACCELERATE_STRATEGY:
        raise ConfigError(
            f"{src}: distributed_type {kind} is not supported; choose one of: {', '.join(ACCELERATE_STRATEGY)}"
        )
    out: dict[str, Any] = {"strategy": _tp_strategy(doc, kind, src) or ACCELERATE_STRATEGY[kind]}
    mixed = str(doc.get("mixed_precision", "no")).lower()
    if mixed not in ACCELERATE_PRECISION:
        raise ConfigError(
            f"{src}: mixed_precision {mixed} is not supported; choose one of: {', '.join(ACCELERATE_PRECISION)}"
        )
    if ACCELERATE_PRECISION[mixed]:
        out["precision"] = ACCELERATE_PRECISION[mixed]
    machines = int(doc.get("num_machines", 1) or 1)
    processes = int(doc.get("num_processes", 1) or 1)
    if processes < 1 or processes % machines:
        raise ConfigError(f"{src}: num_processes {processes} is not a multiple of num_machines {machines}")
    out |= {
        "nproc": processes // machines,
        "nnodes": machines,
        "node_rank": int(doc.get("machine_rank", 0) or 0),
    }
    if doc.get("main_process_ip"):
        out["master_addr"] = str(doc["main_process_ip"])
    if doc.get("main_process_port"):
        out["master_port"] = int(doc["main_process_port"])
    if doc.get("use_cpu") is True:
        out["device"] = "cpu"
    options: dict[str, Any] = {}
    if kind == "FSDP":
        options = _fsdp_options(dict(doc.get("fsdp_config") or {}), src, out)
    elif kind == "DEEPSPEED":
        options = _deepspeed_options(dict(doc.get("deepspeed_config") or {}), src, out)
    out["strategy_options"] = options
    return out


def _tp_strategy(doc: dict[str, Any], kind: str, src: str) -> str | None:
    """accelerate-tp where the YAML's ``parallelism_config`` asks for tensor parallelism: over every process of a
    MULTI_GPU config (what stratbench runs; 2D and other layouts are refused in one line)."""
    block = doc.get("parallelism_config") or {}
    tp = int(block.get("parallelism_config_tp_size", 1) or 1)
    if tp == 1:
        return None
    processes = int(doc.get("num_processes", 1) or 1)
    if kind != "MULTI_GPU" or tp != processes:
        raise ConfigError(
            f"{src}: parallelism_config_tp_size {tp} with distributed_type {kind} and {processes} processes; "
            f"stratbench runs accelerate's tensor parallelism (accelerate-tp) over every process of a MULTI_GPU "
            f"config: give parallelism_config_tp_size {processes} and distributed_type MULTI_GPU"
        )
    return "accelerate-tp"


def _fsdp_options(fsdp: dict[str, Any], src: str, out: dict[str, Any]) -> dict[str, Any]:
    """accelerate-fsdp's options from an accelerate YAML's ``fsdp_config`` (its activation checkpointing goes
    to ``out``, the train values)."""
    extra = sorted(
        set(fsdp) - set(FSDP_KEYS) - {"fsdp_reshard_after_forward", "fsdp_activation_checkpointing"}
    )
    if extra:
        raise ConfigError(
            f"{src}: unknown fsdp_config key(s) {', '.join(extra)}; known: {', '.join(FSDP_KEYS)}"
        )
    options = {FSDP_KEYS[k]: v for k, v in fsdp.items() if k in FSDP_KEYS}
    if isinstance(options.get("fsdp_transformer_layer_cls_to_wrap"), list):
        options["fsdp_transformer_layer_cls_to_wrap"] = ",".join(
            options["fsdp_transformer_layer_cls_to_wrap"]
        )
    options.setdefault("fsdp_version", 1)  # accelerate's default when the YAML does not say
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if reshard is not None:
        if isinstance(reshard, bool) or str(reshard).lower() in ("true", "false"):
            reshard = "FULL_SHARD" if str(reshard).lower() == "true" else "SHARD_GRAD_OP"
        options["fsdp_sharding_strategy"] = reshard
    if fsdp.get("fsdp_activation_checkpointing"):
        out["activation_checkpointing"] = True
    return options


def _deepspeed_options(ds: dict[str, Any], src: str, out: dict[str, Any]) -> dict[str, Any]:
    """accelerate-deepspeed's options from an accelerate YAML's ``deepspeed_config`` (its accumulation and
    clipping go to ``out``, the train values)."""
    extra = sorted(
        set(ds)
        - set(DEEPSPEED_KEYS)
        - DEEPSPEED_IGNORED
        - {"gradient_accumulation_steps", "gradient_clipping"}
    )
    if extra:
        raise ConfigError(
            f"{src}: unknown deepspeed_config key(s) {', '.join(extra)}; known: {', '.join(DEEPSPEED_KEYS)}"
        )
    options = {DEEPSPEED_KEYS[k]: v for k, v in ds.items() if k in DEEPSPEED_KEYS}
    if "gradient_accumulation_steps" in ds:
        out["grad_accum"] = int(ds["gradient_accumulation_steps"])
    if ds.get("gradient_clipping"):
        out["clip_grad_norm"] = float(ds["gradient_clipping"])
    return options


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
