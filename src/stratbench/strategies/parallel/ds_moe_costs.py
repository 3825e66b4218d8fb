"""What DeepSpeed-MoE costs (``deepspeed --ep E``, ``parallel.deepspeed_moe``): the model states one rank holds,
its padded all-to-all buffers and its traffic, for ZeRO 0-2 (DeepSpeed refuses its MoE under ZeRO-3).

Model states (``ds_moe_states``, read by ``zero.deepspeed_memory``): the dense parameters (attention, norms, router,
embedding, head) are one flat group ZeRO partitions over every rank; each rank holds experts / E of every MoE layer
(DeepSpeed's ``Experts``), a flat group of their own that ZeRO-1/2 partitions over the expert data-parallel group
(world / E ranks: the ranks holding the same experts): their fp32 master copy, optimizer state and (ZeRO-2)
reduced gradients are that group's 1/(world / E). Each flat group is padded to a multiple of 2 x its group
(``nccl_start_alignment_factor``).

The exchange (``ds_capacity``): DeepSpeed's ``MOELayer`` sends an (experts, capacity, dim) buffer, padded, to the
ep group and receives as much back; with a capacity factor c the capacity is ceil(c x T x k / experts) (T the
rank's micro-batch tokens, k the top-k), known; dropless it is the busiest expert's assignments on any rank of the
group, known only once routed: priced at its bound, T (a token goes to an expert once), which an untrained router
nearly reaches (gpt-moe-tiny, 2 processes, AdamW, 3 steps: a capacity of 127.25 of 128 on average over the layers; SGD at lr 0.05
after 4 steps: 104.75) and a balanced one would not (T x k / experts: 64 there). The activations are the project's
layer traced (T x k rows through the experts), not DeepSpeed's experts on their E x capacity rows.
"""

from __future__ import annotations

import math

from stratbench.measuring.comm import Collective, ceil_to
from stratbench.models.moe import capacity
from stratbench.models.transformer import SIZES
from stratbench.strategies.parallel.expert_parallel import expert_shapes, micro_tokens, top_k_of

ALIGN = 2
"""DeepSpeed's ``nccl_start_alignment_factor`` (stage_1_and_2.py): a flat group is padded to 2 x its ranks."""


def ds_moe_sizes(ctx, ep: int) -> tuple[int, int]:
    """(the dense trained elements, this rank's expert elements: experts / ``ep`` of each stacked (E, ...) weight)."""
    expert = expert_shapes(ctx) + [False] * len(ctx.adapters)  # LoRA's adapters: dense
    pairs = list(zip(ctx.numels, expert, ctx.trainable, strict=True))
    dense = sum(n for n, e, t in pairs if t and not e)
    return dense, sum(n for n, e, t in pairs if t and e) // ep


def ds_moe_states(ctx, ep: int, stage: int) -> tuple[int, int, int]:
    """(the elements a rank holds, the trained ones, its ZeRO partition of them): the dense group partitioned over
    every rank, its experts over the expert data-parallel group (world / ``ep``), each padded to 2 x its ranks
    (stage 0: nothing partitioned)."""
    dense, local = ds_moe_sizes(ctx, ep)
    frozen = sum(n for n, t in zip(ctx.numels, ctx.trainable, strict=True) if not t)
    held = dense + local
    if stage == 0:
        return held + frozen, held, held
    world, edp = ctx.world, ctx.world // ep
    part = ceil_to(dense, ALIGN * world) // world + ceil_to(local, ALIGN * edp) // edp
    return held + frozen, held, part


def capacity_factor(cfg) -> float | None:
    """The run's --capacity-factor, else the model size's; None: dropless."""
    return cfg.capacity_factor if cfg.capacity_factor is not None else SIZES[cfg.model].capacity_factor


def ds_capacity(ctx) -> tuple[int, str]:
    """(rows per expert in DeepSpeed's buffer, how it is known): ceil(c x T x k / experts) with --capacity-factor
    c (min_capacity 0), else dropless's bound T."""
    cfg, tc = ctx.cfg, SIZES[ctx.cfg.model]
    tokens, k = micro_tokens(cfg, ctx.world), top_k_of(cfg)
    factor = capacity_factor(cfg)
    cap = capacity(tokens, k, tc.n_experts, factor)
    if cap is not None:
        return cap, f"capacity ceil({factor:g} x {tokens} x {k} / {tc.n_experts})"
    balanced = math.ceil(tokens * k / tc.n_experts)
    return (
        tokens,
        f"dropless: capacity priced at its bound, the rank's {tokens} tokens; {balanced} if balanced",
    )


def ds_buffer_bytes(ctx) -> tuple[int, str]:
    """(bytes of one (experts, capacity, dim) buffer in the compute dtype, how its capacity is priced)."""
    tc = SIZES[ctx.cfg.model]
    cap, how = ds_capacity(ctx)
    bit = 2 if ctx.half else ctx.param_bytes
    return tc.n_experts * cap * tc.dim * bit, how


