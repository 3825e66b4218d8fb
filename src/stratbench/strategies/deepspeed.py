"""DeepSpeed: ZeRO stages 0-3 with optional CPU offload, driven by stratbench's own loop, data and options.

The DeepSpeed config is generated from stratbench's options (micro-batch, accumulation, clipping, precision,
ZeRO stage, offload) so that the same command line trains the same problem as every other method; a user's
JSON is merged in and every disagreement with stratbench's options is a clear error before any work starts.

Two things make it run out of the box where the source template never did:
- no JIT compilation by default: the client optimizer is a plain torch optimizer; FusedAdam / DeepSpeedCPUAdam
  are built only when asked for (``--ds-optimizer``), in ``setup``, before the first timed step.
- DeepSpeed's CPU shared-memory communication op (a ~40 s compile on first use) is only used by
  ``inference_all_reduce``; training collectives go through torch.distributed. stratbench marks the op as
  unavailable before DeepSpeed's communication backend is created, so it is never built.

The blocks it composes live in ``parallel/``: ``deepspeed_config`` (the config as rules), ``zero`` (the ZeRO
options and cost model, AutoTP's view of it) and ``deepspeed_engine`` (the runtime fixes, the checks and the
engine's checkpoints), which accelerate-deepspeed shares.

``deepspeed`` is imported lazily: this module is imported by ``stratbench list`` and at CLI start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.core.optim import trainable
from stratbench.core.precision import Precision
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.hf import is_hf_moe
from stratbench.models.transformer import SIZES
from stratbench.models.zoo import is_moe_model
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, all_strategies, register
from stratbench.strategies.costs import lean_refusal
from stratbench.strategies.op_builds import prepare_op_builds
from stratbench.strategies.parallel.deepspeed_config import autotp_degree, build_ds_config, load_user_json
from stratbench.strategies.parallel.deepspeed_engine import (
    DS_TAG,
    align_swapped_gradients,
    autotp_size_of,
    autotp_whole,
    avoid_shm_op_build,
    deepspeed_state_bytes,
    kernel_unavailable,
    nvme_unavailable,
    read_deepspeed_checkpoint,
    refuse_nvme_checkpoint,
    save_engine_checkpoint,
    size_nvme_param_buffers,
    zero_init_keeps_dtype,
    zeropp_unavailable,
)
from stratbench.strategies.parallel.deepspeed_moe import (
    apply_deepspeed_moe,
    ds_moe_layers,
    ep_refusal,
    moe_param_groups,
    whole_moe_state,
)
from stratbench.strategies.parallel.ds_moe_costs import ds_moe_comm, ds_moe_memory
from stratbench.strategies.parallel.expert_parallel import ep_mesh_dims
from stratbench.strategies.parallel.tp_costs import LocalSlice, local_flop_share
from stratbench.strategies.parallel.tp_plan import BLOCKS_ONLY, model_plan
from stratbench.strategies.parallel.tp_plan import unsupported as tp_unsupported
from stratbench.strategies.parallel.zero import (
    DeepSpeedEngineOptions,
    autotp_comm,
    autotp_view,
    deepspeed_comm,
    deepspeed_memory,
    deepspeed_overlap,
    zeropp_mesh,
)

DS_OPTIMIZERS = ("torch", "fused", "cpu-adam")


@dataclasses.dataclass(kw_only=True)
class DeepSpeedOptions(DeepSpeedEngineOptions):
    """Options of the deepspeed strategy: ZeRO's and the engine's (``parallel.zero.DeepSpeedEngineOptions``),
    and DeepSpeed-MoE's expert parallelism."""

    ep: int = 1
    """deepspeed: expert parallelism with DeepSpeed-MoE (deepspeed.moe.layer.MoE, ep_size E): each MoE layer's routed experts split over E consecutive ranks, tokens dispatched to them by all-to-all of a capacity-padded buffer; experts and processes must divide by E; ZeRO 0-2 (DeepSpeed refuses its MoE under ZeRO-3). A mixture of experts always trains on DeepSpeed's MoE layer under deepspeed; 1: every rank holds every expert."""

    def __post_init__(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"ep must be a positive integer (1: no expert parallelism), got {self.ep!r}")


