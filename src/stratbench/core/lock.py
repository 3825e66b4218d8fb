"""One run per output folder: an exclusive ``fcntl`` lock on OUTPUT/.stratbench.lock, holding the holder's pid.

The kernel releases the lock when the holder exits, however it dies, so a lock file left by a dead run is
simply taken over. A run takes the lock once: the launcher that starts torchrun (its workers, whose parent
holds it, see STRATBENCH_LOCKED), or global rank 0 of a run started by an external launcher.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from stratbench.core.errors import ConfigError

LOCK_FILE = ".stratbench.lock"
HELD_ENV = "STRATBENCH_LOCKED"


def check_output_folder(folder: Path, flag: str = "--output") -> Path:
    """``folder`` as a folder we can write, created if needed; one clear line otherwise."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is an existing file; name a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {flag} folder {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} folder {folder} is not writable")
    return folder


def held_here(folder: Path) -> bool:
    """True when a parent process of this one holds the lock of ``folder`` for this run."""
    return os.environ.get(HELD_ENV) == str(Path(folder).resolve())


@contextlib.contextmanager
def output_lock(folder: Path, flag: str = "--output") -> Iterator[None]:
    """Hold the exclusive lock of ``folder`` for the block; refuse with the holder's pid if another run has it.
    Inside the block HELD_ENV names the folder, so processes this one starts know the lock is theirs. A folder
    this call created is removed again when the block fails and left nothing but the lock file in it (a run
    refused before it wrote anything leaves no trace)."""
    created = not Path(folder).exists()
    folder = check_output_folder(folder, flag)
    if held_here(folder):
        yield
        return
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): no lock, as before
        yield
        return
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot create the lock file {path}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"{flag} {folder} is in use by another stratbench run (pid {holder}); wait for it to finish, "
                "stop it, or choose another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        before = os.environ.get(HELD_ENV)
        os.environ[HELD_ENV] = str(folder.resolve())
        try:
            yield
        except BaseException:
            if created:
                remove_if_only_lock(folder)
            raise
        finally:
            if before is None:
                os.environ.pop(HELD_ENV, None)
            else:
                os.environ[HELD_ENV] = before
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock; the file stays (deleting it would race with a waiting run)


def remove_if_only_lock(folder: Path) -> None:
    """Remove ``folder`` (created by this run, and no other run's) when the lock file is all it holds, or
    nothing."""
    with contextlib.suppress(OSError):
        if [p.name for p in Path(folder).iterdir()] in ([LOCK_FILE], []):
            (Path(folder) / LOCK_FILE).unlink(missing_ok=True)
            Path(folder).rmdir()


def lock_holder(folder: Path) -> str | None:
    """The pid written by the run that holds ``folder``'s lock now (``"unknown"`` if it wrote none), or None
    when no run holds it. Probes without creating anything: a folder without a lock file has no holder."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def wait_released(folder: Path, timeout_s: float) -> str | None:
    """Wait up to ``timeout_s`` for the run holding ``folder``'s lock to end (a stopped job's processes winding
    down); the holder's pid if it still holds it then, else None."""
    deadline = time.monotonic() + timeout_s
    while (holder := lock_holder(folder)) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    return holder