def padded_rows_bytes(ctx) -> int:
    """Activations DeepSpeed's experts save beyond the traced layer's, over the MoE layers: each rank's experts run
    on E x capacity rows (every slot, padding too) where the traced layer runs T x k; a row keeps the experts' input
    and output (dim each: the combine keeps the output) and SwiGLU's 4 hidden tensors (w1's and w3's outputs, the
    SiLU, the product). Measured: dropless vs --capacity-factor 1.0 (no padding) on gpt-moe-tiny --ep 2, 5.97 MB
    more at the peak, where this (at the measured capacity) and the buffers say 6.09 MB."""
    cfg, tc = ctx.cfg, SIZES[ctx.cfg.model]
    cap, _ = ds_capacity(ctx)
    extra = tc.n_experts * cap - micro_tokens(cfg, ctx.world) * top_k_of(cfg)
    per_row = (2 * tc.dim + 4 * tc.moe_hidden) * (2 if ctx.half else ctx.param_bytes)
    return max(0, extra) * per_row * (tc.n_layers - tc.moe_first_dense)


def ds_moe_memory(m, ctx, ep: int):
    """``m`` (``deepspeed_memory`` of the DeepSpeed-MoE states) with the exchange's send and receive buffers
    (one layer's, alive together), the experts' activations on the padded rows (``padded_rows_bytes``) and the
    notes saying how the experts are held."""
    tc = SIZES[ctx.cfg.model]
    buffer, how = ds_buffer_bytes(ctx)
    m.gathered += 2 * buffer
    m.saved_extra = padded_rows_bytes(ctx)
    m.saved_extra_note = "plus DeepSpeed-MoE's experts on their padded (experts x capacity) rows"
    m.gather_note = (m.gather_note + "; " if m.gather_note else "") + (
        f"DeepSpeed-MoE's padded (experts, capacity, dim) buffer sent and received ({how})"
    )
    m.sharding_note += (
        f" (dense parts over {ctx.world} ranks; {tc.n_experts // ep} of {tc.n_experts} experts per MoE layer on "
        f"each rank, ep = {ep}, their states over the expert data-parallel group of {ctx.world // ep})"
    )
    return m


def ds_moe_exchanges(ctx, ep: int) -> list[Collective]:
    """Per optimizer step, per MoE layer and micro-step: dropless, the capacity's all-reduce (an int64 max over the
    ep group, forward); the padded buffer out and back (2 all-to-alls) in forward and the same reversed in backward,
    E x capacity x dim numbers each; with activation checkpointing forward's again in backward (not measured)."""
    cfg, tc = ctx.cfg, SIZES[ctx.cfg.model]
    steps = (tc.n_layers - tc.moe_first_dense) * cfg.grad_accum
    buffer, how = ds_buffer_bytes(ctx)
    dim = "ep" if ctx.world > ep else ""
    note = f"DeepSpeed-MoE's padded buffer to the experts' ranks and back ({how})"
    fwd = [Collective("all_to_all", 2 * steps * buffer, 2 * steps, "forward", ep, note, dim=dim)]
    if capacity_factor(cfg) is None:
        fwd.append(
            Collective(
                "all_reduce", 8 * steps, steps, "forward", ep, "dropless capacity (int64 max)", dim=dim
            )
        )
    rows = [
        *fwd,
        Collective(
            "all_to_all", 2 * steps * buffer, 2 * steps, "backward", ep, f"{note} (gradients)", dim=dim
        ),
    ]
    if cfg.activation_checkpointing:
        rows += [
            Collective(r.kind, r.payload_bytes, r.calls, "backward", ep, f"recomputed: {r.note}", dim=dim)
            for r in fwd
        ]
    return rows  # fmt: skip


def ds_moe_comm(ctx, zero: dict, ep: int) -> list[Collective]:
    """DeepSpeed-MoE's traffic per optimizer step (deepspeed 0.19, ZeRO 0-2): the dense gradients all-reduced over
    every rank, the expert gradients over the expert data-parallel group (world / ``ep``; called on a group of one
    too); ZeRO-1/2: each group's gradient norm over every rank and the experts' averaged over their group (three
    fp32 scalars, ``_average_expert_grad_norms``), a 1-byte overflow flag more under fp16/bf16, and after the step
    each group's updated partitions all-gathered over its ranks (padded to 2 x them; none on a group of one);
    with ep > 1 the exchanges (``ds_moe_exchanges``). One process: nothing (as ``zero.deepspeed_comm``)."""
    n, edp = ctx.world, ctx.world // ep
    if n <= 1:
        return []
    bit = 2 if ctx.half else ctx.param_bytes
    dense, local = ds_moe_sizes(ctx, ep)
    edim = "dp" if ep > 1 and edp > 1 else ""
    rows = [
        Collective("all_reduce", dense * bit, 1, "backward", n, "dense gradient buckets"),
        Collective("all_reduce", local * bit, 1, "backward", edp, "expert gradients over the expert data-parallel group", dim=edim),
    ]  # fmt: skip
    if int(zero.get("stage", 2)) >= 1:
        rows += [
            Collective(
                "all_reduce", 8, 2, "optimizer", n, "gradient norms of the dense and expert groups (fp32)"
            ),
            Collective(
                "all_reduce", 4, 1, "optimizer", edp, "expert norm averaged over its group (fp32)", dim=edim
            ),
        ]
        if ctx.half:
            rows.append(Collective("all_reduce", 1, 1, "optimizer", n, "overflow flag (1 byte)"))
        rows.append(
            Collective(
                "all_gather", ceil_to(dense, ALIGN * n) * bit, 1, "optimizer", n, "updated dense partitions"
            )
        )
        if edp > 1:
            rows.append(
                Collective(
                    "all_gather",
                    ceil_to(local, ALIGN * edp) * bit,
                    1,
                    "optimizer",
                    edp,
                    "updated expert partitions",
                    dim=edim,
                )
            )
    return rows + (ds_moe_exchanges(ctx, ep) if ep > 1 else [])  # fmt: skip
