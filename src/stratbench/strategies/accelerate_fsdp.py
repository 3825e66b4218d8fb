"""``accelerate-fsdp``: accelerate's ``FullyShardedDataParallelPlugin`` (FSDP2 by default, FSDP1 on request) with
the knobs of accelerate's fsdp_config; costed as FSDP2 (``parallel.fsdp``). GPU only: accelerate's FSDP does not
run on CPU processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.strategies.accelerate import AccelerateStrategy
from stratbench.strategies.base import CostModel, register
from stratbench.strategies.costs import lean_refusal
from stratbench.strategies.parallel.fsdp import fsdp2_comm, fsdp2_memory

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
class AccelerateFSDP(AccelerateStrategy):
    name = "accelerate-fsdp"
    description = (
        "accelerate.Accelerator with FullyShardedDataParallelPlugin (FSDP2, the source's default_FSDP.yml)"
    )
    requirements = "pip install accelerate; NVIDIA GPUs (accelerate's FSDP does not run on CPU)"
    Options = AccelerateFsdpOptions
    distributed_type = "FSDP"

    @classmethod
    def lora_refusal(cls, cfg: TrainConfig) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with accelerate-fsdp is not supported (untested: it needs CUDA); use fsdp"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type != "cuda":
            return "accelerate's FSDP plugin needs a CUDA GPU (on CPU it fails or silently becomes DDP); use fsdp on CPU"
        if why := cls.lora_refusal(cfg):
            return why
        return lean_refusal(cfg, "FSDP shards the parameters") or super().check_supported(cfg, device, world_size)

    cost = AccelerateFSDPCost

    def plugins(self) -> dict[str, Any]:
        from accelerate import FullyShardedDataParallelPlugin

        return {"fsdp_plugin": FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(self.options))}

    @classmethod
    def yaml_blocks(cls, cfg: TrainConfig, world_size: int) -> dict[str, Any]:
        return {"fsdp_config": fsdp_yaml(cfg, cls.parse_options(cfg.strategy_options))}


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


def fsdp_yaml(cfg: TrainConfig, opts: AccelerateFsdpOptions) -> dict[str, Any]:
    """The ``fsdp_config`` block of the accelerate YAML for this run's accelerate-fsdp options."""
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
