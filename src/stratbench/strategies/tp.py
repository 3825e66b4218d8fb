"""``tp``: Megatron-style tensor parallelism (Shoeybi et al. 2019) through PyTorch's own
``torch.distributed.tensor.parallel``: every process is one rank of a single tensor-parallel group (no data
parallelism: all ranks read the same batch), each holding a 1/T slice of the split matrices as DTensors.

The plan for the built-in transformer (``transformer_plan``, torchtitan's llama plan), per block: attention
wq/wk/wv column-parallel (each rank computes n_heads/T query heads and n_kv_heads/T key/value heads; the attention
reads its local head count from the projections' output, so ``single`` runs the same code), wo row-parallel; MLP
w1/w3 column-parallel, w2 row-parallel. The attention and the MLP each take their input as one replicated
DTensor (``PrepareModuleInput``), so that backward sums the input gradients of their column-parallel projections
locally and all-reduces once per module: Megatron's ``f``/``g`` pair, 2 all-reduces per block forward and 2
backward. Options (``TPOptions``):

* ``--vocab-parallel`` (on by default): the token embedding row-parallel over the vocabulary (each rank looks up
  its rows, the partial lookups summed) and the head column-parallel, its logits left split (``Shard(-1)``) for
  the cross-entropy under ``loss_parallel`` (``TPStrategy.forward_loss``/``backward``); evaluation, and a loss
  other than the built-in cross-entropy (a user's, label smoothing), read them gathered whole (``GatherLogits``).
  A tied embedding/head (gpt2-small, llama-1b) stays one tensor: both styles split it along the vocabulary.
  Off: embedding and head whole on every rank (replicated DTensors).
* ``--sequence-parallel`` (Korthikanti et al. 2022): the residual stream and the norms are sharded along the
  sequence (``SequenceParallel``); each block gathers its norm's output before the attention and the MLP and
  reduce-scatters their row-parallel outputs back into sequence shards, so the all-reduces become all-gather +
  reduce-scatter (the same bytes) and the norms' activations are 1/T per rank. The norms' weight gradients come
  out as partial sums and are all-reduced once per step (``reduce_partial_grads``). The model has no dropout.

Whatever the plan leaves (norms, a whole embedding/head) holds its parameters replicated, so that every parameter
is a DTensor (the foreach optimizer and ``clip_grad_norm_`` take no mix of plain tensors and DTensors), while each
such module computes on their local tensors from the plain inputs it has under torch's ``parallelize_module``
(``LocalParams``): a plan is applied as torch applies it, and the model's forward runs unchanged. A model of the
user's gives its own plan with a ``tp_plan()`` method (checked before any work: ``_own_plan``): the two options
above apply to the built-in plan only (``--sequence-parallel`` with a user's plan is refused: its layouts are the
user's). The communication model (``transformer_comm``) matches the measured bytes per kind exactly on gpt-tiny
(fp64 and bf16-mixed, each option on and off: tests/strategies/test_tp.py; docs/communication.md).

2D and 3D meshes: fsdp and pipeline call ``apply_tp`` with their mesh's tp dimension (``fsdp --tp``,
``pipeline --pp --tp``). The memory estimate traces a rank's slice of the model at the whole batch
(``LocalSlice``; docs/memory.md).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import sharded
from stratbench.core.config import from_dict
from stratbench.core.errors import ConfigError
from stratbench.core.user_code import one_line
from stratbench.measuring.comm import Collective, ceil_to
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.flops import flops_per_sample
from stratbench.models.transformer import (
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    TransformerConfig,
)
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register
from stratbench.strategies.costs import CPU_TP_RUNTIME_BYTES, RankMemory

HOW_TO_PLAN = (
    "give the model a tp_plan() method returning a torch.distributed.tensor.parallel.parallelize_module plan "
    "(module name -> ColwiseParallel()/RowwiseParallel()/...), as the built-in transformers (gpt-tiny, ...) have"
)


@dataclass(kw_only=True)
class TPOptions:
    """Options of the tp strategy."""

    sequence_parallel: bool = False
    """tp: Megatron sequence parallelism (Korthikanti et al. 2022): the built-in transformer's norms run on 1/T of the sequence, each block's two all-reduces forward (and two backward) become an all-gather and a reduce-scatter; --seq-len must divide by the processes."""
    vocab_parallel: bool = True
    """tp: the built-in transformer's token embedding and output head split over the vocabulary (1/T of each per rank), the cross-entropy computed on the split logits (loss_parallel); false: both whole on every rank."""