def autotp_partition_config(model: nn.Module) -> dict[str, Any]:
    """AutoTP's ``partition_config`` for ``model``, read from its tensor-parallel plan
    (``parallel.tp_plan.model_plan``, blocks only: the embedding and the head stay whole): a column-parallel
    Linear's weight split over its outputs, a row-parallel one's over its inputs (its output all-reduced). Only these are split; DeepSpeed leaves every
    weight no spec matches whole, so its name heuristics never guess at a model it does not know."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = {ColwiseParallel: "column", RowwiseParallel: "row"}
    specs: dict[str, list[str]] = {"column": [], "row": []}
    for key, style in (model_plan(model) or {}).items():
        if type(style) in kinds:
            specs[kinds[type(style)]].append(fnmatch.translate(f"{key}.weight"))
    layer_specs = [{"patterns": p, "partition_type": kind} for kind, p in specs.items() if p]
    return {"use_default_specs": False, "layer_specs": layer_specs}


class _DeepSpeedPrecision(Precision):
    """The user's precision as DeepSpeed runs it: DeepSpeed casts the module (fp16/bf16 block, fp32 master
    weights in the optimizer) and scales the loss, so inputs follow the module's dtype and nothing autocasts."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=False)  # DeepSpeed's own dynamic loss scaler
        half = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
        self.input_dtype = half.get(name, torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # fp16/bf16: DeepSpeed casts the module itself

    def convert_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.input_dtype) if x.is_floating_point() and x.dtype != self.input_dtype else x

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _moe_refusal(cfg: TrainConfig, opts: DeepSpeedOptions, world: int | None, stage: int) -> str | None:
    """Why deepspeed cannot train ``cfg``'s model with ``--ep`` (``parallel.deepspeed_moe.ep_refusal``), or
    resume one (untested: DeepSpeed's expert files), in one line; None where it can."""
    if is_hf_moe(cfg.model):  # its experts run in transformers' layer, which DeepSpeed-MoE does not replace
        takers = ", ".join(sorted(n for n, c in all_strategies().items() if c.takes_moe and n != "deepspeed"))
        return (f"deepspeed with model {cfg.model} (a Hugging Face mixture of experts): DeepSpeed-MoE replaces the "
                f"built-in MoE layer only; train it under {takers}")  # fmt: skip
    n_experts = SIZES[cfg.model].n_experts if is_moe_model(cfg.model) else None
    why = ep_refusal(cfg.model, n_experts, opts.ep, world, stage, opts.autotp_size, cfg.clip_grad_norm)
    if why is None and n_experts is not None and (cfg.resume or cfg.resume_from):
        return (f"deepspeed with model {cfg.model} (DeepSpeed-MoE) does not resume; start from its weights with "
                "--init-from")  # fmt: skip
    return why


def _autotp_unsupported(cfg: TrainConfig, t: int) -> str | None:
    """Why the model cannot be split over AutoTP groups of ``t`` (tp's checks on its blocks-only plan), or None."""
    reason = tp_unsupported(cfg, t, "--autotp-size", BLOCKS_ONLY) if t > 1 else None
    return f"deepspeed --autotp-size {t}: {reason}" if reason else None


def _ds_moe_ep(ctx) -> int:
    """The ep ranks per expert set where the model trains on DeepSpeed-MoE's layer (every built-in mixture of
    experts, --ep 1 too), else 0."""
    return ctx.options.ep if is_moe_model(ctx.cfg.model) and not is_hf_moe(ctx.cfg.model) else 0


