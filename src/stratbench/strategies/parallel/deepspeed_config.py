"""The DeepSpeed config of a run, declared as rules: stratbench's options -> DeepSpeed's config fields.

``build_ds_config`` reads the user's JSON (``--deepspeed-config``) and checks it against stratbench's options
(``AGREEMENTS``: a value the JSON gives must be the one the options give, or "auto"), resolves the two blocks
that need more than a rule (the ZeRO block: its stage and offload devices; the JSON's optimizer and scheduler
blocks: their "auto" values), then writes the config from ``FIELDS``, a table of (config key, value, when)
rules applied in order over what is left of the user's JSON. A new option is one more row.

Plain Python (no ``deepspeed`` import): the memory and communication models read the same config.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.data.datasets import split_batch
from stratbench.strategies.parallel.tp_plan import degree_unfit
from stratbench.strategies.parallel.zero import DeepSpeedEngineOptions, node_ranks

OFFLOAD_CHOICES = ("none", "cpu", "nvme")

# DeepSpeed's fp16 dynamic loss scaling, with the values the source documents (loss_scale 0 = dynamic).
FP16_BLOCK = {
    "enabled": True,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 16,
}

CONFIG_OPTIMIZERS = ("Adam", "AdamW", "SGD")
"""Optimizer types a DeepSpeed JSON's ``optimizer`` block may name (DeepSpeed builds them; case-insensitive)."""
CONFIG_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""Scheduler types a DeepSpeed JSON's ``scheduler`` block may name (DeepSpeed builds and steps them)."""
OWN_BLOCKS = ("fp16", "bf16", "optimizer", "scheduler")
"""Top-level blocks of the user's JSON that the rules rebuild rather than keep as written."""


@dataclass(frozen=True)
class Run:
    """What the rules read: the run's config and options, the user's JSON and the blocks resolved from both."""

    cfg: TrainConfig
    opts: DeepSpeedEngineOptions
    world: int
    user: dict[str, Any]
    src: str
    zero: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None

    @property
    def tp(self) -> int:
        """AutoTP's degree (--autotp-size): the ranks of one tensor-parallel group read the same batches."""
        return self.opts.autotp_size

    @property
    def dp(self) -> int:
        """DeepSpeed's data-parallel size, which its batch arithmetic uses: the world over the AutoTP degree."""
        return self.world // self.tp

    @property
    def replicas(self) -> str:
        """The data-parallel size as an error message gives it."""
        return f"world {self.world}" if self.tp == 1 else f"world {self.world} / --autotp-size {self.tp}"

    @property
    def micro(self) -> int:
        return split_batch(self.cfg.batch_size, self.dp, self.cfg.grad_accum)

    @property
    def clip(self) -> float:
        return float(self.cfg.clip_grad_norm or 0.0)

    @property
    def torch_optimizer(self) -> bool:
        """DeepSpeed steps a torch optimizer (the client's, or a JSON Adam with ``torch_adam``), so ZeRO-Offload
        must not force DeepSpeedCPUAdam on it."""
        if self.optimizer is not None:
            return bool(self.optimizer["params"].get("torch_adam", True))
        return self.opts.ds_optimizer == "torch"


@dataclass(frozen=True)
class Agreement:
    """A top-level JSON value that must agree with what stratbench's options give (or be "auto" / absent)."""

    key: str
    ours: Callable[[Run], Any]
    flag: Callable[[Run], str]
    theirs: Callable[[Any], Any] = lambda v: v
    """How the JSON's value is read before comparing (gradient clipping: as a float)."""


AGREEMENTS: tuple[Agreement, ...] = (
    Agreement("train_batch_size", lambda r: r.cfg.batch_size, lambda r: "--batch-size (global batch)"),
    Agreement(
        "train_micro_batch_size_per_gpu",
        lambda r: r.micro,
        lambda r: f"--batch-size {r.cfg.batch_size} / ({r.replicas} x --grad-accum {r.cfg.grad_accum})",
    ),
    Agreement("gradient_accumulation_steps", lambda r: r.cfg.grad_accum, lambda r: "--grad-accum"),
    Agreement("gradient_clipping", lambda r: r.clip, lambda r: "--clip-grad-norm", float),
)


def _always(run: Run) -> bool:
    return True


@dataclass(frozen=True)
class Field:
    """One top-level config key: its value for this run, when it applies, and whether the JSON's own value
    wins (``keep_user``: DeepSpeed defaults stratbench only supplies)."""

    key: str
    value: Callable[[Run], Any]
    when: Callable[[Run], bool] = _always
    keep_user: bool = False


