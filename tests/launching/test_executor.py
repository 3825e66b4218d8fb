"""The executor seam without a cluster (fast): the local executor's jobs of one and of several nodes, cancel,
the registry's one-line refusals, and cells spread over nodes by the matrix (Ray itself: tests/compare/test_ray.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from stratbench.compare.matrix import build_matrix
from stratbench.core.errors import ConfigError
from stratbench.launching.executor import Job, Shape
from stratbench.launching.executors import make_executor
from stratbench.launching.local_executor import LocalExecutor
from stratbench.launching.slurm_executor import SlurmExecutor

ECHO = "import sys, time; print(' '.join(sys.argv[1:]), flush=True); time.sleep(float(sys.argv[1]))"


def _wait(executor, handle, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while (outcome := executor.poll(handle)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return outcome


def test_a_job_of_two_nodes_runs_one_command_per_node_with_node_flags(tmp_path):
    executor = LocalExecutor()
    job = Job("two", (sys.executable, "-c", ECHO, "0"), tmp_path / "train.log", Shape(nodes=2))
    outcome = _wait(executor, executor.submit(job))
    assert outcome.returncode == 0 and not outcome.reason and outcome.cpu_count
    lines = [(tmp_path / name).read_text().splitlines()[-1] for name in ("train.log", "train.node1.log")]
    ports = set()
    for rank, line in enumerate(lines):
        words = line.split()
        assert words[words.index("--node-rank") + 1] == str(rank), line
        assert words[words.index("--nnodes") + 1] == "2"
        assert words[words.index("--master-addr") + 1] == "127.0.0.1"
        ports.add(words[words.index("--master-port") + 1])
    assert len(ports) == 1  # both nodes meet at node 0's port


def test_one_node_adds_no_node_flags_and_a_failing_node_fails_the_job(tmp_path):
    executor = LocalExecutor()
    job = Job("one", (sys.executable, "-c", ECHO, "0"), tmp_path / "a.log")
    assert _wait(executor, executor.submit(job)).returncode == 0
    assert "--node-rank" not in (tmp_path / "a.log").read_text()
    # node 1 fails (exit 5), node 0 succeeds: the job fails with node 1's code
    fail = "import sys; sys.exit(5 if sys.argv[sys.argv.index('--node-rank') + 1] == '1' else 0)"
    bad = Job("bad", (sys.executable, "-c", fail), tmp_path / "c.log", Shape(nodes=2))
    assert _wait(executor, executor.submit(bad)).returncode == 5


def test_cancel_kills_every_node_s_process(tmp_path):
    executor = LocalExecutor()
    handle = executor.submit(
        Job("sleep", (sys.executable, "-c", ECHO, "60"), tmp_path / "s.log", Shape(nodes=2))
    )
    pids = [p.pid for p in handle.state["procs"]]
    time.sleep(0.5)
    executor.cancel(handle)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_registry_refuses_in_one_line():
    with pytest.raises(ConfigError, match=r"--executor 'slurmx' is not one of: local, ray, slurm"):
        make_executor("slurmx")
    with pytest.raises(ConfigError, match=r"--ray-address applies to --executor ray, not local"):
        make_executor("local", ray_address="127.0.0.1:6379")
    assert make_executor("local").slots == 1 and make_executor("local", 3).slots == 3
    with pytest.raises(ConfigError, match=r"--slurm-partition applies to --executor slurm, not ray"):
        make_executor("ray", slurm_partition="debug")


def test_the_slurm_flags_become_sbatch_options_and_bad_ones_are_one_line():
    """What a job of 2 nodes x 4 processes x 4 GPUs asks sbatch for (the SLURM cluster itself: test_slurm.py)."""
    ex = make_executor("slurm", slurm_partition="gpu", slurm_account="proj", slurm_time="2:00:00",
                       slurm_option=["qos=high", "--constraint=a100", "exclusive"])  # fmt: skip
    assert ex.sbatch_options(Shape(nodes=2, procs_per_node=4, gpus_per_node=4)) == {
        "partition": "gpu", "time": "2:00:00", "nodes": 2, "ntasks-per-node": 1, "cpus-per-task": 4,
        "account": "proj", "gpus-per-node": 4, "qos": "high", "constraint": "a100", "exclusive": True,
    }  # fmt: skip
    assert isinstance(ex, SlurmExecutor) and ex.slots > 100  # every cell submitted: SLURM queues them
    with pytest.raises(ConfigError, match=r"--slurm-time '2h' is not a SLURM time limit: MINUTES, "):
        make_executor("slurm", slurm_time="2h")
    with pytest.raises(ConfigError, match=r"--slurm-option 'nodes=4': stratbench sets --nodes itself"):
        make_executor("slurm", slurm_option=["nodes=4"])
    with pytest.raises(ConfigError, match=r"--slurm-option 'N=4' is not KEY=VALUE"):
        make_executor("slurm", slurm_option=["N=4"])


BASE = {"model": "tinynet", "data": "digits", "batch_size": 32, "max_steps": 3}


def test_nodes_spread_multi_process_cells_and_keep_one_node_ids():
    spec = {"base": BASE, "world_size": 4, "cells": [{"method": ["single", "ddp"], "precision": "fp32"}]}
    flat = {c.method: c for c in build_matrix(spec).cells}
    spread = {c.method: c for c in build_matrix(spec, nodes=2).cells}
    assert spread["single"].nodes == 1 and spread["single"].id == flat["single"].id
    ddp = spread["ddp"]
    assert (ddp.nodes, ddp.procs_per_node, ddp.shape) == (2, 2, "x4 on 2 nodes")
    assert ddp.id != flat["ddp"].id and "_w4n2_" in ddp.id
    cfg = ddp.train_config(Path("out"))
    assert (cfg["nproc"], cfg["nnodes"]) == (2, 2)
    entry = {**spec, "cells": [{"method": "ddp", "precision": "fp32", "nodes": 4}]}
    assert build_matrix(entry, nodes=2).cells[0].nodes == 4  # the entry's own nodes win over --nodes
    with pytest.raises(ConfigError, match=r"--nodes 3 must be a whole number of nodes that divides the cell's 4 "
                                          r"processes \(1, 2, 4\)"):  # fmt: skip
        build_matrix(spec, nodes=3)


def test_a_client_session_refused_while_its_server_cleans_up_is_asked_again(monkeypatch, capsys):
    """Ray Client (`ray://`): a refused session is asked for again (CLIENT_ATTEMPTS, 5 s apart, said in one line
    each), as after a killed sweep's client; a plain address is asked once; the last refusal is the one line."""
    from stratbench.core.errors import ConfigError
    from stratbench.launching import ray_executor

    calls = []

    class FakeRay:
        def __init__(self, refusals: int) -> None:
            self.refusals = refusals

        def init(self, address, **_kw):
            calls.append(address)
            if len(calls) <= self.refusals:
                raise ConnectionError("refused")
            return "session"

    monkeypatch.setattr(ray_executor.time, "sleep", lambda s: None)
    assert ray_executor._init(FakeRay(2), "ray://h:1", "--ray-address", {}) == "session" and len(calls) == 3
    assert capsys.readouterr().err.count("refused a session; asking again in 5 s") == 2
    calls.clear()
    with pytest.raises(ConfigError, match=r"cannot connect to the Ray cluster at ray://h:1 \(--ray-address\)"):
        ray_executor._init(FakeRay(9), "ray://h:1", "--ray-address", {})
    assert len(calls) == ray_executor.CLIENT_ATTEMPTS
    calls.clear()
    with pytest.raises(ConfigError):
        ray_executor._init(FakeRay(9), "10.0.0.1:6379", "--ray-address", {})
    assert calls == ["10.0.0.1:6379"]


def test_a_client_session_that_does_not_open_is_one_line_after_the_bound(monkeypatch, capsys):
    """Ray's client waits for its server's answer without a bound: a session that does not open within
    CLIENT_SESSION_TIMEOUT_S is one line naming the address, after a line saying where the sweep connects."""
    import threading

    from stratbench.core.errors import ConfigError
    from stratbench.launching import ray_executor

    release = threading.Event()

    class StuckRay:
        def init(self, address, **_kw):
            release.wait(30)
            return "late"

    monkeypatch.setattr(ray_executor, "CLIENT_SESSION_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(ConfigError, match=r"the Ray Client server at ray://h:1 opened no session within 0.2 s"):
            ray_executor._init(StuckRay(), "ray://h:1", "--ray-address", {})
    finally:
        release.set()
    assert "--executor ray: connecting to ray://h:1 (--ray-address, Ray Client)" in capsys.readouterr().err
