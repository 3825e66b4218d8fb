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

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratbench.checkpoints import checkpoint
from stratbench.core.errors import CheckpointError

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
    crash while writing leaves the previous checkpoint intact.
    """
    import torch.distributed.checkpoint as dcp

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
    dcp.save(state, checkpoint_id=tmp)
    if is_main:
        header = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "layout": LAYOUT} | extra
        checkpoint.atomic_save(header, tmp / checkpoint.META_FILE)
        _swap_in(tmp, path)
    _barrier()
    return path


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` (file or folder) by ``tmp``; the previous checkpoint stays whole until the new one is
    in place (``checkpoint.replace_path``, the one swap every writer uses)."""
    checkpoint.replace_path(tmp, path)


def _refusal_inside(exc: BaseException) -> CheckpointError | None:
    """DCP wraps what a planner raised in a CheckpointException per rank: our own refusal, if it is one."""
    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        seen = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
        while isinstance(seen, BaseException):
            if isinstance(seen, CheckpointError):
                return seen
            seen = seen.__cause__ or seen.__context__
    return None


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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"sharded checkpoint {path} could not be read ({first[:300]})") from None
    if "model" not in state:
        raise CheckpointError(f"sharded checkpoint {path} holds no model state (found {sorted(state)[:6]})")
    return {"model": state["model"], "optimizer": state.get("optimizer", {})}


checkpoint.register_layout(LAYOUT, read_dcp)
