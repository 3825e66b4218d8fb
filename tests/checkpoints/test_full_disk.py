"""A disk without room for a sharded checkpoint, and a sharded checkpoint with a truncated shard: one line each,
naming the folder or the file, and nothing already saved is harmed.

The full disk is real: a small tmpfs mounted in a private mount namespace (``unshare -rm``: root there, nothing
mounted outside it), where the whole scenario runs, the checks on what it left included (the mount goes with
the namespace). Skipped where the machine allows no such namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EQUIV, fails, train

NO_NAMESPACE = 97
TP_RUN = [
    "--strategy", "tp", "--nproc", "2", "--model", "gpt-tiny", "--data", "text", "--seq-len", "32",
    "--batch-size", "4", "--max-steps", "4", "--save-every-steps", "2", "--optimizer", "adamw",
    "--progress", "false", "--measure-flops", "false",
]  # fmt: skip
"""tp on 2 processes, a checkpoint (22 MiB) at steps 2 and 4: the second does not fit beside the first."""

AFTER_THE_RUN = """\
import os
import sys
import traceback
from pathlib import Path

import torch

from stratbench.checkpoints import sharded
from stratbench.cli import main
from stratbench.core.errors import CheckpointError


def logged(log, run):
    # run() with the stdout and stderr of this process (the file descriptors) going to log
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            return run()
        except BaseException:  # in the log, as a process of its own would print it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def fills():
    # the free space read before writing says plenty: the disk fills while the 4 MiB are written
    sharded._space = lambda state, folder: (int(sharded._state_bytes(state) * sharded.FOLDER_OVERHEAD), 1 << 40)
    try:
        sharded.save_sharded(Path("small/ck"), torch.nn.Linear(1024, 1024), None, {}, is_main=True)
    except CheckpointError as exc:
        print(exc)


logged("../consolidate.log", lambda: main(["consolidate", "run/checkpoints/last", "../model.pt"]))
logged("../consolidate_full.log", lambda: main(["consolidate", "run/checkpoints/last", "model.pt"]))
logged("../fills.log", fills)
"""
"""What is checked after the run, in one process (three fresh interpreters took 7 s more on 2 cores): consolidate
elsewhere and onto the full disk (a command's output as the command line's), then the disk filling while the shards
are written (a 2 MiB tmpfs)."""


def _in_a_namespace(tmp_path: Path, script: str) -> None:
    """Run ``script`` (sh) as root of a private mount namespace, its output under ``tmp_path``; skip without one."""
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-ec", script], cwd=tmp_path, capture_output=True, text=True, timeout=400
    )
    if proc.returncode == NO_NAMESPACE or "unshare:" in proc.stderr:
        pytest.skip(f"no private mount namespace with a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
def test_a_full_disk_during_a_tp_checkpoint_save_is_one_line_and_the_previous_checkpoint_stays_whole(tmp_path):
    """36 MiB of disk: the checkpoint of step 2 fits, that of step 4 not. Every line stratbench prints names the
    checkpoints folder (no rank traceback, no torchrun failure table), result.json says the same, no partial
    folder is left, and `last` still names step 2, which consolidates into one file (elsewhere; onto the full
    disk it is one line too)."""
    sb = f"{sys.executable} -m stratbench"
    _in_a_namespace(tmp_path, f"""
        mkdir disk && (mount -t tmpfs -o size=36m tmpfs disk || exit {NO_NAMESPACE})
        cd disk
        {sb} train {" ".join(TP_RUN)} --output run > ../train.log 2>&1 || echo $? > ../train.rc
        ls -A run/checkpoints > ../left.txt && readlink run/checkpoints/last > ../last.txt
        cp run/result.json ..
        mkdir small && mount -t tmpfs -o size=2m tmpfs small
        {sys.executable} -c '{AFTER_THE_RUN}'
        ls -A small > ../small_left.txt
    """)
    out = (tmp_path / "train.log").read_text()
    assert (tmp_path / "train.rc").read_text().strip() == "2"
    said = [ln for ln in out.splitlines() if ln.startswith("stratbench")]
    assert said and all("no space left on device under run/checkpoints for checkpoint step-00000004" in ln for ln in said), out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and "no space left on device under run/checkpoints" in result["reason"]
    assert (tmp_path / "left.txt").read_text().split() == ["last", "step-00000002"], "no partial folder left"
    assert (tmp_path / "last.txt").read_text().strip() == "step-00000002"
    assert (tmp_path / "model.pt").stat().st_size > 20 * 2**20, (tmp_path / "consolidate.log").read_text()
    # one file onto the full disk: torch.save's "unexpected pos" was a traceback; now the OSError it hides
    full = (tmp_path / "consolidate_full.log").read_text().strip()
    assert full == "stratbench consolidate: error: cannot write model.pt: No space left on device (nothing was replaced)"
    # the disk filling while the shards are written: the same line, the partial folder removed
    fills = (tmp_path / "fills.log").read_text()
    assert "no space left on device under small for checkpoint ck (the disk filled while writing" in fills, fills
    assert (tmp_path / "small_left.txt").read_text().split() == []


def test_a_truncated_shard_is_one_line_naming_the_file_before_any_work(capsys, tmp_path):
    """A dcp folder whose shard lost its end (a copy cut short): consolidate and a resume under fsdp on 2
    processes each refuse in one line naming the file and both sizes, the resume before anything is written."""
    train(tmp_path / "saved", "--strategy", "fsdp", *EQUIV, "--max-steps", "2")
    folder = tmp_path / "saved" / "checkpoints" / "last"
    shard = folder / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    want = f"__0_0.distcp is truncated ({size // 2:,} bytes; its .metadata needs {size:,})"
    assert want in fails(capsys, "consolidate", folder, tmp_path / "model.pt")
    out = tmp_path / "resumed"
    err = fails(capsys, "train", "--strategy", "fsdp", "--nproc", "2", *EQUIV, "--resume-from", folder,
                "--output", out)  # fmt: skip
    assert f"sharded checkpoint {folder}: {want}" in err
    assert not out.exists(), "refused before anything is written"
