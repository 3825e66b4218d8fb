"""Checkpoint files and folders: atomic writes, safe loads (``weights_only=True``), and one reader for
every layout so that a checkpoint saved by any method loads into any other.

Safety: a checkpoint may come from anywhere, and unpickling runs code. Every file stratbench or a library it
calls (DeepSpeed, accelerate, torch.distributed.checkpoint) unpickles is first read with torch's weights-only
unpickler, which accepts tensors, containers and the few classes on ``SAFE_GLOBALS`` (named by module path and
imported only when the file names them); a file that needs anything else is refused with one line naming the
file and the class. ``trusted(True)`` (the ``--trust-checkpoint`` flag) skips the check, for checkpoints whose
source the user trusts.

Layouts
- ``full``: one file, ``torch.save`` of {"format": "stratbench", "model": ..., "optimizer": ..., ...}.
- sharded layouts (a folder): ``stratbench_meta.pt`` (format marker, layout name, training progress, model
  meta) next to the method's own files. Each sharded method registers a reader for its layout with
  ``register_layout`` that returns the consolidated full state ({"model": ..., "optimizer": ...}).
- ``hf-llama`` (``hf:FOLDER``, --init-from only): a Hugging Face Llama folder, its keys mapped onto the built-in
  transformer's (``models.hf_llama``); weights only.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratbench.core.errors import CheckpointError
from stratbench.core.files import (  # noqa: F401  (re-exported: every writer's one swap)
    FAULT_SWAP_ENV,
    atomic_output,
    atomic_write,
    fsync_dir,
    remove_path,
    replace_path,
    temp_path_for,
)
from stratbench.core.safe_load import (  # noqa: F401  (re-exported: the loaders' one entry)
    SAFE_GLOBALS,
    add_trust_argument,
    check_file,
    check_folder,
    check_tag,
    is_trusted,
    refusal,
    restricted_pickle_load,
    safe_globals,
    safe_torch_load,
    trusted,
)
from stratbench.models import hf_llama

FORMAT = "stratbench"
VERSION = 1
META_FILE = "stratbench_meta.pt"

LayoutReader = Callable[[Path, dict[str, Any]], dict[str, Any]]
_LAYOUTS: dict[str, LayoutReader] = {}
_CHECKS: dict[str, Callable[[Path], None]] = {}
_LAYOUT_SOURCES: list[Callable[[], None]] = []


def register_layout(name: str, reader: LayoutReader, check: Callable[[Path], None] | None = None) -> None:
    """Register how to read a sharded folder of layout ``name`` into one full state dict (on CPU), and how to
    tell, cheaply, that its files are whole (``check``: raises a one-line CheckpointError; ``read_meta`` runs it,
    so a resume is refused before any work)."""
    _LAYOUTS[name] = reader
    if check is not None:
        _CHECKS[name] = check


def add_layout_source(find_readers: Callable[[], None]) -> None:
    """Register a function that registers layout readers (the method files above this layer do it on import;
    ``strategies.base`` adds its ``discover``), called before a sharded folder's layout is looked up."""
    if find_readers not in _LAYOUT_SOURCES:
        _LAYOUT_SOURCES.append(find_readers)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then swap it in (``replace_path``). A write
    that fails (a full disk) is the OSError it was, with its errno, not torch's "unexpected pos"."""
    with atomic_output(Path(path)) as tmp:
        with open(tmp, "wb") as fh:
            kept = _KeepWriteError(fh)
            try:
                torch.save(obj, kept)
            except RuntimeError:
                if kept.error is not None:
                    raise kept.error from None
                raise
            fh.flush()
            os.fsync(fh.fileno())


