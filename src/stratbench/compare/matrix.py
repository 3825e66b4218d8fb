"""The comparison matrix: cells (method x precision x world size x batch size) on one model and data set.

A matrix is a small mapping - the same shape for the built-in presets and for a user's YAML file::

    name: my-sweep
    base: {model: tinynet, data: digits, epochs: 2, batch_size: 64}   # TrainConfig options of every cell
    world_size: 2                        # processes of multi-process methods (default 2)
    cells:                               # each entry is expanded as a product of its list values
      - {method: single, precision: [fp32, bf16-mixed]}
      - {method: [ddp, fsdp], precision: [fp32, bf16-mixed]}
      - {method: deepspeed, options: [{zero_stage: 1}, {zero_stage: 3}], label: "deepspeed-z{zero_stage}"}
      - {method: single, precision: fp32, config: {tf32: true}, label: "single+tf32"}
      - {method: ddp, precision: fp32, world_size: 4, nodes: 2}  # 2 processes on each of 2 nodes
    pretrain: {model: gpt-tiny, data: text, max_steps: 200}  # optional: one run before the cells (below)

``pretrain`` (TrainConfig options) is one ``single`` run the sweep makes once, before its cells, into
``OUTPUT/pretrain``; every cell starts from its last checkpoint (``init_from``), so that a fine-tuning matrix
compares methods on a trained model. A rerun keeps a finished pretraining run (``compare.pretrain``).

Instead of ``cells`` a file may give ``methods``/``precisions``/``world_sizes``/``batch_sizes`` lists (one product).
Before anything runs, ``plan`` decides for each cell whether it can run here, and why not.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stratbench.checkpoints.checkpoint import last_checkpoint
from stratbench.compare import presets
from stratbench.core.config import TrainConfig, canonical_precision, from_dict, load_yaml
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, StratbenchError, UnsupportedError, did_you_mean
from stratbench.core.precision import SPECS, configure_tf32, slow_on, spec_of
from stratbench.core.tables import fmt_bytes
from stratbench.data.datasets import check_one_batch
from stratbench.predicting.estimate import estimate, parse_bytes
from stratbench.strategies.base import all_strategies
from stratbench.training import engine

STATUSES = ("ok", "failed", "oom", "timeout", "nan", "skipped")
"""Outcome of a cell: ok, failed (crash or bad config), oom, timeout, nan (loss became NaN/inf), skipped (cannot run here)."""

# Options that belong to the sweep, not to a cell: compare sets them per cell (output, processes, progress).
SWEEP_OWNED = (
    "output",
    "strategy",
    "precision",
    "nproc",
    "strategy_options",
    "nnodes",
    "resume",
    "resume_from",
    "progress",
)
ENTRY_KEYS = ("method", "precision", "world_size", "batch_size", "options", "config", "label", "nodes")


def slug(text: str) -> str:
    """``text`` as a file name's part: every run of other characters than letters, digits, '.', '+' and '-' one
    '-' (a cell's id, a ``--methods`` sweep's name from its model and data)."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-")


