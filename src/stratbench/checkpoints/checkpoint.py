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
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
from collections.abc import Callable, Iterator
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

FORMAT = "stratbench"
VERSION = 1
META_FILE = "stratbench_meta.pt"

LayoutReader = Callable[[Path, dict[str, Any]], dict[str, Any]]
_LAYOUTS: dict[str, LayoutReader] = {}
_LAYOUT_SOURCES: list[Callable[[], None]] = []


# Classes that DeepSpeed, accelerate and torch.distributed.checkpoint put into their pickles, none of which
# runs code when rebuilt (plain data classes, an enum, numpy arrays of the RNG state, pathlib paths).
SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "numpy.dtype",
    "numpy.ndarray",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType",
    "numpy.dtypes.Float64DType",
    "numpy.dtypes.Int64DType",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
)
# Files in checkpoint folders that nothing unpickles: safetensors (a JSON header + raw bytes), DeepSpeed's
# `latest` tag file and the scripts it copies (never run by stratbench), DCP's data files (whose
# non-tensor entries are read through ``SafeLoadPlanner``), and DeepSpeed's NVMe swap files (raw tensor bytes
# under offloaded_tensors/; the deepspeed layout refuses those checkpoints in one line).
_NOT_PICKLED = (".safetensors", ".py", ".json", ".yaml", ".yml", ".txt", ".distcp", ".md", ".swp")
_NOT_PICKLED_NAMES = ("latest", "latest_universal")

_trust = False


@contextlib.contextmanager
def trusted(enabled: bool) -> Iterator[None]:
    """Within this block, load checkpoints with full unpickling (``--trust-checkpoint``) when ``enabled``."""
    global _trust
    before, _trust = _trust, bool(enabled)
    try:
        yield
    finally:
        _trust = before


def is_trusted() -> bool:
    return _trust


def add_trust_argument(parser: Any) -> None:
    """``--trust-checkpoint`` for a command that loads checkpoints."""
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load the checkpoint with full unpickling, which runs any code a crafted file holds: only for files "
        "from a source you trust (default: weights-only; a file that needs more is refused)",
    )


def _safe_globals() -> list[Any]:
    """The allow-listed classes of the libraries already imported (importing DeepSpeed costs seconds: it is
    imported only when a file names one of its classes, see ``_with_imports``)."""
    import sys

    found = []
    for name in SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] not in sys.modules:
            continue
        try:
            found.append((getattr(importlib.import_module(module), attr), name))
        except (ImportError, AttributeError):
            continue  # a library (or a version of it) that is not installed cannot be in a file we can read
    return found


def _with_imports(load: Callable[[], Any]) -> Any:
    """``load()``; if it fails on an allow-listed class of a library not imported yet, import it and retry."""
    import sys

    try:
        return load()
    except pickle.UnpicklingError as exc:
        text = str(exc)
        missing = {n.split(".")[0] for n in SAFE_GLOBALS if n in text and n.split(".")[0] not in sys.modules}
        if not missing:
            raise
        for package in missing:
            with contextlib.suppress(ImportError):
                importlib.import_module(package)
        return load()


def safe_globals() -> contextlib.AbstractContextManager:
    """torch's weights-only unpickler, extended by ``SAFE_GLOBALS`` for the duration of the block."""
    return torch.serialization.safe_globals(_safe_globals())


_CODE_SIGNS = ("Unsupported global", "Trying to call", "GLOBAL", "Unsupported class", "REDUCE", "BUILD")


