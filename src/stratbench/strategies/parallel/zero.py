"""DeepSpeed's ZeRO as a building block: the ZeRO options the DeepSpeed methods share and its cost model per rank
(``deepspeed_memory``, ``deepspeed_comm``, ``deepspeed_overlap``, read from a ``zero_optimization`` block), and
AutoTP's view of it (``autotp_view``, ``autotp_comm``). Plain Python: the estimate never imports ``deepspeed``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from stratbench.measuring.comm import Collective, ceil_to
from stratbench.measuring.model_trace import ModelSpec
from stratbench.strategies.costs import DS_PARAM_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, RankMemory
from stratbench.strategies.parallel.ds_moe_costs import ds_moe_states
from stratbench.strategies.parallel.tp_plan import tp_shapes


@dataclasses.dataclass(kw_only=True)
class DeepSpeedZeroOptions:
    """The ZeRO options deepspeed and accelerate-deepspeed share."""

    zero_stage: int | None = None
    """ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also parameters (default: 2, or the stage in --deepspeed-config)."""
    offload_optimizer: str | None = None
    """ZeRO-Offload of optimizer state and step: none, cpu or nvme (default: none, or the device in --deepspeed-config)."""
    offload_params: str | None = None
    """ZeRO-3 only: offload parameters: none, cpu or nvme (default: none, or the device in --deepspeed-config)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON merged into the generated config; its conflicts with stratbench's options are errors."""
    reduce_bucket_size: int | None = None
    """Elements of ZeRO's gradient reduce bucket, which stages 1-3 allocate whole (DeepSpeed's default 5e8: 1.86 GiB in fp32, whatever the model's size): lower it for small models."""
    nvme_path: str | None = None
    """Folder for --offload-optimizer/--offload-params nvme (ZeRO-Infinity, ZeRO-3 only; needs DeepSpeed's async_io op, i.e. libaio)."""


@dataclasses.dataclass(kw_only=True)
class DeepSpeedEngineOptions(DeepSpeedZeroOptions):
    """The ZeRO options and the DeepSpeed engine's own: what ``build_ds_config`` reads (accelerate-deepspeed's
    options become these with the engine's defaults)."""

    ds_optimizer: str = "torch"
    """torch (plain torch optimizer, no compilation), fused (DeepSpeed FusedAdam) or cpu-adam (DeepSpeedCPUAdam); the last two JIT-compile a kernel once and need --optimizer adamw."""
    autotp_size: int = 1
    """DeepSpeed AutoTP training (tensor_parallel.autotp_size): split each block's attention and MLP matrices over T consecutive ranks, which read the same batches (data-parallel size world / T); 1: off."""
    # ZeRO++ (Wang et al. 2023, arXiv 2306.10209): ZeRO-3 only; None: the value in --deepspeed-config, else off.
    zero_hpz: int | None = None
    """ZeRO++ hpZ (zero_hpz_partition_size): a secondary copy of the parameters sharded over S consecutive ranks of one node, so that backward's all-gather stays inside the node (ZeRO-3; S divides the ranks per node; 1: off)."""
    zero_quantized_weights: bool | None = None
    """ZeRO++ qwZ (zero_quantized_weights): all-gather the weights as int8 with fp32 block scales (ZeRO-3; DeepSpeed's CUDA quantizer kernel: GPU only)."""
    zero_quantized_gradients: bool | None = None
    """ZeRO++ qgZ (zero_quantized_gradients): reduce the gradients by a hierarchical int4 all-to-all, inside each node then across nodes, instead of a reduce-scatter (ZeRO-3; CUDA kernels: GPU only)."""
    # ZeRO-3's release of gathered parameters (None: the value in --deepspeed-config, else DeepSpeed's default).
    stage3_param_persistence_threshold: int | None = None
    """ZeRO-3: parameters of at most this many elements stay gathered for the whole run, refreshed after each step (DeepSpeed's default 1e5)."""
    stage3_max_reuse_distance: int | None = None
    """ZeRO-3: a gathered parameter used again within this many elements of other parameters is kept, not released (DeepSpeed's default 1e9: below ~1B parameters nothing is re-gathered for backward); 0 releases every parameter after its forward, as a large model's run does."""
    stage3_prefetch_bucket_size: int | None = None
    """ZeRO-3: elements of parameters fetched ahead of their use (DeepSpeed's default 5e7); a parameter already fetched for a later module is kept."""