@dataclass(frozen=True)
class Cell:
    """One training run of the sweep; ``config`` holds only the options set explicitly (base + the cell's own)."""

    method: str
    precision: str
    world_size: int
    config: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    nodes: int = 1
    """Machines the cell's ``world_size`` processes spread over (``procs_per_node`` on each)."""
    start: str = ""
    """The digest of the matrix's pretraining run the cell starts from ('' where it has none): a cell recorded
    from another pretraining run is another cell."""

    @property
    def procs_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def shape(self) -> str:
        """``x2``, or ``x4 on 2 nodes``: how the display names the cell's processes."""
        return f"x{self.world_size}" + (f" on {self.nodes} nodes" if self.nodes > 1 else "")

    @property
    def batch_size(self) -> int:
        return int(self.config.get("batch_size", TrainConfig.batch_size))

    @property
    def name(self) -> str:
        """Method label shown in the table (e.g. ``deepspeed-z2``); the method name when no label was given."""
        return self.label or self.method

    @property
    def id(self) -> str:
        """Stable id from everything that changes the run: readable part + hash (resume matches on it)."""
        key = {"method": self.method, "precision": self.precision, "world_size": self.world_size,
               "options": self.options, "config": self.config}  # fmt: skip
        if self.start:
            key["start"] = self.start
        nodes = ""
        if self.nodes > 1:  # one node keeps the ids of the sweeps recorded before cells had nodes
            key["nodes"] = self.nodes
            nodes = f"n{self.nodes}"
        digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"{slug(self.name)}_{self.precision}_w{self.world_size}{nodes}_b{self.batch_size}_{digest}"

    def train_config(self, output: str | Path, progress: bool = True) -> dict[str, Any]:
        """The YAML mapping the cell's ``stratbench train --config`` reads."""
        return {
            **self.config,
            "strategy": self.method,
            "precision": self.precision,
            "strategy_options": dict(self.options),
            "nproc": self.procs_per_node,
            **({"nnodes": self.nodes} if self.nodes > 1 else {}),
            "output": str(output),
            "progress": progress,
        }


@dataclass
class Matrix:
    """A named list of cells plus what the whole sweep needs (``gpu_only``: its numbers only mean something on GPUs)."""

    name: str
    description: str
    cells: list[Cell]
    base: dict[str, Any] = field(default_factory=dict)
    gpu_only: bool = False
    timeout_s: float = 900.0
    device_memory: int | None = None
    """Memory of one device (bytes): a cell whose estimate exceeds it is not run but recorded as 'does not fit
    (estimate X of Y)' (``--device-memory`` or the matrix's ``device_memory``)."""
    pretrain: dict[str, Any] | None = None
    """The options of one ``single`` run made before the cells, whose last checkpoint every cell starts from
    (``init_from``, unless the cell sets its own); None: the cells start as their configs say."""
    title: str = ""
    """What the report is titled (the name where empty): a preset run on the user's model says so."""

    @property
    def heading(self) -> str:
        """The report's title: the title where one was given or made, else the name."""
        return self.title or self.name

    def uses_gpus(self, cell: Cell) -> bool:
        """The cell's processes each need a GPU reserved for them (an executor that reserves resources asks):
        its device is cuda, or auto in a matrix that measures GPUs."""
        device = str(cell.config.get("device", "auto"))
        return device == "cuda" or (device == "auto" and self.gpu_only)


# ------------------------------------------------------------------------------------------------
# building


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _default_world(method: str, default: int) -> int:
    """Multi-process methods get the matrix's world size; one-process methods one process."""

    cls = all_strategies().get(method)
    if cls is None:  # not installed: assume it is one of the distributed methods (they are the optional ones)
        return default
    return default if cls.needs_process_group else 1


CELL_DEFAULTS: dict[str, Any] = {"breakdown": True, "comm_volume": True, "measure_alloc": True}
"""What every compare cell measures unless its matrix says otherwise: the step's phases, the collectives of
step 3 against the method's formula, and (CPU) the allocator's bytes against the memory estimate. The last two
record a warm-up step only (3 warm-up steps by default), so they cost the measured steps nothing."""


