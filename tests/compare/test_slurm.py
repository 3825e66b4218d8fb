"""`compare --executor slurm` on a real single-node SLURM on this machine (scripts/local_slurm.sh: munged,
slurmctld and slurmd on loopback, started for this module and stopped at the end; skipped with the reason where it
cannot start). One sweep folder goes through a whole life: SIGTERM of compare while one cell runs and one waits
(no job, no process left), the same command again with one cell's job cancelled by `scancel` (recorded failed,
"cancelled", the other done), and once more (the cancelled cell runs, the done one is kept); its cells and fp64
losses then match the local executor's. The refusals come before any cell."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import REPO, RTOL, assert_curves_match, fails, stratbench_cmd, sweep_processes
from stratbench.api import plan_sweep
from stratbench.compare.runner import SweepRunner, load_records
from stratbench.launching.executors import make_executor

pytest.importorskip("submitit", reason='needs submitit: pip install "stratbench[cluster]"')

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

SCRIPT = REPO / "scripts" / "local_slurm.sh"
BASE = {"model": "tinynet", "width": 8, "norm": "none", "data": "digits", "batch_size": 32, "epochs": 1,
        "max_steps": 3, "lr": 0.02, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False}  # fmt: skip
"""conftest's TINY as a matrix base, 3 steps (as tests/compare/test_ray.py)."""
TWO = [{"method": ["single", "ddp"], "precision": "fp64"}]


def _sweep(matrix: Path, out: Path, executor: str = "local") -> dict:
    """What `stratbench compare --matrix M --output O --executor E` runs (its checks, then its runner), in this
    process and without the report it renders after (~5-10 s here, the same for every executor)."""
    from rich.console import Console

    plan = plan_sweep(matrix=str(matrix), output=str(out), executor=make_executor(executor))
    runner = SweepRunner(plan.matrix, plan.output, timeout_s=plan.timeout_s, executor=plan.executor,
                         console=Console(file=io.StringIO(), width=200))  # fmt: skip
    runner.run(plan.plans)
    return {r["method"]: r for r in load_records(out).values()}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A SLURM of this module's own (free ports, its state in a temporary folder); SLURM_CONF points at it."""
    if os.geteuid() != 0:
        pytest.skip("a local SLURM needs root (slurmd runs the jobs as their user)")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    root = tmp_path_factory.mktemp("slurm")
    state = Path("/tmp") / f"stratbench-slurm-test-{os.getpid()}"  # unix socket paths must stay short
    up = subprocess.run(["bash", str(SCRIPT), "up", str(state)], capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, timeout=120)
        pytest.skip(f"the local SLURM did not start: {(up.stderr or up.stdout).strip()[-300:]}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    matrix = root / "two.yaml"
    matrix.write_text(yaml.safe_dump({"name": "two", "base": BASE, "cells": TWO}))
    pool = ThreadPoolExecutor(1)  # the local reference sweep runs while the SLURM tests do
    local = pool.submit(_sweep, matrix, root / "local")
    yield {"root": root, "matrix": matrix, "out": root / "slurm", "local": local, "state": state}
    pool.shutdown()
    subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, timeout=120)
    shutil.rmtree(state, ignore_errors=True)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


def _jobs() -> list[str]:
    """Every job SLURM still has queued or running (`squeue`): 'ID|NAME|STATE'."""
    out = subprocess.run(
        ["squeue", "--noheader", "--format", "%i|%j|%T"], capture_output=True, text=True, check=True
    )
    return out.stdout.split()



def _until(check, what: str, timeout_s: float = 180.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert proc is None or proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.2)
    return found


