"""Splitting a model into pipeline stages: its pieces in forward order, their cost, and the balanced cut.

A *piece* is the smallest unit a stage boundary can fall between: for the models stratbench builds, the natural
sections of their ``forward`` (ResNet: stem, layer1-4, head; tinynet: stem, each residual block, head; the
transformer: the token embedding, each block, and the final norm with the output head), and for an
``nn.Sequential`` user model, each of its children. A piece names the original modules it runs, in order, so
that a stage is rebuilt from the original module objects (the original parameter names survive: checkpoints
stay portable) and the sequence of pieces computes exactly the model's forward. A transformer block computes
its rotary angles in its own forward (``transformer.Attention``), so a stage of blocks needs nothing from the
embedding's stage but the hidden state: token ids (batch, seq) enter the first stage, hidden states (batch,
seq, dim) cross the boundaries, logits (batch, seq, vocab) leave the last.

The cut is either explicit (``--split-points layer2,layer4``: a new stage begins at each named piece, as
``torch.distributed.pipelining.SplitPoint.BEGINNING``) or balanced: the contiguous partition into S stages
that minimises the most expensive stage, where a piece costs its parameter count (``--balance params``: memory)
or its forward+backward FLOPs (``--balance flops``: time, counted on the meta device by ``flops.flop_counter``,
the counter of ``flops.flops_per_sample``: the pieces' FLOPs add up to the model's).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.core.torchvision_compat import import_torchvision
from stratbench.models.flops import example_input, flop_counter
from stratbench.models.transformer import Transformer
from stratbench.models.zoo import TinyNet

FLATTEN = "<flatten>"
"""A parameter-free ``torch.flatten(x, 1)`` that the model's forward calls between two modules (ResNet and
tinynet before their ``fc``): the stage gets an ``nn.Flatten`` in its place."""

BALANCE = ("params", "flops")


@dataclass(frozen=True)
class Piece:
    """One unit of the split: a label and the fully-qualified names of the modules it applies, in order."""

    name: str
    modules: tuple[str, ...]


@dataclass
class PieceCost:
    name: str
    params: int
    flops: float
    """Forward + backward FLOPs per sample."""
    out_numel: int
    """Elements per sample of the activation this piece hands on (what a stage boundary after it sends)."""
    out_shape: tuple[int, ...] = ()
    """Shape per sample of that activation: (C, H, W), (classes,), (seq, dim), (seq, vocab)."""


@dataclass
class Stage:
    index: int
    pieces: list[str]
    modules: list[str]
    params: int
    flops: float
    out_numel: int
    """Elements per sample of the stage's output (the activation sent to the next stage; logits for the last)."""
    out_shape: tuple[int, ...] = ()
    """Shape per sample of the stage's output."""


@dataclass
class Split:
    """The stages of one split, with what was asked for; ``to_dict`` goes into result.json."""

    model: str
    balance: str
    split_points: list[str]
    stages: list[Stage]
    pieces: list[PieceCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "balance": self.balance,
            "split_points": self.split_points,
            "stages": [asdict(s) for s in self.stages],
            "total_params": sum(s.params for s in self.stages),
        }

    def lines(self) -> list[str]:
        """The split as printed at start: stage -> pieces, parameters, FLOPs per sample."""
        total_p = sum(s.params for s in self.stages) or 1
        total_f = sum(s.flops for s in self.stages) or 1.0
        out = [f"pipeline split of {self.model} ({len(self.stages)} stages, balance {self.balance}):"]
        for s in self.stages:
            out.append(
                f"  stage {s.index}: {', '.join(s.pieces):<34} params {s.params:>11,} ({100 * s.params / total_p:4.1f}%)"
                f"  fwd+bwd {s.flops / 1e6:10.2f} MFLOP/sample ({100 * s.flops / total_f:4.1f}%)"
            )
        return out


# ------------------------------------------------------------------------------------------------
# the pieces of a model


