"""Tensor-parallel plans and what they split: the Megatron plan of the built-in transformer (torchtitan's llama
plan, ``transformer_plan``) or a model's own ``tp_plan()`` (``model_plan``), the weights each plan splits
(``TPShapes``, built on the meta device), and the one-line refusals every method with a tp dimension asks before
any work (``unsupported``, ``degree_unfit``, ``require_tp_group``). ``TPOptions`` holds the plan's two flags
(``--sequence-parallel``, ``--vocab-parallel``): the tp method's options, and another method's tp dimension reads
its own through ``plan_options``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from stratbench.core.config import from_dict
from stratbench.core.errors import ConfigError
from stratbench.core.user_code import one_line
from stratbench.measuring.comm import ceil_to
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.transformer import (
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    TransformerConfig,
)

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


BLOCKS_ONLY = TPOptions(sequence_parallel=False, vocab_parallel=False)
"""``apply_tp``'s own defaults: each block's matrices split, the embedding and head whole (fsdp's and the
pipeline's tp dimension)."""


def block_plan(name: str, module: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
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


def ends_plan(sequence_parallel: bool, vocab_parallel: bool) -> dict[str, Any]:
    """The embedding, the final norm and the head as torchtitan's llama plan has them: split over the vocabulary,
    the embedding's partial sums all-reduced (reduce-scattered into sequence shards) and the head's logits left
    split for loss_parallel. Left whole (``vocab_parallel`` False), ``tensor_parallel.apply_tp`` replicates them
    (to and from the sequence shards under sequence parallelism)."""
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
    """Megatron's plan for ``Transformer``: ``block_plan`` per block (found by type: under an
    activation-checkpointing wrapper too), then ``ends_plan`` for the ends the model holds."""
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        plan.update(block_plan(name, module, sequence_parallel))
    # a pipeline stage keeps some of the ends only (the others are None): the plan names those it has
    ends = ends_plan(sequence_parallel, vocab_parallel)
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


def planned(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, nn.Module, Any]]:
    """(name, module, style) of every module a plan key names (fnmatch patterns as parallelize_module takes)."""
    return [
        (name, module, style)
        for key, style in plan.items()
        for name, module in model.named_modules()
        if name and fnmatch.fnmatchcase(name, key)
    ]


def split_dim(module: nn.Module, style: Any, param: str) -> int | None:
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
    styles = {name: style for name, _, style in planned(model, plan)}
    out: dict[int, list[tuple[int | None, int]]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            d = split_dim(module, styles.get(name), pname)
            out.setdefault(id(p), []).append((d, p.shape[d]) if d is not None else (None, 1))
    return out


def unmatched_keys(model: nn.Module, plan: dict[str, Any]) -> list[str]:
    """The plan's keys that name no module (``parallelize_module`` skips them silently: weights left whole)."""
    names = [name for name, _ in model.named_modules()]
    return [key for key in plan if not fnmatch.filter(names, key)]


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


def tp_options(cfg) -> TPOptions:
    """The tp options among ``cfg``'s ``strategy_options`` (another method's, fsdp's or pipeline's with a tp
    dimension, are its own business: the CLI checks them against that method)."""
    known = {f.name for f in fields(TPOptions)}
    given = {k: v for k, v in cfg.strategy_options.items() if k in known}
    return from_dict(TPOptions, given, where="strategy 'tp' options")


def loss_parallel_applies(cfg, opts: TPOptions) -> bool:
    """Whether the training loss runs on the split logits (``loss_parallel`` computes the built-in cross-entropy
    only, without label smoothing); otherwise a vocabulary-parallel head's logits are gathered for the loss."""
    return opts.vocab_parallel and cfg.loss == "cross-entropy" and not cfg.label_smoothing


def plan_options(options) -> TPOptions:
    """The tp plan's flags among another method's options (fsdp's and pipeline's ``--sequence-parallel``,
    ``--vocab-parallel``; both off where it has none)."""
    return TPOptions(
        sequence_parallel=getattr(options, "sequence_parallel", False),
        vocab_parallel=getattr(options, "vocab_parallel", False),
    )


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
