"""Safe loading of what a user hands in: torch's weights-only unpickler extended by an allow-list of plain data
classes (``SAFE_GLOBALS``), a restricted unpickler for plain pickles, and checks of whole checkpoint files and
folders before any library unpickles them. ``trusted(True)`` (``--trust-checkpoint``) turns the checks off."""

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
    """The allow-listed classes whose modules are already imported (importing DeepSpeed, or torch's DCP and
    DTensor, costs seconds: a module is imported only when a file names one of its classes, ``_with_imports``)."""
    import sys

    found = []
    for name in SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        if module not in sys.modules:
            continue
        try:
            found.append((getattr(sys.modules[module], attr), name))
        except AttributeError:
            continue  # a version of the library without it cannot have written it
    return found


def _with_imports(load: Callable[[], Any]) -> Any:
    """``load()``; while it fails on an allow-listed class whose module is not imported yet, import that module
    and retry (once per module: a file may name classes of several)."""
    import sys

    while True:
        try:
            return load()
        except pickle.UnpicklingError as exc:
            text = str(exc)
            missing = {n.rpartition(".")[0] for n in SAFE_GLOBALS if n in text} - set(sys.modules)
            imported = False
            for module in sorted(missing):
                with contextlib.suppress(ImportError):
                    importlib.import_module(module)
                    imported = True
            if not imported:
                raise


def safe_globals() -> contextlib.AbstractContextManager:
    """torch's weights-only unpickler, extended by ``SAFE_GLOBALS`` for the duration of the block."""
    return torch.serialization.safe_globals(_safe_globals())


_CODE_SIGNS = ("Unsupported global", "Trying to call", "GLOBAL", "Unsupported class", "REDUCE", "BUILD")


def refusal(path: Path, exc: BaseException) -> CheckpointError:
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
        raise refusal(Path(str(name if name is not None else source)), exc) from None


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

            def load() -> Any:
                fh.seek(0)  # a retry (after importing a module the file names) reads from the start again
                return _RestrictedUnpickler(fh, encoding=encoding).load()

            return _with_imports(load)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:
        raise refusal(path, exc) from None


def check_file(path: Path) -> None:
    """Raise CheckpointError unless ``path`` unpickles weights-only (a torch file or a plain pickle such as
    DCP's ``.metadata``). Tensor data is memory-mapped, not read, so this costs little."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(4)
    try:
        _with_imports(lambda: _check(path, head))
    except Exception as exc:
        raise refusal(path, exc) from None


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
