"""Atomic writes: every file and folder stratbench writes (checkpoints, reports, configs, results) is written
next to its target and swapped in with one rename, so a crash leaves the previous version or the new one, never
half of either."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def remove_path(path: Path) -> None:
    """Delete a file, link or folder if it is there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


FAULT_SWAP_ENV = "STRATBENCH_TEST_KILL_IN_SWAP"
"""Fault injection, for tests only (benchmarks/fault_injection.py): set to a glob, a swap whose target's name
matches it SIGKILLs this process's group between its two renames (the previous entry already moved to
``.NAME.old``, the new one not yet in place), the window a random kill almost never hits."""


def _fault_between_renames(path: Path) -> None:
    pattern = os.environ.get(FAULT_SWAP_ENV)
    if not pattern or not fnmatch.fnmatchcase(path.name, pattern):
        return
    import signal

    group = os.getpgrp()
    if group != os.getpgid(
        os.getppid()
    ):  # the run's own group (a test starts each run in one): all its ranks
        os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def replace_path(new: Path, path: Path) -> Path:
    """Put ``new`` (a complete file or folder) at ``path``, replacing what is there; the one swap every
    checkpoint writer uses. The previous entry stays whole as ``.NAME.old`` until ``new`` is in place, and an
    ``.NAME.old`` is never deleted while ``path`` is missing (a kill between the two renames of an earlier
    swap left it as the only copy: ``resolve_resume`` reads it)."""
    new, path = Path(new), Path(path)
    old = path.with_name(f".{path.name}.old")
    if path.exists() or path.is_symlink():
        remove_path(old)  # ``path`` is whole, so an older copy is redundant
        os.replace(path, old)
        _fault_between_renames(path)
    os.replace(new, path)
    fsync_dir(path.parent)
    remove_path(old)
    return path


def temp_path_for(path: Path, suffix: str = ".tmp") -> Path:
    """A free name next to ``path`` (same folder, so that the final rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def atomic_output(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path`` to write (file or folder); on success it replaces ``path``
    (``replace_path``), on any error it is deleted and ``path`` is left as it was. An OSError that names no
    file or the temporary one (a full disk seen by torch.save) is raised naming ``path``, what the user asked for."""
    tmp = temp_path_for(path, ".tmp" + suffix)
    tmp.unlink()  # the writer creates it (a file or a folder)
    try:
        yield tmp
        if not (tmp.exists() or tmp.is_symlink()):
            raise FileNotFoundError(f"nothing was written to {tmp}")
        replace_path(tmp, path)
    except OSError as exc:
        remove_path(tmp)
        if exc.errno is not None and (exc.filename is None or str(exc.filename).startswith(str(tmp))):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    except BaseException:
        remove_path(tmp)
        raise


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file, fsync, rename (reports, CSV, JSON)."""
    payload = data.encode() if isinstance(data, str) else data
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)


def append_json_line(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` and flush it to disk, so that a crash of the writer loses
    nothing written before. A last line cut short by a crash (no newline) is dropped first, or ended if it is
    whole: appended to, it would take the new line down with it."""
    path = Path(path)
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as fh:
            data = fh.read()
            if not data.endswith(b"\n"):
                start = data.rfind(b"\n") + 1
                try:
                    whole = isinstance(json.loads(data[start:]), dict)
                except ValueError:
                    whole = False
                if whole:
                    fh.write(b"\n")
                else:
                    fh.truncate(start)
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file written by ``append_json_line``, in order; a line that is not one (a torn last
    line) is left out. A missing file has none."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records