def test_sigterm_of_compare_cancels_its_queued_and_running_jobs_and_leaves_no_process(slurm):
    """2 CPUs: `single` (1 CPU) runs while `ddp` (2 CPUs) waits in the queue; SIGTERM then: both cancelled."""
    out = slurm["out"]
    cmd = stratbench_cmd(
        "compare", "--matrix", str(slurm["matrix"]), "--output", str(out), "--executor", "slurm"
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    _until(lambda: "RUNNING" in " ".join(_jobs()) and "PENDING" in " ".join(_jobs()), "running + pending job",
           proc=proc)  # fmt: skip
    _until(lambda: list((out / "cells").glob("single*/train.log")), "single's launcher", proc=proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "interrupted (stopped while running" in output
    assert _jobs() == []  # nothing queued or running: scancel'ed, and waited for
    assert sweep_processes(out) == []
    assert load_records(out) == {}  # the stopped cells are not recorded: the same command runs them


@pytest.fixture(scope="module")
def cancelled(slurm) -> dict:
    """The same command again (in this process): once `ddp` trains, its job is cancelled with `scancel`."""
    out = slurm["out"]

    def scancel_ddp_once_it_runs() -> None:
        _until(lambda: list((out / "cells").glob("ddp*/train.log")), "ddp's launcher")
        subprocess.run(["scancel", "--name", next((out / "cells").glob("ddp*")).name], check=True)

    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(scancel_ddp_once_it_runs)
        records = _sweep(slurm["matrix"], out, "slurm")
        killer.result()
    return records


def test_a_scancelled_cell_is_failed_cancelled_the_other_done_and_a_rerun_completes_it(slurm, cancelled):
    ddp, single = cancelled["ddp"], cancelled["single"]
    assert ddp["status"] == "failed" and ddp["lost"], ddp
    assert ddp["reason"].startswith("cancelled (SLURM job"), ddp["reason"]
    assert single["status"] == "ok", single["reason"]
    cell = Path(single["cell_dir"])
    assert list((cell / "slurm").glob("*_0_log.out"))  # the job's stdout/stderr, kept with the cell
    stamp = (cell / "result.json").stat().st_mtime_ns
    records = _sweep(slurm["matrix"], slurm["out"], "slurm")
    assert records["ddp"]["status"] == "ok", records["ddp"]["reason"]
    assert (cell / "result.json").stat().st_mtime_ns == stamp  # done before: not run again
    assert _jobs() == []


def test_the_slurm_sweep_gives_the_local_cells_and_fp64_losses(slurm, cancelled):
    slurm["local"].result(timeout=600)  # the fixture's local sweep, run meanwhile
    local, records = load_records(slurm["root"] / "local"), load_records(slurm["out"])
    assert set(records) == set(local)
    for cell_id, ref in local.items():
        rec = records[cell_id]
        assert rec["status"] == "ok" and ref["status"] == "ok", (rec["reason"], ref["reason"])
        assert_curves_match(rec["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
        assert rec["cell_dir"].startswith(str(slurm["out"]))


def test_a_bad_partition_too_many_cpus_or_no_slurm_is_one_line_before_any_cell(slurm, capsys, monkeypatch):
    out = slurm["root"] / "refused"
    args = ["compare", "--matrix", slurm["matrix"], "--output", out, "--executor", "slurm"]
    err = fails(capsys, *args, "--slurm-partition", "gpu")
    assert "--slurm-partition 'gpu' does not exist; SLURM's partitions: debug (default)" in err, err
    err = fails(capsys, *args, "--world-size", "8", "--batch-size", "32")
    assert f"a cell needs 1 node(s) with 8 CPU(s) each; SLURM partition debug has 1 node(s): localhost " \
           f"({os.cpu_count()} CPU" in err, err  # fmt: skip
    err = fails(capsys, *args, "--slurm-option", "nodes=2")
    assert "stratbench sets --nodes itself" in err, err
    monkeypatch.setenv("SLURM_CONF", str(slurm["root"] / "no-such.conf"))
    err = fails(capsys, *args)
    assert "cannot reach SLURM (s_p_parse_file: cannot stat file" in err, err
    monkeypatch.setenv("PATH", str(slurm["root"]))
    err = fails(capsys, *args)
    assert "--executor slurm needs SLURM's commands (sinfo, sbatch, squeue, scancel, srun not found" in err, (
        err
    )
    assert not out.exists()
