"""Hugging Face accelerate's launch config (the YAML `accelerate config` writes) as a building block, both ways:
``accelerate_config_text`` writes the equivalent of a run (the launcher's keys, then the method's own block),
``read_accelerate_config`` turns a user's YAML into stratbench train values (``--accelerate-config``). Shared by
the accelerate-* methods and ``stratbench train``; ``yaml`` is imported where it is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError

MIXED_PRECISION = {"fp32": "no", "fp64": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""stratbench precision -> accelerate's mixed_precision (accelerate has no pure fp16/bf16 mode)."""


def accelerate_config_text(
    cfg: TrainConfig, world_size: int, distributed_type: str, blocks: dict[str, Any]
) -> str:
    """The `accelerate launch --config_file` equivalent of this run (the source's default_*.yml, today's keys):
    the launcher's keys for ``distributed_type``, then the method's own ``blocks`` (fsdp_config, ...)."""
    import yaml

    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    doc: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
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
    doc.update(blocks)
    return (
        "# accelerate launch --config_file this.yaml -m stratbench train <same flags> (written by stratbench)\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )


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