def _fp16_block(run: Run) -> dict[str, Any]:
    return {**FP16_BLOCK, **_given(run.user.get("fp16")), "enabled": True}


def _bf16_block(run: Run) -> dict[str, Any]:
    return {**_given(run.user.get("bf16")), "enabled": True}


def _tp_block(run: Run) -> dict[str, Any]:
    """``tensor_parallel``: the JSON's block with AutoTP's degree from --autotp-size (the strategy adds the layer
    specs, which it reads from the model's tensor-parallel plan, in ``wrap``)."""
    return {**_given(run.user.get("tensor_parallel")), "autotp_size": run.tp}


def _fused_adam(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    return {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "torch_adam": False}}


FIELDS: tuple[Field, ...] = (
    Field("train_batch_size", lambda r: r.cfg.batch_size),
    Field("train_micro_batch_size_per_gpu", lambda r: r.micro),
    Field("gradient_accumulation_steps", lambda r: r.cfg.grad_accum),
    Field("gradient_clipping", lambda r: r.clip),
    Field("zero_optimization", lambda r: r.zero),
    Field("tensor_parallel", _tp_block, when=lambda r: r.tp > 1),
    Field("steps_per_print", lambda r: 10**9, keep_user=True),  # stratbench prints its own progress
    Field("fp16", _fp16_block, when=lambda r: r.cfg.precision == "fp16-mixed"),
    Field("bf16", _bf16_block, when=lambda r: r.cfg.precision == "bf16-mixed"),
    Field("scheduler", lambda r: r.scheduler, when=lambda r: r.scheduler is not None),
    Field("optimizer", lambda r: r.optimizer, when=lambda r: r.optimizer is not None),
    Field("optimizer", _fused_adam, when=lambda r: r.optimizer is None and r.opts.ds_optimizer == "fused"),
    # Torch's Adam/AdamW/SGD under ZeRO are "untested" to DeepSpeed (SGD), and a torch optimizer is stepped
    # on the CPU under ZeRO-Offload instead of DeepSpeedCPUAdam (a JIT-compiled kernel).
    Field("zero_allow_untested_optimizer", lambda r: True, keep_user=True),
    Field("zero_force_ds_cpu_optimizer", lambda r: False, when=lambda r: r.torch_optimizer, keep_user=True),
)


def build_ds_config(
    cfg: TrainConfig,
    opts: DeepSpeedEngineOptions,
    world_size: int,
    total_steps: int | None = None,
    *,
    config_optimizer: bool = True,
) -> dict[str, Any]:
    """The DeepSpeed config for this run: stratbench's options merged with the user's JSON, conflicts as errors.

    The JSON's ``optimizer`` and ``scheduler`` blocks (the source's configs carry both) are kept: DeepSpeed
    builds that optimizer and LR scheduler and steps the scheduler in ``engine.step()``. Their "auto" values
    are filled in from stratbench's options; ``total_steps`` (the run's optimizer steps, known once the data is
    loaded) fills a decay schedule's ``total_num_steps``. ``config_optimizer=False`` refuses the blocks (a
    caller that always passes its own torch optimizer)."""
    run = _resolve(cfg, opts, world_size, total_steps, config_optimizer)
    ds: dict[str, Any] = {k: v for k, v in run.user.items() if k not in OWN_BLOCKS}
    for rule in FIELDS:
        if not rule.when(run):
            continue
        if rule.keep_user and rule.key in ds:
            continue
        ds[rule.key] = rule.value(run)
    return ds


def _resolve(
    cfg: TrainConfig,
    opts: DeepSpeedEngineOptions,
    world: int,
    total_steps: int | None,
    config_optimizer: bool,
) -> Run:
    """Read and check the user's JSON against the options; resolve the ZeRO, optimizer and scheduler blocks."""
    user = load_user_json(opts.deepspeed_config) if opts.deepspeed_config else {}
    src = f"--deepspeed-config {opts.deepspeed_config}"
    if not config_optimizer:
        for block in ("optimizer", "scheduler"):
            if block in user:
                raise ConfigError(
                    f"{src}: the {block!r} block is not accepted here; this method builds the {block} from "
                    "--optimizer/--lr/--lr-schedule (remove the block, or use --strategy deepspeed)"
                )
    optimizer = _optimizer_block(user, cfg, opts, src) if "optimizer" in user else None
    scheduler = None
    if "scheduler" in user:
        lr = optimizer["params"]["lr"] if optimizer else cfg.lr
        scheduler = _scheduler_block(user, cfg, lr, total_steps, src)
    run = Run(cfg, opts, world, user, src, {}, optimizer, scheduler)
    for rule in AGREEMENTS:
        theirs = user.get(rule.key)
        if theirs is not None and not is_auto(theirs):
            theirs = rule.theirs(theirs)
        _agree(src, rule.key, theirs, rule.ours(run), rule.flag(run))
    _check_precision_blocks(user, cfg, src)
    _check_autotp(user, opts, world, src)
    zero = _zero_block(user, opts, src)
    _check_hpz(zero, cfg, world)
    return Run(cfg, opts, world, user, src, zero, optimizer, scheduler)


