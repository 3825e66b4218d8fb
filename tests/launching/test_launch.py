"""Launching on loopback: stratbench's own torchrun launcher, the same command under a user's torchrun, two
"nodes" on one machine, and torchrun's elastic behaviour (a killed worker fails the run fast; with
--max-restarts the group restarts and resumes from the last checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, run_nodes, stratbench_cmd
from stratbench.core.config import TrainConfig
from stratbench.core.dist import free_port
from stratbench.launching.launch import torchrun_command

SHORT = [*TINY, "--max-steps", "5", "--strategy", "ddp"]
# Long enough that the kill lands mid-run (first checkpoint after 2 of 60 steps), short enough to finish.
LONG = [*TINY, "--strategy", "ddp", "--epochs", "3", "--max-steps", "60", "--save-every-steps", "2", "--save-every-epoch", "false"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _result(output: Path) -> dict:
    return json.loads((output / "result.json").read_text())


def _check(proc: subprocess.CompletedProcess | subprocess.Popen, out: str, err: str) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"


def test_torchrun_command_flags():
    """Multi-node flags pass through to torchrun: static master address/port, or a c10d rendezvous endpoint."""
    cfg = TrainConfig(nproc=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400, max_restarts=2)
    cmd = torchrun_command(cfg, Path("c.yaml"))
    for flag in ("--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400",
                 "--max-restarts=2", f"--rdzv-conf=timeout={cfg.dist_timeout_s}"):  # fmt: skip
        assert flag in cmd
    assert cmd[1:3] == ["-m", "stratbench.launching._torchrun"]  # torchrun, with a failed rendezvous in one line
    assert cmd[-5:] == ["-m", "stratbench", "train", "--config", "c.yaml"]
    # A rendezvous that cannot complete fails after --dist-timeout-s, not torchrun's default 600 s.
    cmd = torchrun_command(cfg.replace(rdzv_endpoint="head:29400", dist_timeout_s=7), Path("c.yaml"))
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=head:29400" in cmd and "--rdzv-conf=join_timeout=7" in cmd
    assert not any(a.startswith(("--master-addr", "--node-rank")) for a in cmd)
    cmd = torchrun_command(TrainConfig(nproc=2, max_restarts=1, dist_timeout_s=9), Path("c.yaml"))
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-conf=join_timeout=9" in cmd


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rendezvous_that_cannot_complete_fails_in_one_line_within_the_timeout(tmp_path, capfd):
    """Node 0 of two with no node 1: the rendezvous fails after --dist-timeout-s (not torchrun's 600 s) in
    one line naming the timeout and why, and result.json says "failed"."""
    from stratbench.cli import main

    out = tmp_path / "run"
    t0 = time.monotonic()
    code = main(["train", "--output", str(out), *SHORT, "--nnodes", "2", "--nproc", "1", "--node-rank", "0",
                 "--dist-timeout-s", "5", "--master-addr", "127.0.0.1", "--master-port", str(free_port())])  # fmt: skip
    elapsed = time.monotonic() - t0
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert code != 0 and elapsed < 60, (code, elapsed)
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "rendezvous" in err[0] and "--dist-timeout-s 5" in err[0] and "1/2" in err[0], err
    result = _result(out)
    assert result["status"] == "failed" and "rendezvous" in result["reason"]
    assert not (out / ".torchrun_error.node0").exists()


@pytest.mark.distributed
def test_under_users_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m stratbench train ...`: each process is one rank, nothing re-launched."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "stratbench", "train", "--output", str(tmp_path), *SHORT]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    _check(proc, proc.stdout, proc.stderr)
    res = _result(tmp_path)
    assert res["status"] == "ok" and res["world_size"] == 2 and res["metrics"]["steps"] == 5


@pytest.mark.distributed
def test_two_nodes_on_loopback(tmp_path):
    """Two `stratbench train --nnodes 2 --nproc 1 --node-rank i` commands, as two machines would run them."""
    outputs = run_nodes(tmp_path, "train", *SHORT, nnodes=2, nproc=1)
    res = _result(tmp_path)
    assert res["status"] == "ok" and res["world_size"] == 2
    assert res["metrics"]["node_of_rank"] == [0, 1]  # each rank's node, as its launcher says it
    assert "val accuracy" in outputs[0]  # node 0 prints the result table
    assert "val accuracy" not in outputs[1]  # node 1 has no result of its own to print


def _worker_pids(output: Path) -> dict[int, int]:
    """rank -> pid of the workers torchrun started for the run writing to ``output`` (read from /proc: the
    launcher's lock of ``output`` is in their environment)."""
    marker = str(output.resolve()).encode()
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"stratbench.launching._torchrun" in args:
                continue
            environ = dict(
                kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if b"=" in kv
            )
        except OSError:  # the process ended while we looked
            continue
        if environ.get(b"STRATBENCH_LOCKED") == marker and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(entry)
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the launcher and everything it started (torchrun, workers), so a hung run leaks no processes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start_and_kill_rank1(output: Path, *extra: str) -> tuple[subprocess.Popen, float]:
    """Start LONG on 2 ranks, wait for its first checkpoint, SIGKILL rank 1; return the launcher and kill time."""
    proc = subprocess.Popen(
        stratbench_cmd("train", "--output", str(output), "--nproc", "2", *LONG, *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    ckpt = output / "checkpoints" / "last"
    while not ckpt.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=60) if proc.poll() is None else proc.communicate()
            _kill_group(proc)
            pytest.fail(f"the run made no checkpoint (exit {proc.returncode})\n{err[-4000:]}")
        time.sleep(0.05)
    pids = _worker_pids(output)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    return proc, time.monotonic()


@pytest.mark.distributed
def test_killed_worker_fails_fast(tmp_path):
    """No restarts: torchrun stops the surviving rank at once (it would otherwise wait in a collective for
    --dist-timeout-s, 300 s) and stratbench reports one clear line."""
    proc, t_kill = _start_and_kill_rank1(tmp_path)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        _kill_group(proc)
    elapsed = time.monotonic() - t_kill
    assert proc.returncode != 0
    assert elapsed < 60, f"the run took {elapsed:.0f} s to fail after a worker was killed"
    last = err.strip().splitlines()[-1]
    assert last.startswith("stratbench train: error: training failed") and "killed" in last, last
    assert "SIGKILL" in err  # torchrun's summary names the signal and the rank
    assert not (tmp_path / "result.json").exists() or _result(tmp_path)["status"] != "ok"


@pytest.mark.distributed
def test_max_restarts_resumes_from_last_checkpoint(tmp_path):
    proc, _ = _start_and_kill_rank1(tmp_path, "--max-restarts", "1")
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        _kill_group(proc)
    _check(proc, out, err)
    res = _result(tmp_path)
    assert res["status"] == "ok" and res["world_size"] == 2
    resumed = res["resumed_from"]["step"]
    assert 2 <= resumed < 60 and resumed % 2 == 0
    assert res["metrics"]["steps"] == 60 - resumed  # the restarted group ran only the remaining steps
    assert res["config"]["resume"] is True


def test_needs_launch_under_slurm_and_torchrun(monkeypatch):
    """An srun task asking for --nproc N launches torchrun for its node; one that does not is a worker itself;
    a torchrun worker never launches again."""
    from stratbench.core.dist import needs_launch

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert needs_launch(TrainConfig(nproc=4, nnodes=2))
    assert not needs_launch(TrainConfig())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert not needs_launch(TrainConfig(nproc=4, nnodes=2))