def build_matrix(
    spec: dict[str, Any], overrides: dict[str, Any] | None = None, world_size: int | None = None,
    nodes: int | None = None, precision: str | None = None, pretrain_steps: int | None = None,
    method_options: dict[str, dict[str, Any]] | None = None,
) -> Matrix:
    """Expand a matrix mapping into cells; ``overrides`` (train options from the command line) replace base values;
    ``nodes`` (``--nodes``): the nodes of every multi-process cell whose entry gives none; ``precision``
    (``--precision``): every cell's precision (cells that then coincide run once); ``pretrain_steps``
    (``--pretrain-steps``): the steps of the matrix's pretraining run; ``method_options``
    (``--method-option``): strategy options added to every cell of their method."""
    if precision is not None:
        precision = canonical_precision(precision)
        spec_of(precision)
    base = _matrix_base(spec, overrides)
    default_world = int(world_size or spec.get("world_size") or 2)
    entries = spec.get("cells")
    if entries is None:
        entries = [{"method": spec.get("methods", ["single"]), "precision": spec.get("precisions", ["fp32"]),
                    **({"world_size": spec["world_sizes"]} if "world_sizes" in spec else {}),
                    **({"batch_size": spec["batch_sizes"]} if "batch_sizes" in spec else {})}]  # fmt: skip
    if not isinstance(entries, list) or not entries:
        raise ConfigError("matrix: 'cells' must be a non-empty list of entries (method, precision, ...)")
    pretrain = _pretrain_of(spec.get("pretrain"), pretrain_steps)
    start = hashlib.sha1(json.dumps(pretrain, sort_keys=True, default=str).encode()).hexdigest()[:8] if pretrain else ""
    cells: list[Cell] = []
    seen: set[str] = set()
    for n, entry in enumerate(entries):
        for cell in _expand_entry(n + 1, entry, base, overrides, default_world, nodes, precision, method_options):
            cell = dataclasses.replace(cell, start=start)
            if cell.id not in seen:  # overrides can make two entries the same run: keep one
                seen.add(cell.id)
                cells.append(cell)
    return Matrix(
        name=str(spec.get("name") or "matrix"),
        description=str(spec.get("description") or ""),
        cells=cells,
        base=base,
        gpu_only=bool(spec.get("gpu_only", False)),
        timeout_s=float(spec.get("timeout_s") or 900),
        device_memory=bytes_of(spec.get("device_memory")),
        pretrain=pretrain,
        title=str(spec.get("title") or ""),
    )


PRETRAIN = "pretrain"
"""The folder of a sweep's pretraining run, in its output folder."""
PRETRAIN_OWNED = ("output", "strategy", "nproc", "nnodes", "strategy_options", "resume", "resume_from",
                  "init_from", "progress")  # fmt: skip
"""What the sweep sets on its pretraining run itself (one process of ``single`` into ``OUTPUT/pretrain``)."""


def _pretrain_of(value: Any, steps: int | None = None) -> dict[str, Any] | None:
    """The matrix's ``pretrain`` mapping, checked as TrainConfig options (one line naming a bad key), with
    ``steps`` (``--pretrain-steps``) as its ``max_steps`` where given."""
    if value is None:
        if steps is not None:
            raise ConfigError("--pretrain-steps: this matrix has no pretraining run (its 'pretrain' entry)")
        return None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"matrix: 'pretrain' must be a mapping of training options, got {value!r}")
    owned = sorted(set(value) & set(PRETRAIN_OWNED))
    if owned:
        raise ConfigError(f"matrix pretrain: {', '.join(map(repr, owned))} is set by compare (one `single` process "
                          "into OUTPUT/pretrain); leave it out")  # fmt: skip
    value = {**value, **({"max_steps": steps} if steps is not None else {})}
    from_dict(TrainConfig, value, where="matrix pretrain")
    return value


def pretrain_config(matrix: Matrix, out: Path) -> dict[str, Any]:
    """The YAML mapping of the sweep's pretraining run (``matrix.pretrain`` into ``out/pretrain``)."""
    return {**(matrix.pretrain or {}), "strategy": "single", "output": str(Path(out) / PRETRAIN), "progress": False}


def pretrained_checkpoint(out: Path) -> Path:
    """The checkpoint the cells of a sweep with a ``pretrain`` run start from: its last one."""
    return last_checkpoint(Path(out) / PRETRAIN)


def bytes_of(value: Any) -> int | None:
    """A device memory budget: bytes, a size such as ``24GiB``, or ``auto``: the memory of this machine's GPU
    (no budget without one). Anything else: one line naming it."""
    if value is None:
        return None
    if str(value).strip().lower() == "auto":
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return parse_bytes(str(value))


MATRIX_KEYS = ("name", "title", "description", "base", "world_size", "gpu_only", "timeout_s", "device_memory", "cells",
               "methods", "precisions", "world_sizes", "batch_sizes", "pretrain")  # fmt: skip


