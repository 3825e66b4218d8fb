"""A model's blocks and the FSDP units built from them: one rule for training (fsdp's wrapping, activation
checkpointing) and for predicting (the estimate's and the projection's units), so that a prediction prices the
units a run builds, and both say which units they assumed.

The blocks (``find_blocks``):

1. the classes the model declares (``_stratbench_block_types`` on the root module: the built-in transformer's
   blocks, tinynet's, a Hugging Face model's decoder layers from its ``_no_split_modules``);
2. else repeated children: among the groups of sibling modules of one class (children of one parent, looking
   through ``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict`` and activation-checkpoint wrappers), the group
   that holds the most parameters, taken when every module of its class together holds at least
   ``MIN_SHARE`` of the model's parameters (a ResNet's Bottlenecks, a user's stack of blocks, an MLP's Linears);
3. else none: ``--wrap block`` is refused in one line that names the largest group found and the other choices.

``wrap_units`` turns fsdp's ``--wrap`` (auto, block, size, none, class names) into the modules that become units;
``auto`` (the default) is block where the model has blocks, else size (a user's plain CNN or MLP), said so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from stratbench.core.errors import ConfigError

MIN_SHARE = 0.5
"""Repeated sibling modules are the blocks when their class holds at least this share of the parameters (most of
them): a pair of norms or a model's two small heads are not."""
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""Modules that only hold others: their children count as their parent's (exact classes: a block that subclasses
nn.Sequential is a block)."""
WRAP_CHOICES = "--wrap size (modules of >= --wrap-min-params parameters), --wrap none (the root only) or --wrap CLASS[,CLASS]"


@dataclass(frozen=True)
class Blocks:
    """The block classes of a model, how many modules of them it holds (outermost ones) and their share of the
    parameters."""

    types: tuple[type[nn.Module], ...]
    count: int
    share: float
    declared: bool
    """Declared by the model (``_stratbench_block_types``), else found as repeated sibling modules."""

    def describe(self) -> str:
        """E.g. "12 x MPTBlock (repeated sibling modules, 96% of the parameters)"."""
        how = "declared by the model" if self.declared else "repeated sibling modules"
        return f"{self.count} x {', '.join(t.__name__ for t in self.types)} ({how}, {self.share:.0%} of the parameters)"


def _inner(module: nn.Module) -> nn.Module:
    """The module under an activation-checkpoint wrapper (itself otherwise)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _children(module: nn.Module) -> Iterator[nn.Module]:
    """The children of ``module`` as its blocks sit in it: containers looked through, wrappers unwrapped."""
    for child in module.children():
        child = _inner(child)
        if type(child) in CONTAINERS:
            yield from _children(child)
        else:
            yield child


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outermost(model: nn.Module, types: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of ``types`` in ``model`` not inside another one of them (pre-order)."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, types):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _group(model: nn.Module, types: tuple[type[nn.Module], ...], declared: bool) -> Blocks:
    mods = _outermost(model, types)
    total = max(1, _numel(model))
    return Blocks(types, len(mods), min(1.0, sum(map(_numel, mods)) / total), declared)


def _largest_group(model: nn.Module) -> Blocks | None:
    """The class of the group of same-class siblings that holds the most parameters (the shallowest on a tie),
    with every module of that class counted; None where no module has two siblings of its class."""
    best: tuple[int, type[nn.Module]] | None = None
    level = [model]
    while level:  # breadth first: a tie goes to the shallower group
        below: list[nn.Module] = []
        for parent in level:
            kids = list(_children(parent))
            below.extend(kids)
            for cls, n in Counter(type(k) for k in kids).items():
                size = sum(_numel(k) for k in kids if type(k) is cls)
                if n >= 2 and size > 0 and (best is None or size > best[0]):
                    best = (size, cls)
        level = below
    return None if best is None else _group(model, (best[1],), declared=False)


def find_blocks(model: nn.Module) -> Blocks | None:
    """The model's blocks by the module docstring's rule, or None where it has none."""
    present = {type(m) for m in model.modules()}
    declared = tuple(t for t in getattr(model, "_stratbench_block_types", ()) if t in present)
    if declared:
        return _group(model, declared, declared=True)
    group = _largest_group(model)
    return group if group is not None and group.share >= MIN_SHARE else None


def why_no_blocks(model: nn.Module) -> str:
    """Why ``find_blocks`` found none, in words naming the largest candidate."""
    group = _largest_group(model)
    largest = f"; the largest group: {group.describe().split(' (')[0]}, {group.share:.0%}" if group else ""
    return (
        f"{type(model).__name__} declares no block classes, and no class of repeated sibling modules holds "
        f"{MIN_SHARE:.0%} of its parameters{largest}"
    )


def block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The block classes (FSDP units, activation checkpointing), empty where the model has none."""
    blocks = find_blocks(model)
    return blocks.types if blocks else ()


# ------------------------------------------------------------------------------------------------
# fsdp's --wrap: the modules that become units


def resolve_wrap(model: nn.Module, wrap: str) -> str:
    """``--wrap auto``: block where the model has blocks, else size; any other choice as it is."""
    if wrap != "auto":
        return wrap
    return "block" if find_blocks(model) is not None else "size"


def wrap_units(model: nn.Module, wrap: str, min_params: int) -> list[nn.Module]:
    """The sub-modules that become FSDP units under ``--wrap`` (auto, block, size, none or class names),
    children before parents (``fully_shard`` goes bottom-up); the root, a unit of its own, is not in the list.

    A block under an activation-checkpointing wrapper is sharded through that wrapper, so that the re-gather
    for the recomputed forward happens inside the checkpointed region (torchtitan's order: AC, then FSDP).
    """
    wrap = resolve_wrap(model, wrap)
    if wrap == "none":
        return []
    if wrap == "size":
        return _size_units(model, min_params)
    if wrap == "block":
        blocks = find_blocks(model)
        if blocks is None:
            raise ConfigError(
                f"fsdp --wrap block: no blocks to wrap: {why_no_blocks(model)}; use {WRAP_CHOICES}"
            )
        types_ = blocks.types

        def matches(m: nn.Module) -> bool:
            return isinstance(m, types_)
    else:
        names = {n.strip() for n in wrap.split(",") if n.strip()}
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(names - present)
        if missing:
            raise ConfigError(
                f"fsdp --wrap: no module of class {', '.join(missing)} in this model; classes present: "
                f"{', '.join(sorted(present))} (or use block, size, none)"
            )

        def matches(m: nn.Module) -> bool:
            return type(m).__name__ in names

    units: list[nn.Module] = []
    inner_of_wrapper: set[int] = set()
    for m in model.modules():  # pre-order: a checkpoint wrapper is seen before the block inside it
        if m is model:
            continue
        if _inner(m) is not m and matches(_inner(m)):
            units.append(m)
            inner_of_wrapper.add(id(_inner(m)))
        elif matches(m) and id(m) not in inner_of_wrapper:
            units.append(m)
    return units[::-1]  # reversed pre-order puts every module after its descendants


def _size_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Post-order walk: a module becomes a unit once it holds >= min_params parameters not in a unit below."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> int:
        n = sum(p.numel() for p in m.parameters(recurse=False))
        n += sum(visit(c) for c in m.children())
        if m is not model and n >= min_params:
            units.append(m)
            return 0
        return n

    visit(model)
    return units


def describe_units(model: nn.Module, wrap: str, min_params: int, units: list[nn.Module]) -> str:
    """One line saying which FSDP units ``--wrap`` gave (train's log, the estimate's and projection's note)."""
    fell_back = ""
    if wrap == "auto":
        wrap = resolve_wrap(model, wrap)
        if wrap == "size":
            fell_back = f" (--wrap auto: {why_no_blocks(model)}, so units by size)"
    if not units:
        how = fell_back.strip() or "(--wrap none: one all-gather per phase)"
        return f"FSDP units: the root only, the whole model in one unit {how}"
    if wrap == "block":
        blocks = find_blocks(model)
        assert blocks is not None  # wrap_units refused a model without blocks
        what = blocks.describe()
    else:
        counts = Counter(type(_inner(u)).__name__ for u in units)
        by_class = ", ".join(f"{n} x {name}" for name, n in counts.most_common())
        rule = f"modules of >= {min_params:,} parameters" if wrap == "size" else f"classes {wrap}"
        what = f"{by_class} (--wrap {wrap}: {rule})"
    return f"FSDP units: {what}, then the root for the rest{fell_back}"