class DeepSpeedCost(CostModel):
    """DeepSpeed's ZeRO stage, offload and buckets, read from the config the run would build
    (``deepspeed_memory``, ``deepspeed_comm``, ``deepspeed_overlap``); under --autotp-size T, over one AutoTP
    rank's slice of the model and the data-parallel group (``autotp_view``), plus Megatron's traffic; a mixture of
    experts on DeepSpeed-MoE's layer (``parallel.ds_moe_costs``): E'/E of the experts per rank, their states over
    the expert data-parallel group, the padded all-to-all buffers, on the (dp, ep) mesh."""

    @classmethod
    def memory_model(cls, ctx, rank):
        ds = build_ds_config(ctx.cfg, ctx.options, ctx.world)
        block = ds.get("optimizer")
        if block is not None:  # the JSON's optimizer, not --optimizer, decides the optimizer state
            sgd = block["type"].lower() == "sgd"
            momentum = float(block["params"].get("momentum", 0.0)) if sgd else ctx.cfg.momentum
            cfg = ctx.cfg.replace(optimizer="sgd" if sgd else "adamw", momentum=momentum)
            ctx = dataclasses.replace(ctx, cfg=cfg)
        view, t = autotp_view(ctx)
        ep = _ds_moe_ep(ctx)
        m = deepspeed_memory(view, ds["zero_optimization"], ep)
        if ep:
            m = ds_moe_memory(m, view, ep)
        if t > 1:
            m.data_ranks, m.trace_transform = view.world, LocalSlice(t)
            m.sharding_note += f", AutoTP: block matrices 1/{t}, embedding, norms and head whole"
        return m

    @classmethod
    def comm_model(cls, ctx):
        view, t = autotp_view(ctx)
        zero = build_ds_config(ctx.cfg, ctx.options, ctx.world)["zero_optimization"]
        if ep := _ds_moe_ep(ctx):
            return ds_moe_comm(ctx, zero, ep)
        return autotp_comm(ctx, view, zero, t) if t > 1 else deepspeed_comm(view, zero)

    @classmethod
    def mesh_dims(cls, ctx) -> dict[str, int]:
        """ZeRO++'s groups (``zeropp_mesh``: hpZ's S consecutive ranks, qgZ's node and cross-node groups), so that
        the projection prices each on the link it crosses; else one dimension (AutoTP's groups are not placed)."""
        if ctx.options.autotp_size > 1:
            return {}
        if _ds_moe_ep(ctx):
            return ep_mesh_dims(ctx.world, ctx.options.ep)
        return zeropp_mesh(ctx.cfg, ctx.world, build_ds_config(ctx.cfg, ctx.options, ctx.world)["zero_optimization"])

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        """Share of forward/backward traffic that can run under compute (stratbench.predicting.projection): none without
        ``overlap_comm`` (stages 0-2 by default: gradients are reduced inside backward's hooks, or after it)."""
        return deepspeed_overlap(build_ds_config(ctx.cfg, ctx.options, ctx.world)["zero_optimization"])

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """1, or under --autotp-size T an AutoTP rank's share of its replica's FLOPs (``parallel.tp_costs.local_flop_share``)."""
        t = ctx.options.autotp_size
        return local_flop_share(ModelSpec.from_config(ctx.cfg), t) if t > 1 else 1.0


