"""`compare --executor slurm` on a real two-node SLURM on this machine (scripts/local_slurm.sh up --nodes 2:
munged, slurmctld and two slurmd, `node1` and `node2`, on loopback, started for this module and stopped at the
end; skipped with the reason where it cannot start). One sweep folder of three cells (single, ddp, and ddp over
both nodes) goes through a whole life: SIGTERM of compare while two cells run and one waits (no job, no process
left), the same command again with ddp's job cancelled by `scancel` (recorded failed, "cancelled", the others
done), and once more (the cancelled cell runs, the done ones are kept); its cells and fp64 losses then match the
local executor's, the 2-node cell the local 2-process ddp's, its node 1 having run on the other SLURM node. The
refusals come before any cell. `compare --preset quick --executor slurm` (conftest's QUICK_FP64: one cell of each
launch shape, in fp64) gives the local table, and `train --executor slurm` one run over both nodes the local
2-process curve."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import (
    QUICK_FP64,
    REPO,
    RTOL,
    assert_curves_match,
    assert_same_table,
    fails,
    quick_base,
    run_stratbench,
    stratbench_cmd,
    sweep_processes,
)
from stratbench.api import plan_sweep
from stratbench.compare.runner import SweepRunner, load_records
from stratbench.launching.executors import make_executor

pytest.importorskip("submitit", reason='needs submitit: pip install "stratbench[cluster]"')

pytestmark = [pytest.mark.distributed, pytest.mark.slurm, pytest.mark.clusters]

SCRIPT = REPO / "scripts" / "local_slurm.sh"
TWO = [{"method": ["single", "ddp"], "precision": "fp64"}]
THREE = [{"method": "ddp", "precision": "fp64", "nodes": 2, "label": "ddp-2nodes"}, *TWO]
"""The SLURM sweep, on the quick preset's problem: ddp with one process on each node (compared with the local quick
sweep's ddp), then single and ddp (compared with its single and ddp). Submitted in that order, ddp-2nodes (1 CPU on
each node) and single (1 CPU) run at once and ddp (2 CPUs on one node) waits for one of them."""


def _sweep(matrix: Path, out: Path, executor: str = "local") -> tuple[dict, str]:
    """What `stratbench compare --matrix M --output O --executor E` runs (its checks, then its runner), in this
    process and without the report it renders after (~5-10 s here, the same for every executor): the records by
    label (else method) and what the runner printed."""
    from rich.console import Console

    plan = plan_sweep(matrix=str(matrix), output=str(out), executor=make_executor(executor))
    printed = io.StringIO()
    runner = SweepRunner(plan.matrix, plan.output, timeout_s=plan.timeout_s, executor=plan.executor,
                         console=Console(file=printed, width=200))  # fmt: skip
    runner.run(plan.plans)
    return {r.get("label") or r["method"]: r for r in load_records(out).values()}, printed.getvalue()


@pytest.fixture(scope="module")
def slurm_up(tmp_path_factory):
    """A 2-node SLURM of this module's own (free ports, its state in a temporary folder); SLURM_CONF points at
    it."""
    if os.geteuid() != 0:
        pytest.skip("a local SLURM needs root (slurmd runs the jobs as their user)")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    root = tmp_path_factory.mktemp("slurm")
    state = Path("/tmp") / f"stratbench-slurm-test-{os.getpid()}"  # unix socket paths must stay short
    up = subprocess.run(["bash", str(SCRIPT), "up", str(state), "--nodes", "2"], capture_output=True, text=True,
                        timeout=300)  # fmt: skip
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, timeout=120)
        pytest.skip(f"a 2-node local SLURM did not start: {(up.stderr or up.stdout).strip()[-300:]}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    two, matrix = root / "two.yaml", root / "three.yaml"
    two.write_text(yaml.safe_dump({"name": "two", "base": quick_base(), "cells": TWO}))
    matrix.write_text(yaml.safe_dump({"name": "three", "base": quick_base(), "cells": THREE}))
    yield {"root": root, "two": two, "matrix": matrix, "out": root / "slurm", "state": state}
    subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, timeout=120)
    shutil.rmtree(state, ignore_errors=True)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="module")
def slurm(slurm_up, quick_fp64_local):
    """The SLURM with the local executor's quick sweep in fp64 by method (what its sweeps are compared with)."""
    local = {r["method"]: r for r in load_records(quick_fp64_local).values() if r["status"] == "ok"}
    return {**slurm_up, "local": local}


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
    """2 nodes of 2 CPUs: `ddp-2nodes` (1 CPU on each node) and `single` (1 CPU) run while `ddp` (2 CPUs on one
    node) waits in the queue; SIGTERM then: all cancelled."""
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
    """The same command again (in this process): once `ddp` (one node) runs, its job is cancelled with `scancel`
    (the other two run meanwhile)."""
    out = slurm["out"]

    def scancel_ddp_once_it_runs() -> None:  # its train.log may be the SIGTERM'd run's: squeue says it runs
        running = _until(lambda: [j for j in _jobs() if j.split("|")[1].startswith("ddp_") and
                                  j.endswith("|RUNNING")], "ddp's job running")  # fmt: skip
        subprocess.run(["scancel", running[0].split("|")[0]], check=True)

    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(scancel_ddp_once_it_runs)
        records, printed = _sweep(slurm["matrix"], out, "slurm")
        killer.result()
    return {"records": records, "printed": printed}


