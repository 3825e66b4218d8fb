"""BatchNorm under pipeline parallelism: what micro-batching does to accuracy.

A pipeline normalises each BatchNorm over a micro-batch (batch / M samples), not over the batch `single` sees,
and updates the running statistics M times per step. This trains ResNet-18 (`--cifar-stem`, BatchNorm) on
scikit-learn's digits with `single` and with a 2-stage GPipe pipeline (2 gloo processes) at M = 1, 4, 8
micro-batches, for several seeds (same seed = same initial weights and the same batches in every method), and
reports the final validation accuracy and loss and the gap between each run's training-loss curve and `single`'s
of the same seed. M = 1 is the control: the same batch statistics as `single`, so its gap is rounding only.
`single --grad-accum M` is the second control: its BatchNorms see the same micro-batches as the pipeline's (and
update their running statistics as often), so the pipeline at M should track it, not `single`.

    .venv/bin/python benchmarks/pipeline_batchnorm.py                    # 3 seeds, M = 1,4,8: 15 runs, 23 min on 2 busy cores
    .venv/bin/python benchmarks/pipeline_batchnorm.py --seeds 0 --microbatches 1,8 --epochs 1

Accuracy and loss do not depend on the machine's load (fixed seeds, fixed data order); times are not reported.
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

from stratbench.measuring.environment import cpu_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def problem(args: argparse.Namespace, seed: int) -> list[str]:
    return [
        "--model", "resnet18", "--cifar-stem", "--data", "digits", "--image-size", str(args.image_size),
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--lr", str(args.lr),
        "--seed", str(seed), "--progress", "false", "--measure-flops", "false", "--save-every-epoch", "false",
        "--timing-warmup-steps", "1",
    ]  # fmt: skip


def cells(ms: list[int], accum: list[int]) -> list[tuple[str, list[str], int]]:
    """(label, method flags, processes) of every configuration, `single` first."""
    out = [("single", ["--strategy", "single"], 1)]
    out += [(f"single --grad-accum {m}", ["--strategy", "single", "--grad-accum", str(m)], 1) for m in accum]
    out += [
        (
            f"pipeline gpipe M={m}",
            [
                "--strategy",
                "pipeline",
                "--schedule",
                "gpipe",
                "--microbatches",
                str(m),
                "--dist-timeout-s",
                "300",
            ],
            2,
        )  # fmt: skip
        for m in ms
    ]
    return out


def run(label: str, flags: list[str], nproc: int, seed: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "stratbench", "train", "--output", str(out), "--nproc", str(nproc),
           *problem(args, seed), *flags]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # every run on 1 thread per process
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    m = res["metrics"]
    return {
        "label": label,
        "seed": seed,
        "curve": m["loss_curve"],
        "val_accuracy": m["val_accuracy"],
        "val_loss": m["val_loss"],
        "val_samples": m["evaluations"][-1]["val_samples"],
        "split": [s["pieces"] for s in res["pipeline"]["split"]["stages"]] if "pipeline" in res else None,
        "micro_batch": res["per_device_batch_size"] // _pieces(flags),
    }


def _pieces(flags: list[str]) -> int:
    """Into how many micro-batches a method cuts the batch (the BatchNorm batch is batch / this)."""
    for flag in ("--microbatches", "--grad-accum"):
        if flag in flags:
            return int(flags[flags.index(flag) + 1])
    return 1


def gap(curve: list[float], ref: list[float]) -> dict[str, float]:
    """How far a training-loss curve is from the reference's (same seed, same batches)."""
    diffs = [abs(a - b) for a, b in zip(curve, ref, strict=True)]
    tail = len(curve) // 3  # the last third of training
    return {
        "mean_abs": statistics.fmean(diffs),
        "max_abs": max(diffs),
        "max_rel": max(d / abs(b) for d, b in zip(diffs, ref, strict=True)),
        "tail_delta": statistics.fmean(curve[-tail:]) - statistics.fmean(ref[-tail:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--microbatches", default="1,4,8")
    ap.add_argument(
        "--accum-control", default="8", help="M values also run as single --grad-accum M ('' for none)"
    )
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--output", default=str(HERE / f"pipeline_batchnorm_cpu_{datetime.date.today()}.md"))
    args = ap.parse_args()
    seeds = [int(v) for v in args.seeds.split(",")]
    ms = [int(v) for v in args.microbatches.split(",")]
    accum = [int(v) for v in args.accum_control.split(",") if v.strip()]
    configs = cells(ms, accum)
    rows: list[dict] = []
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    args.commit = commit.stdout.strip() or "unknown"  # the code the runs use, read before they start
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for label, flags, nproc in configs:
                r = run(label, flags, nproc, seed, args, Path(tmp) / f"{label.replace(' ', '_')}-{seed}")
                loads.append(os.getloadavg()[0])
                rows.append(r)
                print(f"seed {seed} {label:24} val acc {r['val_accuracy']:.4f} val loss {r['val_loss']:.4f} "
                      f"final train loss {r['curve'][-1]:.4f}", flush=True)  # fmt: skip
    write_report(rows, configs, seeds, args, started, loads)


def write_report(rows, configs, seeds, args, started, loads) -> None:
    import torch

    ref = {r["seed"]: r for r in rows if r["label"] == "single"}
    steps = len(rows[0]["curve"])
    cmd = (
        f".venv/bin/python benchmarks/pipeline_batchnorm.py --seeds {args.seeds} --microbatches {args.microbatches} "
        f"--accum-control '{args.accum_control}' --epochs {args.epochs} --batch-size {args.batch_size} "
        f"--image-size {args.image_size} --lr {args.lr}"
    )
    split = next((r["split"] for r in rows if r["split"]), None)
    lines = [
        "# BatchNorm under pipeline parallelism: accuracy effect of micro-batching (CPU)",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {platform.machine()} ({cpu_name()}), {os.cpu_count()} cores (load "
        f"average {min(loads):.1f} to {max(loads):.1f}, of which this benchmark's own processes are at most 2; nothing "
        "below is a time), "
        f"Python {platform.python_version()}, torch {torch.__version__}, stratbench at commit "
        f"{args.commit}; every process 1 thread; the pipeline on 2 gloo processes.",
        "",
        f"Command: `{cmd}`",
        "",
        f"Problem: ResNet-18 with the CIFAR stem (BatchNorm after every convolution) on scikit-learn's digits "
        f"({args.image_size}x{args.image_size}{', their own resolution' if args.image_size == 8 else ''}, "
        f"{rows[0]['val_samples']} validation images), global batch "
        f"{args.batch_size}, {args.epochs} epochs = {steps} SGD steps (momentum 0.9, weight decay 5e-4, lr "
        f"{args.lr} cosine), fp32, seeds {', '.join(map(str, seeds))}. The same seed gives every method the same "
        f"initial weights and the same batches. Pipeline: 2 stages "
        f"({' | '.join(', '.join(p) for p in split) if split else '-'}), GPipe, M micro-batches of "
        f"{args.batch_size}/M samples: each BatchNorm normalises over a micro-batch and updates its running "
        "statistics M times per step. Evaluation uses the running statistics (no batch dependence).",
        "",
        "Gap to single: per seed, the training-loss curve against `single`'s of the same seed: mean and max of "
        "|loss - loss_single| over all steps, and the difference of the mean loss over the last third of the "
        "steps (positive: higher training loss than single); then the mean over seeds.",
        "",
        "| method | BN batch | val accuracy mean (min-max) | val loss mean | final-third train loss - single | "
        "mean abs gap | max abs gap |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for label, _, _ in configs:
        rs = [r for r in rows if r["label"] == label]
        accs = [r["val_accuracy"] for r in rs]
        gaps = [gap(r["curve"], ref[r["seed"]]["curve"]) for r in rs]
        summary[label] = {"acc": statistics.fmean(accs), "gaps": gaps}
        g = {k: statistics.fmean(x[k] for x in gaps) for k in ("tail_delta", "mean_abs", "max_abs")}
        gap_cells = (
            "0 (reference) | 0 | 0"
            if label == "single"
            else f"{g['tail_delta']:+.4f} | {g['mean_abs']:.4f} | {g['max_abs']:.4f}"
        )
        lines.append(
            f"| {label} | {rs[0]['micro_batch']} | {100 * statistics.fmean(accs):.2f}% ({100 * min(accs):.2f}-"
            f"{100 * max(accs):.2f}) | {statistics.fmean(r['val_loss'] for r in rs):.4f} | {gap_cells} |"
        )
    lines += ["", "Per seed (val accuracy / val loss):", "", "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---|" + "---|" * len(seeds)]  # fmt: skip
    for label, _, _ in configs:
        by_seed = {r["seed"]: r for r in rows if r["label"] == label}
        lines.append(
            f"| {label} | "
            + " | ".join(
                f"{100 * by_seed[s]['val_accuracy']:.2f}% / {by_seed[s]['val_loss']:.4f}" for s in seeds
            )
            + " |"
        )
    lines += ["", "Loss curves (seed 0 of each; every step):", "", "```"]
    first = seeds[0]
    for label, _, _ in configs:
        r = next(r for r in rows if r["label"] == label and r["seed"] == first)
        lines.append(f"{label:24} " + " ".join(f"{v:.3f}" for v in r["curve"]))
    lines += ["```", ""]
    for label, _, _ in configs:
        if label.startswith("pipeline") and f"single --grad-accum {label.split('M=')[1]}" in summary:
            m = label.split("M=")[1]
            twin = [r for r in rows if r["label"] == f"single --grad-accum {m}"]
            pipe = {r["seed"]: r for r in rows if r["label"] == label}
            worst = max(gap(pipe[t["seed"]]["curve"], t["curve"])["max_rel"] for t in twin)
            lines.append(
                f"{label} against `single --grad-accum {m}` (the same BatchNorm micro-batches): largest relative "
                f"loss difference over all steps and seeds {worst:.2e}."
            )
    Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
