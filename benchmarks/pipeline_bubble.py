"""The pipeline bubble, measured: the idle fraction of each stage's step vs micro-batches, beside (S-1)/(M+S-1).

A 2-stage pipeline (2 gloo processes) trains a model built to split evenly: an ``nn.Sequential`` of identical
convolution blocks (``build`` below, a stratbench model builder), cut by FLOPs into two stages of equal cost,
so that the textbook assumption (equal stage times) holds. For each micro-batch count M (1 = the naive
schedule, then GPipe; 1F1B beside it) it runs ``stratbench train --strategy pipeline`` several times and reads
the bubble each rank measured (``result.json`` -> ``pipeline.ranks[*].bubble``: 1 - the stage's own
forward/backward/loss compute time / the schedule step's wall time, median over the timed steps). It writes a
markdown table (min / median / max over the repeats of the two stages' mean) and a chart.

    .venv/bin/python benchmarks/pipeline_bubble.py                      # M = 1, 2, 4, 8; 3 repeats; CPU
    .venv/bin/python benchmarks/pipeline_bubble.py --repeats 5 --microbatches 1,2,4,8,16
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
from pathlib import Path

from torch import nn

from stratbench.measuring.environment import cpu_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def build(num_classes: int = 10, width: int = 32, blocks: int = 8) -> nn.Sequential:
    """A stratbench model builder (``--model benchmarks.pipeline_bubble:build``): a 1x1 stem, ``blocks``
    identical 3x3 conv + ReLU blocks, a small head. The blocks dominate the cost, so a FLOP-balanced 2-way
    split gives two stages of (almost) equal time."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 1)]
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU()))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(width, num_classes)))
    return nn.Sequential(*layers)