def _agree(src: str, key: str, theirs: Any, ours: Any, flag: str) -> None:
    if theirs is None or is_auto(theirs) or theirs == ours:
        return
    raise ConfigError(
        f"{src}: {key} is {theirs!r} but {flag} gives {ours!r}; remove it from the JSON or change {flag}"
    )


def autotp_degree(opts: DeepSpeedEngineOptions, world: int) -> int:
    """--autotp-size, checked: a positive integer that divides the world (one line naming the degrees that fit)."""
    t = opts.autotp_size
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ConfigError(f"--autotp-size must be a positive integer (1: no tensor parallelism), got {t!r}")
    why = degree_unfit("deepspeed --autotp-size", t, world)
    if why:
        raise ConfigError(why)
    return t


def _check_autotp(user: dict[str, Any], opts: DeepSpeedEngineOptions, world: int, src: str) -> None:
    """--autotp-size fits the world and agrees with the JSON's tensor_parallel.autotp_size (0 and 1 mean off)."""
    t = autotp_degree(opts, world)
    theirs = (user.get("tensor_parallel") or {}).get("autotp_size")
    if theirs not in (None, 0, 1) or t > 1:
        _agree(src, "tensor_parallel.autotp_size", theirs, t, "--autotp-size")


def _check_precision_blocks(user: dict[str, Any], cfg: TrainConfig, src: str) -> None:
    """The JSON's fp16/bf16 ``enabled`` must say what --precision says (the precision is set there only)."""
    want = {"fp16": cfg.precision == "fp16-mixed", "bf16": cfg.precision == "bf16-mixed"}
    for key, enabled in want.items():
        block = user.get(key)
        if (
            isinstance(block, dict)
            and "enabled" in block
            and not is_auto(block["enabled"])
            and bool(block["enabled"]) != enabled
        ):
            raise ConfigError(
                f"{src}: {key}.enabled is {block['enabled']!r} but --precision {cfg.precision} means {key} "
                f"{'on' if enabled else 'off'}; set the precision with --precision only"
            )


def _zero_block(user: dict[str, Any], opts: DeepSpeedEngineOptions, src: str) -> dict[str, Any]:
    """``zero_optimization``: the JSON's block (its "auto" sizes left to DeepSpeed's defaults), the stage from
    --zero-stage (default 2), and the offload devices from --offload-optimizer/--offload-params."""
    zero = dict(user.get("zero_optimization") or {})
    # HF-style "auto" bucket sizes and thresholds are derived from a transformer's hidden size by the HF
    # integration; here they fall back to DeepSpeed's own defaults.
    zero = {k: v for k, v in zero.items() if k == "stage" or not is_auto(v)}
    stage = zero.get("stage")
    if opts.zero_stage is not None:
        _agree(src, "zero_optimization.stage", stage, opts.zero_stage, "--zero-stage")
        stage = opts.zero_stage
    stage = 2 if stage is None or is_auto(stage) else stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    zero["stage"] = stage
    _sized(zero, src, "reduce_bucket_size", "--reduce-bucket-size", opts.reduce_bucket_size)
    for key in RELEASE_KEYS:
        _sized(zero, src, key, f"--{key.replace('_', '-')}", getattr(opts, key), least=0)
    _offload(zero, "offload_optimizer", "--offload-optimizer", opts.offload_optimizer, opts.nvme_path, src)
    _offload(zero, "offload_param", "--offload-params", opts.offload_params, opts.nvme_path, src)
    if "offload_param" in zero and stage != 3:
        raise ConfigError(
            f"--offload-params cpu needs --zero-stage 3 (parameters are partitioned only in ZeRO-3), got stage {stage}"
        )
    if "offload_optimizer" in zero and stage == 0:
        raise ConfigError("--offload-optimizer cpu needs --zero-stage 1, 2 or 3 (ZeRO-Offload), got stage 0")
    _zeropp(zero, opts, src)
    return zero