def _matrix_base(spec: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The options every cell shares (the cell defaults, the matrix's base, the command line's overrides),
    checked: a matrix with unknown keys, or a base that sets what compare sets per cell, is refused."""
    if not isinstance(spec, dict):
        raise ConfigError(f"a comparison matrix must be a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(MATRIX_KEYS))
    if unknown:
        raise ConfigError(
            f"matrix: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(MATRIX_KEYS))}"
        )
    base = CELL_DEFAULTS | dict(spec.get("base") or {})
    base.update(overrides or {})
    for key in SWEEP_OWNED:
        if key in base:
            raise ConfigError(
                f"matrix base: {key!r} is set per cell by compare; give it in a cell entry instead"
            )
    from_dict(TrainConfig, base, where="matrix base")  # unknown keys / bad types fail here, naming the key
    return base


def _expand_entry(
    n: int, entry: Any, base: dict[str, Any], overrides: dict[str, Any] | None, default_world: int,
    default_nodes: int | None = None, every_precision: str | None = None,
    method_options: dict[str, dict[str, Any]] | None = None,
) -> list[Cell]:
    """The cells of cell entry ``n`` (from 1): the product of its list values (``every_precision``:
    the precision of each, whatever the entry says; ``method_options``: added to each cell of their method)."""
    if not isinstance(entry, dict) or "method" not in entry:
        raise ConfigError(f"matrix cell entry {n} must be a mapping with at least 'method', got {entry!r}")
    bad = sorted(set(entry) - set(ENTRY_KEYS))
    if bad:
        raise ConfigError(
            f"matrix cell entry {n}: unknown key(s) {', '.join(bad)}; known: {', '.join(ENTRY_KEYS)}"
        )
    extra = dict(entry.get("config") or {})
    for key in SWEEP_OWNED:
        if key in extra:
            raise ConfigError(f"matrix cell entry {n}: 'config' cannot set {key!r}; use the entry's own keys")
    cells = []
    for method, precision, world, batch, options in itertools.product(
        _as_list(entry["method"]),
        [every_precision] if every_precision else _as_list(entry.get("precision", "fp32")),
        _as_list(entry.get("world_size")),
        _as_list(entry.get("batch_size")),
        _as_list(entry.get("options") or {}),
    ):
        config = {**base, **extra}
        # Command-line overrides win over cell entries too: the user asked for them for every cell.
        config.update(overrides or {})
        if batch is not None and not (overrides and "batch_size" in overrides):
            config["batch_size"] = int(batch)
        label = str(entry.get("label") or "")
        if label:
            try:
                label = label.format(**options)
            except (KeyError, IndexError):
                raise ConfigError(
                    f"matrix cell entry {n}: label {label!r} names an option not in {options}"
                ) from None
        options = {**options, **(method_options or {}).get(str(method), {})}
        world = int(world) if world is not None else _default_world(str(method), default_world)
        nodes = _nodes_of(n, entry.get("nodes"), default_nodes, world)
        cells.append(
            Cell(str(method), canonical_precision(str(precision)), world, config, dict(options), label, nodes)
        )
    return cells


def _nodes_of(n: int, given: Any, default: int | None, world: int) -> int:
    """Nodes of a cell of ``world`` processes: the entry's ``nodes``, else ``--nodes`` for a cell of several
    processes (a one-process cell runs on one node); they must divide the processes evenly."""
    if given is None:
        if not default or world == 1:
            return 1
        nodes, where = default, "--nodes"
    else:
        nodes, where = given, f"matrix cell entry {n}: nodes"
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or world % nodes:
        raise ConfigError(f"{where} {nodes!r} must be a whole number of nodes that divides the cell's {world} "
                          f"processes (1{''.join(f', {d}' for d in range(2, world + 1) if world % d == 0)})")  # fmt: skip
    return nodes


def load_matrix(preset: str | None, path: str | None, overrides: dict[str, Any] | None = None,
                world_size: int | None = None, nodes: int | None = None, precision: str | None = None,
                pretrain_steps: int | None = None, methods: list[str] | None = None,
                precisions: list[str] | None = None,
                method_options: dict[str, dict[str, Any]] | None = None) -> Matrix:  # fmt: skip
    """A preset by name, a YAML matrix file, or ``methods`` (``compare --methods``: no preset; exactly one of
    them). ``method_options``: strategy options for every cell of a method (``--method-option``)."""
    if methods:
        spec = methods_spec(methods, [precision] if precision else precisions, overrides)
        matrix = build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
        matrix.description = f"{describe_base(matrix.base)}; {spec['description']}"
        return matrix
    if precisions:
        raise ConfigError("--precisions lists the precisions of --methods; with a preset or a matrix use "
                          "--precision (every cell) or --only")  # fmt: skip
    if path:
        spec = load_yaml(path)
        try:
            return build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
        except ConfigError as exc:
            raise ConfigError(f"{path}{_line_of(Path(path), str(exc))}: {exc}") from None
    else:
        name = preset or "quick"
        if name not in presets.PRESETS:
            raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, presets.PRESETS)}; choose one of: "
                              f"{', '.join(presets.PRESETS)} (or --matrix FILE.yaml, or --methods a,b,c)")  # fmt: skip
        if name == "seed":
            spec = presets.preset_seed(world_size, bool((overrides or {}).get("download")))
        elif name in presets.WORLD_PRESETS:
            spec = presets.PRESETS[name](world_size)
        else:
            spec = presets.PRESETS[name]()
    matrix = build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
    return _titled(matrix, spec, name, overrides)


def _line_of(path: Path, message: str) -> str:
    """" line N" of the YAML matrix file ``path`` where ``message`` points: the cell entry it numbers, else the
    first key it quotes ('' where neither is found)."""
    try:
        root = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return ""
    keys: dict[str, int] = {}
    entries: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                keys.setdefault(str(key.value), key.start_mark.line + 1)
                if key.value == "cells" and isinstance(value, yaml.SequenceNode):
                    entries.extend(item.start_mark.line + 1 for item in value.value)
                walk(value)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item)

    walk(root)
    entry = re.search(r"cell entry (\d+)", message)
    if entry and 0 < int(entry.group(1)) <= len(entries):
        return f" line {entries[int(entry.group(1)) - 1]}"
    found = [keys[q] for q in re.findall(r"'([^']+)'", message) if q in keys]
    return f" line {found[0]}" if found else ""


QUICK_KNOBS = ("epochs", "batch_size", "measure_flops", "timing_warmup_steps")
"""The quick preset's training settings a ``--methods`` sweep starts from (its model and data are the user's)."""


def check_methods(methods: list[str]) -> list[str]:
    """The method names, each known (one line with "did you mean" otherwise), in order, once each."""
    known = all_strategies()
    if not methods:
        raise ConfigError(f"--methods needs at least one method; choose from: {', '.join(sorted(known))}")
    for m in methods:
        if m not in known:
            raise ConfigError(f"unknown method {m!r}{did_you_mean(m, known)}; choose from: {', '.join(sorted(known))}")
    return list(dict.fromkeys(methods))


def methods_spec(methods: list[str], precisions: list[str] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The matrix of ``compare --methods a,b,c [--precisions p,q]``: each method at each precision, on the
    model and data the command line gives (the quick preset's tinynet on digits where it gives none), with the
    quick preset's epochs, batch and warm-up."""
    methods = check_methods(methods)
    precisions = [canonical_precision(p) for p in (precisions or ["fp32"])]
    for p in precisions:
        spec_of(p)
    quick = presets.preset_quick()["base"]
    given = overrides or {}
    base = {k: quick[k] for k in QUICK_KNOBS}
    if "model" not in given:
        base.update(model=quick["model"], width=quick["width"])
    if "data" not in given:
        base.update(data=quick["data"], image_size=quick["image_size"])
    model = str(given.get("model", base.get("model")))
    named = f"{model} on {given['data']}" if "data" in given else model  # two data sets: two default folders
    return {
        "name": slug(named) or "methods",
        "title": model,
        "description": f"{', '.join(methods)} at {', '.join(precisions)}",
        "base": base,
        "timeout_s": 600,
        "cells": [{"method": m, "precision": precisions} for m in methods],
    }


