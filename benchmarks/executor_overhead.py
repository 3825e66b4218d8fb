"""Dispatch overhead per cell of `compare --executor ray` against the local executor, on a real two-node Ray
cluster started on this machine (scripts/local_ray.py), median of 3.

The same two tiny cells (single and ddp, fp32, tinynet on digits, 3 steps) are run by `stratbench compare` on each
executor, one cell at a time on both (`--max-concurrent-cells 1`: Ray would otherwise run the two at once), 3 times
each into fresh folders, alternating local and ray so that a change in the machine's load hits both. A cell's time is from its submission to its end (the record's ``queued_s + elapsed_s``: for Ray its
placement group, its node-runner actors, the launcher on each node); the overhead is ray minus local, per cell.

    nice -n 19 .venv/bin/python benchmarks/executor_overhead.py \\
        --report benchmarks/executor_overhead_cpu_$(date +%F).md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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

MATRIX = {
    "name": "overhead",
    "base": {"model": "tinynet", "width": 8, "norm": "none", "data": "digits", "batch_size": 32, "epochs": 1,
             "max_steps": 3, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False},
    "cells": [{"method": ["single", "ddp"], "precision": "fp32"}],
}  # fmt: skip


def run_compare(root: Path, name: str, extra: list[str]) -> dict:
    """One `stratbench compare` of MATRIX: its wall time and each cell's submit-to-end time."""
    out = root / name
    cmd = [sys.executable, "-m", "stratbench", "compare", "--matrix", str(root / "matrix.yaml"), "--output",
           str(out), *extra]  # fmt: skip
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.monotonic() - t0
    cells = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["status"] == "ok", rec["reason"]
        cells[rec["method"]] = (rec.get("queued_s") or 0.0) + rec["elapsed_s"]
        cells[rec["method"] + ":queued"] = rec.get("queued_s") or 0.0
    return {"wall": wall, "cells": cells, "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", type=Path, help="write the markdown report here (default: print it)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="executor-overhead-"))
    (root / "matrix.yaml").write_text(yaml.safe_dump(MATRIX))
    t0 = time.monotonic()
    cluster = local_ray.start(root / "cluster")
    startup = time.monotonic() - t0
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        for k in range(args.repeats):
            runs["local"].append(run_compare(root, f"local-{k}", []))
            ray_flags = [
                "--executor",
                "ray",
                "--ray-address",
                cluster["address"],
                "--max-concurrent-cells",
                "1",
            ]
            runs["ray"].append(run_compare(root, f"ray-{k}", ray_flags))
    finally:
        local_ray.stop(cluster)
    text = report(runs, startup, args)
    if args.report:
        args.report.write_text(text)
    print(text)
    return 0


def report(runs: dict[str, list[dict]], startup: float, args: argparse.Namespace) -> str:
    import ray
    import torch

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} s (" + ", ".join(f"{v:.1f}" for v in values) + ")"

    rows = []
    for cell in ("single", "ddp"):
        local = [r["cells"][cell] for r in runs["local"]]
        ray_ = [r["cells"][cell] for r in runs["ray"]]
        over = [b - a for a, b in zip(local, ray_, strict=True)]
        queued = [r["cells"][cell + ":queued"] for r in runs["ray"]]
        rows.append(f"| {cell} fp32 | {med(local)} | {med(ray_)} | **{statistics.median(over):+.1f} s** | "
                    f"{med(queued)} |")  # fmt: skip
    walls = [f"| whole compare (2 cells) | {med([r['wall'] for r in runs['local']])} | "
             f"{med([r['wall'] for r in runs['ray']])} | "
             f"{statistics.median([b['wall'] - a['wall'] for a, b in zip(runs['local'], runs['ray'], strict=True)]):+.1f} s | |"]  # fmt: skip
    loads = [round(r["load"], 1) for k in ("local", "ray") for r in runs[k]]
    return "\n".join([
        f"# Dispatch overhead per cell: `compare --executor ray` vs local ({datetime.date.today()})", "",
        f"Machine: {platform.node()}, {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}); "
        f"torch {torch.__version__}, ray {ray.__version__}, Python {platform.python_version()}. The two-node Ray "
        f"cluster (a head and a worker node, 2 CPUs each, scripts/local_ray.py) started in {startup:.1f} s.", "",
        "Command: `nice -n 19 .venv/bin/python benchmarks/executor_overhead.py --report ...` (the module docstring "
        "says what it runs). Each value: median of "
        f"{args.repeats} (every run in brackets); a cell's time is from its submission to its end.", "",
        "| | local | ray | ray - local | ray: submission to start (placement group, actors, node 0's address) |",
        "|---|---|---|---|---|", *rows, *walls, "",
        f"1-minute load averages after each compare: {loads} (other work on this shared machine inflates both "
        "columns alike; runs alternate local and ray).", "",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
