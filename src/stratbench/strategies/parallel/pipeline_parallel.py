"""Pipeline parallelism's building blocks, what a method composes around its schedule: the layout of the
processes (``Layout``: ``dp`` replicas of a ``pp``-process pipeline of ``stages`` stages, each over ``tp``
processes; ``resolve_layout``, and ``pipeline_layout``, the compare presets' choice), the split of the run's
model into stages (``spec_split`` on the meta device, ``sample_of``: the split's input), a stage's module
(``StageModule``, ``timed_stage_class``: the stage that times its own compute), the replicas' gradient
all-reduce, the measured bubble (``bubble_stats``) and a stage-split model's full state assembled from its
stages' parts (``merged_model_state``, ``merged_optimizer_state``).

The bubble, per stage, is the fraction of the schedule's step that the stage did not spend in its own
forward/backward compute (``forward_one_chunk``/``backward_one_chunk`` and the loss), i.e. time blocked in
receives and waits, beside the theory (S-1)/(M+S-1) (``Layout.bubble_theory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.data.text import is_text_data
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.split import Split, split_for_spec
from stratbench.strategies.parallel.pipeline_tp import local

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-interleaved", "zbv", "dualpipev", "naive")
LOOPED = ("interleaved-1f1b", "zb-interleaved")
"""Several stages per rank, stage i on pipeline rank i % P."""
V_SHAPED = ("zbv", "dualpipev")
"""Two stages per rank in a V: rank r runs stages r and 2P - 1 - r (the first and the last on rank 0)."""


def coords(rank: int, pp: int, tp_size: int) -> tuple[int, int, int]:
    """(dp, pp, tp) coordinates of global ``rank`` on the mesh ``(dp, pp, tp)`` (``init_device_mesh``'s row-major
    order: the ``tp`` processes of one stage are neighbours, on a GPU machine the same node's fastest link)."""
    return rank // (pp * tp_size), (rank // tp_size) % pp, rank % tp_size


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the processes are arranged: ``dp`` replicas of a ``pp``-process pipeline of ``stages`` stages, each
    stage split over ``tp`` processes (the mesh ``(dp, pp, tp)``)."""

    pp: int
    dp: int
    stages: int
    microbatches: int
    schedule: str
    tp: int = 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of a global rank."""
        return coords(rank, self.pp, self.tp)

    @property
    def mesh(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    @property
    def stages_per_rank(self) -> int:
        return self.stages // self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices a pipeline rank runs (loop order, as ScheduleInterleaved1F1B expects; a V for zbv and
        dualpipev, as torch's ``generate_stage_to_rank_mapping(style="v")`` places them)."""
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        return next(r for r in range(self.pp) if stage in self.stages_of(r))

    def in_flight(self, pp_rank: int) -> int:
        """Most micro-batches whose activations one stage of this rank holds at once (the memory model)."""
        m, s = self.microbatches, self.pp
        if self.schedule in ("gpipe", "naive"):
            return m
        if self.schedule == "1f1b":
            return min(m, s - pp_rank)  # stage r runs S - r warm-up forwards before its first backward
        if self.schedule == "zbv":  # a weight-gradient half (W) keeps its micro-batch's inputs until it runs:
            return min(m, 2 * s)  # measured on 2 x 2 stages, M = 4: every micro-batch held at the peak
        if self.schedule == "dualpipev":  # DeepSeek-V3 report, table 2: P + 1 micro-batches of a device's layers
            return min(m, s + 1)
        # interleaved (Megatron's warm-up): (P - r - 1) * 2 + (v - 1) * P forwards before the first backward,
        # spread over v local stages, plus the one being processed
        v = self.stages_per_rank
        warm = min(m * v, (s - pp_rank - 1) * 2 + (v - 1) * s + 1)
        return min(m, math.ceil(warm / v))

    def bubble_theory(self) -> float:
        """Idle fraction of a step with equal stage times and free communication: (S-1)/(M+S-1) for
        GPipe/1F1B (naive: M=1); interleaving divides the fill/drain by the stages per rank v. The zero-bubble
        schedules split each backward into its input-gradient (B) and weight-gradient (W) halves and fill the
        drain with W (Qi et al. 2024), with F = B = W: zb-interleaved (ZB-H1, interleaved) idles P-1 of 3vM + P-1
        units; zbv idles none once M >= 2P (else the ZB-H1 bound with v = 2); dualpipev idles (P/2 - 1)(F&B + B -
        3W) = 0 units (DeepSeek-V3 report, table 2; F&B = F + B where nothing overlaps them)."""
        p, m, v = self.pp, self.microbatches, self.stages_per_rank
        if self.schedule == "zb-interleaved" or (self.schedule == "zbv" and m < 2 * p):
            return (p - 1) / (3 * v * m + p - 1)
        if self.schedule in V_SHAPED:
            return 0.0
        return (p - 1) / (v * m + p - 1)

    def to_dict(self) -> dict[str, Any]:
        """The layout in result.json (``tp`` is the mesh's, reported beside it)."""
        out = dataclasses.asdict(self) | {"stages_per_rank": self.stages_per_rank}
        del out["tp"]
        return out


def resolve_layout(options: Any, world: int) -> Layout:
    """The layout for ``world`` processes of the pipeline ``options`` (``schedule``, ``pp``, ``stages``,
    ``microbatches``, ``tp``: the pipeline method's); ConfigError naming the bad value otherwise."""
    interleaved = options.schedule in LOOPED
    t = options.tp
    if world % t:
        raise ConfigError(f"world size {world} is not divisible by --tp {t}; use a divisor of {world}")
    if options.pp:
        pp = options.pp
    elif options.stages and not interleaved and options.schedule not in V_SHAPED:
        pp = options.stages
    else:
        pp = world // t
    if t > 1 and world % (pp * t):
        raise ConfigError(
            f"world size {world} is not divisible into pipelines of {pp} stages x --tp {t} = {pp * t} processes; "
            f"choose --pp x --tp dividing {world}"
        )
    if pp > world or world % pp:
        raise ConfigError(
            f"world size {world} is not divisible into pipelines of {pp} processes (--pp/--stages {pp}); "
            f"use a divisor of {world}"
        )
    stages = options.stages or (2 * pp if interleaved or options.schedule in V_SHAPED else pp)
    if options.schedule in V_SHAPED:
        if stages != 2 * pp:
            raise ConfigError(
                f"{options.schedule} runs exactly 2 stages per process in a V: --stages {2 * pp} with {pp} pipeline "
                f"processes; got {stages}"
            )
    elif interleaved:
        if stages % pp or stages < 2 * pp:
            raise ConfigError(
                f"{options.schedule} needs --stages a multiple of the {pp} pipeline processes and at least {2 * pp}; got {stages}"
            )
    elif stages != pp:
        raise ConfigError(
            f"{options.schedule} runs one stage per process: --stages {stages} with {pp} pipeline processes "
            "(use --pp for data parallel replicas, or --schedule interleaved-1f1b, zb-interleaved, zbv or "
            "dualpipev for several stages per process)"
        )
    if options.schedule == "naive":
        if options.microbatches not in (0, 1):
            raise ConfigError(
                f"schedule naive runs one micro-batch (the bubble made visible); got --microbatches {options.microbatches} (use gpipe or 1f1b)"
            )
        m = 1
    else:
        m = options.microbatches or 2 * pp
    if options.schedule == "1f1b" and m < pp:
        raise ConfigError(f"1f1b needs --microbatches >= the {pp} pipeline stages; got {m}")
    if interleaved:
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"{options.schedule} needs --microbatches a multiple of max(1, M // {pp}) = {rounds}; got {m}"
            )
    dp = world // (pp * t)
    return Layout(pp=pp, dp=dp, stages=stages, microbatches=m, schedule=options.schedule, tp=t)


def batch_unfit(cfg, lay: Layout) -> str | None:
    """One line when the micro-batches do not divide a replica's share of the batch, else None."""
    per_replica = cfg.batch_size // lay.dp if cfg.batch_size % lay.dp == 0 else None
    if per_replica is not None and per_replica % lay.microbatches:
        return (
            f"--microbatches {lay.microbatches} does not divide the per-replica batch {per_replica} "
            f"(batch_size {cfg.batch_size} / {lay.dp} data-parallel replica(s)); choose a divisor of {per_replica}"
        )
    return None


def pipeline_layout(world: int, pieces: int) -> dict[str, int]:
    """The pipeline options a preset runs on ``world`` processes of a model cut into ``pieces``: at most 4
    stages (the largest divisor of the world that is <= 4; all processes when none is and the pieces allow),
    the other factor data-parallel replicas (``pp``), and ``2 x stages`` micro-batches rounded up to a power of
    two, at least 4 (``microbatches``: >= the stages, as 1F1B needs, and a divisor of a power-of-two batch).

    More stages than 4 would mostly add bubble on ResNet's 6 pieces (stem and head are small), and one
    process per stage at 8 GPUs is more stages than the pieces."""
    pp = max(d for d in range(1, min(world, 4) + 1) if world % d == 0)
    if pp == 1 and 1 < world <= pieces:
        pp = world
    m = 4
    while m < 2 * pp:
        m *= 2
    # pp only when it is not the default (every process in one pipeline): the cells' ids stay what they were
    return {"microbatches": m} | ({"pp": pp} if pp < world else {})


def run_spec(cfg) -> ModelSpec:
    """The run's model as the splitter builds it on the meta device (hashable: splits are cached). A language
    model's vocabulary is ``--vocab-size``, else byte-level text's 256, without reading the data: a tokenizer's
    or token files' own vocabulary sizes the embedding and the head, not the pieces (the run splits the model
    it built)."""
    if is_text_data(cfg.data):
        return ModelSpec(cfg.model, cfg.vocab_size or 256, 0, seq_len=cfg.seq_len)
    return ModelSpec.from_config(cfg)


def sample_of(cfg) -> tuple[tuple[int, ...], bool]:
    """One input sample's shape and whether it is token ids, as the run's ``DataBundle`` will say (a strategy
    splits the model before the loop builds the data): (seq_len,) token ids on text data, (3, H, W) pixels
    otherwise."""
    spec = run_spec(cfg)
    return spec.sample_shape, spec.is_text


def spec_split(cfg, stages: int, options) -> Split:
    """The split of the model the run ``cfg`` builds, costed on the meta device (the check, the cost model)."""
    spec = run_spec(cfg)
    return split_for_spec(spec, stages, options.balance, options.points, spec.sample_shape, spec.is_text)


class StageModule(nn.Sequential):
    """One stage: the original modules of its pieces in order, run under the precision's autocast (the
    schedule calls the stage module directly, outside the loop's autocast)."""

    def __init__(self, modules: list[nn.Module], autocast: Callable) -> None:
        super().__init__(*modules)
        object.__setattr__(self, "_autocast", autocast)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return super().forward(x)


def timed_stage_class():
    """PipelineStage that adds up the time its own compute takes (forward and backward of its chunks); the
    rest of a schedule step is the stage waiting for activations or gradients: the bubble."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        compute_s = 0.0
        sync: Callable[[], None] = staticmethod(lambda: None)

        def _timed(self, fn, *args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.compute_s += time.perf_counter() - t0

        def forward_one_chunk(self, *args, **kwargs):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

        def _forward_metadata_inference(self, *args, **kwargs):
            # To learn its output shapes, torch runs the stage's forward once on the first step (and on the first
            # step after an evaluation): on the whole batch (first stage) or on uninitialised memory (the others).
            # In training mode that forward would update BatchNorm's running statistics with a batch no step
            # trains on (garbage, often NaN: the evaluation then fails). Run it in eval mode: same shapes and
            # dtypes, buffers untouched (restoring them afterwards would trip autograd's version check in the
            # backward-shape pass that follows on this forward's graph).
            # (Each module's own flag is restored: the stage container is not under the model the loop switches
            # to eval mode, so its flag says nothing about its modules'.)
            modes = [(m, m.training) for m in self.submod.modules()]
            self.submod.eval()
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for m, training in modes:
                    m.training = training

    return TimedStage



def all_reduce_grads(model: nn.Module, group, replicas: int) -> None:
    """Average this rank's stage gradients over the stage's ``replicas`` (the mesh's dp ``group``), in one flat
    all-reduce after the schedule. (DistributedDataParallel around a stage module is what pipelining's
    stages expect, but its reducer fails on the stages' shape-inference pass in torch 2.13: "rebuilt
    parameter indices size is not same as original model parameters size".)"""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    # a tp-split stage: each tp rank reduces its own shards (the replicated ones: the same on every tp rank)
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= replicas
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(reduced)


def bubble_stats(step_records: list[dict[str, float]], skip: int) -> dict[str, Any]:
    """A rank's measured idle fraction per step, from its ``step_records`` (wall and compute seconds per schedule
    step): 1 - compute / wall, the first ``skip`` steps and the shape-inference steps (``warmup``) excluded."""
    rows = [r for i, r in enumerate(step_records) if i >= skip and not r["warmup"]]
    fractions = [max(0.0, 1.0 - r["compute_s"] / r["wall_s"]) for r in rows if r["wall_s"] > 0]
    if not fractions:
        return {"steps": 0}
    return {
        "steps": len(fractions),
        "median": statistics.median(fractions),
        "min": min(fractions),
        "max": max(fractions),
        "compute_median_s": statistics.median(r["compute_s"] for r in rows),
        "step_median_s": statistics.median(r["wall_s"] for r in rows),
    }


def merged_model_state(parts: list[dict], full_names: list[str]) -> dict[str, Any]:
    """The full state dict from every stage's part, in the original model's order (``full_names``)."""
    merged = {k: v for p in parts for k, v in p.items()}
    missing = [k for k in full_names if k not in merged]
    if missing:
        raise RuntimeError(f"pipeline state dict: no stage holds {missing[:3]}")
    return {k: merged[k] for k in full_names}


def merged_optimizer_state(parts: list[dict], full_names: list[str]) -> dict[str, Any]:
    """The full optimizer state from every stage's part (keyed by original parameter names), its entries and
    each parameter group's names in the original model's order (``full_names``)."""
    order = {k: i for i, k in enumerate(full_names)}
    state = {k: v for p in parts for k, v in p["state"].items()}
    groups = []
    for gi, group in enumerate(parts[0]["param_groups"]):
        names = [n for p in parts for n in p["param_groups"][gi]["params"]]
        groups.append(group | {"params": sorted(names, key=lambda n: order.get(n, len(order)))})
    return {
        "state": dict(sorted(state.items(), key=lambda kv: order.get(kv[0], len(order)))),
        "param_groups": groups,
    }


@contextlib.contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """A pipeline schedule's ``eval`` as a forward pass where the schedule is an action list (torch's runtime: zbv,
    dualpipev), whose ``eval`` still runs its backward actions (torch 2.13): the list keeps its forwards and
    their sends and receives, in order (an overlapped forward-and-backward keeps its forward), for the eval."""
    from torch.distributed.pipelining import schedules as sch

    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        yield
        return
    keep = {sch.FORWARD, sch.SEND_F, sch.RECV_F, sch.UNSHARD, sch.RESHARD}

    def forwards(action):
        if action is not None and action.computation_type == sch.OVERLAP_F_B:
            return [a for a in action.sub_actions or () if a.computation_type == sch.FORWARD]
        return [action] if action is None or action.computation_type in keep else []

    schedule.pipeline_order_with_comms = {r: [f for a in acts for f in forwards(a)] for r, acts in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order