class GatherLogits:
    """Forward hook on a vocabulary-parallel head: its logits (a DTensor split over the vocabulary) gathered into
    one plain tensor, what evaluation and a loss other than the built-in cross-entropy read; while ``keep`` is
    set (``split_logits``: the training loss under loss_parallel) they stay split."""

    def __init__(self) -> None:
        self.keep = False

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return output if self.keep or not isinstance(output, DTensor) else output.full_tensor()


@contextlib.contextmanager
def split_logits(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s vocabulary-parallel head returns its logits split (a ``Shard(-1)`` DTensor)."""
    hooks = [m._stratbench_gather_logits for m in model.modules() if hasattr(m, "_stratbench_gather_logits")]
    for h in hooks:
        h.keep = True
    try:
        yield
    finally:
        for h in hooks:
            h.keep = False


def _block_plan(name: str, module: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """One block's entries: the attention's and the MLP's input one replicated DTensor (gathered from the
    sequence shards under sequence parallelism), q/k/v and gate/up column-parallel, o and down row-parallel
    (their outputs summed: all-reduced, or reduce-scattered into sequence shards), the norms sequence-parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if isinstance(module, TransformerBlock) and sequence_parallel:
        plan.update({f"{name}.{n}": SequenceParallel() for n in ("attention_norm", "ffn_norm")})
    if isinstance(module, Attention | FeedForward):
        cols, rows = (
            (("wq", "wk", "wv"), ("wo",)) if isinstance(module, Attention) else (("w1", "w3"), ("w2",))
        )
        plan[name] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan.update({f"{name}.{c}": ColwiseParallel() for c in cols})
        plan.update({f"{name}.{r}": RowwiseParallel(output_layouts=seq) for r in rows})
    return plan


def _ends_plan(sequence_parallel: bool, vocab_parallel: bool) -> dict[str, Any]:
    """The embedding, the final norm and the head as torchtitan's llama plan has them: split over the vocabulary,
    the embedding's partial sums all-reduced (reduce-scattered into sequence shards) and the head's logits left
    split for loss_parallel. Left whole (``vocab_parallel`` False), ``apply_tp`` replicates them
    (``_edge_layouts``: to and from the sequence shards under sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {"norm": SequenceParallel()} if sequence_parallel else {}
    if vocab_parallel:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return plan


def transformer_plan(
    model: Transformer, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> dict[str, Any]:
    """Megatron's plan for ``Transformer``: ``_block_plan`` per block (found by type: under an
    activation-checkpointing wrapper too), then ``_ends_plan`` for the ends the model holds."""
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        plan.update(_block_plan(name, module, sequence_parallel))
    # a pipeline stage keeps some of the ends only (the others are None): the plan names those it has
    ends = _ends_plan(sequence_parallel, vocab_parallel)
    return plan | {name: style for name, style in ends.items() if getattr(model, name, None) is not None}


def model_plan(
    model: nn.Module, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> dict[str, Any] | None:
    """The model's tensor-parallel plan: the built-in one for ``Transformer``, the model's own ``tp_plan()``
    (which decides its own layouts: the two flags apply to the built-in plan), or None (no plan: refused)."""
    if isinstance(model, Transformer):
        return transformer_plan(model, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    own = getattr(model, "tp_plan", None)
    return _own_plan(model, own) if callable(own) else None


def _own_plan(model: nn.Module, tp_plan: Any) -> dict[str, Any]:
    """The model's ``tp_plan()`` as ``parallelize_module`` takes it, a mapping of module-name patterns to
    ParallelStyle objects; a plan that raises or is anything else is one line naming what is wrong (torch would
    fail later, on every rank, with a traceback)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    what = f"tp: {type(model).__name__}.tp_plan()"
    try:
        plan = tp_plan()
    except Exception as exc:
        raise ConfigError(f"{what} raised {one_line(exc)}") from None
    if not isinstance(plan, Mapping):
        raise ConfigError(f"{what} returned a {type(plan).__name__}, not a mapping; {HOW_TO_PLAN}")
    for key, style in plan.items():
        if not isinstance(key, str):
            raise ConfigError(f"{what} has the key {key!r} (type {type(key).__name__}), not a module name")
        if not isinstance(style, ParallelStyle):
            raise ConfigError(
                f"{what} maps {key!r} to {style!r} (type {type(style).__name__}), not a ParallelStyle such as "
                "ColwiseParallel() or RowwiseParallel()"
            )
    return dict(plan)