class _KeepWriteError:
    """A file whose first failed write is kept: torch.save's zip writer swallows the OSError of a write (a full
    disk's ENOSPC) and fails later on a position check, "unexpected pos N vs M", which says nothing to a user."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_full(path: Path, state: dict[str, Any]) -> None:
    atomic_save({"format": FORMAT, "version": VERSION, "layout": "full"} | state, path)


def check_last_link(path: Path) -> None:
    """Refuse a ``checkpoints/last`` link that leads out of its checkpoints folder: stratbench writes ``last`` as
    a relative link to a step entry beside it, so a link elsewhere was made by something else (and following it
    would read, or on the next save tidy, what the user never handed in)."""
    path = Path(path)
    for link in (path, *path.parents):
        if link.name != LAST or link.parent.name != CHECKPOINTS or not link.is_symlink():
            continue
        target = Path(os.path.realpath(link))
        if target.parent != Path(os.path.realpath(link.parent)):
            raise CheckpointError(
                f"{link} points outside its run's checkpoints folder (to {target}); stratbench's own `last` links "
                "to a step entry beside it: give the checkpoint's path instead"
            )


def load_file(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Load a stratbench file, with one clear error for a missing, corrupt or foreign file. Weights-only
    (with ``SAFE_GLOBALS``) unless inside ``trusted(True)``."""
    path = Path(path)
    check_last_link(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if weights_only and not is_trusted():
            obj = safe_torch_load(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=False)
    except pickle.UnpicklingError as exc:
        raise refusal(path, exc) from None
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
    """The header of a checkpoint (progress, model meta, layout) without loading model tensors if sharded; a
    sharded folder whose layout registered a check has its files checked whole too (a truncated shard); a Hugging
    Face Llama folder (``hf:FOLDER``) has every key checked to map onto the built-in transformer."""
    if hf_llama.is_hf_init(str(path)):
        hf_llama.check_keys(str(path))
        return {"layout": hf_llama.LAYOUT, "source": str(path)}
    path = Path(path)
    check_last_link(path)
    if path.is_dir():
        meta_path = path / META_FILE
        if not meta_path.exists():
            raise CheckpointError(
                f"{path} is a folder but not a stratbench checkpoint (no {META_FILE} in it)"
            )
        meta = load_file(meta_path)
        for find_readers in _LAYOUT_SOURCES:
            find_readers()
        check = _CHECKS.get(meta.get("layout"))
        if check is not None:
            check(path)
        return meta
    return load_file(path)


def load_any(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Full state ({"model", "optimizer", progress, meta}) from any layout, consolidated in memory (a Hugging
    Face Llama folder: its weights under the built-in names, memory-mapped)."""
    if hf_llama.is_hf_init(str(path)):
        return read_meta(path) | {"model": hf_llama.builtin_state(str(path))}
    path = Path(path)
    if not path.is_dir():
        return load_file(path, weights_only=weights_only)
    meta = read_meta(path)
    layout = meta.get("layout")
    for find_readers in _LAYOUT_SOURCES:
        find_readers()  # e.g. strategies.base.discover: each method file registers its layout reader on import
    if layout not in _LAYOUTS:
        raise CheckpointError(
            f"checkpoint {path} has layout {layout!r}; readable layouts: {', '.join(['full', *sorted(_LAYOUTS)])}"
        )
    check_folder(path)  # the layout readers call libraries that unpickle with weights_only=False
    return meta | _LAYOUTS[layout](path, meta)


def consolidate(src: Path, dst: Path, *, force: bool = False) -> Path:
    """Turn any checkpoint (e.g. a sharded folder) into one full file that every method loads. An existing
    folder ``dst`` receives ``dst/model.pt``; an existing file is replaced only with ``force``; nothing else
    is ever deleted."""
    src, dst = Path(src), Path(dst)
    if dst.is_dir():
        dst = dst / "model.pt"
    if dst.is_dir():
        raise CheckpointError(f"{dst} is a folder; name a file to write")
    if dst.exists() and not force:
        raise CheckpointError(f"{dst} exists; pass --force to replace it")
    if src.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst} is the checkpoint being read; name another file")
    state = load_any(src)
    state["layout"] = "full"
    try:
        atomic_save(state, dst)
    except OSError as exc:  # read-only folder, full disk: nothing was replaced
        raise CheckpointError(f"cannot write {dst}: {exc.strerror or exc} (nothing was replaced)") from None
    return dst


CHECKPOINTS = "checkpoints"
LAST = "last"
STEP_PREFIX = "step-"


def last_checkpoint(output: Path) -> Path:
    return Path(output) / CHECKPOINTS / LAST


def save_path_for(output: Path, step: int) -> Path:
    """Where the checkpoint of optimizer step ``step`` is written (a step-numbered entry; ``publish`` then
    points ``last`` at it). Writers put it there atomically, so an entry that exists is complete."""
    return Path(output) / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"


def _step_of(entry: Path) -> int | None:
    name = entry.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX) :].isdigit():
        return None
    return int(name[len(STEP_PREFIX) :])


def step_entries(output: Path) -> list[Path]:
    """The step-numbered checkpoints under OUTPUT/checkpoints, oldest first."""
    folder = Path(output) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(s, p) for p in folder.iterdir() if (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def publish(output: Path, path: Path, keep_last: int = 1) -> Path:
    """Point OUTPUT/checkpoints/last at the complete checkpoint ``path`` (a relative symlink swapped in with
    one rename), then delete step entries beyond the newest ``keep_last``. Global rank 0 only, after every rank
    finished writing ``path``. A ``last`` that is a real file or folder (written by an earlier stratbench) is
    kept as a step entry of its own step first."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    output, path = Path(output), Path(path)
    last = last_checkpoint(output)
    if (last.exists() or last.is_dir()) and not last.is_symlink():
        try:
            step = int(read_meta(last).get("progress", {}).get("step", 0))
        except CheckpointError:
            step = 0
        keep = save_path_for(output, step)
        if keep.resolve() != path.resolve() and not keep.exists():
            os.replace(last, keep)
    link = temp_path_for(last, ".link")
    link.unlink()
    os.symlink(os.path.relpath(path, last.parent), link)
    os.replace(link, last)
    fsync_dir(last.parent)
    _tidy(last.parent)
    current = path.resolve()
    entries = [p for p in step_entries(output) if p.resolve() != current]
    for stale in entries[: max(0, len(entries) - (keep_last - 1))]:
        remove_path(stale)
    return last


def _tidy(folder: Path) -> None:
    """What killed saves left in OUTPUT/checkpoints, once ``last`` points at a complete entry again: a
    ``.step-N.old`` whose ``step-N`` is missing (a kill between the two renames of its swap; a resume may have
    read it) is put back as ``step-N`` and then counts for --keep-last; other ``.step-N.old`` copies and the
    temporary files and folders of unfinished saves and link swaps are deleted. Rank 0, after every rank has
    finished writing (no save is in progress)."""
    for p in sorted(Path(folder).iterdir()):
        name = p.name
        if not name.startswith((f".{STEP_PREFIX}", f".{LAST}.")) or not name.endswith(
            (".old", ".tmp", ".link")
        ):
            continue
        if name.startswith(f".{LAST}.") and not name.endswith(".link"):
            continue  # .last.old (an earlier stratbench's swap of a real `last`): resume may still need it
        entry = p.with_name(name[1:-4])
        if (
            name.endswith(".old")
            and _step_of(entry) is not None
            and not (entry.exists() or entry.is_symlink())
        ):
            os.replace(p, entry)
        else:
            remove_path(p)


def resolve_resume(output: str, resume_from: str | None) -> Path | None:
    """The checkpoint to resume from, or None when there is none yet (a fresh start).

    Without ``resume_from``: OUTPUT/checkpoints/last; if a kill left it missing (between the two renames of a
    swap) or dangling, ``.last.old`` (the previous checkpoint, whole), else the newest step entry. Nothing is
    renamed here (every rank calls this at once); the next save puts ``last`` back."""
    if resume_from:
        p = Path(resume_from)
        if not p.exists():
            raise CheckpointError(f"checkpoint not found: {p}")
        return p
    last = last_checkpoint(Path(output))
    if last.exists():
        return last
    candidates = [last.with_name(f".{last.name}.old")]
    if last.is_symlink():  # `last` names a step entry caught between the two renames of its own swap
        target = last.parent / os.readlink(last)
        candidates.append(target.with_name(f".{target.name}.old"))
    for p in candidates:
        if p.exists():
            return p
    entries = step_entries(Path(output))
    return entries[-1] if entries else None
