"""DeepSpeed's JIT-built C++ ops (async_io for NVMe offload, cpu_adam, ...): where they are cached, and waits on a
build that are bounded and say what they wait for.

torch builds an extension under ``TORCH_EXTENSIONS_DIR/NAME`` while holding ``NAME/lock``, a file it creates with
O_EXCL, keeps open and deletes when done; every other process that wants the op sleeps until that file is gone.
A build killed while holding it (a test timeout, a ^C'd install, an OOM kill) leaves the file behind, and every
later run that needs the op waits forever at 0% CPU, silently. Here:

- the cache is keyed to the interpreter (the venv) and the torch/DeepSpeed versions, since the build commands name
  the venv's include folders: two venvs sharing one folder rebuilt each other's objects on every load;
- a lock that no live process holds open is a killed build's: it is removed (one line says so) and the op built;
- a wait on a live build prints who builds what every 30 s and ends, past ``wait_limit_s``, in one line naming
  the process and the file to delete if that process is stuck.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stratbench.core.errors import StratbenchError

WAIT_LIMIT_S = 1800.0
"""The longest a run waits for another process's build of an op: a cold async_io build took 610 s on a shared
2-core VM, so three times that."""
SAY_EVERY_S = 30.0


class OpBuildError(StratbenchError):
    """A DeepSpeed op build this run waited on did not finish (stuck past the limit, or its builder died)."""


def cache_key() -> str:
    """``py3.11-torch2.13.0+cpu-deepspeed0.19.8-1a2b3c4d``: the interpreter (its venv, hashed) and the versions the
    built objects depend on."""
    import torch

    try:
        ds = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds = "none"
    venv = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    return f"py{sys.version_info[0]}.{sys.version_info[1]}-torch{torch.__version__}-deepspeed{ds}-{venv}"


def extensions_cache_dir() -> Path:
    """Where DeepSpeed's ops are built: the user's TORCH_EXTENSIONS_DIR as is, else a per-user folder keyed by
    :func:`cache_key`, so that each op is compiled once per venv and versions, and kept across sessions."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "stratbench" / "torch_extensions" / cache_key()


def lock_holders(lock: Path) -> list[int] | None:
    """The processes that hold ``lock`` open (a live build), from /proc; None where that cannot be read (no
    /proc): the lock is then taken as live."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:  # gone, or another user's (the cache is per user, so its builders are ours)
            continue
        for fd in fds:
            try:
                if os.readlink(entry / "fd" / fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders


def is_stale(lock: Path, recheck_s: float = 1.0) -> bool:
    """Whether ``lock`` is a dead build's: it exists and no process holds it, twice ``recheck_s`` apart (a builder
    closes the file a moment before it deletes it)."""
    for attempt in range(2):
        if attempt:
            time.sleep(recheck_s)
        if not lock.exists() or lock_holders(lock) != []:
            return False
    return True


def take_over_if_stale(lock: Path, say: Callable[[str], None]) -> bool:
    """Remove ``lock`` if it is a dead build's (one line says so); True when it was removed."""
    if not is_stale(lock):
        return False
    try:
        lock.unlink()
    except FileNotFoundError:
        return True
    say(
        f"DeepSpeed op cache: removed {lock}, left by a build that was killed (no process holds it); "
        f"building {lock.parent.name} again"
    )
    return True


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def wait_for_build(lock: Path, limit_s: float = WAIT_LIMIT_S, say: Callable[[str], None] = _say) -> None:
    """Wait until another process's build of ``lock.parent.name`` releases ``lock``: a line every 30 s, and one
    line of error when it passes ``limit_s`` or its builder dies without releasing it."""
    started = last_said = time.monotonic()
    op, folder = lock.parent.name, lock.parent
    while lock.exists():
        now = time.monotonic()
        holders = lock_holders(lock)
        if holders == [] and is_stale(lock):
            lock.unlink(missing_ok=True)
            raise OpBuildError(
                f"DeepSpeed's {op} op build in {folder}, which this run waited for, died without finishing "
                f"(its lock {lock} was held by no process; removed): run again to build it"
            )
        who = f"process {', '.join(map(str, holders))}" if holders else "another process"
        if now - started > limit_s:
            raise OpBuildError(
                f"waited {now - started:.0f} s for {who} building DeepSpeed's {op} op in {folder}: let it finish, "
                f"or stop it and delete {lock}"
            )
        if now - last_said >= SAY_EVERY_S:
            say(f"waiting for {who} building DeepSpeed's {op} op in {folder} ({now - started:.0f} s so far)")
            last_said = now
        time.sleep(0.5)


class BoundedBaton:
    """Stands in for torch's ``FileBaton`` (the build lock of ``cpp_extension``): takes over a dead build's lock and
    waits for a live one with a bound and a message. Built on torch's own class by :func:`prepare_op_builds`."""

    limit_s = WAIT_LIMIT_S


def _bounded_baton(base: type) -> type:
    class Baton(base, BoundedBaton):
        def try_acquire(self) -> bool:
            if super().try_acquire():
                return True
            return take_over_if_stale(Path(self.lock_file_path), _say) and bool(super().try_acquire())

        def wait(self) -> None:
            wait_for_build(Path(self.lock_file_path), self.limit_s)

    return Baton


def prepare_op_builds(limit_s: float = WAIT_LIMIT_S) -> Path:
    """Before DeepSpeed may build or load an op in this process: point TORCH_EXTENSIONS_DIR at the keyed cache
    (unless the user set it) and make torch's build lock take over a dead build's lock and bound its waits (torch
    looks ``FileBaton`` up by name in ``cpp_extension`` at each build). Returns the cache folder."""
    folder = extensions_cache_dir()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(folder))
    import torch.utils.cpp_extension as cpp_extension

    if not issubclass(cpp_extension.FileBaton, BoundedBaton):
        cpp_extension.FileBaton = _bounded_baton(cpp_extension.FileBaton)
    cpp_extension.FileBaton.limit_s = limit_s
    return folder
