"""``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on a device mesh; parameters are DTensors sharded
over the ranks.

Sharding (``--sharding``):
- ``full``: parameters, gradients and optimizer state sharded; each unit's parameters are all-gathered for its
  forward and freed again after it (``reshard_after_forward=True``), then re-gathered for backward: ZeRO-3.
- ``grad-op``: the same shards, but parameters stay gathered from forward to backward
  (``reshard_after_forward=False``): one all-gather per step instead of two, more memory: ZeRO-2-like.
- ``none``: no sharding, DDP-like. FSDP2 has no NO_SHARD flag; its documented way is hybrid sharding (HSDP) on
  a 2-D mesh ``(replicate=world, shard=1)``: every rank holds whole parameters (DTensors replicated over the
  first mesh dimension) and gradients are all-reduced over it.

Wrapping (``--wrap``): each unit is one ``fully_shard`` call, i.e. one all-gather/reduce-scatter group; by
default one per block (``stratbench.models.blocks``: the classes the model declares, else its repeated sibling
modules), then the root for what is left; the estimate and the projection price the same units.

2D parallelism (``--tp T``): a (dp = world/T, tp = T) device mesh; the model's tensor-parallel plan (the tp
method's ``apply_tp``) splits it over ``tp`` first, then ``fully_shard`` shards each rank's slices over ``dp``
(torchtitan's order); the ranks of one tp group read the same data (docs/parallelism.md). The tp method's flags
apply inside each tp group (the same plan, ``apply_tp``): ``--sequence-parallel`` (the norms and the residual
stream on 1/T of the sequence, all-gather + reduce-scatter in place of each all-reduce; FSDP2 sums the norms'
partial gradients itself) and ``--vocab-parallel`` (embedding and head split over the vocabulary, the loss under
``loss_parallel``: ``parallel.tensor_parallel.LossParallel``).

HSDP (``--replicate R``): a (replicate = R, shard = world / R) mesh, torchtitan's dp_replicate x dp_shard; FSDP2 on
the 2-D mesh shards over each group of world / R consecutive ranks (one node's by default: a group that would
span nodes of a known size is refused unless --shard-across-nodes) and all-reduces each rank's gradient shard
over the R replicas; with --tp T the mesh is (R, world / (R T), T). ``--sharding none`` stays the degenerate
(world, 1) case (docs/parallelism.md, HSDP).

Precision is turned into FSDP's ``MixedPrecisionPolicy`` (weights fp32 and sharded, gathered in the compute
dtype, gradients reduced in fp32), so no autocast runs; the pure half precisions convert the module before
sharding. A model with BatchNorm under a mixed precision is the exception (``weights_cast_by_autocast``): its
weights are gathered in fp32 and the precision's autocast casts them per op, as `single` runs, because neither
CPU nor CUDA BatchNorm takes 16-bit weights beside its fp32 running statistics and a policy casts a whole unit;
its units stay the blocks and the root (no unit per BatchNorm).

Context parallelism (``--cp C``, Ulysses): a (dp = world / C, cp = C) mesh; the C consecutive ranks of a cp group
read the same samples, each takes 1/C of their positions, and each attention exchanges queries, keys, values and
its output by all-to-all over the group (``parallel/context_parallel.py``). FSDP2 shards over every rank and
averages the gradients over all of them, which makes the step's loss the token mean over every rank's chunk. With
--replicate R the mesh is (replicate, shard, cp): FSDP2's HSDP mesh (R, world / R) shards over shard x cp. With --tp T
the mesh is (dp, cp, tp), torchtitan's order: the tp plan gives each rank H / T heads, Ulysses exchanges 1/C of those
over the cp group (ranks T apart), and FSDP2 shards each rank's slices over dp x cp flattened (torchtitan's
dp_shard_cp).

Expert parallelism (``--ep E``, a mixture of experts): a (dp = world / E, ep = E) mesh; each ep group of E consecutive
ranks splits every MoE layer's experts and exchanges tokens by all-to-all, the dp groups hold replicas of the
experts (gradients summed over dp before the step); the dense parts FSDP2-sharded over every rank
(``parallel/expert_parallel.py``).

FSDP2's memory and traffic, the policy precision and the checkpoint I/O are building blocks
(``parallel/fsdp.py``) that fsdp1 and accelerate-fsdp share; this file composes them with tp's plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.core.optim import states_per_local_shard
from stratbench.core.precision import SPECS
from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelSpec, wrap_units_of
from stratbench.models.blocks import describe_units, wrap_units
from stratbench.strategies.base import CostModel, Strategy, register
from stratbench.strategies.costs import MemoryContext, lean_refusal
from stratbench.strategies.parallel.context_parallel import (
    CPChunk,
    check_cp_impl,
    chunk_eval_sums,
    cp_memory,
    cp_mesh,
    cp_unfit,
    cp_world_unfit,
    local_chunk,
    ulysses_rows,
)
from stratbench.strategies.parallel.ep_costs import ep_comm, ep_memory
from stratbench.strategies.parallel.expert_parallel import (
    EPCheckpointIO,
    EPSetup,
    clip_grad_norm_ep,
    ep_mesh_dims,
    ep_refusal,
    ep_report,
    moe_layout_unfit,
    setup_ep,
)
from stratbench.strategies.parallel.fsdp import (
    CHECKPOINT_FORMATS,
    choice,
    fsdp2_comm,
    fsdp2_memory,
    hsdp_comm,
    policy_precision,
    weights_cast_by_autocast,
)
from stratbench.strategies.parallel.tensor_parallel import LossParallel, apply_tp, splits_loss
from stratbench.strategies.parallel.tp_costs import (
    LocalSlice,
    clip_norms_row,
    local_flop_share,
    megatron_rows,
    norm_grads_row,
    transformer_comm,
)
from stratbench.strategies.parallel.tp_plan import (
    degree_unfit,
    plan_options,
    require_tp_group,
    tp_shapes,
    unsupported,
)

SHARDING = ("full", "grad-op", "none")


@dataclasses.dataclass(kw_only=True)
class FSDPOptions:
    """Options of the fsdp (FSDP2) strategy."""

    sharding: str = "full"
    """fsdp: full (ZeRO-3: params, grads, optimizer state sharded; params re-gathered for backward), grad-op (ZeRO-2-like: params kept gathered between forward and backward), none (DDP-like: replicated on a (world, 1) HSDP mesh)."""
    wrap: str = "auto"
    """fsdp: FSDP units: auto (block where the model has blocks, else size: said in the log), block (one per residual block), size (any module holding >= --wrap-min-params parameters not yet wrapped), none (the root only), or comma-separated module class names (e.g. Conv2d,Linear)."""
    wrap_min_params: int = 100_000
    """fsdp --wrap size: parameter count from which a module becomes its own FSDP unit."""
    cpu_offload: bool = False
    """fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2's CPUOffloadPolicy; runs on CPU too)."""
    checkpoint_format: str = "sharded"
    """sharded (a torch.distributed.checkpoint folder, each rank writes its shards) or full (one file written by rank 0)."""
    tp: int = 1
    """fsdp: tensor-parallel degree T (2D parallelism): the ranks form a (dp = world/T, tp = T) mesh; the model's tensor-parallel plan (as the tp method's) splits each block's matrices over tp, then FSDP2 shards them over dp. 1: FSDP alone."""
    sequence_parallel: bool = False
    """fsdp --tp: Megatron sequence parallelism in each tp group, as the tp method's: the norms and the residual stream sharded along the sequence, each block's all-reduces become all-gather + reduce-scatter; --seq-len must divide by --tp."""
    vocab_parallel: bool = False
    """fsdp --tp: the built-in transformer's embedding and head split over the vocabulary in each tp group, the cross-entropy on the split logits (loss_parallel), as the tp method's; false (fsdp's default): both whole in each tp group, sharded over dp."""
    replicate: int = 1
    """fsdp: HSDP, R replicas: a (replicate = R, shard = world / R) mesh (torchtitan's dp_replicate x dp_shard); each shard group of world/R consecutive ranks (one node's by default) gathers and reduce-scatters as FSDP, the gradient shards are all-reduced over the R replicas; with --tp T: (R, world / (R T), T). 1: plain FSDP."""
    cp: int = 1
    """fsdp: context parallelism, C ranks per sequence (Ulysses): a (dp = world / C, cp = C) mesh; the ranks of a cp group read the same samples, each computes 1/C of their positions and each attention exchanges queries, keys, values and its output by all-to-all (the built-in transformers and Hugging Face decoders whose attention goes through transformers' attention interface; heads, key/value heads and --seq-len must divide by C; with --replicate R, C must divide world / R). With --tp T: a (dp, cp, tp) mesh, heads and key/value heads must divide by T x C (not with --replicate). 1: none."""
    ep: int = 1
    """fsdp: expert parallelism, E ranks per expert set: a (dp = world / E, ep = E) mesh; each MoE layer's routed experts split over the E consecutive ranks of an ep group (experts / E each, not FSDP-sharded), tokens sent to their experts' ranks and back by all-to-all; the experts replicated over dp (their gradients summed over it), the dense parts FSDP2-sharded over every rank; E must divide the world and the experts. 1: none."""
    cp_impl: str = "ulysses"
    """fsdp --cp: ulysses (all-to-all from sequence-sharded to head-sharded and back; torch collectives, any device)."""
    shard_across_nodes: bool = False
    """fsdp --replicate: allow a shard group that spans nodes (refused by default where the node size is known, --nnodes or torchrun's LOCAL_WORLD_SIZE: HSDP keeps its gathers on the node's links)."""

    def __post_init__(self) -> None:
        choice("sharding", self.sharding, SHARDING)
        choice("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        if not self.wrap.strip():
            raise ConfigError("wrap must be auto, block, size, none or comma-separated module class names; got ''")
        if self.wrap_min_params <= 0:
            raise ConfigError(f"wrap_min_params must be a positive integer, got {self.wrap_min_params!r}")
        if self.tp < 1:
            raise ConfigError(f"tp must be a positive integer (1: no tensor parallelism), got {self.tp!r}")
        if self.replicate < 1:
            raise ConfigError(f"replicate must be a positive integer (1: plain FSDP, no HSDP), got {self.replicate!r}")
        if self.replicate > 1 and self.sharding == "none":
            raise ConfigError(
                f"fsdp --replicate {self.replicate} with --sharding none: none already replicates the whole model "
                "on every rank (a (world, 1) mesh); for HSDP give --sharding full or grad-op with --replicate"
            )
        if self.cp < 1:
            raise ConfigError(f"cp must be a positive integer (1: no context parallelism), got {self.cp!r}")
        check_cp_impl(self.cp_impl)
        if self.ep < 1:
            raise ConfigError(f"ep must be a positive integer (1: no expert parallelism), got {self.ep!r}")
        if self.cp > 1 and self.tp > 1 and self.sharding == "none":
            raise ConfigError(
                f"fsdp --tp {self.tp} --cp {self.cp} with --sharding none is not supported: the mesh dp x cp x tp "
                "shards over dp x cp (use --sharding full or grad-op)"
            )
        if self.shard_across_nodes and self.replicate == 1:
            raise ConfigError("fsdp --shard-across-nodes applies to HSDP's shard groups: give --replicate 2 or more")
        require_tp_group(self, "fsdp", "within a tensor-parallel group")


def lean_unsupported(cfg, options: FSDPOptions) -> str | None:
    """One line where the optimizer cannot step FSDP2's shards: torchao's build their states from a row shard
    alone (priced per shard: ``fsdp2_memory``), Adafactor's factors cannot, and --tp's slices are not priced."""
    if options.tp > 1:
        return lean_refusal(cfg, "fsdp --tp slices the weight matrices (DTensors)")
    if not states_per_local_shard(cfg.optimizer):
        return lean_refusal(cfg, "its row and column factors cannot be built from FSDP2's row shards (DTensors)")
    return None


def tp_unsupported(cfg, options: FSDPOptions, world: int) -> str | None:
    """One line saying why ``--tp`` cannot run with this world, model and these options, or None."""
    t = options.tp
    if t == 1:
        return None
    if cfg.activation_checkpointing and cfg.ac_mode != "full":
        return (f"fsdp --tp {t} with --ac-mode {cfg.ac_mode} is not supported: the tensor-parallel collectives a "
                "block recomputes are priced for full checkpointing only (use --ac-mode full)")  # fmt: skip
    unfit = degree_unfit("fsdp --tp", t, world)
    if unfit:
        return unfit
    why = unsupported(cfg, t, "--tp", plan_options(options))
    return f"fsdp --tp {t}: {why}" if why else None


def replicate_unfit(options: FSDPOptions, world: int) -> str | None:
    """One line when ``--replicate R`` does not split the data-parallel ranks (world / --tp) into R shard groups
    of 2 or more ranks (a shard group of one is --sharding none), naming the R that fit; else None."""
    r, t = options.replicate, options.tp
    dp = world // t
    if r == 1 or (dp % r == 0 and r < dp):
        return None
    fits = ", ".join(str(d) for d in range(1, dp) if dp % d == 0)
    over = f"{dp} data-parallel ranks ({world} processes / --tp {t})" if t > 1 else f"{world} processes"
    why = (
        f"do not divide by {r}"
        if dp % r
        else f"in {r} replicas leave shard groups of 1 rank (that is --sharding none)"
    )
    return f"fsdp --replicate {r}: {over} {why}; --replicate that fit: {fits}"


def node_size(cfg, world: int) -> int | None:
    """Processes per node where known: world / --nnodes when stratbench starts several nodes, else torchrun's
    LOCAL_WORLD_SIZE where another launcher started this process; None: one node as far as this run knows."""
    if cfg.nnodes > 1:
        return world // cfg.nnodes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local if local < world else None


def shard_group_spans_nodes(cfg, options: FSDPOptions, world: int) -> str | None:
    """One line when HSDP's shard groups (world / R consecutive ranks, x --tp T) would not sit inside nodes of the
    known size and --shard-across-nodes was not given, naming the --replicate that keep them in a node."""
    r, t = options.replicate, options.tp
    per_node = node_size(cfg, world)
    if r == 1 or options.shard_across_nodes or per_node is None:
        return None
    group = world // r  # shard x tp: consecutive ranks
    if per_node % group == 0:
        return None
    dp = world // t
    fits = [d for d in range(2, dp + 1) if dp % d == 0 and d < dp and per_node % (world // d) == 0]
    hint = {0: "no --replicate keeps", 1: "--replicate {} keeps"}.get(len(fits), "--replicate {} keep")
    return (
        f"fsdp --replicate {r}: a shard group of {group} ranks ({world} processes / {r}"
        + (f", tp {t} included" if t > 1 else "")
        + f") does not fit nodes of {per_node} processes; {hint.format(', '.join(map(str, fits)))} it in a node, "
        "or give --shard-across-nodes to shard over the inter-node link"
    )


def tp_local(ctx) -> MemoryContext:
    """The model as one rank of a tensor-parallel group holds it, over the dp dimension of the mesh: each split
    parameter 1/T (its dim 0 too where split along it: column-parallel), the rest whole; world = world / T.
    FSDP2 then chunks these local tensors along dim 0 over dp, as ``fsdp2_memory``/``fsdp2_comm`` price them."""
    t, info = ctx.options.tp, ctx.info
    split = tp_shapes(ModelSpec.from_config(ctx.cfg), ctx.options.vocab_parallel).split
    local = dataclasses.replace(
        info,
        numels=[n // t if d is not None else n for n, d in zip(info.numels, split, strict=True)],
        dim0=[d0 // t if d == 0 else d0 for d0, d in zip(info.dim0, split, strict=True)],
    )
    return dataclasses.replace(ctx, world=ctx.world // t, info=local)


def fsdp_tp_comm(ctx) -> list[Collective] | None:
    """fsdp x tp per optimizer step: FSDP2's all-gathers and reduce-scatters (``fsdp2_comm``) over the dp group
    of each rank's tensor-parallel slices, Megatron's all-reduces over the tp group (``tp_rows``) and, with
    --clip-grad-norm, the per-parameter norms all-reduced over each mesh dimension the gradients are sharded
    on, in turn (DTensor: one all-reduce per dimension; not over dp for --sharding none, whose gradients are
    replicated there). A model of the user's: None (its plan's traffic is not derived). With --cp C (mesh dp x cp x
    tp): FSDP2's rows over dp x cp (world / T ranks, T apart: dim "dp+cp"), Megatron's at a cp rank's chunk of
    T / C positions of its replica's batch (global / dp, dp = world / (C T)), and Ulysses' all-to-alls of the
    tp-local heads (``ulysses_rows``)."""
    dp, c = tp_local(ctx), ctx.options.cp
    chunk = dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, seq_len=ctx.cfg.seq_len // c))
    megatron = tp_rows(chunk, dp.world // c)
    if megatron is None:
        return None
    rows = data_parallel_rows(dp)
    rows += [
        dataclasses.replace(r, dim="tp", critical=True) for r in megatron
    ]  # FSDP's prefetch cannot hide them
    if c > 1:
        rows += ulysses_rows(ctx, c)
    if ctx.cfg.clip_grad_norm:
        rows += clip_norms_over_shards(ctx, dp)
    return rows


def data_parallel_rows(ctx) -> list[Collective]:
    """FSDP2's rows over the data-parallel ranks of ``ctx`` (a tensor-parallel slice's with --tp): over one "dp"
    dimension, or with --replicate HSDP's over "shard" and "replicate" (``hsdp_comm``), or with --cp over dp and cp
    flattened ("dp+cp")."""
    opts = ctx.options
    if opts.replicate > 1:
        return hsdp_comm(ctx, opts.sharding, opts.replicate)
    return [dataclasses.replace(r, dim=data_dim(opts)) for r in fsdp2_comm(ctx, opts.sharding)]


def data_dim(opts) -> str:
    """The mesh dimension FSDP2 shards over beside --tp: "dp", or with --cp dp and cp flattened, "dp+cp"
    (``measuring.comm.mesh_span``); "" (every rank: no named dimension) without --tp."""
    return ("dp+cp" if opts.cp > 1 else "dp") if opts.tp > 1 else ""


def clip_norms_over_shards(ctx, dp) -> list[Collective]:
    """--clip-grad-norm: DTensor all-reduces the per-parameter gradient norms (one fp number each) over the
    data-parallel dimension the gradients are sharded on: dp, or HSDP's shard groups (the replicas hold equal
    gradients: no reduction over replicate), or plain fsdp's (and --cp's) every rank; none for --sharding none
    (replicated)."""
    opts = ctx.options
    group = dp.world // opts.replicate
    # HSDP's shard dimension, fsdp --tp's dp (dp x cp with --cp), or plain fsdp's (and --cp's) every rank
    dim = "shard" if opts.replicate > 1 else data_dim(opts)
    if group <= 1 or opts.sharding == "none":
        return []
    norms = len(ctx.info.numels) * ctx.param_bytes
    return [Collective("all_reduce", norms, 1, "optimizer", group, f"per-parameter norms over {dim}", dim=dim)]


def shard_group(ctx, rank: int) -> tuple[MemoryContext, int]:
    """``ctx`` over the ranks FSDP2 shards over and ``rank``'s place among them: all of them, or with --replicate R
    HSDP's shard group (world / R consecutive ranks, the rank's shard coordinate)."""
    r = ctx.options.replicate
    if r == 1:
        return ctx, rank
    s = ctx.world // r
    return dataclasses.replace(ctx, world=s), rank % s


def tp_rows(ctx, dp: int) -> list[Collective] | None:
    """Megatron's traffic over the tp group (``transformer_comm`` with the run's plan: all-reduces, or under
    --sequence-parallel all-gathers and reduce-scatters) at the replica's batch (global / dp). FSDP's policy
    runs no autocast: the gathered weights are in the compute dtype, so every activation and gradient is too
    (traffic as the pure compute-dtype precision's; tp alone under autocast sends some in the weights' dtype).
    The sequence-parallel norms' partial gradients are summed by FSDP2 itself, one all-reduce per norm before
    its reduce-scatter (every micro-step under full sharding). Activation checkpointing runs each block's
    forward again in backward (``_recomputed``)."""
    cfg, t, plan = ctx.cfg, ctx.options.tp, plan_options(ctx.options)
    replica = dataclasses.replace(cfg, batch_size=cfg.batch_size // dp)
    pure = next(n for n, s in SPECS.items() if s.param_dtype == ctx.pspec.compute_dtype and not s.autocast)
    as_computed = dataclasses.replace(ctx, world=t, cfg=dataclasses.replace(replica, precision=pure))
    rows = transformer_comm(dataclasses.replace(as_computed, options=plan))
    if rows is None:
        return None
    rows = [r for r in rows if r.phase != "optimizer"]
    tc = tp_shapes(ModelSpec.from_config(cfg)).transformer
    if plan.sequence_parallel:  # the norms' gradients in the gathered weights' dtype (measured: bf16)
        # each norm's gradient once per micro-step under full sharding (FSDP2 reduces every micro-step)
        summed = (2 * tc.n_layers + 1) * (cfg.grad_accum if ctx.options.sharding == "full" else 1)
        row = norm_grads_row(as_computed, summed, tc.dim, t, summed)
        rows.append(dataclasses.replace(row, phase="backward"))
    if cfg.clip_grad_norm:  # the per-parameter norms over tp, in the weights' dtype
        rows.append(clip_norms_row(ctx, tp_shapes(ModelSpec.from_config(cfg), plan.vocab_parallel), t))
    if cfg.activation_checkpointing:
        act = (replica.batch_size // cfg.grad_accum) * cfg.seq_len * tc.dim
        blocks = megatron_rows(as_computed, tc.n_layers, act, cfg.grad_accum, t, "", plan.sequence_parallel)
        rows += _recomputed(blocks)
    return rows


def _recomputed(block_rows: list[Collective]) -> list[Collective]:
    """The blocks' forward collectives that activation checkpointing runs again in backward, up to the last
    tensor backward needs (torch's early stop): the gathers before the attention and the MLP (their inputs are
    saved), the attention's wo output summed again, the MLP's w2 (the block's last op) not."""
    out = []
    for r in block_rows:
        if r.phase == "forward":
            calls = r.calls if r.kind == "all_gather" else r.calls // 2
            bytes_ = r.payload_bytes * calls // r.calls
            out.append(dataclasses.replace(r, payload_bytes=bytes_, calls=calls, phase="backward",
                                           note=f"recomputed: {r.note}"))  # fmt: skip
    return out


class FSDPCost(CostModel):
    """FSDP2 with the run's ``--sharding`` and ``--cpu-offload`` (``fsdp2_memory``, ``fsdp2_comm``); with
    ``--tp`` the same over the dp dimension of each rank's tensor-parallel slices (``tp_local``); with
    ``--replicate R`` (HSDP) the same over each shard group of world / R ranks (``shard_group``, ``hsdp_comm``)."""

    @classmethod
    def memory_model(cls, ctx, rank):
        opts = ctx.options
        ctx, units_note = as_wrapped(ctx)
        if why := replicate_unfit(opts, ctx.world) or cp_unfit(
            ctx.cfg, opts.cp, opts.tp, opts.replicate, ctx.world, opts.sequence_parallel
        ):
            raise ConfigError(why)
        if opts.ep > 1:  # the dense parts FSDP2's shards, experts / E whole per rank (parallel.ep_costs)
            return ep_memory(ctx, rank, opts.ep, opts.sharding)
        if opts.cp > 1 and opts.tp == 1:
            return cp_memory(ctx, *shard_group(ctx, rank), units_note)
        if opts.tp == 1:
            shard, at = shard_group(ctx, rank)
            m = fsdp2_memory(shard, at, opts.sharding, opts.cpu_offload)
            if opts.replicate > 1:
                m.sharding_note += f" over a shard group (N = {shard.world}), replicated {opts.replicate}x"
            m.units_note = units_note
            return m
        why = tp_unsupported(ctx.cfg, opts, ctx.world)
        if why:  # before any trace of a slice that cannot be cut (one line, as train refuses it)
            raise ConfigError(why)
        dp = tp_local(ctx)
        shard, at = shard_group(dp, rank // opts.tp)
        m = fsdp2_memory(shard, at, opts.sharding, opts.cpu_offload)
        over = (
            f"over a shard group (N = {shard.world}), replicated {opts.replicate}x"
            if opts.replicate > 1
            else f"over dp (N = {dp.world})"
        )
        m.sharding_note = f"split weights 1/{opts.tp} over tp, then {m.sharding_note} {over}"
        # each rank computes its replica's batch through its slice of the split matrices
        m.data_ranks = dp.world
        m.trace_transform = LocalSlice(opts.tp, opts.vocab_parallel, opts.sequence_parallel)
        m.units_note = units_note
        if opts.cp > 1:  # and a chunk of T / C positions of it, its H / T heads exchanged (Ulysses)
            c = opts.cp
            m.sharding_note = m.sharding_note.replace("over dp", "over dp x cp") + f"; activations of T / {c} positions"
            m.data_ranks = dp.world // c
            m.trace_transform, m.trace_seq_len = CPChunk(c, m.trace_transform), ctx.cfg.seq_len // c
        return m

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """1, or with --tp a rank's slice of its replica's FLOPs (``parallel.tp_costs.local_flop_share``), times
        with --cp C 1/C (its positions through every layer, all positions of 1/C of the heads in attention)."""
        t, c = ctx.options.tp, ctx.options.cp
        share = 1.0 if t == 1 else local_flop_share(ModelSpec.from_config(ctx.cfg), t, ctx.options.vocab_parallel)
        return share / c

    @classmethod
    def mesh_dims(cls, ctx) -> dict[str, int]:
        """``FSDPStrategy.mesh``'s dimensions: with --replicate R (replicate = R, shard = world / (R T)[, tp = T]),
        with --tp T alone (dp = world / T, tp = T), with --ep E < world (dp = world / E, ep = E); else one
        dimension."""
        t, r, c = ctx.options.tp, ctx.options.replicate, ctx.options.cp
        if ctx.options.ep > 1:
            return ep_mesh_dims(ctx.world, ctx.options.ep)
        if c > 1 and r > 1:
            return {"replicate": r, "shard": ctx.world // (r * c), "cp": c}
        if c > 1:
            return {"dp": ctx.world // (c * t), "cp": c} | ({"tp": t} if t > 1 else {})
        if r > 1:
            return {"replicate": r, "shard": ctx.world // (r * t)} | ({"tp": t} if t > 1 else {})
        return {"dp": ctx.world // t, "tp": t} if t > 1 else {}

    @classmethod
    def comm_model(cls, ctx):
        ctx = as_wrapped(ctx)[0]
        if why := replicate_unfit(ctx.options, ctx.world):
            raise ConfigError(why)
        if ctx.options.tp > 1:
            return fsdp_tp_comm(ctx)
        if ctx.options.ep > 1:
            return ep_comm(ctx)
        clip = clip_norms_over_shards(ctx, ctx) if ctx.cfg.clip_grad_norm else []
        cp = ulysses_rows(ctx, ctx.options.cp) if ctx.options.cp > 1 else []
        if ctx.options.replicate > 1:
            rows = hsdp_comm(ctx, ctx.options.sharding, ctx.options.replicate) + clip
            # with --cp, FSDP2 shards over shard x cp: world / R consecutive ranks, no one dimension of the mesh
            return [dataclasses.replace(r, dim="") if cp and r.dim == "shard" else r for r in rows] + cp
        return fsdp2_comm(ctx, ctx.options.sharding) + cp + clip


def as_wrapped(ctx) -> tuple[MemoryContext, str]:
    """``ctx`` with the units ``--wrap`` builds (``models.blocks.wrap_units``, as ``wrap`` builds them: refused
    in the same line where it refuses), and the line naming them."""
    opts = ctx.options
    units = wrap_units_of(ModelSpec.from_config(ctx.cfg), opts.wrap, opts.wrap_min_params)
    return dataclasses.replace(ctx, info=dataclasses.replace(ctx.info, block_units=units.indices)), units.note


@register
class FSDPStrategy(LossParallel, Strategy):
    name = "fsdp"
    takes_moe = True
    description = (
        "FSDP2 (fully_shard): params/grads/optimizer state sharded as DTensors; --sharding full|grad-op|none; "
        "--replicate R: HSDP"
    )
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA); one process per device"
    launcher = "torchrun"
    needs_process_group = True
    Options = FSDPOptions
    channels_last_weights = False  # flat/sharded parameters must be contiguous
    takes_float8 = True

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, policy_precision(precision), options)

    @classmethod
    def float8_refusal(cls, cfg, device) -> str | None:
        """torchao's float8 Linears shard under FSDP2 as any Linear does; under the tensor-parallel plan they would
        need torchao's float8 parallel styles, which the plan does not use."""
        if cfg.float8 != "none" and cls.parse_options(cfg.strategy_options).tp > 1:
            return "--float8 with fsdp --tp is not supported: the tensor-parallel plan would need torchao's float8 parallel styles"
        return super().float8_refusal(cfg, device)

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank and cls.parse_options(cfg.strategy_options).tp > 1:
            return "--lora-rank with fsdp --tp is not supported: the tensor-parallel plan shards nn.Linear modules, which LoRA replaces by PEFT's adapter layers"
        return None

    @classmethod
    def quantize_refusal(cls, cfg) -> str | None:
        """FSDP2 shards and all-gathers torchao's NF4 weights (their fsdp_pre/post_all_gather hooks); offloading
        them to the host is not tested. bitsandbytes' int8 layers compute from codes and scales held beside the
        parameter (the module's state), which fully_shard's DTensor shards do not replace."""
        if cfg.quantize_base == "int8":
            return "--quantize-base int8 with fsdp is not supported: bitsandbytes' Int8Params do not shard under FSDP2 (use single, or nf4 with fsdp)"
        if cfg.quantize_base != "none" and cls.parse_options(cfg.strategy_options).cpu_offload:
            return "--quantize-base with fsdp --cpu-offload is not supported (untested with torchao's NF4 weights)"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type not in ("cpu", "cuda"):
            return f"fsdp runs on cpu or cuda devices, not {device.type}"
        if why := cls.lora_refusal(cfg) or cls.quantize_refusal(cfg):
            return why
        opts = cls.parse_options(cfg.strategy_options)
        return (
            lean_unsupported(cfg, opts)
            or tp_unsupported(cfg, opts, world_size)
            or replicate_unfit(opts, world_size)
            or shard_group_spans_nodes(cfg, opts, world_size)
            or cp_unfit(cfg, opts.cp, opts.tp, opts.replicate, world_size, opts.sequence_parallel)
            or ep_refusal(cfg, opts, world_size)
            or moe_layout_unfit(cfg, opts)
        )

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        """The replicas the batch is split over: the mesh's data-parallel ranks (world / --tp: with --replicate,
        replicate x shard; refused here, first, when --tp does not divide the world or --replicate the rest)."""
        opts = cls.parse_options(cfg.strategy_options)
        why = (
            degree_unfit("fsdp --tp", opts.tp, world_size)
            or replicate_unfit(opts, world_size)
            or cp_world_unfit(opts.cp, world_size, opts.tp)
        )
        if why:
            raise ConfigError(why)
        return world_size // (opts.tp * opts.cp)

    cost = FSDPCost
    checkpoint_io_class = EPCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        """The rank's dp coordinate (with --replicate, its (replicate, shard) coordinate row-major): the ranks of
        one tensor-parallel or context-parallel group read the same batches."""
        group = self.options.tp * self.options.cp
        return self.env.rank // group, self.env.world_size // group

    def sequence_shards(self) -> int:
        return self.options.cp

    def report(self) -> dict[str, Any]:
        """The FSDP units (each one gather/reduce group: the wrapped modules and the root) and how the weights
        reach the compute dtype; with --tp or --replicate, the mesh (its named dimensions and their sizes); with
        --tp the tp plan's flags."""
        own = {"fsdp": {"units": len(self.units) + 1, "weights": self.precision.report()}}
        opts = self.options
        cp = {"cp": {"impl": opts.cp_impl, "size": opts.cp}} if opts.cp > 1 else {}
        if opts.ep > 1:
            return own | ep_report(self.model, opts.ep, self.env.world_size)
        if opts.tp == 1 and cp:
            return own | {"mesh": self.mesh_shape} | cp
        if opts.tp == 1:
            return own | ({"mesh": self.mesh_shape} if opts.replicate > 1 else {})
        flags = {"sequence_parallel": opts.sequence_parallel, "vocab_parallel": opts.vocab_parallel}
        return own | {"mesh": self.mesh_shape, "tp": flags | {"loss_parallel": self.split_loss}} | cp

    # ---- set-up -------------------------------------------------------------------------------
    def mesh(self):
        """1-D mesh over all ranks for sharding; (world, 1) for replication (HSDP with a shard group of one).
        With --tp T a last dimension ``tp`` of size T (consecutive ranks form one tensor-parallel group) and the
        data-parallel ranks before it: (dp = world/T, tp), or (replicate = world/T, shard = 1, tp) for none. With
        --replicate R (HSDP) (replicate = R, shard = world / (R T)[, tp = T]): each shard group consecutive ranks."""
        from torch.distributed.device_mesh import init_device_mesh

        kind, world, t, r = self.env.device.type, self.env.world_size, self.options.tp, self.options.replicate
        if r > 1:
            dims = (r, world // (r * t), t) if t > 1 else (r, world // r)
            return init_device_mesh(kind, dims, mesh_dim_names=("replicate", "shard", "tp")[: len(dims)])
        if t > 1 and self.options.sharding == "none":
            return init_device_mesh(kind, (world // t, 1, t), mesh_dim_names=("replicate", "shard", "tp"))
        if t > 1:
            return init_device_mesh(kind, (world // t, t), mesh_dim_names=("dp", "tp"))
        if self.options.sharding == "none":
            return init_device_mesh(kind, (world, 1), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(kind, (world,), mesh_dim_names=("shard",))

    def shard_mesh(self, model: nn.Module):
        """The mesh FSDP2 shards over. With --tp the model is split over the mesh's tp dimension first
        (torchtitan's order: TP, then FSDP over the data-parallel dimensions), and the mesh is printed once (with
        --tp or --replicate). A 2-D mesh (replicate, shard) is FSDP2's HSDP."""
        opts = self.options
        if opts.cp > 1:
            return self._context_parallel(model)
        mesh = self.mesh()
        if opts.tp == 1 and opts.replicate == 1:
            return mesh
        self.mesh_shape = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
        if opts.tp > 1:
            apply_tp(
                model, mesh["tp"], sequence_parallel=opts.sequence_parallel, vocab_parallel=opts.vocab_parallel
            )
            self.split_loss = splits_loss(model, self.cfg, plan_options(opts))
        if self.env.is_main:
            dims = " x ".join(f"{k} {v}" for k, v in self.mesh_shape.items())
            why = [
                "the ranks of one tp group read the same data" if opts.tp > 1 else "",
                "FSDP2 shards over shard, gradient shards all-reduced over replicate" if opts.replicate > 1 else "",
            ]
            print(f"fsdp mesh: {dims}, ranks {mesh.mesh.tolist()} ({'; '.join(w for w in why if w)})", flush=True)
        if opts.tp == 1:
            return mesh
        data_dims = mesh.mesh_dim_names[:-1]
        return mesh[data_dims[0]] if len(data_dims) == 1 else mesh[data_dims]

    def _context_parallel(self, model: nn.Module):
        """--cp C: this rank's cp group and place in it (``cp_mesh``); FSDP2 shards over all ranks (``mesh``: 1-D,
        or HSDP's 2-D). With --tp T the model is split over the (dp, cp, tp) mesh's tp dimension first, then FSDP2
        shards each rank's slices over dp x cp flattened into one dimension (torchtitan's dp_shard_cp)."""
        opts = self.options
        shape, self.cp_group, self.cp_rank, mesh = cp_mesh(model, self.env, opts.cp, opts.replicate, opts.tp)
        self.mesh_shape = shape
        if opts.tp == 1:
            return self.mesh()
        apply_tp(model, mesh["tp"], sequence_parallel=opts.sequence_parallel, vocab_parallel=opts.vocab_parallel)
        self.split_loss = splits_loss(model, self.cfg, plan_options(opts))
        return mesh["dp", "cp"]._flatten("dp_cp")

    def move(self, model: nn.Module) -> nn.Module:
        # With CPU offload the full model never goes to the device: fully_shard moves only the shards it keeps.
        return model if self.options.cpu_offload else super().move(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        opts, spec, device = self.options, self.precision.spec, self.env.device
        mesh = self.shard_mesh(model)
        if opts.ep > 1:  # each rank's experts, left out of FSDP2
            self.ep_setup: EPSetup = setup_ep(model, self.env, opts.ep)
        experts = self.ep_setup.params if opts.ep > 1 else []
        self.precision.autocasts = weights_cast_by_autocast(model, device.type, spec)
        if spec.autocast and not self.precision.autocasts:
            # fp32 master weights, gathered in the compute dtype, gradients reduced in fp32
            mp = MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
        else:  # gathered as held (fp32 under autocast: BatchNorm keeps fp32 weights in its block's unit)
            mp = MixedPrecisionPolicy()
        # Pinned host memory needs an accelerator; on CPU the offload is a no-op move with plain memory.
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if opts.cpu_offload else OffloadPolicy()
        reshard = opts.sharding == "full"
        common: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard, "offload_policy": offload}
        if experts:  # the experts stay whole on their rank (not FSDP-sharded)
            common["ignored_params"] = set(experts)
        self.units = wrap_units(model, opts.wrap, opts.wrap_min_params)
        if self.env.is_main:
            print(describe_units(model, opts.wrap, opts.wrap_min_params, self.units), flush=True)
        for unit in self.units:
            fully_shard(unit, mp_policy=mp, **common)
        fully_shard(model, mp_policy=mp, **common)
        return model

    # ---- one step -----------------------------------------------------------------------------
    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # grad-op/none keep whole gradients between micro-steps and reduce once; full sharding reduce-scatters
        # every micro-step so that only gradient shards are ever kept (the memory is the point of ZeRO-3).
        if self.cfg.grad_accum == 1 or self.options.sharding == "full":
            return contextlib.nullcontext()
        return _gradient_sync(self.model, is_last_micro_step)

    def forward_loss(self, model, x, y, loss_fn):
        """With --cp: this rank's chunk of the positions (``local_chunk``), then the loss over it."""
        if self.options.cp > 1:
            x, y = local_chunk(x, y, self.cp_rank, self.options.cp)
        return super().forward_loss(model, x, y, loss_fn)

    def eval_per_sample(self, model, x, y, per_sample_eval):
        """With --cp: each sample's summed loss, correct tokens and scored tokens over this rank's chunk, summed
        over the cp group, then divided: the sample's means, the same on each rank of the group."""
        if self.options.cp == 1:
            return super().eval_per_sample(model, x, y, per_sample_eval)
        import torch.distributed as dist

        x, y = local_chunk(x, y, self.cp_rank, self.options.cp)
        sums = chunk_eval_sums(self.eval_logits(model, x), y).double()
        dist.all_reduce(sums, group=self.cp_group)
        count = sums[:, 2].clamp(min=1)
        return sums[:, 0] / count, sums[:, 1] / count

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip: float | None) -> bool:
        """With --ep over dp > 1 replicas: the expert gradients summed over dp first (``EPSetup.sync_grads``)."""
        if self.options.ep > 1:
            self.ep_setup.sync_grads()
        return super().optimizer_step(optimizer, clip)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The base's ``torch.nn.utils.clip_grad_norm_`` works on DTensor gradients (the norm is reduced over the
        mesh), so every rank scales its shards by the same global factor; under --ep the experts' plain gradients
        join it over the ep group (``clip_grad_norm_ep``)."""
        if self.options.ep > 1:
            return clip_grad_norm_ep(self.model, self.ep_setup, max_norm)
        return super().clip_grad_norm(max_norm)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
