"""The layer rule of docs/architecture.md, checked on the source: stratbench's imports go down the layers, with no
cycles and none inside functions; the parallelism blocks never import a method; no module imports another's
private name; no module outside ``strategies/`` compares a method's name. Read from the files (``ast``), so it
costs well under a second and needs nothing imported."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stratbench"
PKG = "stratbench"

# Bottom to top: a module imports from its own layer or a layer listed before it (docs/architecture.md).
LAYERS = (
    "core", "models", "data", "measuring", "checkpoints", "strategies", "training", "predicting", "launching",
    "inference", "compare",
)  # fmt: skip
TOP = len(LAYERS)  # api.py, cli.py, commands/, __init__.py, __main__.py: they may import everything

# The one documented upward import: the config resolves a pretrained-weights name, an `hf:` model and an
# `--init-from hf:` Llama folder at parse time, so that a bad name is refused before any work (docs/architecture.md,
# the `core/` row).
ALLOWED_UP = {
    ("stratbench.core.config", "stratbench.models.zoo"), ("stratbench.core.config", "stratbench.models.hf"),
    ("stratbench.core.config", "stratbench.models.hf_llama"),
}  # fmt: skip

# Inside strategies/: what a method may lean on; everything else there is a method's own file.
STRATEGY_SHARED = ("stratbench.strategies.base", "stratbench.strategies.costs", "stratbench.strategies.op_builds")
BLOCKS = "stratbench.strategies.parallel"


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    top: set[str] = field(default_factory=set)  # what it imports at module level (stratbench modules)
    inner: list[tuple[int, str]] = field(default_factory=list)  # (line, module) imported inside a function
    private: list[tuple[int, str]] = field(default_factory=list)  # (line, "module._name") from another module


def _name_of(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[tuple[str, str]]:
    """(the stratbench module an import reaches, the imported name or "") for each name of the import."""
    if isinstance(node, ast.Import):
        pairs = [(a.name, "") for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = mod.split(".")
            parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
            base = ".".join(parts + ([base] if base else []))
        pairs = [(f"{base}.{a.name}", "") if f"{base}.{a.name}" in known else (base, a.name) for a in node.names]
    out = []
    for target, name in pairs:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target.split(".")[0] == PKG and target != mod:
            out.append((target, name))
    return out


def _scan(path: Path, known: set[str], src: Path = SRC) -> Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    m = Module(_name_of(path, src), path, tree)
    is_pkg = path.name == "__init__.py"
    typing_only = {id(n) for block in tree.body if _is_type_checking(block) for n in ast.walk(block)}
    in_functions = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target, name in _targets(m.name, is_pkg, node, known):
            if id(node) in in_functions:
                m.inner.append((node.lineno, target))
            elif id(node) not in typing_only:  # a type-only import is no dependency at run time
                m.top.add(target)
            if name.startswith("_") and not name.startswith("__"):
                m.private.append((node.lineno, f"{target}.{name}"))
    return m


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    paths = sorted(SRC.rglob("*.py"))
    known = {_name_of(p) for p in paths}
    return {m.name: m for m in (_scan(p, known) for p in paths)}


def _layer(mod: str) -> int:
    part = mod.split(".")[1] if "." in mod else ""
    return LAYERS.index(part) if part in LAYERS else TOP


def _where(m: Module, line: int) -> str:
    return f"{m.path.relative_to(ROOT)}:{line}"


def test_the_layers_are_the_folders(modules):
    """Every sub-package is a layer of the table (a new folder is placed in LAYERS and in docs/architecture.md)."""
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"commands"} == set(LAYERS)


def test_imports_go_down_the_layers(modules):
    up = [
        f"{m.name} imports {t} ({LAYERS[_layer(m.name)]} -> {LAYERS[_layer(t)]})"
        for m in modules.values()
        for t in sorted(m.top)
        if _layer(t) > _layer(m.name) and (m.name, t) not in ALLOWED_UP
    ]
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_no_stratbench_import_inside_a_function(modules):
    inner = [f"{_where(m, line)} imports {t}" for m in modules.values() for line, t in m.inner]
    assert not inner, "stratbench imports inside functions (move them to the top of the file):\n" + "\n".join(inner)


def test_no_import_cycles(modules):
    graph = {name: {t for t in m.top if t in modules} for name, m in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(sorted(c)) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_private_name_from_another_module(modules):
    private = [f"{_where(m, line)} imports {what}" for m in modules.values() for line, what in m.private]
    assert not private, "private names imported from another module (make them public):\n" + "\n".join(private)


def test_blocks_never_import_a_method(modules):
    """strategies/parallel/ holds what the methods share; a block that imported a method would tie every other
    method that composes the block to that one."""
    bad = [
        f"{m.name} imports {t}"
        for m in modules.values()
        if m.name.startswith(BLOCKS)
        for t in sorted(m.top)
        if t.startswith("stratbench.strategies.") and not t.startswith(BLOCKS) and t not in STRATEGY_SHARED
    ]
    assert not bad, "parallelism blocks importing a method file:\n" + "\n".join(bad)


def _strategy_names() -> set[str]:
    """The registered method names, read from the ``@register`` classes' ``name = "..."`` in strategies/."""
    names = set()
    for path in (SRC / "strategies").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(_is_register(d) for d in node.decorator_list):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "name" for t in stmt.targets):
                        if isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                            names.add(stmt.value.value)
    return names


