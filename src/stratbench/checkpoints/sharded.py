"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): the ``dcp`` folder layout.

A checkpoint is a folder: DCP's files (``.metadata`` + one ``*.distcp`` file per writing rank) holding
{"model": ..., "optimizer": ...} keyed by fully-qualified parameter names (FQNs, through
``torch.distributed.checkpoint.state_dict``), next to ``stratbench_meta.pt`` (progress, scheduler, RNG, model
meta) that global rank 0 writes. Because keys are FQNs and DCP records every tensor's global shape, the folder
loads into any method and any world size: a sharded method reads only its own shards (``load_sharded``), any
other process reads it without a process group into one full state on CPU (the registered layout reader,
used by ``checkpoint.load_any``, ``stratbench consolidate`` and the base ``Strategy.load_checkpoint``).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.errors import CheckpointError
from stratbench.core.user_code import one_line

LAYOUT = "dcp"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_remove = checkpoint.remove_path


def module_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's part of the model and optimizer state, FQN-keyed (DTensor/ShardedTensor shards where sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_sharded(
    path: Path,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    *,
    is_main: bool,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write a ``dcp`` checkpoint folder at ``path``; a collective (every rank calls it, each writes its shards).

    ``state`` overrides what is saved (default: ``module_state(model, optimizer)``) for methods whose optimizer
    has no FQN-keyed ``state_dict`` of its own; it must be {"model": ..., "optimizer": ...} keyed by FQNs.
    The folder is written under a temporary name and renamed over ``path`` (an earlier file or folder), so a
    crash while writing leaves the previous checkpoint intact. A disk without room for it is one line naming the
    folder on every rank, before anything is written (``_space``) or, where it filled meanwhile, after the
    partial folder is removed (``_filled``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)  # left over from a crash during an earlier save
        tmp.mkdir()
    _barrier()
    if state is None:
        if model is None:
            raise ValueError("save_sharded needs a model or an explicit state")
        state = module_state(model, optimizer)
    need, free = _space(state, path.parent)
    if free < need:  # refused before writing anything: every rank read the same two numbers
        if is_main:
            _remove(tmp)
        raise CheckpointError(_no_space_line(path, f"it needs {_mib(need)}, {_mib(free)} free"))
    try:
        # DCP gathers every rank's write result: a rank whose disk filled raises on all ranks alike
        dcp.save(state, checkpoint_id=tmp)
        if is_main:
            header = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "layout": LAYOUT} | extra
            checkpoint.atomic_save(header, tmp / checkpoint.META_FILE)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        full = _filled(exc, tmp, need)
        if full is None:
            raise
        if is_main:
            _remove(tmp)  # the space the partial folder took, back (result.json is written next)
        raise CheckpointError(_no_space_line(path, full)) from None
    if is_main:
        _swap_in(tmp, path)
    _barrier()
    return path


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""A full disk, and a full quota (the same for the user)."""


def _no_space_line(path: Path, detail: str) -> str:
    return (
        f"no space left on device under {path.parent} for checkpoint {path.name} ({detail}); earlier checkpoints "
        "there are unchanged: free space, lower --keep-last or give --output on a larger disk"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _state_bytes(state: Any) -> int:
    """Tensor bytes this rank writes of ``state`` into a DCP folder: each tensor's local shard, a copy that
    several ranks hold (a replicated DTensor's, or a plain tensor) counted on one of them only (DCP writes it
    once), so that the ranks' sum is the folder's payload."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    if isinstance(state, DTensor):
        coordinate = state.device_mesh.get_coordinate() or []
        replicas = [c for c, pl in zip(coordinate, state.placements, strict=True) if pl.is_replicate()]
        return state.to_local().nbytes if not any(replicas) else 0
    if isinstance(state, torch.Tensor):
        return state.nbytes if not dist.is_initialized() or dist.get_rank() == 0 else 0
    return 0


FOLDER_OVERHEAD = 1.03
"""DCP's folder over its tensors' bytes: a zip header per tensor and the .metadata (gpt-tiny under tp on 2 ranks,
AdamW: 22,909,767 bytes for 22,434,204 of tensors, +2.1%). A little under still fails safely (``_filled``)."""


