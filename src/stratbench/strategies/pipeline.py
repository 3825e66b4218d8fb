"""``pipeline``: the model split into stages, one (or, interleaved, several) per process, micro-batches
streamed through them by a ``torch.distributed.pipelining`` schedule; optionally replicated (pipeline x data
parallel on a 2-D DeviceMesh).

Layout. ``--pp P`` processes form one pipeline (default: every process); the world is ``dp x P`` with
``dp = world / P`` data-parallel replicas of the pipeline, on a DeviceMesh ``(dp, pp)``. Each stage's replicas
all-reduce their gradients over the mesh's ``dp`` dimension, in one flat all-reduce per stage after the
schedule's step (not DistributedDataParallel: its reducer fails on the stages' shape-inference pass in torch
2.13, see ``all_reduce_grads``). ``--stages S`` is the number of model stages: P for gpipe/1f1b/naive, a multiple of P for
interleaved-1f1b (default 2P; stage ``i`` runs on pipeline rank ``i % P``).

3D parallelism. ``--tp T`` splits each stage Megatron-style over T processes (``apply_tp`` on the modules the
rank keeps, over the mesh's ``tp`` dimension, as torchtitan parallelises each pipeline chunk): the mesh becomes
``(dp, pp, tp)`` with ``dp = world / (P x T)``, a stage's p2p runs on the ``pp`` group between the ranks of the
same tp slot, the replicas' all-reduce covers each rank's local shards. The tp-specific pieces (refusals, the
stage's split bytes and Megatron traffic for the cost model, DTensor shards in the gradient all-reduce, the
clipping norm and checkpoints) are in ``parallel/pipeline_tp.py``; docs/parallelism.md has the formulas.
``--sequence-parallel`` shards each stage's residual stream and norms along the sequence over tp: at a stage edge
each tp rank sends its peer its own sequence shard, what the plan produces (torchtitan's choice: 1/T of the
bytes, no gather at the edge; the next stage's first block takes it as its ``Shard(1)`` input), and the norms'
partial gradients are summed over tp once after the schedule. ``--vocab-parallel`` splits the embedding and the
head over the vocabulary; the last stage gathers the logits for its loss (the schedule hands the loss a plain
tensor: no ``loss_parallel``).

Schedules (``--schedule``): ``gpipe`` (ScheduleGPipe: all forwards, then all backwards), ``1f1b`` (Schedule1F1B,
PipeDream-Flush: at most S micro-batches in flight), ``interleaved-1f1b`` (ScheduleInterleaved1F1B, several
stages per rank, a smaller bubble), the zero-bubble schedules ``zb-interleaved`` (ScheduleInterleavedZeroBubble,
ZB-H1), ``zbv`` (ScheduleZBVZeroBubble) and ``dualpipev`` (ScheduleDualPipeV), which split each backward into
its input- and weight-gradient halves (the last two run 2 stages per rank in a V: the first and the last stage on
rank 0, whose loss it broadcasts), ``naive`` (GPipe with one micro-batch: plain model parallelism across
processes, the bubble made visible). ``--microbatches M`` split each replica's batch; each micro-batch's loss
(its mean) is divided by M before its backward, as the loop's ``--grad-accum`` divides, so one step equals the
full-batch step and each backward equals one micro-step of ``single --grad-accum M``.

Precision: autocast inside each stage (activations travel in the compute dtype). fp16-mixed scales each
micro-batch's loss by the loss scale; the scaler's "found inf/NaN" is all-reduced over every process (all
stages, all replicas) before the optimizer step, so every stage skips the same steps and updates the scale
identically (``ShardedGradScaler``: a GradScaler whose found-inf is summed over a process group).

The model is split by ``stratbench.models.split`` (printed at start, written into result.json under
``pipeline.split``). Each process keeps the original model object with every piece it does not run removed,
so parameter names (state dicts, optimizer state) are the original ones: checkpoints are full state dicts any
method loads, gathered on rank 0.

The building blocks are in ``strategies/parallel/``: the layout, the split, the stage modules, the replicas'
all-reduce and the measured bubble in ``pipeline_parallel``, the stages' costs in ``pipeline_costs``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.models.split import BALANCE, drop_modules, piece_count, split_model, stage_module
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register
from stratbench.strategies.costs import CPU_TP_RUNTIME_BYTES, RankMemory, lean_refusal
from stratbench.strategies.parallel import pipeline_tp
from stratbench.strategies.parallel.pipeline_costs import (
    receive_buffer_bytes,
    send_rows,
    stage_activations,
    stage_params,
    stage_reductions,
)
from stratbench.strategies.parallel.pipeline_parallel import (
    SCHEDULES,
    StageModule,
    all_reduce_grads,
    batch_unfit,
    bubble_stats,
    forward_only,
    merged_model_state,
    merged_optimizer_state,
    pipeline_layout,
    resolve_layout,
    run_spec,
    sample_of,
    spec_split,
    timed_stage_class,
)
from stratbench.strategies.parallel.tensor_parallel import apply_tp, reduce_partial_grads
from stratbench.strategies.parallel.tp_plan import plan_options, require_tp_group


@dataclasses.dataclass(kw_only=True)
class PipelineOptions:
    """Options of the pipeline strategy."""

    schedule: str = "1f1b"
    """pipeline: gpipe (all forwards then all backwards), 1f1b (one forward one backward, at most S micro-batches in flight), interleaved-1f1b (several stages per process), zb-interleaved (interleaved, each backward split into its input- and weight-gradient halves, the weight halves filling the bubble: ZB-H1), zbv (zero bubble, 2 stages per process in a V), dualpipev (DeepSeek's DualPipe cut to a V, 2 stages per process), naive (one micro-batch: model parallelism, the whole bubble)."""
    microbatches: int = 0
    """pipeline: micro-batches each replica's batch is split into per step (0: 1 for naive, else 2 x the pipeline processes); must divide the per-replica batch."""
    stages: int = 0
    """pipeline: number of model stages (0: the pipeline processes; interleaved-1f1b: 2 x them)."""
    pp: int = 0
    """pipeline: processes per pipeline; the world size / (pp x tp) replicas all-reduce gradients per stage (0: --stages, or the world size / tp)."""
    tp: int = 1
    """pipeline: processes each stage is split over, Megatron tensor parallel (3D parallelism: a (dp, pp, tp) mesh); the built-in transformers."""
    sequence_parallel: bool = False
    """pipeline --tp: Megatron sequence parallelism in each stage, as the tp method's: the norms and the residual stream sharded along the sequence (the stages send each other their tp rank's sequence shard); --seq-len must divide by --tp."""
    vocab_parallel: bool = False
    """pipeline --tp: the embedding (first stage) and the head (last stage) split over the vocabulary, as the tp method's; the last stage gathers the logits for its loss (no loss_parallel). False (pipeline's default): both whole on every tp rank."""
    balance: str = "params"
    """Balance the automatic split by parameters (memory) or flops (forward+backward time)."""
    split_points: str = ""
    """Explicit split, comma-separated pieces where a stage begins, e.g. layer2,layer4 (see the printed split for the pieces)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.balance not in BALANCE:
            raise ConfigError(f"unknown balance {self.balance!r}; choose one of: {', '.join(BALANCE)}")
        for name in ("microbatches", "stages", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a positive integer (or 0 for the default), got {value!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp must be a positive integer (1: no tensor parallelism), got {self.tp!r}")
        require_tp_group(self, "pipeline", "each stage over --tp processes")

    @property
    def points(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.split_points.split(",") if p.strip())


class PipelineModule(nn.Module):
    """What the loop holds: ``module`` is the original model keeping only this rank's stages (original names);
    calling it runs the evaluation forward through all stages and returns the logits on every stage."""

    def __init__(self, module: nn.Module, strategy: PipelineStrategy) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._strategy.eval_forward(x)


class PipelineCost(CostModel):
    """The stages each pipeline rank holds (``spec_split`` of the run's layout), the micro-batches in flight,
    the stage-to-stage sends and the schedule's bubble."""

    @classmethod
    def memory_model(cls, ctx, rank):
        """The stages of ``rank``: their parameters, gradients and optimizer state (nothing else is held), a
        flat gradient buffer for the replicas' all-reduce, and the activations of the micro-batches in flight
        (``stage_activations``)."""
        lay = resolve_layout(ctx.options, ctx.world)
        why = batch_unfit(ctx.cfg, lay) or pipeline_tp.refusal(run_spec(ctx.cfg), ctx.cfg, lay.tp)
        if why:  # before any trace of a slice that cannot be cut (one line, as train refuses it)
            raise ConfigError(why)
        split = spec_split(ctx.cfg, lay.stages, ctx.options)
        pp_rank = lay.coords(rank)[1]
        ids = lay.stages_of(pp_rank)
        mine = [split.stages[i] for i in ids]
        local = stage_params(ctx, lay, mine)
        pd = ctx.param_bytes
        m = RankMemory(params=local * pd, grads=local * pd, optim=ctx.flat_optim_bytes(local))
        total = sum(s.params for s in split.stages) or 1
        held = sum(s.params for s in mine)
        m.step_scalars = round(4 * len(ctx.info.numels) * held / total) if ctx.adam else 0
        m.sharding_note = f"stage(s) {', '.join(str(s.index) for s in mine)} of {lay.stages}"
        if lay.tp > 1:
            m.sharding_note += f", its blocks' attention/MLP matrices 1/{lay.tp} (tp)"
            m.cpu_runtime, m.cpu_runtime_note = CPU_TP_RUNTIME_BYTES, "DTensor's op caches under tp, measured"
        micro = ctx.cfg.batch_size // lay.dp // lay.microbatches
        m.data_ranks = lay.dp  # the batch is split over the replicas, not over every rank
        recv = receive_buffer_bytes(ctx, lay, split, ids, micro)
        notes = [f"receive buffers for {lay.microbatches} micro-batches"] if recv else []
        if lay.dp > 1:
            notes.append(f"flat gradient all-reduce over {lay.dp} replicas")
        m.buckets, m.bucket_note = recv + (local * pd if lay.dp > 1 else 0), " + ".join(notes)
        m.activations, m.activation_note = stage_activations(ctx, lay, mine, pp_rank, micro)
        names = [name for s in mine for name in s.modules]
        m.runs_linear = any(
            lin == name or lin.startswith(name + ".") for lin in ctx.info.linear_names for name in names
        )
        return m

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """The busiest pipeline rank's share of the replica's FLOPs (its stages in the split; under --tp its
        blocks' FLOPs 1/T, ``pipeline_tp.stage_flops``), stretched by the schedule's bubble:
        step = busy / (1 - bubble), bubble = (P-1)/(vM+P-1) (``Layout.bubble_theory``)."""
        lay = resolve_layout(ctx.options, ctx.world)
        split = spec_split(ctx.cfg, lay.stages, ctx.options)
        total = sum(s.flops for s in split.stages)
        if not total:
            return 1.0
        flops = [pipeline_tp.stage_flops(split, s, lay.tp, ctx.options.vocab_parallel) for s in split.stages]
        busiest = max(sum(flops[i] for i in lay.stages_of(r)) for r in range(lay.pp)) / total
        return busiest / (1.0 - lay.bubble_theory())

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        """Share of the stage-to-stage traffic that runs under compute: none (a stage waits for the activation
        it needs; the schedule's sends sit on the critical path), which the bubble term does not include."""
        return 0.0

    @classmethod
    def mesh_dims(cls, ctx) -> dict[str, int]:
        """The (dp, pp, tp) mesh of the run's layout (``Layout.mesh``)."""
        return resolve_layout(ctx.options, ctx.world).mesh

    @classmethod
    def comm_model(cls, ctx):
        """Per step, on the pipeline rank that sends the most: the stage-to-stage sends and the loss broadcast
        (``send_rows``); and the all-reduces of the rank that reduces the most (``stage_reductions``)."""
        lay = resolve_layout(ctx.options, ctx.world)
        split = spec_split(ctx.cfg, lay.stages, ctx.options)
        micro = ctx.cfg.batch_size // lay.dp // lay.microbatches
        per_rank = [stage_reductions(ctx, lay, split, r, micro) for r in range(lay.pp)]
        return send_rows(ctx, lay, split, micro) + max(
            per_rank, key=lambda rs: sum(r.payload_bytes for r in rs)
        )


class PipelineCheckpointIO(CheckpointIO):
    """Full state dicts with the original names, assembled on rank 0 from every stage's part (the first
    replica's; a tp-split stage's tensors whole, gathered over its tp ranks first), and this rank's part (its
    tp shard) taken from any method's full state dict on load."""

    def _gather_to_main(self, local: dict) -> list[dict] | None:
        """Every pipeline rank's part on global rank 0 (replicas other than the first, and tp ranks other than
        a stage's first, send nothing: they hold the same whole tensors)."""
        first = self.strategy.dp_rank == 0 and self.strategy.tp_rank == 0
        part = local if first else None
        if self.strategy.env.world_size == 1:
            return [local]
        parts: list | None = [None] * self.strategy.env.world_size if self.strategy.env.is_main else None
        dist.gather_object(part, parts, dst=0)
        return [p for p in parts if p is not None] if parts is not None else None

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict, original names, on rank 0 (a collective; other ranks get {})."""
        # a split stage's DTensors whole (a collective over its tp ranks, in the state dict's order on each)
        local = {k: pipeline_tp.full_value(v) for k, v in self.strategy.unwrap(model).state_dict().items()}
        parts = self._gather_to_main(local)
        if parts is None:
            return {}
        return merged_model_state(parts, self.strategy.full_names)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by original parameter names, on rank 0 (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        local = get_optimizer_state_dict(
            self.strategy.unwrap(model), optimizer, options=StateDictOptions(full_state_dict=False)
        )
        local = {
            "state": {
                k: {n: pipeline_tp.full_value(v) for n, v in s.items()} for k, s in local["state"].items()
            },
            "param_groups": local["param_groups"],
        }
        parts = self._gather_to_main(local)
        if parts is None:
            return {}
        return merged_optimizer_state(parts, self.strategy.full_names)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's part of a full state dict (any method's), by original names (under --tp: its shard
        of each split tensor)."""
        module = self.strategy.unwrap(model)
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise CheckpointError(
                f"the checkpoint has no {missing[0]!r} (and {len(missing) - 1} more of this stage's tensors)"
            )
        module.load_state_dict({k: pipeline_tp.like(state[k], v) for k, v in own.items()}, strict=True)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        module = self.strategy.unwrap(model)
        own = dict(module.named_parameters())
        local = {
            "state": {
                k: {n: pipeline_tp.like_state(v, own[k]) for n, v in s.items()}
                for k, s in state.get("state", {}).items()
                if k in own
            },
            "param_groups": [
                g | {"params": [n for n in g["params"] if n in own]} for g in state.get("param_groups", [])
            ],
        }
        set_optimizer_state_dict(
            module, optimizer, local, options=StateDictOptions(full_state_dict=False, strict=False)
        )


@register
class PipelineStrategy(Strategy):
    name = "pipeline"
    splits_model = True
    description = (
        "pipeline parallel (torch.distributed.pipelining): stages per process, micro-batches; "
        "--schedule gpipe|1f1b|interleaved-1f1b|zb-interleaved|zbv|dualpipev|naive, --pp for pipeline x data "
        "parallel, --tp for 3D"
    )
    requirements = (
        "torch.distributed (gloo on CPU, nccl on CUDA); a splittable model (resnet*, tinynet, the transformers, "
        "nn.Sequential)"
    )
    launcher = "torchrun"
    needs_process_group = True
    Options = PipelineOptions
    calibration_refused = (
        "a pipeline on one device is one stage, not the method (its stages are the devices);"
        " its projection models the stages and the bubble"
    )

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, precision, options)
        if precision.spec.loss_scaling:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # Each stage sees only its own gradients: an overflow in one stage must skip the step on every
            # stage (and replica), or the stages would train different steps and their scales drift apart.
            # ShardedGradScaler all-reduces found-inf over the group (None: the default group, every process).
            precision.scaler = ShardedGradScaler(env.device.type, process_group=None)

    # ---- what it needs ------------------------------------------------------------------------
    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with pipeline is not supported: its stages and merged checkpoints are not built for frozen parameters (untested)"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type not in ("cpu", "cuda"):
            return f"pipeline runs on cpu or cuda devices, not {device.type}"
        if why := lean_refusal(cfg, "its memory model prices a stage's states per element (and --tp shards them)"):
            return why
        options = cls.parse_options(cfg.strategy_options)
        try:
            lay = resolve_layout(options, world_size)
        except ConfigError as exc:
            return str(exc)
        if why := cls.lora_refusal(cfg):
            return why
        if cfg.activation_checkpointing:
            return "--activation-checkpointing with pipeline is not supported (the stages hold the original modules)"
        if cfg.compile:
            return "--compile with pipeline is not supported (the schedule calls the stage modules directly)"
        why = batch_unfit(cfg, lay)
        if why:
            return why
        try:
            spec_split(cfg, lay.stages, options)
        except ConfigError as exc:
            return str(exc)
        return pipeline_tp.refusal(run_spec(cfg), cfg, lay.tp, plan_options(options))

    @classmethod
    def options_for_world(cls, cfg, world_size: int) -> dict[str, Any]:
        """Without --pp/--stages every process is one stage, which a model of fewer pieces than processes cannot
        be cut into: then the compare presets' layout (``pipeline_layout``) of the world / --tp processes, the
        user's other options kept."""
        given = dict(cfg.strategy_options)
        if given.get("pp") or given.get("stages") or given.get("split_points"):
            return given
        tp_size = given.get("tp") or 1
        return pipeline_layout(max(1, world_size // tp_size), piece_count(run_spec(cfg))) | given

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        """The replicas of the pipeline (a layout that does not fit ``world_size`` is refused here, first)."""
        return resolve_layout(cls.parse_options(cfg.strategy_options), world_size).dp

    cost = PipelineCost
    checkpoint_io_class = PipelineCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        """Every stage of one pipeline, and every tp rank of a stage, reads the same batches: the data is sharded
        over the replicas (the mesh's dp coordinate) only."""
        lay = resolve_layout(self.options, self.env.world_size)
        return lay.coords(self.env.rank)[0], lay.dp

    def step_chunks(self) -> int:
        """The schedule splits the replica's step (the loop's micro-steps concatenated) into M micro-batches."""
        return resolve_layout(self.options, self.env.world_size).microbatches

    # ---- set-up -------------------------------------------------------------------------------
    def move(self, model: nn.Module) -> nn.Module:
        return model  # only this rank's stages go to the device (wrap)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        env = self.env
        self.layout = lay = resolve_layout(self.options, env.world_size)
        self.mesh = init_device_mesh(
            env.device.type, tuple(lay.mesh.values()), mesh_dim_names=tuple(lay.mesh)
        )
        if env.is_main:
            print("pipeline mesh: " + " x ".join(f"{k} {v}" for k, v in lay.mesh.items()), flush=True)
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        self.tp_group = self.mesh.get_group("tp") if lay.tp > 1 else None
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        shape, tokens = sample_of(self.cfg)
        self.split = split_model(
            model,
            lay.stages,
            balance=self.options.balance,
            split_points=list(self.options.points),
            sample_shape=shape,
            tokens=tokens,
            name=self.cfg.model,
        )
        if env.is_main:
            print("\n".join(self.split.lines()), flush=True)
        self.full_names = list(model.state_dict())
        self.out_shape = self.split.stages[-1].out_shape  # per sample: (classes,) or (seq, vocab)
        self.stage_ids = lay.stages_of(self.pp_rank)
        modules = [stage_module(model, self.split.stages[i]) for i in self.stage_ids]
        drop_modules(model, {m for i in self.stage_ids for m in self.split.stages[i].modules})
        model.to(env.device)
        if lay.tp > 1:  # the blocks this rank kept, split over its stage's tp processes (torchtitan's order)
            opts = self.options
            apply_tp(
                model,
                self.mesh["tp"],
                sequence_parallel=opts.sequence_parallel,
                vocab_parallel=opts.vocab_parallel,
            )
        TimedStage = timed_stage_class()
        self.stage_modules: list[nn.Module] = []
        self.stages = []
        for i, seq in zip(self.stage_ids, modules, strict=True):
            sub = StageModule(list(seq), self.precision.autocast)
            stage = TimedStage(sub, i, lay.stages, env.device, group=self.pp_group)
            if env.device.type == "cuda":
                stage.sync = lambda d=env.device: torch.cuda.synchronize(d)
            self.stage_modules.append(sub)
            self.stages.append(stage)
        self.holds_first = 0 in self.stage_ids
        self.holds_last = lay.stages - 1 in self.stage_ids
        self.last_rank = lay.rank_of(lay.stages - 1)  # the pipeline rank with the loss (rank 0 in a V)
        self.loss_fn: Callable = nn.CrossEntropyLoss()
        self._unscaled: dict[int, torch.Tensor] = {}
        self.schedule = self._make_schedule()
        self.step_records: list[dict[str, float]] = []
        self._after_eval = True  # the first step (and the first after an evaluation) infers shapes
        self._eval_batch: int | None = None
        return PipelineModule(model, self)

    def _make_schedule(self):
        from torch.distributed import pipelining as pl

        lay = self.layout
        # scale_grads=False: _stage_loss divides each micro-batch's loss by M before its backward (as --grad-accum
        # does), rather than the schedule dividing the accumulated gradients afterwards: fp16 gradients then have
        # the magnitudes single's micro-steps have, so both overflow (and skip) at the same loss scale.
        multi = {"interleaved-1f1b": pl.ScheduleInterleaved1F1B, "zb-interleaved": pl.ScheduleInterleavedZeroBubble,
                 "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}  # fmt: skip
        if lay.schedule in multi:
            return multi[lay.schedule](self.stages, lay.microbatches, loss_fn=self._stage_loss, scale_grads=False)
        cls = pl.Schedule1F1B if lay.schedule == "1f1b" else pl.ScheduleGPipe
        return cls(self.stages[0], lay.microbatches, loss_fn=self._stage_loss, scale_grads=False)

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss on the last stage (the schedule calls it per micro-batch and runs backward on what this
        returns): the micro-batch's mean loss divided by M and scaled by the loss scale (a no-op without
        fp16-mixed); the unscaled loss is kept for the loss the step reports (the first step also calls this on
        the shape-inference pass, which the schedule does not count). Timed as the stage's compute."""
        t0 = time.perf_counter()
        loss = self.loss_fn(self.precision.loss_input(output), target)
        scaled = self.precision.scaler.scale(loss / self.layout.microbatches)
        self._unscaled[id(scaled)] = loss.detach()
        self.stages[-1].compute_s += time.perf_counter() - t0
        return scaled

    # ---- one step -----------------------------------------------------------------------------
    def run_step(self, model: nn.Module, batches: list, loss_fn: Callable) -> torch.Tensor:
        """One schedule step over this replica's whole batch (the loop's micro-steps concatenated: the schedule
        makes its own micro-batches); returns the mean loss, broadcast from the last stage to every stage."""
        self.loss_fn = loss_fn
        with self.phase("other"):  # the replica's whole batch, which the schedule splits itself
            x = torch.cat([b[0] for b in batches]) if len(batches) > 1 else batches[0][0]
            y = torch.cat([b[1] for b in batches]) if len(batches) > 1 else batches[0][1]
            args = (self.precision.convert_input(x),) if self.holds_first else ()
        self._unscaled = {}
        losses: list[torch.Tensor] = []
        if not self.holds_last:
            # GradScaler creates its scale on the first scale(loss); a stage without the loss never calls it,
            # and its unscale_ would then find no scale.
            self.precision.scaler.scale(torch.zeros((), device=self.env.device))
        for stage in self.stages:
            stage.compute_s = 0.0
        # The schedule interleaves forwards and backwards of the micro-batches (with the stages' sends and the
        # bubble): --breakdown shows all of it, and the replicas' all-reduce, as the "backward" phase; the
        # split into compute and idle is the bubble measurement (metrics.pipeline).
        with self.phase("backward"):
            self.synchronize()
            t0 = time.perf_counter()
            self.schedule.step(
                *args,
                target=y if self.holds_last else None,
                losses=losses if self.holds_last else None,
                return_outputs=False,
            )
            self.synchronize()
            if self.layout.pp > 1:
                # The step ends for every stage when the last one finishes: without this, the last stage would
                # leave after its backward and wait for the first stage's backward in the loss broadcast below,
                # outside its timed span, and its measured bubble would miss the drain.
                ids = [self.env.device.index or 0] if self.env.device.type == "cuda" else None
                dist.barrier(group=self.pp_group, device_ids=ids)
            wall = time.perf_counter() - t0
            compute = sum(s.compute_s for s in self.stages)
            self.step_records.append(
                {"wall_s": wall, "compute_s": compute, "warmup": float(self._after_eval)}
            )
            self._after_eval = False
            if self.layout.tp > 1:  # the sequence-parallel norms' partial gradients summed over tp, once
                reduce_partial_grads(self.model)
            if self.layout.dp > 1:
                all_reduce_grads(self.model, self.dp_group, self.layout.dp)
        with self.phase("other"):  # the mean loss, sent from the last stage to every stage
            loss = torch.zeros((), dtype=torch.float64, device=self.env.device)
            if self.holds_last:
                # the schedule's losses are what _stage_loss returned per micro-batch (scaled): report them unscaled
                loss = torch.stack([self._unscaled[id(v)].double() for v in losses]).mean()
            if self.layout.pp > 1:
                dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm over every stage's gradients (each stage holds a disjoint part), then the scale. The
        norm in the gradients' dtype, as ``clip_grad_norm_`` computes it (fp64 runs: not rounded to fp32)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        sq = pipeline_tp.grad_sq_norm(params, self.tp_group, self.env.device)
        if self.layout.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        total = sq.sqrt().to(params[0].grad.dtype if params else torch.float32)
        pipeline_tp.clip_with_norm(params, max_norm, total)
        return total

    # ---- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of a batch through all stages (the schedule's forward-only ``eval``); the logits of the
        last stage are broadcast to every stage of the pipeline so that the loop's metrics run anywhere. The
        batch is padded to a fixed multiple of the micro-batches (the stages' buffers have fixed shapes)."""
        m = self.layout.microbatches
        n = x.shape[0]
        if self._eval_batch is None:
            self._eval_batch = math.ceil(n / m) * m
        size = self._eval_batch
        if n > size:
            raise RuntimeError(f"pipeline evaluation batch {n} is larger than the first one ({size})")
        if n < size:
            x = torch.cat([x, x.new_zeros((size - n, *x.shape[1:]))])
        args = (x,) if self.holds_first else ()
        # the schedule's loss needs a target: a class per sample, a token per position
        target = torch.zeros(size, *self.out_shape[:-1], dtype=torch.long, device=x.device)
        target = target if self.holds_last else None
        self._after_eval = True
        self._unscaled = {}
        with forward_only(self.schedule):
            out = self.schedule.eval(*args, target=target)
        dtype = torch.float64 if self.precision.spec.param_dtype == torch.float64 else torch.float32
        logits = torch.empty(size, *self.out_shape, dtype=dtype, device=x.device)
        if self.holds_last:
            logits.copy_(out)
        if self.layout.pp > 1:
            dist.broadcast(logits, group=self.pp_group, group_src=self.last_rank)
        return logits[:n]

    def report(self) -> dict[str, Any]:
        """``pipeline`` in result.json: the layout, the split and the measured bubble per rank (a collective)."""
        mine = {
            "rank": self.env.rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "stages": self.stage_ids,
            # the loss scaler's view on this rank: equal on every rank when the stages agree on skipping
            "skipped_steps": self.precision.skipped_steps,
            "loss_scale": self.precision.scaler.get_scale() if self.precision.scaler.is_enabled() else None,
        }
        mine |= {"bubble": bubble_stats(self.step_records, self.cfg.timing_warmup_steps)}
        ranks = self.all_gather_object(mine)
        medians = [r["bubble"]["median"] for r in ranks if r["bubble"].get("steps")]
        return {
            "mesh": self.layout.mesh,
            "pipeline": {
                "layout": self.layout.to_dict(),
                "split": self.split.to_dict(),
                "bubble_theory": self.layout.bubble_theory(),
                "bubble_measured_median": statistics.median(medians) if medians else None,
                "bubble_definition": "1 - (the stage's forward/backward/loss compute time) / (the schedule step's wall time), "
                "per rank, median over the measured steps",
                "ranks": ranks,
            },
        }