def _is_register(d: ast.expr) -> bool:
    return (isinstance(d, ast.Name) and d.id == "register") or (isinstance(d, ast.Attribute) and d.attr == "register")


def _constants(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _constants(e)]
    return []


def test_no_method_name_compared_outside_strategies(modules):
    """Callers ask a method's class (``baseline``, ``spans_devices``, its cost model), never its name."""
    names = _strategy_names()
    assert {"single", "ddp", "fsdp", "tp"} <= names, f"the registry scan found {sorted(names)}"
    hits = []
    for m in modules.values():
        if m.name.startswith("stratbench.strategies"):
            continue
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Compare):
                consts = [s for side in [node.left, *node.comparators] for s in _constants(side)]
                hits += [f"{_where(m, node.lineno)} compares {s!r}" for s in consts if s in names]
    assert not hits, "method names compared outside strategies/:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_forbid(tmp_path):
    """Each rule on a tiny tree that breaks it: the scan sees an upward, an inner and a private import and a
    cycle (a check that could not fail would prove nothing)."""
    src = tmp_path / PKG
    (src / "core").mkdir(parents=True)
    (src / "models").mkdir()
    for d in (src, src / "core", src / "models"):
        (d / "__init__.py").write_text("")
    (src / "core" / "a.py").write_text("from stratbench.models.b import thing\n")
    (src / "models" / "b.py").write_text("from stratbench.core.a import _hidden\n\ndef f():\n    import stratbench.core.a\n")
    paths = sorted(src.rglob("*.py"))
    known = {_name_of(p, src) for p in paths}
    mods = {m.name: m for m in (_scan(p, known, src) for p in paths)}
    a, b = mods["stratbench.core.a"], mods["stratbench.models.b"]
    assert a.top == {"stratbench.models.b"} and _layer("stratbench.models.b") > _layer(a.name)
    assert b.private == [(1, "stratbench.core.a._hidden")]
    assert b.inner == [(4, "stratbench.core.a")]
    assert _cycles({n: m.top for n, m in mods.items()}) == [{"stratbench.core.a", "stratbench.models.b"}]


def test_no_function_over_80_lines(modules):
    long = [
        f"{_where(m, n.lineno)} {n.name}: {n.end_lineno - n.lineno + 1} lines"
        for m in modules.values()
        for n in ast.walk(m.tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
    ]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)