class DeepSpeedCheckpointIO(CheckpointIO):
    """DeepSpeed's own (sharded) engine checkpoint plus stratbench's header; full state dicts gathered from
    ZeRO-3's partitions; weights of any other layout through --init-from only."""

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full fp32-or-native model state on CPU; under ZeRO-3 every rank gathers the partitions (a collective)."""
        module = self.strategy.unwrap(model)
        if self.strategy._stage() == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        else:
            gathered = contextlib.nullcontext()
        tp_whole = (
            autotp_whole(module) if autotp_size_of(self.strategy.ds_config) > 1 else contextlib.nullcontext()
        )
        with gathered, tp_whole:
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return whole_moe_state(module, state) if ds_moe_layers(module) else state

    def save_checkpoint(self, path: Path, model: nn.Module, optimizer, extra: dict) -> Path:
        """DeepSpeed's own (sharded) checkpoint plus stratbench's header, swapped into place atomically."""
        strategy = self.strategy
        assert strategy.engine is not None
        return save_engine_checkpoint(strategy, strategy.engine, Path(path), strategy.ds_config, extra)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Resume from a DeepSpeed checkpoint of the same world size and stage; weights of other layouts load
        only through --init-from (their optimizer state cannot be mapped onto ZeRO's partitions)."""
        strategy, engine = self.strategy, self.strategy.engine
        assert engine is not None
        path = Path(path)
        meta = checkpoint.read_meta(path)
        if meta.get("layout") != "deepspeed":
            if optimizer is not None:
                raise CheckpointError(
                    f"deepspeed resumes only from its own checkpoints; {path} has layout {meta.get('layout')!r}: "
                    "start from its weights with --init-from instead"
                )
            state = checkpoint.load_any(path)
            self._load_weights(state["model"])
            return state
        world, stage, t = strategy.env.world_size, strategy._stage(), autotp_size_of(strategy.ds_config)
        if (meta.get("world_size"), meta.get("zero_stage"), meta.get("autotp_size", 1)) != (world, stage, t):
            raise CheckpointError(
                f"{path} was saved by deepspeed with world size {meta.get('world_size')}, ZeRO stage "
                f"{meta.get('zero_stage')} and --autotp-size {meta.get('autotp_size', 1)}; this run has world size "
                f"{world}, stage {stage} and --autotp-size {t}. "
                f"Run `stratbench consolidate {path} FILE` and start with --init-from FILE"
            )
        saved = (meta.get("scheduler") or {}).get("deepspeed_scheduler")
        ours = type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None
        if saved != ours:

            def name(kind: str | None) -> str:
                return f"DeepSpeed's {kind}" if kind else "stratbench's"

            raise CheckpointError(
                f"{path} was trained with {name(saved)} LR schedule, this run uses {name(ours)}: resume with the "
                "same --deepspeed-config scheduler block, or start from its weights with --init-from"
            )
        # DeepSpeed's loader unpickles with weights_only=False: every file is checked weights-only first.
        tag = checkpoint.check_tag(path, meta.get("deepspeed_tag", DS_TAG))
        refuse_nvme_checkpoint(path, tag)
        checkpoint.check_folder(path)
        load_path, _ = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=engine.lr_scheduler is not None,
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {path}")
        if engine.lr_scheduler is not None:
            _apply_scheduler_lr(engine.lr_scheduler)
        return meta

    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        module = self.strategy.unwrap(self.strategy.engine)
        if ds_moe_layers(module):
            raise CheckpointError(
                "deepspeed with a mixture of experts loads another layout's weights only through --init-from "
                "(before its experts become DeepSpeed-MoE's)"
            )
        if autotp_size_of(self.strategy.ds_config) > 1:
            with autotp_whole(module):  # every rank loads the whole weights, then keeps its slices
                module.load_state_dict(state)
        elif self.strategy._stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                if self.strategy.env.is_main:
                    module.load_state_dict(state)
        else:
            module.load_state_dict(state)


