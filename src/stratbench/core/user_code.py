"""The user's own code (``--model``/``--data``/``--loss package.module:function``): one importer and one caller,
so that every mistake in it is one line naming the spec, never a traceback.

Where a module is found: on ``sys.path`` as Python would, then in the current working directory (what
``python -m`` puts first), so a file next to the user is found without PYTHONPATH — also by the console script
and by launched workers, which inherit the working directory. The working directory is appended, not put
first: a user's ``json.py`` or ``types.py`` must not replace the standard-library module every other import
gets. A file in the working directory whose name a standard-library module or an installed package already
takes is refused in one line (Python would import the other one).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError, did_you_mean, is_out_of_memory
from stratbench.core.torchvision_compat import guard_torchvision_import


def parse_spec(spec: str, what: str, noun: str = "builder") -> tuple[str, str]:
    """``'pkg.module:function'`` -> ``('pkg.module', 'function')``; one line for anything else."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(f"{what} {spec!r}: a {noun} is given as 'package.module:function'")
    return module_name, attr


def _local_file(top: str, folder: str) -> Path | None:
    """``top.py`` or the package folder ``top/`` in ``folder``, if there is one."""
    for candidate in (Path(folder) / f"{top}.py", Path(folder) / top / "__init__.py"):
        if candidate.is_file():
            return candidate.parent if candidate.name == "__init__.py" else candidate
    return None


def _origin(top: str) -> str | None:
    """Where Python finds the top-level module ``top`` without the working directory (None: nowhere)."""
    module = sys.modules.get(top)
    if module is not None:
        return getattr(module, "__file__", None) or "built in"
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    return None if spec is None else (spec.origin or "a namespace package")


def check_shadowing(spec: str, module_name: str, what: str, cwd: str) -> None:
    """Refuse a file in the working directory that has the name of a module Python takes from elsewhere."""
    top = module_name.split(".")[0]
    local = _local_file(top, cwd)
    if local is None:
        return
    origin = _origin(top)
    if origin is None or Path(str(origin)).resolve().is_relative_to(Path(cwd).resolve()):
        return
    kind = "the standard-library module" if top in sys.stdlib_module_names else "the installed module"
    raise ConfigError(
        f"{what} {spec!r}: {local.name} in {cwd} has the name of {kind} {top!r} ({origin}), which Python imports "
        f"instead; rename your file (e.g. my_{local.name})"
    )


def import_builder(spec: str, what: str = "model", noun: str = "builder", prefixes: tuple[str, ...] = ()) -> Callable:
    """``package.module:function`` -> the function (or an ``nn.Module`` class); one line for every failure:
    a malformed spec, a module that is not found or shadowed, an import that raises, a missing name. A module
    that is not found but whose name is close to one of ``prefixes`` (the option's own ``PREFIX:`` forms, e.g.
    ``jsonl``) names it: ``jsnl:x`` is a mistyped ``jsonl:x`` more likely than a missing module."""
    from torch import nn

    head = spec.split(":", 1)[0]
    hint = did_you_mean(f"{head}:", [f"{p}:" for p in prefixes]) if "." not in head else ""
    try:
        module_name, attr = parse_spec(spec, what, noun)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{hint}") from None
    cwd = os.getcwd()
    check_shadowing(spec, module_name, what, cwd)
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    guard_torchvision_import()  # the user's module may import torchvision: make that work on a CPU torch too
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{what} {spec!r}: cannot import {attr!r} from {module_name!r} ({exc}; looked in sys.path and {cwd})"
            f"{hint}"
        ) from None
    except Exception as exc:  # the user's module itself raised while importing (SyntaxError included)
        raise ConfigError(f"{what} {spec!r}: importing {module_name!r} raised {one_line(exc)}") from None
    builder = getattr(module, attr, None)
    if builder is None:
        raise ConfigError(
            f"{what} {spec!r}: cannot import {attr!r} from {module_name!r} ({_where(module)} has no {attr!r})"
        )
    if not callable(builder) or isinstance(builder, type) and not issubclass(builder, nn.Module):
        raise ConfigError(f"{what} {spec!r}: {attr!r} is a {type(builder).__name__}, not a {noun} function")
    return builder


def check_signature(fn: Callable, spec: str, what: str, requirement: str, *args: Any, **kwargs: Any) -> None:
    """The call ``fn(*args, **kwargs)`` binds to ``fn``'s signature, or one line: "``what spec`` is not a
    ``requirement``" (e.g. "model builder: it does not take num_classes=")."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"{what} {spec!r} is not a {requirement} ({exc})") from None
    except ValueError:
        pass  # no signature to read (some C functions): the call itself is checked


def call_user(fn: Callable, spec: str, what: str, *args: Any, **kwargs: Any) -> Any:
    """Call the user's ``fn``; an exception it raises becomes one line naming the spec, the call and the
    exception (out-of-memory errors pass through: the run reports them as such)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise
        shown = ", ".join([*(_short(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        name = getattr(fn, "__name__", spec.partition(":")[2])
        raise ConfigError(f"{what} {spec!r}: {name}({shown}) raised {one_line(exc)}") from None


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"<tensor {tuple(shape)}>" if shape is not None else repr(value)


def _where(module: Any) -> str:
    return getattr(module, "__file__", None) or "built in"


def one_line(exc: BaseException) -> str:
    """``ValueError: message`` on one line (the first line of the message), with the user's file and line."""
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
    frame = _user_frame(exc)
    return f"{message} ({frame})" if frame else message


def _user_frame(exc: BaseException) -> str | None:
    """``file.py:12``: the innermost frame of the traceback outside stratbench and the libraries."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{Path(exc.filename).name}:{exc.lineno}"
    library = (str(Path(__file__).parents[1]), os.path.dirname(os.__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(library)]
    frames = [f for f in frames if "site-packages" not in f.filename and "dist-packages" not in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else None