def run_cell(schedule: str, m: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "stratbench", "train", "--output", str(out), "--nproc", "2",
        "--strategy", "pipeline", "--schedule", schedule, "--microbatches", str(m), "--balance", "flops",
        "--model", "benchmarks.pipeline_bubble:build", "--data", "synthetic", "--image-size", "32",
        "--synthetic-samples", str(args.batch_size * (args.steps + 2)), "--batch-size", str(args.batch_size),
        "--epochs", "1", "--max-steps", str(args.steps), "--timing-warmup-steps", "2", "--progress", "false",
        "--measure-flops", "false", "--eval-every-epoch", "false", "--save-every-epoch", "false",
        "--dist-timeout-s", "120",
    ]  # fmt: skip
    load0 = os.getloadavg()[0]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    pipe = res["pipeline"]
    ranks = [r["bubble"] for r in pipe["ranks"]]
    return {
        "schedule": schedule,
        "m": m,
        "theory": pipe["bubble_theory"],
        "stage": [r["median"] for r in ranks],
        "mean": statistics.fmean(r["median"] for r in ranks),
        "step_s": max(r["step_median_s"] for r in ranks),
        "compute_s": [r["compute_median_s"] for r in ranks],
        "flops_share": [s["flops"] for s in pipe["split"]["stages"]],
        "load": (load0 + os.getloadavg()[0]) / 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--schedules", default="", help="comma-separated schedules, each at every M (default: naive at "
                    "M = 1, gpipe and 1f1b at the others)")
    ap.add_argument("--output", default=str(HERE / f"pipeline_bubble_cpu_{datetime.date.today()}"))
    args = ap.parse_args()
    ms = [int(v) for v in args.microbatches.split(",")]
    cells = [("naive" if m == 1 else "gpipe", m) for m in ms] + [("1f1b", m) for m in ms if m >= 2]
    if args.schedules:
        cells = [(s, m) for s in args.schedules.split(",") for m in ms]
    rows: list[dict] = []
    args.load_before = os.getloadavg()[0]  # other jobs' load: none of this benchmark's processes runs yet
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(
            args.repeats
        ):  # repeats outermost: drift of the shared machine hits every cell alike
            for schedule, m in cells:
                r = run_cell(schedule, m, args, Path(tmp) / f"{schedule}-{m}-{rep}")
                rows.append(r)
                print(f"rep {rep} {schedule:5} M={m}: bubble {r['mean']:.3f} (stages {r['stage'][0]:.3f}, "
                      f"{r['stage'][1]:.3f}), theory {r['theory']:.3f}, step {r['step_s'] * 1e3:.0f} ms, "
                      f"load {r['load']:.1f}", flush=True)  # fmt: skip
    write_report(rows, cells, args)


def write_report(rows: list[dict], cells: list[tuple[str, int]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    out = Path(args.output)
    lines = [
        "# Pipeline bubble vs micro-batches (2 processes, CPU)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.processor() or 'x86_64'} "
        f"({cpu_name()}), {os.cpu_count()} cores; load average before the sweep {args.load_before:.1f} (other jobs), "
        f"during the runs {min(r['load'] for r in rows):.1f} to {max(r['load'] for r in rows):.1f} (the 2 stage "
        f"processes count up to 2 of it; more is other jobs sharing the cores); torch {torch.__version__}, "
        "2 gloo processes (1 thread each).",
        "",
        "Command: `.venv/bin/python benchmarks/pipeline_bubble.py "
        f"--microbatches {args.microbatches} --repeats {args.repeats} --steps {args.steps} --batch-size {args.batch_size}"
        + (f" --schedules {args.schedules}`" if args.schedules else "`"),
        "",
        "Model: `benchmarks.pipeline_bubble:build` (8 identical 3x3 conv blocks of width 32, 32x32 synthetic "
        f"images, global batch {args.batch_size}), split by FLOPs into 2 stages, or 4 for the schedules that run 2 "
        f"per process (FLOP shares {_shares(rows[0]['flops_share'])} for the first row). "
        "Bubble = 1 - (the stage's own forward/backward/loss compute time) / (the schedule step's wall time), "
        "per rank, median over the timed steps (2 warm-up steps excluded); the row value is the mean of the 2 "
        f"processes; min / median / max over {args.repeats} repeats. Theory: the layout's "
        "``bubble_theory`` (docs/pipeline.md: (P-1)/(vM+P-1) for gpipe/1f1b/interleaved, the zero-bubble "
        "schedules' below it), P = 2 processes.",
        "",
        "| schedule | M | theory | measured min | median | max | median - theory (pp) | stage 0 / stage 1 (median run) | step time (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule, m in cells:
        rs = sorted((r for r in rows if r["schedule"] == schedule and r["m"] == m), key=lambda r: r["mean"])
        mid = rs[len(rs) // 2]
        values = [r["mean"] for r in rs]
        med = statistics.median(values)
        lines.append(
            f"| {schedule} | {m} | {rs[0]['theory']:.3f} | {min(values):.3f} | {med:.3f} | {max(values):.3f} | "
            f"{100 * (med - rs[0]['theory']):+.1f} | {mid['stage'][0]:.3f} / {mid['stage'][1]:.3f} | "
            f"{statistics.median(r['step_s'] for r in rs) * 1e3:.0f} ms |"
        )
    lines += ["", f"![bubble vs micro-batches]({out.name}.png)", ""]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    mgrid = [1 + i * 0.1 for i in range(int((max(m for _, m in cells) - 1) * 10) + 1)]
    ax.plot(mgrid, [1 / (m + 1) for m in mgrid], "k--", label="theory (S-1)/(M+S-1), S=2")
    for label, names, marker in (("gpipe", ("naive", "gpipe"), "o"), ("1f1b", ("1f1b",), "s")):
        pts = [
            (m, [r["mean"] for r in rows if r["m"] == m and r["schedule"] == s])
            for s, m in cells
            if s in names
        ]
        pts = [(m, v) for m, v in pts if v]
        if not pts:
            continue
        xs = [m for m, _ in pts]
        med = [statistics.median(v) for _, v in pts]
        lo = [med[i] - min(v) for i, (_, v) in enumerate(pts)]
        hi = [max(v) - med[i] for i, (_, v) in enumerate(pts)]
        ax.errorbar(
            xs, med, yerr=[lo, hi], fmt=marker + "-", capsize=3, label=f"measured {label} (median, min-max)"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks([m for m in sorted({m for _, m in cells})], [str(m) for m in sorted({m for _, m in cells})])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble (idle fraction of a step)")
    ax.set_ylim(0, 0.7)
    ax.set_title("2-stage pipeline bubble, 2 shared CPU cores (gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


def _shares(values: list[float]) -> str:
    total = sum(values) or 1.0
    return " / ".join(f"{100 * v / total:.1f}%" for v in values)


if __name__ == "__main__":
    main()