def pieces_of(model: nn.Module) -> list[Piece]:
    """The pieces of a model stratbench knows how to split, in forward order; ConfigError otherwise."""

    if isinstance(model, TinyNet):
        blocks = [Piece(f"blocks.{i}", (f"blocks.{i}",)) for i in range(len(model.blocks))]
        return [Piece("stem", ("stem",)), *blocks, Piece("head", ("pool", FLATTEN, "fc"))]
    if isinstance(model, Transformer):
        blocks = [Piece(f"layers.{i}", (f"layers.{i}",)) for i in range(len(model.layers))]
        return [Piece("tok_embeddings", ("tok_embeddings",)), *blocks, Piece("head", ("norm", "output"))]
    if _is_torchvision_resnet(model):
        layers = [Piece(f"layer{i}", (f"layer{i}",)) for i in range(1, 5)]
        return [
            Piece("stem", ("conv1", "bn1", "relu", "maxpool")),
            *layers,
            Piece("head", ("avgpool", FLATTEN, "fc")),
        ]
    if isinstance(model, nn.Sequential):
        if len(model) < 2:
            raise ConfigError(f"the model is an nn.Sequential of {len(model)} module: nothing to split")
        return [Piece(name, (name,)) for name, _ in model.named_children()]
    raise ConfigError(
        f"cannot split a {type(model).__name__} into pipeline stages: stratbench splits resnet*, tinynet, the "
        "built-in transformers and nn.Sequential models (a user builder can return an nn.Sequential of its layers)"
    )


def _is_torchvision_resnet(model: nn.Module) -> bool:
    if type(model).__name__ != "ResNet":
        return False
    try:
        return isinstance(model, import_torchvision().models.ResNet)
    except Exception:
        return False


def piece_module(model: nn.Module, piece: Piece) -> nn.Module:
    """The piece as one module over the original module objects (shared, not copied)."""
    mods = [nn.Flatten(1) if name == FLATTEN else model.get_submodule(name) for name in piece.modules]
    return mods[0] if len(mods) == 1 else nn.Sequential(*mods)


def piece_costs(
    model: nn.Module, pieces: list[Piece], sample_shape: tuple[int, ...], tokens: bool = False
) -> list[PieceCost]:
    """Parameters, forward+backward FLOPs per sample and output size per sample of each piece, by running
    the pieces one after the other on meta tensors (the model itself may be on meta or any device), in the
    dtype of the model's weights; ``tokens``: the model takes token ids of ``sample_shape`` (seq_len,)."""
    import copy

    meta = model if _on_meta(model) else copy.deepcopy(model).to("meta")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    costs = []
    with torch.device("meta"):
        x = example_input(2, sample_shape) if tokens else torch.empty(2, *sample_shape, dtype=dtype)
    for i, piece in enumerate(pieces):
        mod = piece_module(meta, piece)
        params = sum(p.numel() for p in piece_module(model, piece).parameters())
        x = x.detach().requires_grad_(i > 0)
        counter = flop_counter()
        try:
            with counter:
                out = mod(x)
                out.float().sum().backward()
        except Exception as exc:
            raise ConfigError(
                f"cannot trace piece {piece.name!r} on the meta device to cost it ({type(exc).__name__}: {exc})"
            ) from None
        flops = counter.get_total_flops() / 2
        costs.append(PieceCost(piece.name, params, flops, out[0].numel(), tuple(out.shape[1:])))
        x = out
    return costs


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# the cut


