"""What a pipeline's stages cost, per pipeline rank, for a cost model to compose: the parameters a rank holds of
its stages (``stage_params``: under a tp dimension the split matrices 1/T), the receive buffers and the
activations of the micro-batches in flight (``receive_buffer_bytes``, ``stage_activations``), the
stage-to-stage sends of the busiest sender (``send_rows``) and the all-reduces of one pipeline rank
(``stage_reductions``: tp's, the replicas', the clipping norm's, the loss scaler's).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import trace_pieces
from stratbench.models.split import Split
from stratbench.strategies.parallel import pipeline_tp
from stratbench.strategies.parallel.pipeline_parallel import Layout, run_spec, sample_of
from stratbench.strategies.parallel.tp_costs import LocalSlice
from stratbench.strategies.parallel.tp_plan import plan_options


def boundary_share(ctx, lay: Layout) -> int:
    """What a stage boundary's activation is divided by on one rank: under --sequence-parallel T (each tp
    rank sends and receives its own sequence shard), else 1 (every tp rank its whole copy)."""
    return lay.tp if plan_options(ctx.options).sequence_parallel else 1


def boundary_itemsize(ctx) -> int:
    """Bytes per element of the activations crossing a stage boundary: under autocast a convolutional stage
    hands on the compute dtype, a transformer block its residual stream, which stays in the weights' dtype
    (h + the bf16 output of wo/w2 promotes; measured: gpt-tiny bf16-mixed sends fp32); else the weights'."""
    if ctx.pspec.autocast and not pipeline_tp.is_transformer(run_spec(ctx.cfg)):
        return ctx.pspec.compute_dtype.itemsize
    return ctx.param_bytes


def stage_params(ctx, lay: Layout, stages: list) -> int:
    """Parameters one rank holds of its ``stages``: all of them, or under --tp the split matrices 1/T
    (``pipeline_tp.stage_numel``)."""
    if lay.tp == 1:
        return sum(s.params for s in stages)
    modules = [m for s in stages for m in s.modules]
    return pipeline_tp.stage_numel(
        run_spec(ctx.cfg), modules, lay.tp, plan_options(ctx.options).vocab_parallel
    )[0]


def receive_buffer_bytes(ctx, lay: Layout, split: Split, ids: list[int], micro: int) -> int:
    """torch.distributed.pipelining keeps one receive buffer per micro-batch for every boundary a stage
    receives across, allocated at the first step and reused: the input activations of a stage after the
    first, the output gradients of a stage before the last (measured: 4 x 0.5 MiB on each rank of the 2-stage
    fp64 test problem)."""
    act_bytes = boundary_itemsize(ctx)
    boundary = sum(split.stages[i - 1].out_numel for i in ids if i > 0) + sum(
        split.stages[i].out_numel for i in ids if i < lay.stages - 1
    ) // boundary_share(ctx, lay)
    return lay.microbatches * boundary * micro * act_bytes


def stage_activations(ctx, lay: Layout, mine: list, pp_rank: int, micro: int) -> tuple[int, str]:
    """The bytes autograd saves for the pieces of the rank's stages at one micro-batch (``trace_pieces``: in
    the run's precision, attention through the fused kernel a real run picks; under --tp on a rank's slice,
    ``LocalSlice``, its norms on 1/T of the positions under --sequence-parallel; the logits whole, as the
    last stage gathers them for its loss even under --vocab-parallel) x the most micro-batches a stage holds
    at once: all M for gpipe (every forward runs before the first backward), min(M, P - r) for 1f1b on
    pipeline rank r (its warm-up forwards), the interleaved warm-up spread over the rank's stages for
    interleaved-1f1b, 1 for naive; plus the step's whole input batch, which every stage loads (the first
    splits it into micro-batches). Returns the bytes and their note."""
    sequence_parallel = plan_options(ctx.options).sequence_parallel
    transform = LocalSlice(lay.tp, False, sequence_parallel) if lay.tp > 1 else None
    traced = {p.name: p for p in trace_pieces(run_spec(ctx.cfg), micro, ctx.cfg.precision, transform)}
    per_mb = sum(traced[s.pieces[0]].input_bytes + sum(traced[p].saved_bytes for p in s.pieces) for s in mine)
    flight = lay.in_flight(pp_rank)
    shape, tokens = sample_of(ctx.cfg)
    values = ctx.cfg.batch_size // lay.dp * math.prod(shape)
    if tokens:  # the loader's int64 token ids and as many int64 next-token targets
        batch_input = 2 * values * 8
    else:  # the loader's fp32 images, and their copy in the weights' dtype where the precision converts them
        converted = ctx.pspec.param_dtype != torch.float32
        batch_input = values * 4 + (values * ctx.param_bytes if converted else 0)
    note = (
        f"{flight} micro-batch(es) of {micro} in flight ({lay.schedule}, pipeline rank {pp_rank}) "
        "+ the step's input batch"
    )
    return int(per_mb * flight) + batch_input, note