ZEROPP_KEYS = (
    ("zero_hpz_partition_size", "--zero-hpz", "zero_hpz"),
    ("zero_quantized_weights", "--zero-quantized-weights", "zero_quantized_weights"),
    ("zero_quantized_gradients", "--zero-quantized-gradients", "zero_quantized_gradients"),
)
"""ZeRO++'s keys of ``zero_optimization``: (DeepSpeed's key, stratbench's flag, the option's field)."""


def _zeropp(zero: dict[str, Any], opts: DeepSpeedEngineOptions, src: str) -> None:
    """ZeRO++'s keys of ``zero`` (in place): each option's value, else the JSON's; checked (hpZ's size a positive
    integer, the switches booleans) and refused below ZeRO-3, which DeepSpeed's ZeRO++ partitions."""
    for key, flag, field in ZEROPP_KEYS:
        value = getattr(opts, field)
        if value is not None:
            _agree(src, f"zero_optimization.{key}", zero.get(key), value, flag)
            zero[key] = value
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1:
        raise ConfigError(f"--zero-hpz must be a positive integer (ranks of the secondary partition; 1: off), got {hpz!r}")
    for key, flag, _ in ZEROPP_KEYS[1:]:
        if not isinstance(zero.get(key, False), bool):
            raise ConfigError(f"{flag} (zero_optimization.{key}) must be true or false, got {zero[key]!r}")
    on = zeropp_flags(zero)
    if on and zero["stage"] != 3:
        raise ConfigError(
            f"{' and '.join(on)} {'needs' if len(on) == 1 else 'need'} --zero-stage 3 (DeepSpeed's ZeRO++ works on "
            "ZeRO-3's partitioned "
            f"parameters), got stage {zero['stage']}"
        )


def zeropp_flags(zero: dict[str, Any]) -> list[str]:
    """The ZeRO++ features a ``zero_optimization`` block turns on, as their flags (``--zero-hpz S``)."""
    on = [f"--zero-hpz {zero['zero_hpz_partition_size']}"] if zero.get("zero_hpz_partition_size", 1) > 1 else []
    return on + [flag for key, flag, _ in ZEROPP_KEYS[1:] if zero.get(key)]


def _check_hpz(zero: dict[str, Any], cfg: TrainConfig, world: int) -> None:
    """hpZ's secondary group of S consecutive ranks must lie inside one node: S divides the ranks per node."""
    s = zero.get("zero_hpz_partition_size", 1)
    if s <= 1:
        return
    node = node_ranks(cfg, world)
    nodes = world // node
    where = f"{node} ranks per node (world {world} over {nodes} node{'s' if nodes > 1 else ''})"
    if s > node:
        raise ConfigError(f"--zero-hpz {s} is larger than the node: {where}; choose a divisor of {node}")
    if node % s:
        fits = ", ".join(str(d) for d in range(1, node + 1) if node % d == 0)
        raise ConfigError(f"--zero-hpz {s} does not divide the node's ranks: {where}; choose one of {fits}")