def describe_base(base: dict[str, Any]) -> str:
    """What every cell trains, in words: "mynet:build on mydata:build, 2 epochs, global batch 64"."""
    steps = base.get("max_steps")
    epochs = int(base.get("epochs", TrainConfig.epochs))
    length = f"{steps} steps" if steps else f"{epochs} epoch{'s' if epochs != 1 else ''}"
    model, data = base.get("model", TrainConfig.model), base.get("data", TrainConfig.data)
    return f"{model} on {data}, {length}, global batch {base.get('batch_size', TrainConfig.batch_size)}"


def _titled(matrix: Matrix, spec: dict[str, Any], preset: str | None, overrides: dict[str, Any] | None) -> Matrix:
    """The report's title and Setup line as the cells run: a preset whose model or data the command line
    replaced says so instead of describing its own."""
    given = overrides or {}
    base = spec.get("base") or {}
    if preset and any(k in given and given[k] != base.get(k) for k in ("model", "data")):
        matrix.title = f"{preset} on {matrix.base.get('model', TrainConfig.model)}"
        matrix.description = f"{describe_base(matrix.base)}; the {preset} preset's cells"
    return matrix


METHOD_OPTION = re.compile(r"^([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)=(.*)$")


def parse_method_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--method-option METHOD.KEY=VALUE`` (repeatable) as {method: {key: value}} (VALUE read as YAML), each
    checked as ``check_method_option`` checks it."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        found = METHOD_OPTION.match(item.strip())
        if not found:
            raise ConfigError(f"--method-option {item!r} is not METHOD.KEY=VALUE (e.g. fsdp.wrap=size)")
        method, key, raw = found.group(1), found.group(2).replace("-", "_"), found.group(3)
        value = yaml.safe_load(raw) if raw.strip() else raw
        check_method_option(method, key, value, f"--method-option {item!r}")
        out.setdefault(method, {})[key] = value
    return out


