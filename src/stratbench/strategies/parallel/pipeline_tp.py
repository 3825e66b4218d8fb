"""The tensor-parallel dimension of a pipeline's mesh (``pipeline --pp P --tp T``, 3D parallelism): what the
pipeline strategy adds when each stage is split Megatron-style over ``T`` processes (``apply_tp`` on the
stage's modules over the mesh's ``tp`` dimension, as torchtitan's ``parallelize`` does to each pipeline chunk).

The pipeline method (``strategies/pipeline.py``) calls these: the refusals, the stage's split parameters and
tp traffic for the cost model (Megatron's, or with --sequence-parallel/--vocab-parallel the tp method's rows for
the blocks and ends the stage holds), the gradients' local shards for the replicas' all-reduce and the clipping
norm, and the full tensors of a checkpoint. With ``T == 1`` every function here is the identity of the plain
pipeline (plain tensors pass through unchanged, no rows are added).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelSpec
from stratbench.strategies.parallel.tp_costs import Ends, Traffic, ends_rows, megatron_rows, norm_grads_row
from stratbench.strategies.parallel.tp_plan import (
    BLOCKS_ONLY,
    TPOptions,
    plan_options,
    tp_shapes,
    unsupported,
)


def is_transformer(spec: ModelSpec) -> bool:
    """Whether ``spec`` builds a built-in transformer (the one family a pipeline's stages split over tp)."""
    return tp_shapes(spec).transformer is not None


def refusal(spec: ModelSpec, cfg, tp_size: int, plan: TPOptions = BLOCKS_ONLY) -> str | None:
    """One line why the pipeline's stages cannot be split over ``tp_size`` processes with the tp ``plan``'s
    flags, or None. The model must be a built-in transformer (its plan is made from the blocks a stage holds; a
    user's ``tp_plan()`` names modules of every stage) whose heads and widths divide, and under
    --sequence-parallel whose --seq-len divides, by ``tp_size`` (``unsupported``)."""
    if tp_size == 1:
        return None
    if not is_transformer(spec):
        return (
            f"pipeline --tp {tp_size}: tensor parallelism inside pipeline stages splits the built-in "
            f"transformers (gpt-tiny, gpt2-small, llama-*), not model {cfg.model!r}; use --tp 1"
        )
    line = unsupported(cfg, tp_size, "--tp", plan)
    if line is not None:
        return f"pipeline --tp {tp_size}: {line}"
    return None


def stage_numel(
    spec: ModelSpec, modules: list[str], tp_size: int, vocab_parallel: bool = False
) -> tuple[int, int]:
    """(elements a tp rank holds, elements of the stage) for the stage's ``modules``: the plan's split weights
    1/T, the norms whole, the embedding and head whole or (``vocab_parallel``) 1/T too (``tp_shapes``)."""
    shapes = tp_shapes(spec, vocab_parallel)
    local = whole = 0
    for name, numel, d in zip(shapes.names, shapes.numels, shapes.split, strict=True):
        if any(name.startswith(m + ".") for m in modules):
            whole += numel
            local += numel // tp_size if d is not None else numel
    return local, whole


def stage_blocks(spec: ModelSpec, modules: list[str]) -> int:
    """How many transformer blocks (each: attention + MLP, two Megatron all-reduces each way) ``modules`` hold."""
    shapes = tp_shapes(spec)
    layers = shapes.transformer.n_layers if shapes.transformer is not None else 0
    return sum(f"layers.{i}" in modules for i in range(layers))


def stage_flops(split, stage, tp_size: int, vocab_parallel: bool = False) -> float:
    """Forward+backward FLOPs per sample one tp rank of ``stage`` computes: its blocks' 1/T (their matrices and
    attention heads are split), the embedding and head whole (replicated: every tp rank computes them), or the
    head 1/T too under ``vocab_parallel``."""
    if tp_size == 1:
        return stage.flops
    flops = {c.name: c.flops for c in split.pieces}
    split_pieces = ("layers.", "head") if vocab_parallel else ("layers.",)
    return sum(flops[p] / tp_size if p.startswith(split_pieces) else flops[p] for p in stage.pieces)


def stage_comm(
    ctx, spec: ModelSpec, modules: list[str], micro: int, m: int, tp_size: int
) -> list[Collective]:
    """The tp traffic of one rank of the stage(s) holding ``modules`` per step, ``m`` micro-batches of ``micro``
    samples: Megatron's per block (``megatron_rows``: all-reduces, or under --sequence-parallel all-gathers
    and reduce-scatters), the embedding's and head's where the stage holds them (``ends_rows``: sequence
    shards gathered, vocabulary-parallel sums; the logits gathered whole for the last stage's loss, no
    loss_parallel) and, under --sequence-parallel, the stage's norms' partial gradients summed once per step."""
    tc = tp_shapes(spec).transformer
    if tp_size == 1 or tc is None:
        return []
    plan = plan_options(ctx.options)
    blocks = stage_blocks(spec, modules)
    ends = Ends(embedding="tok_embeddings" in modules, head="output" in modules, loss_parallel=False)
    act = micro * ctx.cfg.seq_len * tc.dim
    where = f"tp: {blocks} block(s) x {m} micro-batch(es), "
    rows = megatron_rows(ctx, blocks, act, m, tp_size, where, plan.sequence_parallel) if blocks else []
    rows += ends_rows(ctx, tc, act, plan, Traffic(m, tp_size), ends)
    norms = 2 * blocks + ends.head
    if plan.sequence_parallel and norms:
        rows.append(norm_grads_row(ctx, norms, tc.dim, tp_size))
    return rows


# ---- the runtime: DTensor parameters and their local shards ----------------------------------------------


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return getattr(t, "_local_tensor", t)


def is_split(p: torch.Tensor) -> bool:
    """Whether a parameter is sharded over its mesh (not replicated: its pieces differ per tp rank)."""
    placements = getattr(p, "placements", ())
    return any(pl.is_shard() for pl in placements)


def grad_sq_norm(params: list[nn.Parameter], tp_group, device: torch.device) -> torch.Tensor:
    """Sum of the squares of this stage's gradients (fp64): the split ones summed over the tp group (one
    all-reduce of a scalar), the replicated ones counted once (every tp rank holds the same)."""
    split = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        sq = local(p.grad).detach().double().pow(2).sum()
        if is_split(p):
            split += sq
        else:
            whole += sq
    if tp_group is not None:
        dist.all_reduce(split, group=tp_group)
    return split + whole


def clip_with_norm(params: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients by max_norm / (total + 1e-6), at most 1 (``clip_grads_with_norm_``'s rule), on each
    rank's shards: the global norm ``total`` is the same on every rank."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        local(p.grad).mul_(coef)


def full_value(v: Any) -> Any:
    """A DTensor's whole tensor, on the CPU (a collective over its mesh); anything else unchanged."""
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def like(value: Any, ref: Any) -> Any:
    """``value`` (a whole tensor from a checkpoint) laid out as ``ref``: this rank's shard of it as a DTensor
    where ``ref`` is one (no communication: every rank has the whole tensor), else unchanged."""
    if not hasattr(ref, "device_mesh") or not isinstance(value, torch.Tensor):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=ref.device, dtype=ref.dtype)
    return distribute_tensor(value, ref.device_mesh, ref.placements, src_data_rank=None)


def like_state(value: Any, param: Any) -> Any:
    """An optimizer state entry of ``param`` from a checkpoint laid out as the parameter (AdamW's moments: its
    shape, split as it is); a scalar (AdamW's step) unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) == tuple(param.shape):
        return like(value, param)
    return value