@register
class DeepSpeed(Strategy):
    name = "deepspeed"
    description = "DeepSpeed engine: ZeRO stages 0-3, optional CPU offload (ZeRO-Offload/ZeRO-Infinity)"
    Options = DeepSpeedOptions
    channels_last_weights = False  # flat/sharded parameters must be contiguous
    needs_process_group = True
    requirements = "pip install deepspeed; 1+ processes (CPU with gloo, or one GPU each)"
    launcher = "deepspeed"
    checkpoint_layout = "deepspeed"
    takes_moe = True  # on DeepSpeed-MoE's layer (parallel.deepspeed_moe), --ep E ranks per expert set

    @classmethod
    def check_checkpoint(cls, path: Path, meta: dict[str, Any]) -> None:
        """An --offload-optimizer nvme checkpoint cannot be resumed or started from (``refuse_nvme_checkpoint``)."""
        refuse_nvme_checkpoint(path, checkpoint.check_tag(path, meta.get("deepspeed_tag", DS_TAG)))

    @classmethod
    def lora_refusal(cls, cfg: TrainConfig) -> str | None:
        if cfg.lora_rank and cls.parse_options(cfg.strategy_options).autotp_size > 1:
            return "--lora-rank with deepspeed --autotp-size is not supported: AutoTP shards nn.Linear modules, which LoRA replaces by PEFT's adapter layers"
        return None

    @classmethod
    def moe_refusal(cls, cfg: TrainConfig) -> str | None:
        """Why deepspeed cannot train ``cfg``'s mixture of experts (``_moe_refusal``) at the --zero-stage given (2 by
        default), before the world is known: what the estimate's, list's and advise's rows say. ``check_supported``
        checks again with the world and a --deepspeed-config's stage."""
        opts = cls.parse_options(cfg.strategy_options)
        return _moe_refusal(cfg, opts, None, 2 if opts.zero_stage is None else opts.zero_stage)

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        opts: DeepSpeedOptions = cls.parse_options(cfg.strategy_options)
        try:
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                return "needs the deepspeed package (pip install deepspeed)"
        except (ImportError, ValueError):
            return "needs the deepspeed package (pip install deepspeed)"
        if why := lean_refusal(cfg, "DeepSpeed steps flat fp32 partitions with its own optimizer (--ds-optimizer)"):
            return why
        if why := cls.quantize_refusal(cfg):
            return why
        if cfg.precision == "fp64":
            return (
                "DeepSpeed has no fp64 mode: its ZeRO optimizers keep fp32 master weights, gradient partitions and "
                "optimizer state whatever the weights' dtype (stage 0 refuses fp64 gradients); use fp32"
            )
        if cfg.precision in ("fp16-true", "bf16-true"):
            return (
                f"DeepSpeed keeps fp32 master weights; it has no {cfg.precision} mode (use "
                f"{cfg.precision.replace('-true', '-mixed')}, DeepSpeed's {cfg.precision[:4]} block)"
            )
        if opts.ds_optimizer not in DS_OPTIMIZERS:
            raise ConfigError(
                f"--ds-optimizer must be one of: {', '.join(DS_OPTIMIZERS)}; got {opts.ds_optimizer!r}"
            )
        if why := cls.lora_refusal(cfg):
            return why
        ds = build_ds_config(cfg, opts, world_size)  # raises ConfigError on conflicts
        zero = ds["zero_optimization"]
        reason = (
            _autotp_unsupported(cfg, opts.autotp_size) or nvme_unavailable(zero) or zeropp_unavailable(zero, device)
        )
        if reason:
            return reason
        if why := _moe_refusal(cfg, opts, world_size, int(zero.get("stage", 0))):
            return why
        user_block = bool(opts.deepspeed_config) and "optimizer" in load_user_json(opts.deepspeed_config)
        if opts.ds_optimizer != "torch" and not user_block and cfg.optimizer != "adamw":
            raise ConfigError(
                f"--ds-optimizer {opts.ds_optimizer} is an Adam kernel; it needs --optimizer adamw (got {cfg.optimizer})"
            )
        offloaded = "offload_optimizer" in ds["zero_optimization"]
        block = ds.get("optimizer")
        kernel = None
        if (
            block is not None
            and block["type"].lower() != "sgd"
            and not block["params"].get("torch_adam", False)
        ):
            # DeepSpeed's choice for a config Adam without torch_adam: DeepSpeedCPUAdam under ZeRO-Offload,
            # else FusedAdam (CUDA).
            kernel = "cpu_adam" if offloaded else "fused_adam"
        elif opts.ds_optimizer == "cpu-adam":
            kernel = "cpu_adam"
            if device.type == "cuda" and not offloaded:
                return "--ds-optimizer cpu-adam steps on the CPU: it needs --offload-optimizer cpu on a GPU"
        if kernel == "fused_adam" and device.type != "cuda":
            how = (
                'the JSON\'s optimizer block without "torch_adam": true'
                if user_block
                else "--ds-optimizer fused"
            )
            return (
                f'{how} means DeepSpeed\'s CUDA FusedAdam: it needs a GPU (on CPU set "torch_adam": true, or '
                "offload the optimizer for DeepSpeedCPUAdam)"
            )
        return kernel_unavailable(kernel) if kernel else None

    @classmethod
    def data_parallel_size(cls, cfg: TrainConfig, world_size: int) -> int:
        """The replicas the batch is split over: world / --autotp-size (refused here when it does not divide)."""
        return world_size // autotp_degree(cls.parse_options(cfg.strategy_options), world_size)

    cost = DeepSpeedCost
    checkpoint_io_class = DeepSpeedCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        """The rank's data-parallel coordinate: DeepSpeed's AutoTP groups are consecutive ranks (its (dp, tp) mesh),
        which read the same batches (its first forward checks that they do)."""
        t = self.options.autotp_size
        return self.env.rank // t, self.env.world_size // t

    def report(self) -> dict[str, Any]:
        """With --autotp-size or ZeRO++, the mesh in result.json (DeepSpeed's (dp, tp) groups; hpZ's and qgZ's,
        ``zeropp_mesh``), as fsdp --tp reports its."""
        t = self.options.autotp_size
        if layers := ds_moe_layers(self.model):
            n, e = layers[0].n_experts, self.options.ep
            return {"ep": {"size": e, "experts_per_rank": n // e, "layer": "deepspeed.moe.layer.MoE"}}
        if t > 1:
            return {"mesh": {"dp": self.env.world_size // t, "tp": t}}
        mesh = zeropp_mesh(self.cfg, self.env.world_size, self.ds_config.get("zero_optimization", {}))
        return {"mesh": mesh} if mesh else {}

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, precision, options)
        # DeepSpeed's fp16/bf16 blocks replace stratbench's casting and GradScaler.
        self.precision = _DeepSpeedPrecision(precision.name, env.device)
        self.engine = None
        self.applied_lr: list[float] = []
        self.ds_config: dict[str, Any] = {}

    # ---- set-up -------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Join DeepSpeed's communication layer and write its config; the engine wraps in build_optimizer."""
        prepare_op_builds()  # the keyed op cache; a killed build's lock is taken over, a wait is bounded
        import deepspeed

        avoid_shm_op_build()
        # The engine already created the process group (gloo on CPU, nccl on GPU); DeepSpeed adopts it.
        deepspeed.init_distributed(dist_backend=self.env.backend, verbose=False)
        self.ds_config = build_ds_config(self.cfg, self.options, self.env.world_size, self.total_steps)
        size_nvme_param_buffers(self.ds_config["zero_optimization"], model, self.env.world_size)
        if "tensor_parallel" in self.ds_config:
            self.ds_config["tensor_parallel"].setdefault("partition_config", autotp_partition_config(model))
        if apply_deepspeed_moe(model, self.options.ep, self.env.rank) and self.env.is_main:
            n = ds_moe_layers(model)[0].n_experts
            print(f"deepspeed --ep {self.options.ep}: DeepSpeed-MoE layers, each rank holding "
                  f"{n // self.options.ep} of each layer's {n} experts", flush=True)  # fmt: skip
        return model

    def run_files(self) -> dict[str, str]:
        return {"deepspeed_config.json": json.dumps(self.ds_config, indent=2) + "\n"}

    def build_optimizer(self, model: nn.Module, make_optimizer) -> torch.optim.Optimizer:
        """The client optimizer and the engine (every kernel build happens here); self.model becomes the engine."""
        import deepspeed

        if "optimizer" in self.ds_config:
            client = None  # built by DeepSpeed from the config's optimizer block
        else:
            client = self._client_optimizer(model, make_optimizer)
        zero = self.ds_config["zero_optimization"]
        if (zero.get("offload_optimizer") or {}).get("device") == "nvme":
            align_swapped_gradients()
        param_nvme = (zero.get("offload_param") or {}).get("device") == "nvme"
        with zero_init_keeps_dtype() if param_nvme else contextlib.nullcontext():
            engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=client,
                model_parameters=None if client is not None else trainable(model.parameters()),
                config=self.ds_config,
                mpu=self._autotp_groups(),
            )
        self.engine = engine
        self.model = engine
        # The torch optimizer DeepSpeed finally steps (its param_groups are the ones the ZeRO wrapper uses),
        # so stratbench's LR scheduler, where DeepSpeed has none, sets the learning rate DeepSpeed applies.
        return engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer

    def _client_optimizer(self, model: nn.Module, make_optimizer) -> torch.optim.Optimizer:
        """The torch optimizer (or DeepSpeedCPUAdam) over the trained parameters; with DeepSpeed-MoE layers,
        over the dense and the expert groups ZeRO needs (``moe_param_groups``)."""
        params = trainable(model.parameters())
        groups = moe_param_groups(params) if ds_moe_layers(model) else params
        if self.options.ds_optimizer == "torch":
            return make_optimizer.prepare(make_optimizer.cls(groups, **make_optimizer.kwargs))
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, adamw_mode=True)

    def _autotp_groups(self):
        """Under --autotp-size, DeepSpeed's (dp, tp) process groups, passed as the ``mpu``: without one, deepspeed
        0.19's config reads the whole world as the data-parallel size and refuses the batch (train_batch_size !=
        micro-batch x accumulation x world), although the engine then splits the world into AutoTP groups itself."""
        if self.options.autotp_size == 1:
            return None
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=self.options.autotp_size)
        return groups

    def lr_scheduler(self, optimizer, lr_lambda):
        """DeepSpeed's scheduler when the config has a scheduler block (engine.step() steps it), else stratbench's."""
        if self.engine is not None and self.engine.lr_scheduler is not None:
            return EngineLRSchedule(self)
        return super().lr_scheduler(optimizer, lr_lambda)

    def optimizer_report(self, optimizer) -> dict[str, Any]:
        report = super().optimizer_report(optimizer)
        assert self.engine is not None
        block = self.ds_config.get("optimizer")
        opt = report["optimizer"]
        if block is not None:
            opt["built_by"] = "deepspeed (config optimizer block)"
            opt["config"] = block
        opt["wrapper"] = (
            f"{type(self.engine.optimizer).__module__}.{type(self.engine.optimizer).__qualname__}"
        )
        sched = self.engine.lr_scheduler
        if sched is not None:
            report["lr_schedule"] = {
                "built_by": "deepspeed (config scheduler block)",
                "class": f"{type(sched).__module__}.{type(sched).__qualname__}",
                "config": self.ds_config["scheduler"],
            }
        return report

    # ---- one step -----------------------------------------------------------------------------
    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """The loop calls step() once per accumulation group: tell DeepSpeed where the boundary is, so that
        gradients are reduced (and ZeRO-2/3 partitions finalised) on the last micro-step only."""
        assert self.engine is not None
        self.engine.set_gradient_accumulation_boundary(is_last_micro_step)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        assert self.engine is not None
        # The loop already divided the loss by grad_accum: DeepSpeed must not divide it again.
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, optimizer, clip) -> bool:
        """engine.step(): DeepSpeed unscales, clips (gradient_clipping from --clip-grad-norm), steps, zeroes."""
        assert self.engine is not None
        # engine.step() moves a config scheduler on to the next lr
        self.applied_lr = list(self.engine.get_lr())
        self.engine.step()
        self.precision.skipped_steps = int(self.engine.skipped_steps)
        return bool(self.engine.was_step_applied())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError("DeepSpeed clips inside engine.step() (gradient_clipping in its config)")

    def _stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    # ---- measurement --------------------------------------------------------------------------
    def state_bytes(self, model: nn.Module, optimizer) -> dict[str, int]:
        """What this rank really holds: ZeRO-3 parameter partitions (``ds_tensor``), the partitioned gradient
        buffers, the optimizer's state tensors (over DeepSpeed's flat partitions) and fp32 master partitions."""
        assert self.engine is not None
        return deepspeed_state_bytes(self.engine, self._stage())


