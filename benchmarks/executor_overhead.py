"""Dispatch overhead per cell of `compare --executor ray` and `--executor slurm` against the local executor, on a
real two-node Ray cluster (scripts/local_ray.py) and a real single-node SLURM (scripts/local_slurm.sh up) started
on this machine, median of 3.

The same two tiny cells (single and ddp, fp32, tinynet on digits, 3 steps) are run by `stratbench compare` on each
executor, one cell at a time on each (`--max-concurrent-cells 1`: Ray and SLURM would otherwise run the two at
once), 3 times each into fresh folders, alternating local, ray and slurm so that a change in the machine's load
hits all three. A cell's time is from its submission to its end (the record's ``queued_s + elapsed_s``: for Ray
its placement group, its node-runner actors, the launcher on each node; for SLURM sbatch, the scheduler, srun,
the launcher); the overhead is the executor's time minus local's, per cell.

    nice -n 19 .venv/bin/python benchmarks/executor_overhead.py \\
        --report benchmarks/executor_overhead_cpu_$(date +%F).md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import local_ray  # noqa: E402

LOCAL_SLURM = REPO / "scripts" / "local_slurm.sh"
MATRIX = {
    "name": "overhead",
    "base": {"model": "tinynet", "width": 8, "norm": "none", "data": "digits", "batch_size": 32, "epochs": 1,
             "max_steps": 3, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False},
    "cells": [{"method": ["single", "ddp"], "precision": "fp32"}],
}  # fmt: skip
CELLS = ("single", "ddp")
STARTS = {"ray": "placement group, actors, node 0's address", "slurm": "sbatch, the scheduler, squeue seen"}
"""What each executor does between a cell's submission and its start (the record's ``queued_s``)."""


def run_compare(root: Path, name: str, extra: list[str], env: dict[str, str] | None = None) -> dict:
    """One `stratbench compare` of MATRIX: its wall time and each cell's submit-to-end time."""
    out = root / name
    cmd = [sys.executable, "-m", "stratbench", "compare", "--matrix", str(root / "matrix.yaml"), "--output",
           str(out), *extra]  # fmt: skip
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    wall = time.monotonic() - t0
    cells = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["status"] == "ok", rec["reason"]
        cells[rec["method"]] = (rec.get("queued_s") or 0.0) + rec["elapsed_s"]
        cells[rec["method"] + ":queued"] = rec.get("queued_s") or 0.0
    return {"wall": wall, "cells": cells, "load": os.getloadavg()[0]}


def start_slurm(state: Path) -> float:
    """scripts/local_slurm.sh up STATE (one node): how long it took."""
    t0 = time.monotonic()
    up = subprocess.run(["bash", str(LOCAL_SLURM), "up", str(state)], capture_output=True, text=True)
    if up.returncode != 0:
        stop_slurm(state)
        raise SystemExit(f"the local SLURM did not start: {(up.stderr or up.stdout).strip()[-300:]}")
    return time.monotonic() - t0


def stop_slurm(state: Path) -> None:
    subprocess.run(["bash", str(LOCAL_SLURM), "down", str(state)], capture_output=True, timeout=300)
    shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", type=Path, help="write the markdown report here (default: print it)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="executor-overhead-"))
    (root / "matrix.yaml").write_text(yaml.safe_dump(MATRIX))
    state = Path("/tmp") / f"stratbench-slurm-overhead-{os.getpid()}"  # unix socket paths must stay short
    t0 = time.monotonic()
    cluster = local_ray.start(root / "cluster")
    startup = {"ray": time.monotonic() - t0}
    runs: dict[str, list[dict]] = {"local": [], "ray": [], "slurm": []}
    try:
        startup["slurm"] = start_slurm(state)
        one_at_a_time = ["--max-concurrent-cells", "1"]
        for k in range(args.repeats):
            runs["local"].append(run_compare(root, f"local-{k}", []))
            ray_flags = ["--executor", "ray", "--ray-address", cluster["address"], *one_at_a_time]
            runs["ray"].append(run_compare(root, f"ray-{k}", ray_flags))
            runs["slurm"].append(run_compare(root, f"slurm-{k}", ["--executor", "slurm", *one_at_a_time],
                                             env={"SLURM_CONF": str(state / "slurm.conf")}))  # fmt: skip
    finally:
        local_ray.stop(cluster)
        stop_slurm(state)
    text = report(runs, startup, args)
    if args.report:
        args.report.write_text(text)
    print(text)
    return 0


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s (" + ", ".join(f"{v:.1f}" for v in values) + ")"


def _row(what: str, runs: dict[str, list[dict]], key: str | None) -> str:
    """One table row: local, then each executor's time, its difference from local and its submission-to-start;
    ``key``: a cell's (its submit-to-end time), None: the whole compare's wall time."""

    def value(run: dict) -> float:
        return run["cells"][key] if key else run["wall"]

    local = [value(r) for r in runs["local"]]
    cells = [_med(local)]
    for name in STARTS:
        mine = [value(r) for r in runs[name]]
        over = statistics.median([b - a for a, b in zip(local, mine, strict=True)])
        queued = _med([r["cells"][f"{key}:queued"] for r in runs[name]]) if key else ""
        cells += [_med(mine), f"**{over:+.1f} s**", queued]
    return f"| {what} | " + " | ".join(cells) + " |"


def report(runs: dict[str, list[dict]], startup: dict[str, float], args: argparse.Namespace) -> str:
    import ray
    import submitit
    import torch

    # slurmd -V needs no slurm.conf (sinfo --version does)
    slurm = subprocess.run(["slurmd", "-V"], capture_output=True, text=True).stdout.strip()
    rows = [_row(f"{cell} fp32", runs, cell) for cell in CELLS]
    rows.append(_row("whole compare (2 cells)", runs, None))
    head = " | ".join(f"{n} | {n} - local | {n}: submission to start ({why})" for n, why in STARTS.items())
    loads = {name: [round(r["load"], 1) for r in done] for name, done in runs.items()}
    return "\n".join([
        f"# Dispatch overhead per cell: `compare --executor ray|slurm` vs local ({datetime.date.today()})", "",
        f"Machine: {platform.node()}, {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}); "
        f"torch {torch.__version__}, ray {ray.__version__}, {slurm}, submitit {submitit.__version__}, Python "
        f"{platform.python_version()}. The two-node Ray cluster (a head and a worker node, 2 CPUs each, "
        f"scripts/local_ray.py) started in {startup['ray']:.1f} s; the single-node SLURM (scripts/local_slurm.sh up: "
        f"munged, slurmctld, one slurmd) in {startup['slurm']:.1f} s.", "",
        "Command: `nice -n 19 .venv/bin/python benchmarks/executor_overhead.py --report ...` (the module docstring "
        "says what it runs). Each value: median of "
        f"{args.repeats} (every run in brackets); a cell's time is from its submission to its end; every executor "
        "runs one cell at a time.", "",
        f"| | local | {head} |", "|---|---|" + "---|---|---|" * len(STARTS), *rows, "",
        f"1-minute load averages after each compare: {loads} (other work on this shared machine inflates every "
        "column alike; runs alternate local, ray and slurm).", "",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
