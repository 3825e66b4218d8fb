"""What expert parallelism costs (``fsdp --ep E``): the model states one rank holds, and the load imbalance the
projection prices its exchanges and its busiest rank's experts with.

Memory (``ep_memory``): the dense parts (attention, norms, router, embedding, head) are FSDP2's shards over every
rank, as plain fsdp prices them (``fsdp2_memory`` of the model with the experts left out, ``ep_dense``: the units
it gathers hold no expert); each rank holds experts / E of every MoE layer's routed experts *whole*: their weights,
their gradients (not reduce-scattered: each is the rank's own) and their optimizer state, never gathered. With
dp x ep (E below the world) the same experts / E are held by each of the world / E ep groups, so a rank's expert
bytes depend on E alone. The exchange's token buffers are the rank's T x k routed rows (T its micro-batch's tokens)
sent and the same number returned, in the compute dtype, alive together in forward and again in backward: at
balanced routing each rank receives as many rows as it sends (the router's real split is measured by the run:
``moe.load_imbalance``). The activations are the traced model's (every expert on its share of T x k rows, a
capacity applied as the layer applies it): a rank's experts / E run on the T x k rows it receives, the same rows.

Load imbalance (``DEFAULT_IMBALANCE``, ``rank_imbalance``): the busiest rank of an ep group receives more than the
mean T x k rows, and every all-to-all waits for it: the projection multiplies the exchanges' bytes by the busiest
rank's share, measured by its calibration run where that routed over as many experts, else the stated default. The
busiest rank's extra expert FLOPs are not priced (the compute stays the active FLOPs of a balanced layer).
"""

from __future__ import annotations

import dataclasses

from stratbench.measuring.comm import Collective
from stratbench.models.transformer import SIZES
from stratbench.strategies.costs import RankMemory
from stratbench.strategies.parallel.expert_parallel import (
    ep_clip_rows,
    ep_dense,
    ep_rows,
    expert_grads_row,
    micro_tokens,
    top_k_of,
)
from stratbench.strategies.parallel.fsdp import fsdp2_comm, fsdp2_memory

DEFAULT_IMBALANCE = 1.1
"""The busiest ep rank's rows over the mean where no run measured it: a stated assumption (a router trained with a
load-balancing loss or DeepSeek-V3's bias keeps its ranks near balance; Megatron-Bridge's MoE benchmarks force
balance, 1.0), not a measurement; the exchanges' note says when it is used. An untrained router is far from it:
gpt-moe-tiny's 3 steps on this CPU measured 1.85 max/mean per expert."""


def ep_memory(ctx, rank: int, ep: int, sharding: str) -> RankMemory:
    """One rank's model states under ``--ep ep``: the model without its experts (``ep_dense``) as FSDP2 shards
    it with ``sharding``, plus experts / ``ep`` of each expert weight whole with its gradient and optimizer
    state; the exchange's send and return buffers of T x k rows of dim in the compute dtype with the units'."""
    m = fsdp2_memory(ep_dense(ctx), rank, sharding, False)
    # the stacked (E, ...) experts are the only 3-D parameters (``expert_shapes``; ctx.shapes adds LoRA's adapters)
    shapes = [s for s, t in zip(ctx.shapes, ctx.trainable, strict=True) if len(s) == 3 and t]
    local = [(s[0] // ep, *s[1:]) for s in shapes]
    numel = sum(a * b * c for a, b, c in local)
    m.params += numel * ctx.param_bytes
    m.grads += numel * ctx.param_bytes
    m.optim += ctx.optim_bytes(local)
    tc = SIZES[ctx.cfg.model]
    routed = micro_tokens(ctx.cfg, ctx.world) * top_k_of(ctx.cfg)
    m.gathered += 2 * routed * tc.dim * ctx.pspec.compute_dtype.itemsize
    m.gather_note += f"; the all-to-all's {routed:,} routed rows sent and returned"
    experts = tc.n_experts
    m.sharding_note = (
        f"dense parts {m.sharding_note} (N = {ctx.world}); {experts // ep} of {experts} experts per MoE layer "
        f"whole on each rank (ep = {ep}), with their gradients and optimizer state"
    )
    return m


def rank_imbalance(tokens_per_expert: list[list[int]], ep: int) -> float:
    """The busiest ep rank's received rows over the mean, from a run's ``moe.tokens_per_expert`` (layers x
    experts, summed over its micro-batches): each rank holds ``experts / ep`` consecutive experts; the largest over
    the layers (every layer's exchange waits for its busiest rank)."""
    worst = 1.0
    for layer in tokens_per_expert:
        per = len(layer) // ep
        loads = [sum(layer[r * per : (r + 1) * per]) for r in range(ep)]
        mean = sum(loads) / ep
        worst = max(worst, max(loads) / mean if mean else 1.0)
    return worst


def imbalance(ctx, ep: int) -> tuple[float, str]:
    """(the busiest ep rank's rows over the mean, where it comes from): ``rank_imbalance`` of the calibration run's
    tokens per expert where it routed over as many experts as this model has, else ``DEFAULT_IMBALANCE``."""
    experts = SIZES[ctx.cfg.model].n_experts
    counts = ctx.routed_counts
    if counts and all(len(layer) == experts for layer in counts):
        return rank_imbalance(counts, ep), f"measured ({ctx.routed_source or 'the calibration run'})"
    why = "no calibration run routed" if not counts else "the calibration run routed over another number of"
    return DEFAULT_IMBALANCE, f"default ({why} {experts} experts)"


def exchange_rows(ctx, ep: int) -> list[Collective]:
    """``ep_rows`` (the exchanges at balanced routing), on the critical path (the experts wait for their rows, the
    next op for the returned ones: ``ExpertExchange`` overlaps nothing); where ``ctx.busiest_rank`` (the projection)
    their bytes scaled to the busiest rank's share of the routed rows (``imbalance``): every all-to-all waits for
    the rank that receives the most."""
    rows = [dataclasses.replace(r, critical=True) for r in ep_rows(ctx, ep)]
    if not ctx.busiest_rank:
        return rows
    factor, how = imbalance(ctx, ep)
    return [
        dataclasses.replace(r, payload_bytes=round(r.payload_bytes * factor), note=f"{r.note}; x {factor:.2f} "
                            f"the mean rows at the busiest rank, {how}")
        for r in rows
    ]  # fmt: skip


def ep_comm(ctx) -> list[Collective]:
    """fsdp --ep per optimizer step: FSDP2 over the dense parts (``ep_dense``: every rank), the experts' all-to-alls
    (``exchange_rows``), with --clip-grad-norm the norms (``ep_clip_rows``) and, with dp = world / E > 1, the expert
    gradients summed over dp (``expert_grads_row``); the groups over ep named so on the (dp, ep) mesh
    (``ep_mesh_dims``) where dp > 1."""
    ep, dp = ctx.options.ep, ctx.world // ctx.options.ep
    rows = fsdp2_comm(ep_dense(ctx), ctx.options.sharding) + exchange_rows(ctx, ep)
    rows += ep_clip_rows(ctx, ep) if ctx.cfg.clip_grad_norm else []
    if dp == 1:
        return rows
    rows = [dataclasses.replace(r, dim="ep") if r.group_size == ep else r for r in rows]
    return rows + [expert_grads_row(ctx, ep, dp)]
