"""DeepSpeed's ZeRO as a building block: the ZeRO options the DeepSpeed methods share and its cost model per rank
(``deepspeed_memory``, ``deepspeed_comm``, ``deepspeed_overlap``, read from a ``zero_optimization`` block), and
AutoTP's view of it (``autotp_view``, ``autotp_comm``). Plain Python: the estimate never imports ``deepspeed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stratbench.measuring.comm import Collective, ceil_to
from stratbench.measuring.model_trace import ModelSpec
from stratbench.strategies.costs import DS_PARAM_PERSISTENCE, DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, RankMemory
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


DS_TRACE_PRECISION = {"fp16-mixed": "fp16-true", "bf16-mixed": "bf16-true"}
"""The run's precision -> the one DeepSpeed's forward/backward runs in: its fp16/bf16 block casts the module."""


def deepspeed_memory(ctx, zero: dict[str, Any]):
    """DeepSpeed's per-rank model states for a ``zero_optimization`` block: weights in the compute dtype, a flat
    fp32 master partition the optimizer steps, partitioned gradients from stage 2, partitioned weights in
    stage 3, and the reduce/prefetch buckets sized by its defaults."""
    info, world, pd = ctx.info, ctx.world, ctx.param_bytes
    stage = int(zero.get("stage", 2))
    # total: every weight (LoRA's adapters included); trained: the optimizer's (with LoRA the adapters only),
    # which the master partition, the optimizer state and the gradients cover
    total, trained = sum(ctx.numels), sum(ctx.trainable_numels)
    bit = 2 if ctx.half else pd
    master_bytes = 4  # DeepSpeed's master partitions and optimizer state are fp32
    part = -(-trained // world) if stage >= 1 else trained
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
    if stage == 3:
        persistent = sum(x for x in ctx.numels if x < DS_PARAM_PERSISTENCE)
        m.gathered = (persistent + min(DS_PREFETCH_BUCKET, 2 * info.largest_layer)) * bit
        m.gather_note = "small parameters kept whole (persistence threshold) + prefetch bucket"
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
    gathered = sum(ceil_to(x, n) for x in ctx.numels) * bit
    return [
        Collective("all_gather", gathered, len(ctx.numels), "forward", n, "each parameter once per step"),
        Collective("reduce_scatter", ceil_to(trained, n) * bit, 1, "backward", n, "gradients"),
        Collective("all_reduce", 8, 1, "optimizer", n, "overflow check (fp64 scalar)"),
    ]


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