def _refuse(path: Path, exc: BaseException) -> CheckpointError:
    """One line for a file the weights-only unpickler rejected: "would run code" when it names a callable or
    class, "corrupt" otherwise (garbage bytes also fail to unpickle)."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if any(sign in ln for sign in _CODE_SIGNS)), None)
    if hit is None:
        first = lines[-1] if lines else type(exc).__name__
        return CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file ({first[:200]})")
    found = f" ({hit.rstrip('.')[:200]})"
    return CheckpointError(
        f"refusing to load {path}: it is not loadable weights-only{found}; loading it would run code from the file. "
        "If you trust where it came from, pass --trust-checkpoint"
    )


def safe_torch_load(source: Any, *, name: Path | str | None = None, mmap: bool = False) -> Any:
    """``torch.load`` weights-only with ``SAFE_GLOBALS`` (full unpickling inside ``trusted(True)``)."""
    if _trust:
        return torch.load(source, map_location="cpu", weights_only=False)

    def load() -> Any:
        if hasattr(source, "seek"):
            source.seek(0)
        with safe_globals():
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        return _with_imports(load)
    except pickle.UnpicklingError as exc:
        raise _refuse(Path(str(name if name is not None else source)), exc) from None


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's documented "restricting globals" unpickler for plain pickles (DCP's ``.metadata``, protocol 4
    with frames, which torch's weights-only unpickler does not parse): only torch's weights-only allow-list and
    ``SAFE_GLOBALS`` can be named, so nothing else can be called."""

    def find_class(self, module: str, name: str) -> Any:
        from torch._weights_only_unpickler import _get_allowed_globals

        full = f"{module}.{name}"
        allowed = _get_allowed_globals() | {n: obj for obj, n in _safe_globals()}
        if full in allowed:
            return allowed[full]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {full} is not on stratbench's allow-list")


def restricted_pickle_load(path: Path, encoding: str = "ASCII") -> Any:
    """A plain pickle read with the restricted unpickler: containers, strings, numbers and numpy arrays (torch's
    weights-only allow-list and ``SAFE_GLOBALS``); anything that would call other code is refused in one line."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _with_imports(lambda: _RestrictedUnpickler(fh, encoding=encoding).load())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:
        raise _refuse(path, exc) from None


def check_file(path: Path) -> None:
    """Raise CheckpointError unless ``path`` unpickles weights-only (a torch file or a plain pickle such as
    DCP's ``.metadata``). Tensor data is memory-mapped, not read, so this costs little."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(4)
    try:
        _with_imports(lambda: _check(path, head))
    except Exception as exc:
        raise _refuse(path, exc) from None


def _check(path: Path, head: bytes) -> None:
    with safe_globals():
        if head == b"PK\x03\x04":  # torch's zip format
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return
        with open(path, "rb") as fh:  # a plain pickle (protocol 0 starts with any opcode, so try them all)
            _RestrictedUnpickler(fh).load()
            at_end = fh.read(1) == b""
        if not at_end:  # more after the first pickle: torch's legacy (pre-zip) format
            torch.load(path, map_location="cpu", weights_only=True)


def check_folder(path: Path) -> None:
    """``check_file`` every file in a checkpoint folder that some loader unpickles (links followed once),
    unless inside ``trusted(True)``."""
    if _trust:
        return
    seen: set[str] = set()
    for root, dirs, files in os.walk(path, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        for name in sorted(files):
            if name.endswith(_NOT_PICKLED) or name in _NOT_PICKLED_NAMES:
                continue
            check_file(Path(root) / name)


def check_tag(path: Path, tag: Any) -> str:
    """A DeepSpeed tag read from a checkpoint's header: one plain folder name inside ``path``."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise CheckpointError(
            f"checkpoint {path} names DeepSpeed tag {tag!r}; expected one folder name inside it"
        )
    return tag


def register_layout(name: str, reader: LayoutReader) -> None:
    """Register how to read a sharded folder of layout ``name`` into one full state dict (on CPU)."""
    _LAYOUTS[name] = reader


def add_layout_source(find_readers: Callable[[], None]) -> None:
    """Register a function that registers layout readers (the method files above this layer do it on import;
    ``strategies.base`` adds its ``discover``), called before a sharded folder's layout is looked up."""
    if find_readers not in _LAYOUT_SOURCES:
        _LAYOUT_SOURCES.append(find_readers)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then swap it in (``replace_path``)."""
    with atomic_output(Path(path)) as tmp:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())


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
        if weights_only and not _trust:
            obj = safe_torch_load(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=False)
    except pickle.UnpicklingError as exc:
        raise _refuse(path, exc) from None
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
    check_last_link(path)
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