@pytest.fixture(scope="module")
def rerun(slurm, cancelled) -> dict:
    """Once more: the cancelled cell runs, the others are kept; then nothing of the sweep is left."""
    done = {label: Path(r["cell_dir"]) / "result.json" for label, r in cancelled["records"].items()
            if r["status"] == "ok"}  # fmt: skip
    stamps = {label: path.stat().st_mtime_ns for label, path in done.items()}
    records, _ = _sweep(slurm["matrix"], slurm["out"], "slurm")
    return {"records": records, "stamps": stamps, "kept": {label: p.stat().st_mtime_ns for label, p in done.items()},
            "jobs": _jobs(), "left": sweep_processes(slurm["out"])}  # fmt: skip


def test_a_scancelled_cell_is_failed_cancelled_the_others_done_and_a_rerun_completes_it(cancelled, rerun):
    first = cancelled["records"]
    ddp = first["ddp"]
    assert ddp["status"] == "failed" and ddp["lost"], ddp
    assert ddp["reason"].startswith("cancelled (SLURM job"), ddp["reason"]
    for label in ("single", "ddp-2nodes"):
        assert first[label]["status"] == "ok", first[label]["reason"]
    assert list((Path(first["single"]["cell_dir"]) / "slurm").glob("*_0_log.out"))  # the job's stdout/stderr
    assert rerun["records"]["ddp"]["status"] == "ok", rerun["records"]["ddp"]["reason"]
    assert rerun["kept"] == rerun["stamps"] and len(rerun["stamps"]) == 2  # done before: not run again
    assert rerun["jobs"] == [] and rerun["left"] == []  # nothing queued or running, no process of the sweep