def _planned(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, nn.Module, Any]]:
    """(name, module, style) of every module a plan key names (fnmatch patterns as parallelize_module takes)."""
    return [
        (name, module, style)
        for key, style in plan.items()
        for name, module in model.named_modules()
        if name and fnmatch.fnmatchcase(name, key)
    ]


def _split_dim(module: nn.Module, style: Any, param: str) -> int | None:
    """The dimension of ``module``'s parameter ``param`` that ``style`` splits, else None (whole): a
    column-parallel Linear splits its outputs (weight and bias dim 0), a row-parallel one its inputs (weight dim
    1; the bias is added once, whole); a row-parallel Embedding splits the vocabulary (dim 0), a column-parallel
    one the width (dim 1)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear):
        return 0 if colwise else 1 if rowwise and param == "weight" else None
    if isinstance(module, nn.Embedding) and param == "weight":
        return 0 if rowwise else 1 if colwise else None
    return None


def _param_splits(model: nn.Module, plan: dict[str, Any]) -> dict[int, list[tuple[int | None, int]]]:
    """Per parameter (by id), the split (dimension, its size; (None, 1): whole) that each module holding it gives
    it: two entries for a tied parameter (an embedding that is also the head)."""
    styles = {name: style for name, _, style in _planned(model, plan)}
    out: dict[int, list[tuple[int | None, int]]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            d = _split_dim(module, styles.get(name), pname)
            out.setdefault(id(p), []).append((d, p.shape[d]) if d is not None else (None, 1))
    return out


@dataclass(frozen=True)
class TPShapes:
    """What the cost model and the refusals read from the model and its plan (built on the meta device)."""

    numels: tuple[int, ...]
    """Parameters in ``model.parameters()`` order (a tied pair once)."""
    split: tuple[int | None, ...]
    """The dimension each parameter is split along (None: replicated)."""
    sizes: tuple[int, ...]
    """The size of that dimension (1 for a replicated parameter)."""
    names: tuple[str, ...]
    transformer: TransformerConfig | None
    has_plan: bool
    unmatched: tuple[str, ...] = ()
    """Plan keys that name no module of the model."""
    tie_conflicts: tuple[str, ...] = ()
    """Tied parameters whose holders the plan splits differently (one tensor cannot be both)."""

    def local_numels(self, world: int) -> list[int]:
        """Each parameter's elements on one of ``world`` ranks: 1/world of a split one, a replicated one whole."""
        return [n // world if d is not None else n for n, d in zip(self.numels, self.split, strict=True)]

    def local_numel(self, world: int) -> int:
        return sum(self.local_numels(world))


@functools.cache
def tp_shapes(spec: ModelSpec, vocab_parallel: bool = False) -> TPShapes:
    """The model of ``spec`` built on the meta device (no memory), its plan and which weights it splits."""
    with torch.device("meta"):
        model = spec.build()
    plan = model_plan(model, vocab_parallel=vocab_parallel)
    splits = _param_splits(model, plan or {})
    named = list(model.named_parameters())
    first = [splits[id(p)][0] for _, p in named]
    return TPShapes(
        numels=tuple(p.numel() for _, p in named),
        split=tuple(d for d, _ in first),
        sizes=tuple(size for _, size in first),
        names=tuple(n for n, _ in named),
        transformer=model.config if isinstance(model, Transformer) else None,
        has_plan=plan is not None,
        unmatched=tuple(unmatched_keys(model, plan or {})),
        tie_conflicts=tuple(n for n, p in named if len(set(splits[id(p)])) > 1),
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
        for _, module, style in _planned(model, plan or {}):
            if isinstance(style, SequenceParallel):
                module.forward = _on_sequence_shard(module.forward, self.world)
            for name in ("weight", "bias"):
                p, d = getattr(module, name, None), _split_dim(module, style, name)
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


def unmatched_keys(model: nn.Module, plan: dict[str, Any]) -> list[str]:
    """The plan's keys that name no module (``parallelize_module`` skips them silently: weights left whole)."""
    names = [name for name, _ in model.named_modules()]
    return [key for key in plan if not fnmatch.filter(names, key)]


def tp_options(cfg) -> TPOptions:
    """The tp options among ``cfg``'s ``strategy_options`` (another method's, fsdp's or pipeline's with a tp
    dimension, are its own business: the CLI checks them against that method)."""
    known = {f.name for f in fields(TPOptions)}
    given = {k: v for k, v in cfg.strategy_options.items() if k in known}
    return from_dict(TPOptions, given, where="strategy 'tp' options")


def _options_of(ctx) -> TPOptions:
    return ctx.options if isinstance(ctx.options, TPOptions) else tp_options(ctx.cfg)


def _transformer_unsupported(
    cfg, tc: TransformerConfig, world: int, opts: TPOptions, flag: str
) -> str | None:
    """The built-in transformer's shapes that do not divide by ``world``: heads, vocabulary, sequence."""
    if tc.n_heads % world or tc.n_kv_heads % world:
        fits = [t for t in range(1, tc.n_heads + 1) if tc.n_heads % t == 0 and tc.n_kv_heads % t == 0]
        return (
            f"tp over {world} processes: n_heads {tc.n_heads} and n_kv_heads {tc.n_kv_heads} of {cfg.model} must "
            f"both divide by {world}; {flag} that fit: {', '.join(map(str, fits))}"
        )
    if opts.vocab_parallel and tc.vocab_size % world:
        return (
            f"tp over {world} processes with --vocab-parallel: the vocabulary of {tc.vocab_size} tokens does not "
            f"divide by {world}; give --vocab-size a multiple of {world} (e.g. {ceil_to(tc.vocab_size, world)}) "
            "or --vocab-parallel false"
        )
    if opts.sequence_parallel and cfg.seq_len % world:
        return (
            f"tp over {world} processes with --sequence-parallel: --seq-len {cfg.seq_len} does not divide by "
            f"{world}; give a multiple of {world} (e.g. {ceil_to(cfg.seq_len, world)}) or leave sequence "
            "parallelism off"
        )
    return None


BLOCKS_ONLY = TPOptions(sequence_parallel=False, vocab_parallel=False)
"""``apply_tp``'s own defaults: each block's matrices split, the embedding and head whole (fsdp's and the
pipeline's tp dimension)."""


def unsupported(cfg, world: int, flag: str = "--nproc", options: TPOptions | None = None) -> str | None:
    """One line saying why ``cfg`` cannot run under tp over ``world`` processes, or None; ``flag`` names the
    setting that gives the degree (tp's --nproc, fsdp's and pipeline's --tp), ``options`` the plan's flags
    (default: the tp method's own, from ``cfg``)."""
    opts = options or tp_options(cfg)
    shapes = tp_shapes(ModelSpec.from_config(cfg), opts.vocab_parallel)
    if not shapes.has_plan:
        return f"tp: model {cfg.model!r} has no tensor-parallel plan; {HOW_TO_PLAN}"
    if shapes.unmatched:
        return f"tp: the plan of model {cfg.model!r} names no module of it: {', '.join(shapes.unmatched)}"
    tc = shapes.transformer
    if tc is None and opts.sequence_parallel:
        return (
            f"tp --sequence-parallel builds the built-in transformers' plan only; model {cfg.model!r} gives its "
            "own (tp_plan()): put its sequence-sharded layouts (SequenceParallel(), Shard(1)) in that plan and "
            "leave --sequence-parallel off"
        )
    why = _transformer_unsupported(cfg, tc, world, opts, flag) if tc is not None else None
    if why:
        return why
    if shapes.tie_conflicts:
        return (
            f"tp: the plan of model {cfg.model!r} splits the tied parameter {shapes.tie_conflicts[0]} differently "
            "in the modules that share it; give them the same style (or untie them)"
        )
    for name, d, size in zip(shapes.names, shapes.split, shapes.sizes, strict=True):
        if d is not None and size % world:
            return f"tp over {world} processes: {name} dim {d} of size {size} does not divide by {world}"
    return None


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
        m = RankMemory(params=local * pd, grads=local * pd, optim=ctx.opt_slots * local * pd)
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


@functools.cache
def local_flop_share(spec: ModelSpec, world: int, vocab_parallel: bool = False) -> float:
    """The forward+backward FLOPs of one tp rank's slice of the model over the whole model's (1.0 where either
    cannot be counted: no saving is claimed)."""
    whole = flops_per_sample(spec.build, spec.sample_shape, spec.num_classes)

    def build_slice() -> nn.Module:
        model = spec.build()
        LocalSlice(world, vocab_parallel)(model)
        return model

    local = flops_per_sample(build_slice, spec.sample_shape, spec.num_classes)
    return local / whole if whole and local else 1.0


class TPCheckpointIO(CheckpointIO):
    """A ``torch.distributed.checkpoint`` folder (the ``dcp`` layout fsdp writes): each rank writes its slices,
    keyed by parameter names with their global shapes, so the folder resumes under tp on another world size and
    loads whole into any other method (``checkpoint.load_any``); a full file loads too."""

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        return sharded.save_sharded(path, model, optimizer, extra, is_main=self.strategy.env.is_main)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        if sharded.is_dcp(path):
            return sharded.load_sharded(path, model, optimizer)
        return super().load_checkpoint(path, model, optimizer)


def _edge_layouts(model: nn.Module, sequence_parallel: bool, vocab_parallel: bool) -> dict[str, tuple]:
    """Where a whole (replicated) module sits inside the sequence-sharded residual stream: the built-in
    transformer's embedding hands on this rank's sequence shard, its head gathers the shards first."""
    from torch.distributed.tensor import Replicate, Shard

    if not (sequence_parallel and isinstance(model, Transformer)) or vocab_parallel:
        return {}
    return {"tok_embeddings": (Replicate(), Shard(1)), "output": (Shard(1), Replicate())}


def _replicate_rest(model: nn.Module, mesh, edges: dict[str, tuple]) -> None:
    """Every module whose own parameters the plan left plain holds them as replicated DTensors, so that the
    model's parameters are all DTensors (the foreach optimizers and ``clip_grad_norm_`` take no mix of plain
    tensors and DTensors), while its forward sees what it would see under ``parallelize_module`` alone
    (``LocalParams``): a user's forward that adds a plain tensor to a plan's output runs as under torch. A
    module ``edges`` names (the built-in transformer's whole embedding and head in the sequence-sharded stream)
    takes a plain input as this rank's part of the first layout, computes on DTensors and hands on its part of
    the second."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def hooks(given, wanted):
        def to_dtensor(module, inputs, mesh):
            return tuple(
                (
                    x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [given], run_check=False)
                ).redistribute(mesh, [Replicate()])
                if isinstance(x, torch.Tensor)
                else x
                for x in inputs
            )

        def to_local(module, output, mesh):
            return output.redistribute(mesh, [wanted]).to_local() if isinstance(output, DTensor) else output

        return to_dtensor, to_local

    for name, module in list(model.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for p in own.values()):
            continue
        if name in edges:
            to_dtensor, to_local = hooks(*edges[name])
            distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)
            continue
        for pname, p in own.items():  # replicated from rank 0 (a broadcast), as distribute_module does
            whole = distribute_tensor(p.detach(), mesh, [Replicate()])
            module.register_parameter(pname, nn.Parameter(whole, requires_grad=p.requires_grad))
        LocalParams(tuple(own)).attach(module)


class LocalParams:
    """Forward hooks that hand a module its replicated DTensor parameters as their local tensors while its inputs
    are plain (as ``parallelize_module`` leaves an unplanned module: plain parameters, plain inputs), and as
    DTensors while an input is a DTensor (DTensor then lays the result out). The swap is FSDP2's own (its
    unsharded parameters are set on the module the same way), so under ``fsdp --tp`` it reads the gathered
    parameter FSDP2 has just put in place; ``to_local`` hands the gradient back as a replicated DTensor."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.held: list[dict[str, Any]] = []  # a stack: the module may be called again inside its own forward

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        from torch.distributed.tensor import DTensor

        held = {n: module._parameters[n] for n in self.names}
        self.held.append(held)
        if any(isinstance(x, DTensor) for x in (*args, *kwargs.values())):
            return
        for n, p in held.items():
            if isinstance(p, DTensor):
                module._parameters[n] = p.to_local()

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.held:
            module._parameters.update(self.held.pop())


def _tied(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) pairs that share one Parameter, per shared Parameter (a tied embedding and head)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group share one Parameter again: ``parallelize_module`` and ``distribute_module`` give every
    module its own DTensor copy. The copies must be laid out alike (refused before any work otherwise)."""
    for (module, name), *rest in groups:
        first = getattr(module, name)
        for other, other_name in rest:
            if getattr(other, other_name).placements != first.placements:
                raise ConfigError(
                    f"tp: the plan splits the tied parameter {name} differently where it is shared"
                )
            other.register_parameter(other_name, first)


def _grads_laid_out_as_params(model: nn.Module) -> None:
    """A split parameter whose gradient comes back replicated (the vocabulary-parallel embedding's: DTensor's
    embedding backward gives every rank the whole (vocab, dim) gradient) keeps only its own slice of it, before
    it is accumulated: a local slice, no communication, and 1/T of the gradient's memory as the cost model says.

    The hook keeps the parameter's placements, not the parameter: a hook stored on a tensor that refers back to
    it makes a reference cycle, and a parameter that FSDP2 then replaces by its dp shard (``fsdp --tp``: every
    split matrix, a rank's whole tp slice) stayed alive until Python's garbage collector happened to run,
    inside the measured step or not (test_tp: no reference cycle keeps a tensor alive)."""
    from torch.distributed.tensor import DTensor

    def keep_own_slice(placements):
        def hook(grad):
            if isinstance(grad, DTensor) and all(pl.is_replicate() for pl in grad.placements):
                return grad.redistribute(grad.device_mesh, placements)
            return grad

        return hook

    for p in model.parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            p.register_hook(keep_own_slice(p.placements))


def apply_tp(
    model: nn.Module, mesh, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> None:
    """Split ``model`` in place over the one-dimensional ``mesh`` (the tp dimension of a larger mesh under 2D/3D):
    its plan's modules become DTensor slices, the rest replicated DTensors on the same mesh. For the built-in
    transformer, ``sequence_parallel`` shards the norms and the residual stream along the sequence and
    ``vocab_parallel`` splits the embedding and the head over the vocabulary: the model then returns the
    logits gathered whole, except within ``split_logits`` (the loss under ``loss_parallel``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model_plan(model, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    if plan is None:  # checked before any work too (check_supported)
        raise ConfigError(f"tp: the model has no tensor-parallel plan; {HOW_TO_PLAN}")
    if sequence_parallel and not isinstance(model, Transformer):  # checked before any work too
        raise ConfigError(
            "tp --sequence-parallel builds the built-in transformers' plan only, not a tp_plan()"
        )
    unmatched = unmatched_keys(model, plan)
    if unmatched:  # checked before any work too (check_supported), on the model as built, unwrapped
        raise ConfigError(f"tp: the plan names no module of the model: {', '.join(unmatched)}")
    ties = _tied(model)
    parallelize_module(model, mesh, plan)
    _replicate_rest(model, mesh, _edge_layouts(model, sequence_parallel, vocab_parallel))
    _retie(ties)
    _grads_laid_out_as_params(model)
    if vocab_parallel and isinstance(model, Transformer) and model.output is not None:  # a stage may lack it
        model.output._stratbench_gather_logits = hook = GatherLogits()
        model.output.register_forward_hook(hook)


def reduce_partial_grads(model: nn.Module) -> None:
    """Sum, in one all-reduce per mesh, the gradients backward leaves as partial sums on replicated weights (a
    sequence-parallel norm's: each rank's share of the positions), so that clipping and the optimizer read them
    whole; left partial, each DTensor op of the step would all-reduce them again (measured: 4 all-reduces per
    norm per AdamW step with clipping)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[nn.Parameter]] = {}
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            if grad.device_mesh.ndim == 1 and all(pl.is_replicate() for pl in p.placements):
                groups.setdefault(grad.device_mesh, []).append(p)
            else:  # not on this rank's one tp dimension: let DTensor sum it
                p.grad = grad.redistribute(grad.device_mesh, p.placements)
    for mesh, params in groups.items():
        local = [p.grad.to_local() for p in params]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, g, part in zip(params, local, flat.split([g.numel() for g in local]), strict=True):
            p.grad = DTensor.from_local(part.view_as(g), mesh, p.placements, run_check=False)


def loss_parallel_applies(cfg, opts: TPOptions) -> bool:
    """Whether the training loss runs on the split logits (``loss_parallel`` computes the built-in cross-entropy
    only, without label smoothing); otherwise a vocabulary-parallel head's logits are gathered for the loss."""
    return opts.vocab_parallel and cfg.loss == "cross-entropy" and not cfg.label_smoothing


class LossParallel:
    """The training loss on logits split over the vocabulary (``loss_parallel``), for a method whose model has a
    vocabulary-parallel head (tp, fsdp --tp --vocab-parallel); its ``wrap`` sets ``split_loss``
    (``splits_loss``). Without it the loop's forward and backward run unchanged."""

    split_loss: bool = False
    """The training loss runs on the logits split over the vocabulary (set by ``wrap``)."""

    def _loss_context(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.split_loss else contextlib.nullcontext()

    def forward_loss(self, model, x, y, loss_fn):
        """The loss on the logits split over the vocabulary (``loss_parallel``: each rank's share of the softmax
        and the target logits, summed by small all-reduces); the logits returned are that split DTensor."""
        if not self.split_loss:
            return super().forward_loss(model, x, y, loss_fn)
        x = self.precision.convert_input(x)
        with split_logits(model), self.precision.autocast(), self._loss_context():
            logits = model(x)
            loss = loss_fn(self.precision.loss_input(logits), y)
        return loss.to_local(), logits

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_context():  # loss_parallel's backward must run under it too
            super().backward(loss)


def splits_loss(model: nn.Module, cfg, opts: TPOptions) -> bool:
    """Whether ``model`` (after ``apply_tp``) has a vocabulary-parallel head whose logits the loss reads split."""
    split_head = any(hasattr(m, "_stratbench_gather_logits") for m in model.modules())
    return split_head and loss_parallel_applies(cfg, opts)


def degree_unfit(flag: str, t: int, world: int) -> str | None:
    """One line when ``world`` processes do not form groups of ``t`` (``flag``: the method and its option, e.g.
    "fsdp --tp"), naming the degrees that fit; else None."""
    if world % t == 0:
        return None
    fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    return f"{flag} {t}: {world} processes do not divide by {t}; {flag.split()[-1]} that fit: {fits}"


def require_tp_group(options, method: str, where: str) -> None:
    """Refuse --sequence-parallel / --vocab-parallel on another method's options (fsdp's, pipeline's) without a
    tensor-parallel group to split in (``options.tp`` of 1): one line naming the flags given."""
    split = [f for f in ("sequence_parallel", "vocab_parallel") if getattr(options, f)]
    if split and options.tp == 1:
        flags = " and ".join("--" + f.replace("_", "-") for f in split)
        raise ConfigError(f"{method} {flags} split(s) {where}: give --tp 2 or more (got 1)")


def plan_options(options) -> TPOptions:
    """The tp plan's flags among another method's options (fsdp's and pipeline's ``--sequence-parallel``,
    ``--vocab-parallel``; both off where it has none)."""
    return TPOptions(
        sequence_parallel=getattr(options, "sequence_parallel", False),
        vocab_parallel=getattr(options, "vocab_parallel", False),
    )


@register
class TPStrategy(LossParallel, Strategy):
    name = "tp"
    description = "tensor parallel (Megatron 1D on DTensor): attention and MLP matrices split over the ranks"
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA); a model with a tensor-parallel plan"
    launcher = "torchrun"
    needs_process_group = True
    check_settings = {"model": "gpt-tiny", "data": "text"}  # the default image model has no tp plan
    Options = TPOptions

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type not in ("cpu", "cuda"):
            return f"tp runs on cpu or cuda devices, not {device.type}"
        return unsupported(cfg, world_size)

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        return 1  # every rank of the one tensor-parallel group computes the whole batch

    cost = TPCost
    checkpoint_io_class = TPCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        return 0, 1  # the same batches on every rank

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("tp",))
        opts = self.options
        apply_tp(model, mesh, sequence_parallel=opts.sequence_parallel, vocab_parallel=opts.vocab_parallel)
        self.split_loss = splits_loss(model, self.cfg, opts)
        return model

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip: float | None) -> bool:
        assert self.model is not None
        reduce_partial_grads(self.model)
        return super().optimizer_step(optimizer, clip)

    def report(self) -> dict[str, Any]:
        opts = self.options
        return {
            "mesh": {"tp": self.env.world_size},
            "tp": {
                "sequence_parallel": opts.sequence_parallel,
                "vocab_parallel": opts.vocab_parallel,
                "loss_parallel": self.split_loss,
            },
        }

    # clip_grad_norm: the base's torch.nn.utils.clip_grad_norm_ works on DTensor gradients (the norm of the split
    # ones is reduced over the mesh), so every rank scales by the same global factor.
