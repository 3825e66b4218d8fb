"""DeepSpeed's op cache: keyed to the venv and versions; a killed build's lock is taken over; a wait on a live build
says what it waits for and ends. The locks here are torch's own (``FileBaton``) held by real processes, killed with
SIGKILL as a test timeout kills a build; the whole load path runs in test_deepspeed's nvme test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stratbench.strategies import op_builds

HOLD = """import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(lock: Path) -> subprocess.Popen:
    """A process that takes ``lock`` as torch's build does (created with O_EXCL, kept open) and sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_the_cache_is_keyed_to_the_venv_and_versions(monkeypatch, tmp_path):
    import torch

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = op_builds.extensions_cache_dir()
    assert here.parent == tmp_path / "stratbench" / "torch_extensions"
    assert f"torch{torch.__version__}" in here.name and f"py{sys.version_info[0]}.{sys.version_info[1]}" in here.name
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert op_builds.extensions_cache_dir() != here  # another venv builds into a folder of its own
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert op_builds.extensions_cache_dir() == tmp_path / "mine"  # the user's choice, as is


def test_a_killed_builds_lock_is_taken_over_and_a_live_one_is_not(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    builder = _holder(lock)
    try:
        assert op_builds.lock_holders(lock) == [builder.pid]
        assert not op_builds.take_over_if_stale(lock, print)  # a live build keeps its lock
    finally:
        _kill(builder)
    assert lock.exists() and op_builds.lock_holders(lock) == []
    said: list[str] = []
    assert op_builds.take_over_if_stale(lock, said.append)
    assert not lock.exists()
    assert len(said) == 1 and str(lock) in said[0] and "killed" in said[0]


def test_a_wait_on_a_live_build_says_who_and_ends_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(op_builds, "SAY_EVERY_S", 0.5)
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    builder = _holder(lock)
    said: list[str] = []
    try:
        with pytest.raises(op_builds.OpBuildError) as err:
            op_builds.wait_for_build(lock, limit_s=2.0, say=said.append)
    finally:
        _kill(builder)
    msg = str(err.value)
    assert "\n" not in msg and f"process {builder.pid}" in msg and "cpu_adam" in msg and str(lock) in msg
    assert said and all(f"waiting for process {builder.pid} building DeepSpeed's cpu_adam op" in s for s in said)


def test_a_wait_whose_builder_dies_ends_in_one_line(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    builder = _holder(lock)
    killer = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {builder.pid}"])
    with pytest.raises(op_builds.OpBuildError, match="died without finishing.*run again"):
        op_builds.wait_for_build(lock, limit_s=60)
    killer.wait()
    builder.wait()
    assert not lock.exists()


def test_torchs_build_lock_is_the_bounded_one_after_prepare(monkeypatch, tmp_path):
    """What DeepSpeed's op loads go through: torch's ``cpp_extension`` takes its lock class by name at each build."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "FileBaton", cpp_extension.FileBaton)  # restored after the test
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_builds.prepare_op_builds(limit_s=5) == tmp_path
    baton = cpp_extension.FileBaton(str(tmp_path / "lock"))
    assert isinstance(baton, op_builds.BoundedBaton) and baton.limit_s == 5
    (tmp_path / "lock").touch()  # a lock no process holds: a killed build's
    assert baton.try_acquire() and os.path.exists(tmp_path / "lock")
    baton.release()
    assert not (tmp_path / "lock").exists()