def test_the_slurm_sweep_gives_the_local_cells_and_fp64_losses_the_2_node_cell_on_both_nodes(
    slurm, cancelled, rerun
):
    local = slurm["local"]  # the quick preset's cells in fp64 on the local executor (conftest)
    records = rerun["records"]
    assert set(records) == {"single", "ddp", "ddp-2nodes"}
    assert {local[m]["id"] for m in ("single", "ddp")} <= {rec["id"] for rec in records.values()}  # same cells
    for label, rec in records.items():  # the 2-node ddp against the local 2-process ddp
        ref = local[rec["method"]]
        assert rec["status"] == "ok" and ref["status"] == "ok", (rec["reason"], ref["reason"])
        assert_curves_match(rec["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
        assert rec["cell_dir"].startswith(str(slurm["out"])), label
    two = Path(records["ddp-2nodes"]["cell_dir"])
    assert records["ddp-2nodes"]["nodes"] == 2 and records["ddp-2nodes"]["world_size"] == 2
    node1 = (two / "train.node1.log").read_text().splitlines()[0]  # node 1's launcher, at node1's NodeAddr
    assert "--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 " in node1, node1
    ran_on = {json.loads((two / "slurm" / f"node{i}.json").read_text())["node"] for i in (0, 1)}
    assert ran_on == {"node1", "node2"}  # one launcher on each SLURM node
    assert "ok ddp-2nodes fp64 x2 on 2 nodes" in cancelled["printed"], cancelled["printed"]


def test_a_bad_partition_too_many_cpus_or_no_slurm_is_one_line_before_any_cell(slurm, capsys, monkeypatch):
    out = slurm["root"] / "refused"
    args = ["compare", "--matrix", slurm["two"], "--output", out, "--executor", "slurm"]
    err = fails(capsys, *args, "--slurm-partition", "gpu")
    assert "--slurm-partition 'gpu' does not exist; SLURM's partitions: debug (default)" in err, err
    err = fails(capsys, *args, "--world-size", "8", "--batch-size", "32")
    assert f"a cell needs 1 node(s) with 8 CPU(s) each; SLURM partition debug has 2 node(s): node1 " \
           f"({os.cpu_count()} CPU" in err, err  # fmt: skip
    err = fails(capsys, *args, "--world-size", "3", "--nodes", "3", "--batch-size", "30")
    assert "a cell needs 3 node(s) with 1 CPU(s) each; SLURM partition debug has 2 node(s)" in err, err
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


def test_the_quick_preset_on_slurm_gives_the_local_table(slurm, quick_fp64_local):
    """The issue's check as a user runs it: `stratbench compare --preset quick --executor slurm` (QUICK_FP64's
    cells in fp64) gives the local executor's table, and leaves no job or process."""
    out = slurm["root"] / "quick"
    proc = run_stratbench("compare", *QUICK_FP64, "--output", str(out), "--executor", "slurm", cwd=slurm["root"],
                          timeout=900)  # fmt: skip
    assert f"-> {out} (SLURM" in proc.stdout, proc.stdout[:300]
    assert_same_table(out, quick_fp64_local)
    assert _jobs() == [] and sweep_processes(out) == []


def test_train_on_slurm_over_two_nodes_is_the_local_run(slurm):
    """`stratbench train --executor slurm --nnodes 2 --nproc 1` (one run): a rank on each SLURM node, the local
    quick sweep's ddp curve within 1e-9, the result written here."""
    ref = slurm["local"]["ddp"]
    out = slurm["root"] / "train-2nodes"
    proc = run_stratbench("train", "--config", str(Path(ref["cell_dir"]) / "config.yaml"), "--output", str(out),
                          "--executor", "slurm", "--nnodes", "2", "--nproc", "1", "--progress", "false",
                          cwd=slurm["root"], timeout=300)  # fmt: skip
    assert "training on SLURM partition debug: 2 node(s) with 1 CPU(s) each" in proc.stderr, proc.stderr[-2000:]
    res = json.loads((out / "result.json").read_text())
    assert res["status"] == "ok" and res["world_size"] == 2
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
    assert {json.loads(p.read_text())["node"] for p in (out / "slurm").glob("node*.json")} == {"node1", "node2"}
    assert _jobs() == [] and sweep_processes(out) == []


def _jobs_of(out: Path) -> dict[str, list[str]]:
    """Every job SLURM knows (`squeue --states=all`: MinJobAge keeps ended ones 10 min here) named after a cell
    of ``out`` (a job's name is its cell's id, unique to the matrix), by cell: ['ID|STATE', ...]."""
    cells = {p.name for p in (out / "cells").iterdir()} if (out / "cells").is_dir() else set()
    rows = subprocess.run(["squeue", "--noheader", "--states=all", "--format", "%i|%T|%j"], capture_output=True,
                          text=True, check=True).stdout.split()  # fmt: skip
    jobs: dict[str, list[str]] = {}
    for row in rows:
        job_id, state, name = row.split("|", 2)
        if name in cells:
            jobs.setdefault(name, []).append(f"{job_id}|{state}")
    return jobs


def test_a_killed_sweep_s_jobs_are_adopted_by_the_rerun_never_run_twice(slurm_up):
    """`kill -9` of compare while both its jobs run: they stay (they are SLURM's). The same command again, with
    the jobs' ids lost from its journal (as if it was killed between sbatch's answer and its own line) and the
    jobs suspended meanwhile (live whatever the machine's load), finds them by their comment, adopts them, cleans
    no folder under them and submits nothing: exactly one job per cell, COMPLETED; then nothing is left."""
    root = slurm_up["root"]
    out, matrix = root / "killed", root / "killed.yaml"
    matrix.write_text(yaml.safe_dump({"name": "killed", "base": {**quick_base(), "max_steps": 20}, "cells": TWO}))
    cmd = stratbench_cmd("compare", "--matrix", str(matrix), "--output", str(out), "--executor", "slurm")
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)

    def both_running() -> list[str]:
        jobs = [j for states in _jobs_of(out).values() for j in states if j.endswith("|RUNNING")]
        return jobs if len(jobs) == 2 and len(list((out / "cells").glob("*/train.log"))) == 2 else []

    ids = [j.split("|")[0] for j in _until(both_running, "both jobs running", proc=first)]
    first.kill()  # SIGKILL: no handler runs, nothing is cancelled
    first.communicate(timeout=60)
    subprocess.run(["scontrol", "suspend", *ids], check=True)
    journal = out / "submissions.jsonl"
    lines = journal.read_text().splitlines() if journal.exists() else []
    journal.write_text("".join(ln + "\n" for ln in lines if '"submitted"' not in ln))
    folders = {p.parent.name: (p.parent.stat().st_ino, p.stat().st_ino) for p in (out / "cells").glob("*/train.log")}
    rerun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    _until(lambda: journal.read_text().count('"adopted"') == 2 or sum(map(len, _jobs_of(out).values())) > 2,
           "both jobs adopted (or submitted again)", proc=rerun)  # fmt: skip
    subprocess.run(["scontrol", "resume", *ids], check=True)
    output, _ = rerun.communicate(timeout=300)
    jobs = _jobs_of(out)
    assert sorted(jobs) == sorted(folders) and all(len(states) == 1 for states in jobs.values()), (jobs, output)
    assert rerun.returncode == 0, output
    assert output.count("adopted SLURM job") == 2, output
    assert sum('"submitted"' in ln for ln in lines) == 2, lines  # the first run wrote each id as sbatch answered
    assert {states[0] for states in jobs.values()} == {f"{i}|COMPLETED" for i in ids}, jobs
    records = load_records(out)
    assert {r["status"] for r in records.values()} == {"ok"} and len(records) == 2, records
    now = {p.parent.name: (p.parent.stat().st_ino, p.stat().st_ino) for p in (out / "cells").glob("*/train.log")}
    assert now == folders  # the jobs' folders and logs were never deleted and made again
    assert _jobs() == [] and sweep_processes(out) == []


def test_a_killed_train_on_slurm_is_adopted_by_the_same_command(slurm_up):
    """`train --executor slurm` killed (`kill -9`) while its job runs: the same command again follows that job to
    its end (suspended meanwhile: live whatever the load) instead of rewriting its folder and submitting a
    second one."""
    out = slurm_up["root"] / "train-killed"
    cmd = stratbench_cmd("train", "--model", "tinynet", "--width", "8", "--data", "digits", "--image-size", "16",
                         "--batch-size", "32", "--max-steps", "20", "--output", str(out), "--executor", "slurm",
                         "--progress", "false")  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent)
    staging = out / ".staging-train"  # the nodes' config and logs and the journal, until the run wrote its result

    def running() -> list[str]:
        jobs = [j for j in _jobs() if j.split("|")[1] == out.name and j.endswith("|RUNNING")]
        return jobs if (staging / "train.log").exists() else []

    job_id = _until(running, "the run's job running", proc=first)[0].split("|")[0]
    first.kill()
    first.communicate(timeout=60)
    subprocess.run(["scontrol", "suspend", job_id], check=True)
    config = (staging / "config.yaml").stat().st_mtime_ns
    rerun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out.parent)
    journal = staging / "submissions.jsonl"

    def adopted_or_doubled() -> bool:
        return journal.exists() and '"adopted"' in journal.read_text() or len(_jobs()) > 1

    _until(adopted_or_doubled, "the job adopted (or submitted again)", proc=rerun)
    seen_config = [(staging / "config.yaml").stat().st_mtime_ns]
    subprocess.run(["scontrol", "resume", job_id], check=True)
    stdout, stderr = rerun.communicate(timeout=300)
    ran = subprocess.run(["squeue", "--noheader", "--states=all", "--name", out.name, "--format", "%i|%T"],
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert ran == [f"{job_id}|COMPLETED"], (ran, stderr[-3000:])
    assert rerun.returncode == 0 and f"adopted SLURM job {job_id} (SUSPENDED)" in stderr, stderr[-3000:]
    assert seen_config == [config]  # the job's folder was left as it was while it ran
    assert (out / "train.log").exists() and not staging.exists()  # its log joined the output folder at the end
    assert json.loads((out / "result.json").read_text())["status"] == "ok"
    assert _jobs() == [] and sweep_processes(out) == []
