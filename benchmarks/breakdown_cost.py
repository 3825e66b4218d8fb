"""What --breakdown costs: the same run with and without it, alternated, repeated; step time min/median/max.

    python benchmarks/breakdown_cost.py [--repeats 5] [--strategy single] [--nproc 1]

Writes benchmarks/breakdown_cost_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from stratbench.measuring.environment import cpu_name


def run(out: Path, breakdown: bool, strategy: str, nproc: int) -> float:
    cmd = [sys.executable, "-m", "stratbench", "train", "--output", str(out), "--strategy", strategy, "--nproc", str(nproc),
           "--model", "tinynet", "--width", "16", "--data", "digits", "--batch-size", "64", "--max-steps", "60",
           "--progress", "false", "--measure-flops", "false", "--breakdown", str(breakdown).lower()]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads((out / "result.json").read_text())["metrics"]["step_time_mean_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--strategy", default="single")
    ap.add_argument("--nproc", type=int, default=1)
    a = ap.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for on in (False, True):
                times[on].append(run(Path(tmp) / f"{i}-{on}", on, a.strategy, a.nproc))
    off, on = (sorted(times[k]) for k in (False, True))
    ratio = statistics.median(on) / statistics.median(off)
    lines = [
        f"# What --breakdown costs ({a.strategy}, {a.nproc} process(es), CPU)",
        "",
        f"`python benchmarks/breakdown_cost.py --repeats {a.repeats} --strategy {a.strategy} --nproc {a.nproc}` "
        f"({dt.date.today()}): tinynet width 16, digits, global batch 64, 60 steps (3 warm-up), runs alternated,"
        f" 1 thread per process. Machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}.",
        "",
        "| --breakdown | step time min / median / max |",
        "|---|---|",
        f"| false | {off[0] * 1e3:.2f} / {statistics.median(off) * 1e3:.2f} / {off[-1] * 1e3:.2f} ms |",
        f"| true | {on[0] * 1e3:.2f} / {statistics.median(on) * 1e3:.2f} / {on[-1] * 1e3:.2f} ms |",
        "",
        f"Median ratio on/off: **{ratio:.3f}**. On a CPU a phase boundary is a clock read and a profiler range;"
        " on a GPU each boundary also synchronises the device, which removes the overlap of the host's kernel"
        " launches with the device's work: measure it there before leaving it on.",
    ]
    name = Path(__file__).parent / f"breakdown_cost_cpu_{a.strategy}_w{a.nproc}_{dt.date.today()}.md"
    name.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