def _apply_scheduler_lr(sched) -> None:
    """Set the optimizer's lr to what a DeepSpeed scheduler gives at its current iteration (its load_state_dict
    restores the counter only; the rate itself is set by its next step())."""
    from deepspeed.runtime.lr_schedules import update_lr

    if sched.last_batch_iteration >= 0:
        sched._last_lr = update_lr(sched.optimizer.param_groups, sched.get_lr())


class EngineLRSchedule:
    """The loop's view of the LR scheduler DeepSpeed built from the config's scheduler block. DeepSpeed steps it
    inside engine.step() after each applied step, so ``step`` here does nothing and ``get_last_lr`` is the rate
    the step just taken used. Its state is DeepSpeed's (also saved in DeepSpeed's checkpoint), tagged with
    its class, so a checkpoint of another schedule is refused rather than misread."""

    def __init__(self, strategy: DeepSpeed) -> None:
        self.strategy = strategy
        self.scheduler = strategy.engine.lr_scheduler

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.strategy.applied_lr or self.strategy.engine.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"deepspeed_scheduler": type(self.scheduler).__name__, **self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = type(self.scheduler).__name__
        if state.get("deepspeed_scheduler") != kind:
            raise CheckpointError(
                f"the checkpoint's LR schedule is {state.get('deepspeed_scheduler') or 'stratbench'}'s, this run's "
                f"is DeepSpeed's {kind}: resume with the same --deepspeed-config, or start with --init-from"
            )
        self.scheduler.load_state_dict({k: v for k, v in state.items() if k != "deepspeed_scheduler"})
        _apply_scheduler_lr(self.scheduler)


def _register_layout() -> None:
    checkpoint.register_layout("deepspeed", read_deepspeed_checkpoint)


_register_layout()
