"""Checkpoint files and folders: atomic writes, safe loads (``weights_only=True``), and one reader for
every layout so that a checkpoint saved by any method loads into any other.

Layouts
- ``full``: one file, ``torch.save`` of {"format": "stratbench", "model": ..., "optimizer": ..., ...}.
- sharded layouts (a folder): ``stratbench_meta.pt`` (format marker, layout name, training progress, model
  meta) next to the method's own files. Each sharded method registers a reader for its layout with
  ``register_layout`` that returns the consolidated full state ({"model": ..., "optimizer": ...}).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratbench.errors import CheckpointError

FORMAT = "stratbench"
VERSION = 1
META_FILE = "stratbench_meta.pt"

LayoutReader = Callable[[Path, dict[str, Any]], dict[str, Any]]
_LAYOUTS: dict[str, LayoutReader] = {}


def register_layout(name: str, reader: LayoutReader) -> None:
    """Register how to read a sharded folder of layout ``name`` into one full state dict (on CPU)."""
    _LAYOUTS[name] = reader


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if path.is_dir():  # a sharded checkpoint of another method sat here: keep it until the new file is in
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_full(path: Path, state: dict[str, Any]) -> None:
    atomic_save({"format": FORMAT, "version": VERSION, "layout": "full"} | state, path)


def load_file(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Load a stratbench file, with one clear error for a missing, corrupt or foreign file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # garbage bytes raise anything from UnpicklingError to IndexError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file ({first[:200]})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        what = sorted(obj)[:6] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"checkpoint {path} is not a stratbench checkpoint (found {what}); use --weights for a plain state dict"
        )
    if obj.get("version", 0) > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {obj['version']}; this stratbench reads <= {VERSION}"
        )
    return obj


def read_meta(path: Path) -> dict[str, Any]:
    """The header of a checkpoint (progress, model meta, layout) without loading model tensors if sharded."""
    path = Path(path)
    if path.is_dir():
        meta_path = path / META_FILE
        if not meta_path.exists():
            raise CheckpointError(
                f"{path} is a folder but not a stratbench checkpoint (no {META_FILE} in it)"
            )
        return load_file(meta_path)
    return load_file(path)


def load_any(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Full state ({"model", "optimizer", progress, meta}) from any layout, consolidated in memory."""
    path = Path(path)
    if not path.is_dir():
        return load_file(path, weights_only=weights_only)
    meta = read_meta(path)
    layout = meta.get("layout")
    from stratbench.strategies.base import discover

    discover()  # strategies register their layout readers on import
    if layout not in _LAYOUTS:
        raise CheckpointError(
            f"checkpoint {path} has layout {layout!r}; readable layouts: {', '.join(['full', *sorted(_LAYOUTS)])}"
        )
    return meta | _LAYOUTS[layout](path, meta)


def consolidate(src: Path, dst: Path) -> Path:
    """Turn any checkpoint (e.g. a sharded folder) into one full file that every method loads."""
    state = load_any(src)
    state["layout"] = "full"
    atomic_save(state, Path(dst))
    return Path(dst)


def last_checkpoint(output: Path) -> Path:
    return Path(output) / "checkpoints" / "last"


def resolve_resume(output: str, resume_from: str | None) -> Path | None:
    """The checkpoint to resume from, or None when there is none yet (a fresh start)."""
    if resume_from:
        p = Path(resume_from)
        if not p.exists():
            raise CheckpointError(f"checkpoint not found: {p}")
        return p
    p = last_checkpoint(Path(output))
    return p if p.exists() else None