def check_method_option(method: str, key: str, value: Any, where: str) -> None:
    """One of a method's options, against the method's ``Options``: an unknown method or key, or a bad value,
    is one line naming ``where``, with "did you mean"."""
    known = all_strategies()
    if method not in known:
        raise ConfigError(f"{where}: unknown method {method!r}{did_you_mean(method, known)}")
    fields = [f.name for f in dataclasses.fields(known[method].Options)]
    if key not in fields:
        raise ConfigError(f"{where}: {method} has no option {key!r}{did_you_mean(key, fields)}; its options: "
                          f"{', '.join(fields)}")  # fmt: skip
    from_dict(known[method].Options, {key: value}, where=where)


# ------------------------------------------------------------------------------------------------
# filters


def _matches(cell: Cell, token: str) -> bool:
    token = token.strip()
    names = (cell.method, cell.name, cell.precision, cell.id, f"w{cell.world_size}")
    return any(token == n or fnmatch.fnmatchcase(n, token) for n in names)


def select(cells: list[Cell], only: list[str] | None, skip: list[str] | None) -> list[Cell]:
    """``only``: each flag is a comma list; a cell must match one name of every flag. ``skip``: drop any match.

    A name matches a cell's method (ddp), label (deepspeed-z2), precision (bf16-mixed), id, or ``wN``
    (world size); shell wildcards work (``deepspeed*``)."""
    groups = [[t for t in g.split(",") if t.strip()] for g in (only or [])]
    dropped = [t for g in (skip or []) for t in g.split(",") if t.strip()]
    out = [c for c in cells if all(any(_matches(c, t) for t in g) for g in groups)]
    out = [c for c in out if not any(_matches(c, t) for t in dropped)]
    if not out:
        raise ConfigError(
            f"--only/--skip left no cells; cells are: {', '.join(sorted({c.name for c in cells}))} "
            f"x {', '.join(sorted({c.precision for c in cells}))}"
        )
    return out


