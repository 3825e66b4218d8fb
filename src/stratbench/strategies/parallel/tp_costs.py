"""What tensor parallelism costs: a rank's slice of the model for the memory estimate's trace and the FLOPs
(``LocalSlice``, ``local_flop_share``), Megatron's traffic per step (``megatron_rows`` for the blocks,
``ends_rows`` for the embedding, head and loss, ``norm_grads_row``, ``clip_norms_row``; ``transformer_comm``
for a whole model over one tp group) and the tp method's cost model (``TPCost``), which other methods with a tp
dimension compose or subclass. The rows match the measured bytes per kind on gpt-tiny (docs/communication.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.flops import flops_per_sample
from stratbench.models.transformer import TransformerConfig
from stratbench.strategies.base import CostModel
from stratbench.strategies.costs import CPU_TP_RUNTIME_BYTES, RankMemory
from stratbench.strategies.parallel.tp_plan import (
    TPOptions,
    TPShapes,
    loss_parallel_applies,
    model_plan,
    planned,
    split_dim,
    tp_options,
    tp_shapes,
    unsupported,
)


@dataclass(frozen=True)
class LocalSlice:
    """What one of ``world`` tensor-parallel ranks computes, for the memory estimate's trace and the projection's
    FLOPs: every weight the model's plan splits narrowed in place to its 1/world slice (a column-parallel Linear's
    outputs, a row-parallel one's inputs, with ``vocab_parallel`` the embedding's and the head's vocabulary), so
    that the traced activations are a rank's: its heads' queries, keys, values and scores, its part of the MLP's
    hidden state and of the logits, and the whole-width tensors every rank holds (block inputs, the row-parallel
    outputs before their reduction). With ``sequence_parallel`` each norm the plan shards along the sequence
    runs on 1/world of the positions and its output is repeated to the whole sequence (the all-gather before the
    next column-parallel matmul, which saves the whole tensor for its backward), so that what the norms save is
    1/world. A tied weight stays one narrowed tensor. Hashable: traces are cached per transform."""

    world: int
    vocab_parallel: bool = False
    sequence_parallel: bool = False

    def __call__(self, model: nn.Module) -> None:
        from torch.distributed.tensor.parallel import SequenceParallel

        done: dict[int, nn.Parameter] = {}
        plan = model_plan(model, vocab_parallel=self.vocab_parallel, sequence_parallel=self.sequence_parallel)
        for _, module, style in planned(model, plan or {}):
            if isinstance(style, SequenceParallel):
                module.forward = _on_sequence_shard(module.forward, self.world)
            for name in ("weight", "bias"):
                p, d = getattr(module, name, None), split_dim(module, style, name)
                if isinstance(p, nn.Parameter) and d is not None:
                    done.setdefault(id(p), _narrowed(p, d, self.world))
                    setattr(module, name, done[id(p)])
            if isinstance(module, nn.Linear):
                module.out_features, module.in_features = module.weight.shape
            elif isinstance(module, nn.Embedding):
                module.num_embeddings, module.embedding_dim = module.weight.shape


def _on_sequence_shard(forward: Any, world: int) -> Any:
    """``forward`` on the first 1/world of the positions (a rank's sequence shard, copied: what it saves is its
    own), its output repeated back to the whole sequence (the all-gather that follows the norm)."""

    def sharded(x: torch.Tensor) -> torch.Tensor:
        return forward(x[:, : x.shape[1] // world].contiguous()).repeat(1, world, 1)

    return sharded


def _narrowed(p: nn.Parameter, dim: int, world: int) -> nn.Parameter:
    """A parameter of ``p``'s kind (fake under the trace's fake mode) with dimension ``dim`` divided by ``world``."""
    shape = list(p.shape)
    shape[dim] //= world
    return nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)


@functools.cache
def local_flop_share(spec: ModelSpec, world: int, vocab_parallel: bool = False) -> float:
    """The forward+backward FLOPs of one tp rank's slice of the model over the whole model's (1.0 where either
    cannot be counted: no saving is claimed)."""
    whole = flops_per_sample(spec.build, spec.sample_shape, spec.num_classes, spec.is_text)

    def build_slice() -> nn.Module:
        model = spec.build()
        LocalSlice(world, vocab_parallel)(model)
        return model

    local = flops_per_sample(build_slice, spec.sample_shape, spec.num_classes, spec.is_text)
    return local / whole if whole and local else 1.0


def _options_of(ctx) -> TPOptions:
    return ctx.options if isinstance(ctx.options, TPOptions) else tp_options(ctx.cfg)


@dataclass(frozen=True)
class Traffic:
    """Builds the rows of one step: ``calls`` per micro-batch of a tensor of ``elements`` of ``itemsize`` bytes."""

    micro: int
    group: int

    def __call__(
        self, kind: str, calls: int, elements: int, itemsize: int, phase: str, note: str
    ) -> Collective:
        n = calls * self.micro
        return Collective(kind, n * elements * itemsize, n, phase, self.group, note)


def megatron_rows(
    ctx, blocks: int, act: int, micro_steps: int, group: int, where: str = "", sequence_parallel: bool = False
) -> list[Collective]:
    """The traffic of ``blocks`` blocks over a tp ``group``, ``micro_steps`` times per step, in (b, s, dim)
    activations of ``act`` elements. Megatron's f/g pair: per block 2 all-reduces forward (the row-parallel
    outputs, in the compute dtype) and 2 backward (the attention's and the MLP's input gradients, in the weights'
    dtype). Under sequence parallelism each all-reduce becomes an all-gather and a reduce-scatter of the same
    tensor: the norm's output gathered from the sequence shards before the column-parallel projections, the
    row-parallel output reduce-scattered into shards, and the mirror image backward (row outputs and their
    gradients in the compute dtype, norm outputs and the residual stream's gradients in the weights'; measured:
    bf16-mixed sends the first in 2 bytes, the second in 4). ``where`` prefixes each note (a pipeline stage
    names its blocks)."""
    t = Traffic(micro_steps, group)
    cd, pd, calls = ctx.pspec.compute_dtype.itemsize, ctx.param_bytes, 2 * blocks
    if not sequence_parallel:
        return [
            t("all_reduce", calls, act, cd, "forward", f"{where}row-parallel outputs (wo, w2)"),
            t("all_reduce", calls, act, pd, "backward", f"{where}attention and MLP input gradients"),
        ]
    return [
        t(
            "reduce_scatter",
            calls,
            act,
            cd,
            "forward",
            f"{where}row-parallel outputs (wo, w2) into sequence shards",
        ),
        t(
            "all_gather",
            calls,
            act,
            pd,
            "forward",
            f"{where}attention and MLP inputs from the sequence shards",
        ),
        t("all_gather", calls, act, cd, "backward", f"{where}gradients of the row-parallel outputs"),
        t(
            "reduce_scatter",
            calls,
            act,
            pd,
            "backward",
            f"{where}attention and MLP input gradients into shards",
        ),
    ]


def norm_grads_row(ctx, norms: int, dim: int, group: int, calls: int = 1) -> Collective:
    """The sequence-parallel norms' weight gradients, which each rank computes from its sequence shard (partial
    sums), summed over the tp ``group`` once per step: one flat all-reduce (``reduce_partial_grads``), or one
    per norm (``calls``: FSDP2 sums each gradient itself before its reduce-scatter)."""
    note = "sequence-parallel norms' weight grads"
    return Collective("all_reduce", norms * dim * ctx.param_bytes, calls, "optimizer", group, note)


def _block_comm(ctx, tc: TransformerConfig, act: int, sequence_parallel: bool) -> list[Collective]:
    """The blocks' traffic (``megatron_rows``), with the norms' gradients summed once per step under sequence
    parallelism (``norm_grads_row``)."""
    rows = megatron_rows(ctx, tc.n_layers, act, ctx.cfg.grad_accum, ctx.world, "", sequence_parallel)
    if sequence_parallel:
        rows.append(norm_grads_row(ctx, 2 * tc.n_layers + 1, tc.dim, ctx.world))
    return rows


@dataclass(frozen=True)
class Ends:
    """Which of the built-in transformer's ends a rank holds (a pipeline stage: some or none), and whether its
    loss runs on the split logits (loss_parallel) or on the logits gathered whole."""

    embedding: bool = True
    head: bool = True
    loss_parallel: bool = True


def ends_rows(
    ctx, tc: TransformerConfig, act: int, opts: TPOptions, traffic: Traffic, ends: Ends = Ends()
) -> list[Collective]:
    """The embedding's, the head's and the loss's traffic, in the weights' dtype (the residual stream's). Split
    over the vocabulary: the embedding's partial lookups summed forward (all-reduce, or reduce-scatter into
    sequence shards: then its output gradient is all-gathered backward); the head's input gathered from the
    sequence shards forward, its input gradient summed backward (all-reduce, or reduce-scatter); loss_parallel's
    3 all-reduces of one number per token (the logits' max, the sum of exponentials, the target's logit: in the
    loss's dtype, fp32 at least), or the logits all-gathered for any other loss. Whole under sequence
    parallelism: the head's input gathered forward, the embedding's output gradient gathered backward."""
    t, sp = traffic, opts.sequence_parallel
    pd, cd = ctx.param_bytes, ctx.pspec.compute_dtype.itemsize
    rows: list[Collective] = []
    if sp and ends.head:
        rows.append(t("all_gather", 1, act, pd, "forward", "head input from the sequence shards"))
    if sp and ends.embedding:
        rows.append(
            t("all_gather", 1, act, pd, "backward", "embedding output gradient from the sequence shards")
        )
    if not opts.vocab_parallel:
        return rows
    summed = "reduce_scatter" if sp else "all_reduce"
    if ends.embedding:
        rows.append(t(summed, 1, act, pd, "forward", "vocabulary-parallel embedding's partial lookups"))
    if not ends.head:
        return rows
    rows.append(t(summed, 1, act, pd, "backward", "vocabulary-parallel head's input gradient"))
    tokens = act // tc.dim
    if ends.loss_parallel and loss_parallel_applies(ctx.cfg, opts):
        rows.append(
            t("all_reduce", 3, tokens, max(cd, 4), "forward", "loss_parallel: max, sum exp, target logit")
        )
    else:
        rows.append(t("all_gather", 1, tokens * tc.vocab_size, cd, "forward", "logits gathered for the loss"))
    return rows


def transformer_comm(ctx) -> list[Collective] | None:
    """Megatron's tensor-parallel traffic per optimizer step (``_block_comm``, ``ends_rows``), per micro-batch
    of b samples (every rank takes the whole batch) in (b, s, dim) activations. With --clip-grad-norm,
    ``clip_grad_norm_`` on DTensors stacks one norm per parameter and all-reduces them once (measured: 39
    scalars for gpt-tiny's 39 parameters). A model of the user's: no model (its plan's traffic is not derived)."""
    opts = _options_of(ctx)
    shapes = tp_shapes(ModelSpec.from_config(ctx.cfg), opts.vocab_parallel)
    tc = shapes.transformer
    if tc is None:
        return None
    if ctx.world <= 1:
        return []
    cfg = ctx.cfg
    act = (cfg.batch_size // cfg.grad_accum) * cfg.seq_len * tc.dim
    ends = ends_rows(ctx, tc, act, opts, Traffic(cfg.grad_accum, ctx.world))
    rows = _block_comm(ctx, tc, act, opts.sequence_parallel) + ends
    if cfg.clip_grad_norm:
        rows.append(clip_norms_row(ctx, shapes, ctx.world))
    return rows


def clip_norms_row(ctx, shapes: TPShapes, group: int) -> Collective:
    """--clip-grad-norm on DTensors over a tp ``group``: ``clip_grad_norm_`` stacks one norm per parameter (in the
    weights' dtype) and all-reduces them once per step."""
    norms = len(shapes.numels) * ctx.param_bytes
    return Collective("all_reduce", norms, 1, "optimizer", group, "per-parameter gradient norms (clipping)")


class TPCost(CostModel):
    """1/T of the split weights (with their gradients and optimizer state) plus the replicated rest per rank."""

    @classmethod
    def memory_model(cls, ctx, rank):
        opts = _options_of(ctx)
        why = unsupported(ctx.cfg, ctx.world, "--nproc/--world-size", opts)
        if why:  # before any trace of a slice that cannot be cut (one line, as train refuses it)
            raise ConfigError(why)
        shapes = tp_shapes(ModelSpec.from_config(ctx.cfg), opts.vocab_parallel)
        local, pd = shapes.local_numel(ctx.world), ctx.param_bytes
        m = RankMemory(params=local * pd, grads=local * pd, optim=ctx.flat_optim_bytes(local))
        m.step_scalars = 4 * len(shapes.numels) if ctx.adam else 0
        m.cpu_runtime, m.cpu_runtime_note = CPU_TP_RUNTIME_BYTES, "DTensor's op caches under tp, measured"
        whole = "norms" if opts.vocab_parallel and shapes.transformer else "embedding, norms and head"
        m.sharding_note = f"split weights 1/{ctx.world}, {whole} replicated"
        # every rank computes the whole batch through its slice of the split matrices
        m.data_ranks = 1
        m.trace_transform = LocalSlice(ctx.world, opts.vocab_parallel, opts.sequence_parallel)
        return m

    @classmethod
    def mesh_dims(cls, ctx) -> dict[str, int]:
        """One dimension, every process one tensor-parallel group."""
        return {"tp": ctx.world}

    @classmethod
    def comm_model(cls, ctx):
        return transformer_comm(ctx)

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        """None of it: each all-reduce sits between a row-parallel matmul and the op that needs its sum (no
        asynchronous or micro-pipelined TP here), so it is on the critical path."""
        return 0.0

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """A rank's share of the whole batch's FLOPs: its slice of the split matrices and attention heads plus the
        replicated rest (embedding, norms, head), counted on the meta device (``LocalSlice``)."""
        return local_flop_share(ModelSpec.from_config(ctx.cfg), ctx.world, _options_of(ctx).vocab_parallel)