def _space(state: dict[str, Any], folder: Path) -> tuple[int, int]:
    """(bytes the checkpoint needs, bytes free under ``folder``), the same on every rank: the ranks' payloads
    summed, the smallest free space any rank sees."""
    import shutil

    mine = torch.tensor([_state_bytes(state), shutil.disk_usage(folder).free], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        mine = torch.stack(every).cpu()
    else:
        mine = mine.unsqueeze(0)
    return int(mine[:, 0].sum() * FOLDER_OVERHEAD), int(mine[:, 1].min())


def _failures(exc: BaseException) -> list[BaseException]:
    """The exceptions a DCP CheckpointException gathered from the ranks (each with its causes), or ``exc``'s."""
    failures = getattr(exc, "failures", None) or {}
    found = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [exc]
    out = []
    for seen in found:
        while isinstance(seen, BaseException):
            out.append(seen)
            seen = seen.__cause__ or seen.__context__
    return out


def _filled(exc: BaseException, tmp: Path, need: int) -> str | None:
    """Why a save failed, if the disk filled while writing it (space taken by something else meanwhile): an
    ENOSPC, or (torch.save's zip writer drops the errno: "unexpected pos") less free space than what was still
    to be written; None for any other failure."""
    import shutil

    for seen in _failures(exc):
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return f"writing {Path(seen.filename).name}" if seen.filename else "the disk filled while writing"
    written = sum(f.stat().st_size for f in tmp.glob("*") if f.is_file()) if tmp.is_dir() else 0
    free = shutil.disk_usage(tmp.parent).free
    if free < need - written:
        return f"the disk filled while writing: {_mib(need - written)} still to write, {_mib(free)} free"
    return None


def _first_failure(exc: BaseException) -> str:
    """The first line of what a rank's DCP call really raised (not the "CheckpointException ranks:..." summary)."""
    inner = [e for e in _failures(exc) if not getattr(e, "failures", None)]
    seen = inner[0] if inner else exc
    text = str(seen).strip()
    return f"{type(seen).__name__}: {text.splitlines()[0][:300]}" if text else type(seen).__name__


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` (file or folder) by ``tmp``; the previous checkpoint stays whole until the new one is
    in place (``checkpoint.replace_path``, the one swap every writer uses)."""
    checkpoint.replace_path(tmp, path)


def _refusal_inside(exc: BaseException) -> CheckpointError | None:
    """DCP wraps what a planner raised in a CheckpointException per rank: our own refusal, if it is one."""
    if not getattr(exc, "failures", None):
        return None
    return next((e for e in _failures(exc) if isinstance(e, CheckpointError)), None)


def check_whole(path: Path) -> None:
    """Every ``*.distcp`` file the folder's ``.metadata`` points into exists and is as long as the byte ranges it
    lists: a truncated or missing shard is one line naming the file, before DCP reads anything. Called after
    ``checkpoint.check_folder`` (DCP unpickles ``.metadata`` with pickle.load)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
    except Exception as exc:  # a truncated or foreign .metadata
        raise CheckpointError(f"sharded checkpoint {path}: .metadata is unreadable ({one_line(exc)})") from None
    needed: dict[str, int] = {}
    for item in storage.values():
        where = getattr(item, "relative_path", None)
        if where is not None:
            needed[where] = max(needed.get(where, 0), item.offset + item.length)
    for name, need in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"sharded checkpoint {path}: {name} is missing (its .metadata lists it)")
        size = file.stat().st_size
        if size < need:
            raise CheckpointError(
                f"sharded checkpoint {path}: {name} is truncated ({size:,} bytes; its .metadata needs {need:,}); "
                "the folder is incomplete (a save cut short, or a partial copy)"
            )


def _safe_planner(base: type) -> type:
    """``base`` (a DCP load planner) reading the non-tensor entries of ``*.distcp`` files weights-only: DCP's
    own planners ``torch.load(..., weights_only=False)`` them, which runs whatever a crafted file holds."""
    from torch.distributed.checkpoint._traverse import set_element

    class Safe(base):
        def load_bytes(self, read_item, value) -> None:
            obj = checkpoint.safe_torch_load(
                value, name=f"a non-tensor entry {read_item.dest_index.fqn!r} of a .distcp file"
            )
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    Safe.__name__ = Safe.__qualname__ = f"Safe{base.__name__}"
    return Safe


def is_dcp(path: Path) -> bool:
    """True when ``path`` is a stratbench checkpoint folder in the ``dcp`` layout."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / checkpoint.META_FILE).exists()
        and checkpoint.read_meta(path).get("layout") == LAYOUT
    )


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a ``dcp`` folder into a (possibly sharded) model and optimizer; a collective. DCP reads, on each
    rank, just the pieces of each tensor that rank holds, whatever the world size the folder was saved with.
    Returns the header (progress, scheduler, rng, meta)."""
    import torch.distributed.checkpoint as dcp  # DCP and DTensor: ~0.8 s of imports a run without them skips
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    meta = checkpoint.read_meta(path)
    if meta.get("layout") != LAYOUT:
        raise CheckpointError(f"checkpoint {path} has layout {meta.get('layout')!r}, not {LAYOUT!r}")
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    checkpoint.check_folder(path)  # DCP unpickles .metadata with pickle.load
    check_whole(path)
    state = module_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path, planner=_safe_planner(DefaultLoadPlanner)())
    except CheckpointError:
        raise
    except (
        Exception,
        CheckpointException,
    ) as exc:  # DCP reports a missing key or a shape mismatch as a long CheckpointException
        refused = _refusal_inside(exc)
        if refused is not None:
            raise refused from None
        first = _first_failure(exc)
        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer (saved with model {meta.get('meta', {}).get('model')!r}, "
            f"optimizer of run config {meta.get('config', {}).get('optimizer')!r}): {first[:300]}"
        ) from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return meta


def read_dcp(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Layout reader: the whole folder as ONE full state on CPU, without a process group (as DCP's own
    ``format_utils.dcp_to_torch_save`` does), in the FQN-keyed format of the base Strategy's full checkpoints."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint.check_folder(path)  # DCP unpickles .metadata with pickle.load (load_any checked it too)
    check_whole(path)
    state: dict[str, Any] = {}
    planner = _safe_planner(_EmptyStateDictLoadPlanner)()
    try:
        # The empty planner fills ``state`` with every entry the metadata lists, re-nested as it was saved;
        # no_dist keeps this process from talking to others (each caller reads the whole folder). The public
        # dcp.load would fill a copy of ``state``, so this is the call dcp_to_torch_save makes.
        _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        refused = _refusal_inside(exc)
        if refused is not None:
            raise refused from None
        raise CheckpointError(f"sharded checkpoint {path} could not be read ({_first_failure(exc)})") from None
    if "model" not in state:
        raise CheckpointError(f"sharded checkpoint {path} holds no model state (found {sorted(state)[:6]})")
    return {"model": state["model"], "optimizer": state.get("optimizer", {})}


def _check_layout(path: Path) -> None:
    """The layout's check before any work (``checkpoint.read_meta``): the safety scan, then ``check_whole``."""
    checkpoint.check_folder(path)
    check_whole(path)


checkpoint.register_layout(LAYOUT, read_dcp, check=_check_layout)