# ------------------------------------------------------------------------------------------------
# what can run here


@dataclass(frozen=True)
class Plan:
    """What the sweep will do with a cell before running it: run it, or record it as skipped/failed with a reason."""

    cell: Cell
    status: str | None
    """None: run it; 'skipped': cannot run on this machine; 'failed': its configuration is invalid."""
    reason: str = ""


def plan_cell(cell: Cell, matrix: Matrix, allow_slow: bool = False) -> Plan:
    """Decide, without starting any work, whether ``cell`` can run on this machine (and why not)."""

    cls = all_strategies().get(cell.method)
    if cls is None:
        return Plan(cell, "skipped", f"strategy {cell.method} is not available in this install")
    try:
        cfg = from_dict(TrainConfig, cell.train_config("unused"), where=f"cell {cell.id}")
        try:
            device = resolve_device(cfg.device)
        except UnsupportedError as exc:
            return Plan(cell, "skipped", str(exc))
        if matrix.gpu_only and device.type != "cuda" and not allow_slow:
            return Plan(cell, "skipped", f"preset {matrix.name!r} measures GPUs and this machine has none "
                        "(--allow-slow runs it on the CPU anyway)")  # fmt: skip
        spec = SPECS.get(cell.precision)
        slow = slow_on(spec, device) if spec is not None else None
        if slow and not allow_slow:
            return Plan(cell, "skipped", f"{slow} (--allow-slow runs it anyway)")
        gpus = presets.gpu_count()
        if device.type == "cuda" and cls.needs_process_group and cell.procs_per_node > gpus:
            return Plan(
                cell, "skipped", f"needs {cell.procs_per_node} GPUs (one per process); this machine has {gpus}"
            )
        engine.preflight(cfg, world_size=cell.world_size)
        check_one_batch(cfg)
        configure_tf32(cfg.tf32, device)  # --tf32 needs an Ampere GPU; only flips flags in this idle process
        if matrix.device_memory is not None:
            unfit = does_not_fit(cfg, cell.world_size, device.type, matrix.device_memory)
            if unfit:
                return Plan(cell, "skipped", unfit)
    except UnsupportedError as exc:
        return Plan(cell, "skipped", str(exc))
    except ConfigError as exc:
        return Plan(cell, "failed", f"invalid cell configuration: {exc}")
    except StratbenchError as exc:  # missing data set, unreadable weights file, ...
        return Plan(cell, "failed", str(exc))
    return Plan(cell, None)


def does_not_fit(cfg: TrainConfig, world_size: int, device_type: str, device_memory: int) -> str | None:
    """'does not fit (estimate X of Y)' when the memory estimate's device total for the busiest rank exceeds
    ``device_memory``; None when it fits, or when the estimate cannot be made (the run then shows what happens)."""
    try:
        total = estimate(cfg, world_size, device_type).total_bytes
    except Exception:  # noqa: BLE001 - a model the estimate cannot trace still runs; its row shows what happened
        return None
    if total <= device_memory:
        return None
    return f"does not fit (estimate {fmt_bytes(total)} of {fmt_bytes(device_memory)} per device)"


def plan(matrix: Matrix, cells: list[Cell] | None = None, allow_slow: bool = False) -> list[Plan]:
    return [plan_cell(c, matrix, allow_slow) for c in (matrix.cells if cells is None else cells)]


def check_runnable(plans: list[Plan]) -> None:
    """A sweep in which no cell would run and some cell's configuration is refused (``--lr nan``, an unknown
    model, a missing token file) is bad input: one line naming the first such cell, before anything is written
    (a rerun into a finished sweep leaves it as it was), not a sweep of failed rows."""
    if any(p.status is None for p in plans):
        return
    refused = next((p for p in plans if p.status == "failed"), None)
    if refused is not None:
        raise ConfigError(f"no cell can run: {refused.cell.name} {refused.cell.precision}: {refused.reason}")