def balanced_cut(costs: list[float], stages: int) -> list[int]:
    """Start index of each stage (the first is 0) of the contiguous partition of ``costs`` into ``stages``
    non-empty parts whose largest part is smallest (dynamic programming; ties: the earliest cut)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max-part cost of the first i pieces in k parts; cut[k][i]: where part k begins
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_model(
    model: nn.Module,
    stages: int,
    *,
    balance: str = "params",
    split_points: list[str] | None = None,
    sample_shape: tuple[int, ...] = (3, 32, 32),
    tokens: bool = False,
    name: str = "",
) -> Split:
    """The split of ``model`` into ``stages`` stages (``tokens``: it takes token ids of ``sample_shape``
    (seq_len,)); ConfigError naming the problem when it cannot be done (a bad stage count or split point
    before anything is costed)."""
    if balance not in BALANCE:
        raise ConfigError(f"unknown balance {balance!r}; choose one of: {', '.join(BALANCE)}")
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    pieces = pieces_of(model)
    labels = [p.name for p in pieces]
    name = name or type(model).__name__
    if stages > len(pieces):
        raise ConfigError(
            f"{stages} stages need {stages - 1} split points, but {name} has only {len(pieces) - 1}: "
            f"{name} has {len(pieces)} pieces ({', '.join(labels)}), so at most {len(pieces)} stages"
        )
    points = [p.strip() for p in (split_points or []) if p.strip()]
    starts = _explicit_starts(points, labels, stages) if points else None
    costs = piece_costs(model, pieces, sample_shape, tokens)
    if starts is None:
        key = (lambda c: float(c.params)) if balance == "params" else (lambda c: c.flops)
        starts = balanced_cut([key(c) for c in costs], stages)
    bounds = [*starts, len(pieces)]
    _check_disjoint(model, pieces, bounds, name)
    out = []
    for s in range(stages):
        part = range(bounds[s], bounds[s + 1])
        last = costs[bounds[s + 1] - 1]
        out.append(
            Stage(
                index=s,
                pieces=[labels[i] for i in part],
                modules=[m for i in part for m in pieces[i].modules],
                params=_unique_params(model, [pieces[i] for i in part]),
                flops=sum(costs[i].flops for i in part),
                out_numel=last.out_numel,
                out_shape=last.out_shape,
            )
        )
    return Split(name, balance, points, out, costs)


def _explicit_starts(points: list[str], labels: list[str], stages: int) -> list[int]:
    """The first piece of each stage for ``--split-points`` (pieces where a stage begins)."""
    unknown = [p for p in points if p not in labels[1:]]
    if unknown:
        raise ConfigError(
            f"split point {unknown[0]!r} is not a piece a stage can begin at; choose among: {', '.join(labels[1:])}"
        )
    if len(points) != stages - 1:
        raise ConfigError(
            f"{len(points)} split points ({', '.join(points)}) make {len(points) + 1} stages, not {stages}"
        )
    starts = [0, *(labels.index(p) for p in points)]
    if starts != sorted(set(starts)):
        raise ConfigError(f"split points must be distinct and in forward order: {', '.join(labels[1:])}")
    return starts


def _unique_params(model: nn.Module, pieces: list[Piece]) -> int:
    """Parameters of a stage, a tied weight its pieces share counted once."""
    unique = {id(p): p for piece in pieces for p in piece_module(model, piece).parameters()}
    return sum(p.numel() for p in unique.values())


def _check_disjoint(model: nn.Module, pieces: list[Piece], bounds: list[int], name: str) -> None:
    """Each stage holds its own parameters: a parameter two stages would share (a head tied to the token
    embedding, gpt2-small's and llama-1b's) would get two gradients, each stage's own, and drift apart."""
    owner: dict[int, tuple[int, str]] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for s in range(len(bounds) - 1):
        for piece in pieces[bounds[s] : bounds[s + 1]]:
            for p in piece_module(model, piece).parameters():
                stage, first = owner.setdefault(id(p), (s, piece.name))
                if stage != s:
                    raise ConfigError(
                        f"{name}'s pieces {first} and {piece.name} share the parameter {names[id(p)]!r} (a tied "
                        f"weight), and this split puts them in stages {stage} and {s}: a stage holds its own "
                        "parameters; use one stage or a model without tied weights (gpt-tiny, llama-8b)"
                    )


def stage_module(model: nn.Module, stage: Stage) -> nn.Sequential:
    """The stage as an ``nn.Sequential`` over the original module objects of its pieces."""
    return nn.Sequential(
        *(nn.Flatten(1) if name == FLATTEN else model.get_submodule(name) for name in stage.modules)
    )


def drop_modules(model: nn.Module, keep: set[str]) -> None:
    """Remove from ``model`` every top-level piece module not named in ``keep`` (set to None: its parameters
    are freed and it leaves the state dict), so that the model holds only this rank's stages under their
    original names."""
    for name in {m for m in _all_piece_modules(model) if m not in keep}:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent._modules[child] = None


def _all_piece_modules(model: nn.Module) -> list[str]:
    return [m for p in pieces_of(model) for m in p.modules if m != FLATTEN]


# ------------------------------------------------------------------------------------------------
# from a run config (preflight, estimate): the split of the model the run will build, on the meta device


@functools.cache
def piece_count(spec) -> int:
    """How many pieces the model ``spec`` builds (``spec.build()``: a hashable description of the run's model)
    can be split into (meta device)."""
    with torch.device("meta"):
        return len(pieces_of(spec.build()))


@functools.cache
def split_for_spec(
    spec,
    stages: int,
    balance: str,
    split_points: tuple[str, ...],
    sample_shape: tuple[int, ...],
    tokens: bool = False,
) -> Split:
    """The split of the model ``spec`` builds (``spec.build()``, ``spec.model`` its name), costed on the meta
    device on samples of ``sample_shape`` (``tokens``: token ids)."""
    with torch.device("meta"):
        model = spec.build()
    return split_model(
        model,
        stages,
        balance=balance,
        split_points=list(split_points),
        sample_shape=sample_shape,
        tokens=tokens,
        name=spec.model,
    )