DS_TRACE_PRECISION = {"fp16-mixed": "fp16-true", "bf16-mixed": "bf16-true"}
"""The run's precision -> the one DeepSpeed's forward/backward runs in: its fp16/bf16 block casts the module."""


def deepspeed_memory(ctx, zero: dict[str, Any], ep: int = 0):
    """DeepSpeed's per-rank model states for a ``zero_optimization`` block: weights in the compute dtype, a flat
    fp32 master partition the optimizer steps, partitioned gradients from stage 2, partitioned weights in
    stage 3, and the reduce/prefetch buckets sized by its defaults. ``ep`` > 0: a DeepSpeed-MoE model with ep
    ranks per expert set, its experts held and partitioned as ``ds_moe_costs.ds_moe_states`` says."""
    info, world, pd = ctx.info, ctx.world, ctx.param_bytes
    stage = int(zero.get("stage", 2))
    # total: every weight (LoRA's adapters included); trained: the optimizer's (with LoRA the adapters only),
    # which the master partition, the optimizer state and the gradients cover
    total, trained = sum(ctx.numels), sum(ctx.trainable_numels)
    bit = 2 if ctx.half else pd
    master_bytes = 4  # DeepSpeed's master partitions and optimizer state are fp32
    part = -(-trained // world) if stage >= 1 else trained
    if ep:
        total, trained, part = ds_moe_states(ctx, ep, stage)
    m = RankMemory(params=(-(-total // world) if stage == 3 else total) * bit)
    # Stage 3 reuses the partition as the master when it already has the master's dtype on the device
    # (stage3.py, _create_fp32_partitions); stages 1-2 always clone it.
    offload_optimizer = "offload_optimizer" in zero
    same = stage == 3 and not ctx.half and not offload_optimizer
    m.master = part * master_bytes if ((stage >= 1 or ctx.half) and not same) else 0
    m.optim = ctx.flat_optim_bytes(part, master_bytes)
    # After backward, stages 1-3 hold the reduced gradients of their own partition only; stage 0 all of them.
    m.grads = (trained if stage == 0 else part) * bit
    m.step_scalars = 4 if ctx.adam else 0
    bucket = int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET))
    if stage >= 1 and zero.get("contiguous_gradients", True):
        # Stages 1-3 allocate their whole reduce bucket (torch.empty(reduce_bucket_size)), whatever the
        # model's size: 5e8 elements by default, 1.86 GiB in fp32 -- measured on CPU, 2.1 GiB allocated per
        # rank by a 2-rank ResNet-18 run whose model states are 0.1 GiB. Lower reduce_bucket_size for small models.
        m.buckets, m.bucket_note = bucket * bit, "DeepSpeed reduce bucket (allocated whole)"
    elif stage >= 2 and world > 1:
        m.buckets, m.bucket_note = min(bucket, trained) * bit, "DeepSpeed reduce bucket"
    m.sharding_note = f"ZeRO-{stage}"
    # DeepSpeed casts the module to fp16/bf16 and feeds it 16-bit inputs, no autocast: traced as that 16-bit
    # model, not as autocast over fp32 weights, whose per-forward weight casts (2 bytes per parameter, saved
    # for backward) a DeepSpeed run never makes.
    m.trace_precision = DS_TRACE_PRECISION.get(ctx.cfg.precision)
    m.grads_whole_in_backward = stage <= 1  # every gradient waits for the reduction at the end of backward
    if ep and stage <= 1:  # ... the rank's: the dense ones and its own experts'
        m.grads_whole_in_backward, m.grads_in_backward = False, trained * bit
    if stage == 3:
        persistent = sum(x for x in ctx.numels if x < DS_PARAM_PERSISTENCE)
        m.gathered = (persistent + min(DS_PREFETCH_BUCKET, 2 * info.largest_layer)) * bit
        m.gather_note = "small parameters kept whole (persistence threshold) + prefetch bucket"
        s = int(zero.get("zero_hpz_partition_size", 1))
        if s > 1:
            # hpZ: each parameter above the persistence threshold keeps a secondary copy sharded over S ranks
            # (ds_secondary_tensor, its dtype, the world-padded size / S) from its first release in forward or
            # backward until the step drops it (stage3.py invalidate_secondary_tensor).
            persist = int(zero.get("stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE))
            m.gathered += sum(ceil_to(x, world) // s for x in ctx.numels if x > persist) * bit
            m.gather_note += f" + hpZ's secondary partition (1/{s} of the parameters)"
    if "offload_param" in zero:
        m.offload_params_to_host()
    if offload_optimizer:
        m.offload_optimizer_to_host()
    # The step flattens the partition's gradients (a copy in their dtype) and converts the copy to the master
    # dtype: under fp16/bf16 both live at once (stage_1_and_2.py step, stage3.py _prepare_fp32_grad_for_sub_group;
    # measured on CPU: +1.2 MiB then +2.4 MiB for a 0.63M-element partition); in fp32 the conversion is the copy
    # itself. On the host (0 here) when the optimizer is offloaded.
    flat_copy = part * bit if ctx.half and m.master else 0
    m.step_scratch = m.master + flat_copy if stage >= 1 else (0 if offload_optimizer else None)
    return m


def deepspeed_overlap(zero: dict[str, Any]) -> float:
    """1 where DeepSpeed reduces on a side stream (``overlap_comm``; its default is on for stage 3 only)."""
    return 1.0 if zero.get("overlap_comm", int(zero.get("stage", 2)) == 3) else 0.0


def deepspeed_comm(ctx, zero: dict[str, Any]):
    """DeepSpeed's traffic per optimizer step (measured on deepspeed 0.19, docs/communication.md), in the
    compute dtype of its bit16 weights under fp16/bf16, else fp32:

    * stage 0: the gradients all-reduced (Φ);
    * stages 1 and 2: the gradients all-reduced too (Φ): DeepSpeed's "reduce-scatter" is an all-reduce of each
      bucket after which every rank keeps its partition (``use_multi_rank_bucket_allreduce``, the default);
      then a 4-byte fp32 all-reduce (the gradient-overflow/norm check), a 1-byte one more under fp16/bf16, and
      after the step the updated partitions all-gathered, the flat group padded to a multiple of 2 x world
      elements (``nccl_start_alignment_factor``);
    * stage 3: every parameter all-gathered once per step, padded to a multiple of the world (small models:
      the persistence threshold keeps them gathered, refreshed after each step; larger ones are gathered
      before use and, with the default reuse distance, kept for backward), the gradients reduce-scattered
      (Φ), and an 8-byte fp64 all-reduce (the overflow check).
    Gradients and the updated partitions are the trained parameters' only (DeepSpeed is given those: LoRA's
    frozen base is neither reduced nor stepped); stage 3 gathers every parameter.
    Not modelled: gradient accumulation with stages 2/3 (reduced every micro-step)."""
    n = ctx.world
    if n <= 1:
        return []
    stage = int(zero.get("stage", 2))
    bit = 2 if ctx.half else ctx.param_bytes
    trained = sum(ctx.trainable_numels)
    phi = trained * bit
    grads = Collective("all_reduce", phi, 1, "backward", n, "gradient buckets")
    if stage == 0:
        return [grads]
    if stage in (1, 2):
        rows = [grads, Collective("all_reduce", 4, 1, "optimizer", n, "overflow/norm check (fp32 scalar)")]
        if ctx.half:
            rows.append(Collective("all_reduce", 1, 1, "optimizer", n, "overflow flag (1 byte)"))
        gathered = ceil_to(trained, 2 * n) * bit
        rows.append(Collective("all_gather", gathered, 1, "optimizer", n, "updated partitions"))
        return rows
    return [
        *zero3_gathers(ctx, zero, n, bit),
        *zero3_gradients(ctx, zero, n, bit),
        Collective("all_reduce", 8, 1, "optimizer", n, "overflow check (fp64 scalar)"),
    ]


DS_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's ``stage3_max_reuse_distance`` default (elements; deepspeed/runtime/zero/config.py)."""
QUANT_GROUP_TARGET = 8000
"""DeepSpeed's ``CUDAQuantizer.target_group_size`` (partition_parameters.py): qwZ's blocks hold at most ~8k weights."""


def released_after_forward(numels: list[int], zero: dict[str, Any]) -> list[bool]:
    """Which parameters (in forward order) ZeRO-3 frees after forward and gathers again for backward: those above
    ``stage3_param_persistence_threshold`` whose next use (in backward, after the rest of forward and of backward:
    twice the elements behind it) lies beyond both ``stage3_max_reuse_distance`` and the prefetcher's window
    (``stage3_prefetch_bucket_size``: a parameter it already fetched for a later module is kept,
    partitioned_param_coordinator.py ``__params_to_release``). Measured on deepspeed 0.19 (docs/communication.md):
    a small model with the defaults keeps every parameter; with all three at 0 it frees every one."""
    persist = int(zero.get("stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE))
    reuse = int(zero.get("stage3_max_reuse_distance", DS_REUSE_DISTANCE))
    window = max(reuse, int(zero.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET)))
    out, after = [], sum(numels)
    for x in numels:
        after -= x
        out.append(x > persist and 2 * after >= window)
    return out


def quant_groups(numel: int) -> int:
    """The int8 blocks DeepSpeed's qwZ quantizer cuts ``numel`` weights into, one fp32 scale each
    (``CUDAQuantizer.quantize``, partition_parameters.py: at least numel / 8000 blocks, a block count whose
    blocks hold a multiple of 8 weights, doubled while blocks stay above 8000)."""
    groups = -(-numel // QUANT_GROUP_TARGET)
    while groups < numel and numel % (8 * groups):
        groups += 1
    while numel % (16 * groups) == 0 and numel / groups > QUANT_GROUP_TARGET:
        groups *= 2
    return groups


def zero3_gathers(ctx, zero: dict[str, Any], n: int, bit: int) -> list[Collective]:
    """ZeRO-3's parameter all-gathers per step, each padded to a multiple of the world: every parameter once
    (small ones stay gathered, refreshed after the step; larger ones gathered for forward), and again for
    backward those freed after forward (``released_after_forward``). ZeRO++: hpZ gathers backward's from the
    secondary partition over its S ranks (dim ``hpz``, inside a node); qwZ sends the gathered weights as int8
    with an fp32 scale per block (``quant_groups`` of each rank's partition), the persistent ones' refresh
    after the step excepted (DeepSpeed gathers those unquantised)."""
    numels = ctx.numels
    persist = int(zero.get("stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE))
    released = released_after_forward(numels, zero)
    s = int(zero.get("zero_hpz_partition_size", 1))
    rows = []
    if zero.get("zero_quantized_weights"):
        kept = [x for x in numels if x <= persist]
        if kept:
            rows.append(Collective("all_gather", sum(ceil_to(x, n) for x in kept) * bit, len(kept), "optimizer", n,
                                   "persistent parameters refreshed after the step (unquantised)"))
        fetched = [x for x in numels if x > persist]
        rows += _int8_gathers(fetched, n, "forward", "", "weights (qwZ)")
        again = [x for x, r in zip(numels, released, strict=True) if r]
        return rows + _int8_gathers(again, s if s > 1 else n, "backward", "hpz" if s > 1 else "",
                                    "weights gathered again for backward (qwZ)", pad=n)
    rows.append(Collective("all_gather", sum(ceil_to(x, n) for x in numels) * bit, len(numels), "forward", n,
                           "each parameter once per step"))
    again = [x for x, r in zip(numels, released, strict=True) if r]
    if again:
        note = "freed after forward, gathered again for backward"
        if s > 1:
            note += f" from hpZ's secondary partition ({s} ranks, inside a node)"
        rows.append(Collective("all_gather", sum(ceil_to(x, n) for x in again) * bit, len(again), "backward",
                               s if s > 1 else n, note, dim="hpz" if s > 1 else ""))
    return rows  # fmt: skip


def _int8_gathers(numels: list[int], g: int, phase: str, dim: str, note: str, pad: int = 0) -> list[Collective]:
    """qwZ's all-gathers of ``numels`` over ``g`` ranks: int8 weights (one byte each, padded to a multiple of
    the world ``pad``: hpZ's secondary partition is that size over S) and their fp32 block scales (``quant_groups``
    of each rank's 1/g partition)."""
    if not numels:
        return []
    parts = [ceil_to(x, pad or g) for x in numels]
    scales = sum(4 * quant_groups(p // g) * g for p in parts)
    return [
        Collective("all_gather", sum(parts), len(numels), phase, g, f"int8 {note}", dim=dim),
        Collective("all_gather", scales, len(numels), phase, g, f"fp32 block scales of the {note}", dim=dim),
    ]


def zero3_gradients(ctx, zero: dict[str, Any], n: int, bit: int) -> list[Collective]:
    """ZeRO-3's gradient reduction per step: the trained parameters reduce-scattered (Φ, padded to the world).
    qgZ across nodes (``__avg_scatter_grads``, stage3.py; ``all_to_all_quant_reduce``, coalesced_collectives.py):
    each gradient of two or more dimensions whose size divides by 2 x world goes as int4 (two per byte) with fp32
    scales of G = max(dim 0, dim 1, world) blocks through an all-to-all among the node's L ranks, then, reduced
    to 1/L of it (G/L scales), through an all-to-all among the N nodes' ranks of the same local index; the rest
    is reduce-scattered. On one node qgZ falls back to the reduce-scatter (DeepSpeed's own condition)."""
    trained = [(x, sh) for x, sh, t in zip(ctx.numels, ctx.shapes, ctx.trainable, strict=True) if t]
    local = node_ranks(ctx.cfg, n)
    nodes = n // local
    quantised = [(x, sh) for x, sh in trained if len(sh) > 1 and x % (2 * n) == 0]
    if not zero.get("zero_quantized_gradients") or nodes <= 1 or not quantised:
        return [Collective("reduce_scatter", ceil_to(sum(x for x, _ in trained), n) * bit, 1, "backward", n, "gradients")]
    rest = [x for x, sh in trained if (x, sh) not in quantised]
    groups = [max(sh[0], sh[1], n) for _, sh in quantised]
    k = len(quantised)
    rows = [
        Collective("all_to_all", sum(x // 2 for x, _ in quantised), k, "backward", local,
                   "int4 gradients inside the node (qgZ)", dim="local"),
        Collective("all_to_all", sum(4 * g for g in groups), k, "backward", local,
                   "fp32 block scales inside the node (qgZ)", dim="local"),
        Collective("all_to_all", sum(x // 2 // local for x, _ in quantised), k, "backward", nodes,
                   "int4 node-reduced gradients across nodes (qgZ)", dim="node"),
        Collective("all_to_all", sum(4 * (g // local) for g in groups), k, "backward", nodes,
                   "fp32 block scales across nodes (qgZ)", dim="node"),
    ]
    if rest:
        rows.append(Collective("reduce_scatter", sum(ceil_to(x, n) for x in rest) * bit, len(rest), "backward", n,
                               "gradients qgZ leaves out (1-D, or not a multiple of 2 x world)"))
    return rows  # fmt: skip


def node_ranks(cfg, world: int) -> int:
    """The ranks of one node: world / --nnodes where stratbench places several nodes, else the launcher's
    LOCAL_WORLD_SIZE (torchrun: this node's processes) where it divides the world, else the whole world."""
    if cfg.nnodes > 1:
        return max(1, world // cfg.nnodes)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) >= 1 and world % int(local) == 0:
        return int(local)
    return world


def zeropp_mesh(cfg, world: int, zero: dict[str, Any]) -> dict[str, int]:
    """ZeRO++'s groups as a device mesh (``CostModel.mesh_dims``): hpZ's secondary groups of S consecutive ranks
    (``groups._create_zero_param_parallel_group``), qgZ's node of L ranks and its cross-node groups of one rank
    per node; empty without them (one dimension, the world)."""
    s = int(zero.get("zero_hpz_partition_size", 1))
    if zero.get("zero_quantized_gradients"):
        local = node_ranks(cfg, world)
        if s > 1:
            return {"node": world // local, "hpz_replica": local // s, "hpz": s}
        return {"node": world // local, "local": local}
    return {"dp": world // s, "hpz": s} if s > 1 else {}


def autotp_view(ctx):
    """(the context one AutoTP rank's ZeRO sees, the degree T): its parameters are 1/T of each split matrix plus
    the whole replicated rest, and ZeRO partitions them over the data-parallel group, world / T."""
    t = ctx.options.autotp_size
    if t == 1:
        return ctx, 1
    numels = tp_shapes(ModelSpec.from_config(ctx.cfg)).local_numels(t)
    return dataclasses.replace(
        ctx, info=dataclasses.replace(ctx.info, numels=numels), world=ctx.world // t
    ), t


def autotp_comm(ctx, view, zero: dict[str, Any], t: int) -> list[Collective]:
    """AutoTP's traffic (measured on deepspeed 0.19, docs/deepspeed_accelerate.md), on the data-parallel
    replica's micro-batch of (b, s, dim) activations in the dtype DeepSpeed runs the model in: forward, each
    row-parallel Linear's output all-reduced over the AutoTP group (RowParallel); backward, each column-parallel
    Linear's input gradient all-reduced (ColumnParallel): q, k, v and gate, up each their own, 5 per block where
    Megatron sums the attention's and the MLP's once (2). The gradient norm is summed over the AutoTP group
    (ZeRO 1-2's overflow/norm check, or clipping). On a data-parallel group of one rank DeepSpeed still calls its
    gradient all-reduce and norm all-reduce there (no bytes move); a larger one is ``deepspeed_comm``'s."""
    shapes = tp_shapes(ModelSpec.from_config(ctx.cfg))
    cfg, bit, dp = ctx.cfg, 2 if ctx.half else ctx.param_bytes, view.world
    act = cfg.batch_size // (dp * cfg.grad_accum) * cfg.seq_len * shapes.transformer.dim * bit
    weights = [d for n, d in zip(shapes.names, shapes.split, strict=True) if n.endswith(".weight")]
    row, col = weights.count(1) * cfg.grad_accum, weights.count(0) * cfg.grad_accum
    rows = [
        Collective("all_reduce", row * act, row, "forward", t, "row-parallel outputs (RowParallel)"),
        Collective(
            "all_reduce", col * act, col, "backward", t, "column-parallel input gradients, one per layer"
        ),
    ]
    stage = int(zero.get("stage", 2))
    norm = stage >= 1 or bool(cfg.clip_grad_norm)
    if norm:
        rows.append(Collective("all_reduce", 4, 1, "optimizer", t, "gradient norm over the AutoTP group"))
    if dp > 1:
        return rows + deepspeed_comm(view, zero)
    rows.append(
        Collective("all_reduce", view.info.total * bit, 1, "backward", 1, "gradients, 1-rank dp group")
    )
    if norm:
        rows.append(Collective("all_reduce", 4, 1, "optimizer", 1, "gradient norm, 1-rank dp group"))
    return rows