RELEASE_KEYS = ("stage3_param_persistence_threshold", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size")
"""ZeRO-3's options of when a gathered parameter is released (the options' names are DeepSpeed's keys)."""


def _sized(zero: dict[str, Any], src: str, key: str, flag: str, value: int | None, least: int = 1) -> None:
    """A size the options give (elements): at least ``least``, agreeing with the JSON's, written into ``zero``
    (in place)."""
    if value is None:
        return
    if value < least:
        what = "a positive number" if least == 1 else f"a number >= {least}"
        raise ConfigError(f"{flag} must be {what} of elements, got {value}")
    _agree(src, f"zero_optimization.{key}", zero.get(key), value, flag)
    zero[key] = value


def _offload(
    zero: dict[str, Any], key: str, flag: str, value: str | None, nvme: str | None, src: str
) -> None:
    """One offload block of ``zero`` (in place): the option's device, else the JSON's; none removes it."""
    theirs = _offload_device(zero.get(key))
    if value is not None:
        _agree(src, f"zero_optimization.{key}.device", theirs, value, flag)
    device = value if value is not None else (theirs or "none")
    if device not in OFFLOAD_CHOICES:
        raise ConfigError(f"{flag} must be one of: {', '.join(OFFLOAD_CHOICES)}; got {device!r}")
    if device == "none":
        zero.pop(key, None)
        return
    # pin_memory needs an accelerator; on CPU the tensors already live in host memory.
    zero[key] = {**(zero.get(key) or {}), "device": device, "pin_memory": torch.cuda.is_available()}
    if device == "nvme":
        path = nvme or zero[key].get("nvme_path")
        if not path:
            raise ConfigError(f"{flag} nvme needs --nvme-path DIR (a folder on the NVMe drive)")
        if zero["stage"] != 3:
            raise ConfigError(f"{flag} nvme (ZeRO-Infinity) needs --zero-stage 3, got stage {zero['stage']}")
        zero[key]["nvme_path"] = str(path)


def _optimizer_block(
    user: dict[str, Any], cfg: TrainConfig, opts: DeepSpeedEngineOptions, src: str
) -> dict[str, Any]:
    """The JSON's optimizer block as DeepSpeed will build it: "auto" (HF-style) values filled in from stratbench's
    options (--lr, --weight-decay, --momentum), and Adam/AdamW as torch's own implementation unless the block
    (or --ds-optimizer fused/cpu-adam) asks for DeepSpeed's JIT-compiled kernels."""
    block = user["optimizer"]
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ConfigError(f'{src}: the optimizer block must be an object with a "type", got {block!r}')
    names = {n.lower(): n for n in CONFIG_OPTIMIZERS}
    kind = names.get(block["type"].lower())
    if kind is None:
        raise ConfigError(
            f"{src}: optimizer type {block['type']!r} is not supported; choose one of: {', '.join(CONFIG_OPTIMIZERS)}"
        )
    params = dict(block.get("params") or {})
    fill = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if kind == "SGD":
        fill["momentum"] = cfg.momentum
    else:
        fill |= {"betas": [0.9, 0.999], "eps": 1e-8}
    for key, value in fill.items():
        if key not in params or is_auto(params[key]):
            params[key] = value
    for key, value in params.items():
        if is_auto(value):
            raise ConfigError(
                f'{src}: optimizer.params.{key} is "auto" and stratbench has no value for it; give a number'
            )
    if kind != "SGD" and "torch_adam" not in params:
        params["torch_adam"] = opts.ds_optimizer == "torch"  # no kernel build unless asked for
    if kind == "SGD" and opts.ds_optimizer != "torch":
        raise ConfigError(
            f"{src}: --ds-optimizer {opts.ds_optimizer} is an Adam kernel; the JSON asks for SGD"
        )
    return {"type": block["type"], "params": params}


def _scheduler_block(
    user: dict[str, Any], cfg: TrainConfig, lr: float, total_steps: int | None, src: str
) -> dict[str, Any]:
    """The JSON's scheduler block as DeepSpeed will build it: "auto" or missing warm-up values from --lr-warmup-steps
    (at least 1: DeepSpeed refuses 0) and the optimizer's lr, total_num_steps from the run's optimizer steps."""
    block = user["scheduler"]
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ConfigError(f'{src}: the scheduler block must be an object with a "type", got {block!r}')
    kind = block["type"]
    if kind not in CONFIG_SCHEDULERS:
        raise ConfigError(
            f"{src}: scheduler type {kind!r} is not supported; choose one of: {', '.join(CONFIG_SCHEDULERS)}"
        )
    params = dict(block.get("params") or {})
    fill: dict[str, Any] = {"warmup_num_steps": max(1, cfg.lr_warmup_steps)}
    if kind == "WarmupCosineLR":
        fill["warmup_min_ratio"] = 0.0
    else:
        fill |= {"warmup_min_lr": 0.0, "warmup_max_lr": lr}
    if kind != "WarmupLR":
        fill["total_num_steps"] = total_steps if total_steps is not None else "auto"
    for key, value in fill.items():
        if key not in params or is_auto(params[key]):
            params[key] = value
    for key, value in params.items():
        if is_auto(value) and not (key == "total_num_steps" and total_steps is None):
            raise ConfigError(
                f'{src}: scheduler.params.{key} is "auto" and stratbench has no value for it; give a number'
            )
    steps = params.get("warmup_num_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ConfigError(
            f"{src}: scheduler.params.warmup_num_steps must be a positive integer, got {steps!r}"
        )
    return {"type": kind, "params": params}


def load_user_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--deepspeed-config: file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed-config {p} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config {p} must hold a JSON object, got {type(data).__name__}")
    return data


def is_auto(value: Any) -> bool:
    """HF-style "auto" values mean 'fill in from the trainer': stratbench fills them in."""
    return value == "auto"


def _given(block: Any) -> dict[str, Any]:
    """The JSON's own values of a block, "auto" ones left out."""
    return {k: v for k, v in (block or {}).items() if not is_auto(v)}


def _offload_device(block: Any) -> str | None:
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ConfigError(f"--deepspeed-config: an offload block must be an object, got {block!r}")
    device = block.get("device", "none")
    return "none" if device in (None, "none") else str(device)