def busiest_sender(lay: Layout, split: Any, sample_bytes: int) -> tuple[int, int, list[int]]:
    """(bytes sent forward, bytes sent backward per micro-batch, its stages) of the pipeline rank that sends
    the most (the last such rank on ties); ``sample_bytes``: the micro-batch x the activations' itemsize."""
    best = None
    for r in range(lay.pp):
        ids = lay.stages_of(r)
        # boundaries this rank sends across: after each of its stages but the last, before each but the first,
        # where the neighbouring stage runs on another rank (a V's turn, stages P-1 and P, stays on one)
        out_b = sum(split.stages[i].out_numel for i in _sends(lay, ids, +1)) * sample_bytes
        in_b = sum(split.stages[i - 1].out_numel for i in _sends(lay, ids, -1)) * sample_bytes
        key = (out_b + in_b, r)
        if best is None or key > best[0]:
            best = (key, out_b, in_b, ids)
    _, out_b, in_b, ids = best
    return out_b, in_b, ids


def _sends(lay: Layout, ids: list[int], step: int) -> list[int]:
    """The rank's stages whose neighbour ``step`` away exists and runs on another rank."""
    return [i for i in ids if 0 <= i + step < lay.stages and lay.rank_of(i + step) != lay.rank_of(i)]


def send_rows(ctx, lay: Layout, split: Split, micro: int) -> list[Collective]:
    """Per step, on the pipeline rank that sends the most: each micro-batch's activation it sends to the next
    stage and the input gradient it sends back to the previous one (it receives the mirror image, not counted
    as its wire bytes; under --tp every tp rank sends its own whole copy to its peer of the next stage, or under
    --sequence-parallel its sequence shard), and the loss broadcast to the stages."""
    pd = boundary_itemsize(ctx)
    out_b, in_b, ids = busiest_sender(lay, split, micro * pd)
    share = boundary_share(ctx, lay)
    out_b, in_b = out_b // share, in_b // share
    m = lay.microbatches
    rows: list[Collective] = []
    if out_b:
        sends = m * len(_sends(lay, ids, +1))
        note = f"sent: activations of {m} micro-batches to the next stage"
        rows.append(Collective("send_recv", out_b * m, sends, "forward", 2, note, dim="pp"))
    if in_b:
        sends = m * len(_sends(lay, ids, -1))
        note = f"sent: input gradients of {m} micro-batches to the previous stage"
        rows.append(Collective("send_recv", in_b * m, sends, "backward", 2, note, dim="pp"))
    if lay.pp > 1:
        rows.append(
            Collective("broadcast", 8, 1, "other", lay.pp, "the step's loss from the last stage", dim="pp")
        )
    return rows


def stage_reductions(ctx, lay: Layout, split: Split, pp_rank: int, micro: int) -> list[Collective]:
    """The all-reduces of one pipeline rank per step: under --tp Megatron's two per block each way and
    micro-batch (``pipeline_tp.stage_comm``), the replicas' all-reduce of its stages' local gradients, with
    --clip-grad-norm the norm's fp64 square sums (over tp, then over the stages), and under fp16-mixed the
    loss scaler's found-inf over every process."""
    mine = [split.stages[i] for i in lay.stages_of(pp_rank)]
    modules = [m for s in mine for m in s.modules]
    rows = [
        dataclasses.replace(r, dim="tp", critical=True)
        for r in pipeline_tp.stage_comm(ctx, run_spec(ctx.cfg), modules, micro, lay.microbatches, lay.tp)
    ]
    if ctx.pspec.loss_scaling:
        note = "the loss scaler's found-inf flag (fp32)"
        rows.append(Collective("all_reduce", 4, 1, "optimizer", ctx.world, note))
    if lay.dp > 1:
        local = stage_params(ctx, lay, mine)
        note = "stage gradients over the replicas"
        rows.append(Collective("all_reduce", local * ctx.param_bytes, 1, "backward", lay.dp, note, dim="dp"))
    if ctx.cfg.clip_grad_norm:
        for size, note, dim in ((lay.tp, "over tp", "tp"), (lay.pp, "over the stages", "pp")):
            if size > 1:
                rows.append(
                    Collective("all_reduce", 8, 1, "optimizer", size, f"gradient norm {note}", dim=dim)
                )
    return rows
