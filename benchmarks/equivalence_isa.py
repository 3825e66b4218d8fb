"""Does "every method trains the same model" hold on any CPU? Train the test suite's equivalence problem
(tests/conftest.py EQUIV: tinynet without normalisation on digits, global batch 32, 20 SGD steps) under several
oneDNN/MKL instruction-set caps, in fp32 and fp64, with single, single + accumulation and 2-process methods, and
print the largest relative loss-curve difference of each pair.

    .venv/bin/python benchmarks/equivalence_isa.py --output benchmarks/equivalence_isa_cpu_2026-11-22.md

The caps make the CPU kernels choose other algorithms (with other rounding) on purpose, as another CPU would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROBLEM = [
    "--model", "tinynet", "--width", "8", "--norm", "none", "--data", "digits", "--batch-size", "32",
    "--epochs", "1", "--max-steps", "20", "--lr", "0.02", "--progress", "false", "--measure-flops", "false",
    "--timing-warmup-steps", "1",
]  # fmt: skip
RUNS = {
    "single fp64": (["--strategy", "single", "--precision", "fp64"], 1),
    "single fp64 accum 2": (["--strategy", "single", "--precision", "fp64", "--grad-accum", "2"], 1),
    "ddp fp64": (["--strategy", "ddp", "--precision", "fp64"], 2),
    "fsdp fp64": (["--strategy", "fsdp", "--precision", "fp64"], 2),
    "single fp32": (["--strategy", "single", "--precision", "fp32"], 1),
    "single fp32 accum 2": (["--strategy", "single", "--precision", "fp32", "--grad-accum", "2"], 1),
    "ddp fp32": (["--strategy", "ddp", "--precision", "fp32"], 2),
    "deepspeed-2 fp32": (["--strategy", "deepspeed", "--zero-stage", "2", "--precision", "fp32"], 2),
}
PAIRS = [
    ("single fp64 accum 2", "single fp64"),
    ("ddp fp64", "single fp64"),
    ("fsdp fp64", "single fp64"),
    ("single fp32 accum 2", "single fp32"),
    ("ddp fp32", "single fp32"),
    ("ddp fp32", "single fp32 accum 2"),
    ("deepspeed-2 fp32", "single fp32 accum 2"),
]
CAPS = {"none": {}, "AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        "AVX": {"ONEDNN_MAX_CPU_ISA": "AVX", "MKL_ENABLE_INSTRUCTIONS": "AVX"},
        "SSE4.1": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}  # fmt: skip


def curve(out: Path, flags: list[str], nproc: int, caps: dict[str, str]) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **caps)
    cmd = [sys.executable, "-m", "stratbench", "train", "--output", str(out), "--nproc", str(nproc), *PROBLEM, *flags]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    return json.loads((out / "result.json").read_text())["metrics"]["loss_curve"]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def cpu_line() -> str:
    name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), [])
    avx = sorted(f for f in flags if f.startswith("avx"))
    return f"{name}, {os.cpu_count()} cores, flags {' '.join(avx)}; torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", nargs="+", default=["none", "AVX", "SSE4.1"], choices=sorted(CAPS))
    ap.add_argument("--output", help="write the markdown report here (default: stdout only)")
    args = ap.parse_args()
    curves: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cap, (name, (flags, nproc)) in itertools.product(args.caps, RUNS.items()):
            print(f"[{cap}] {name}", file=sys.stderr, flush=True)
            curves[cap, name] = curve(Path(tmp) / f"{cap}-{name}".replace(" ", "_"), flags, nproc, CAPS[cap])
    lines = [
        "# Equivalence under different CPU kernels",
        "",
        f"Machine: {cpu_line()}. Command: `.venv/bin/python benchmarks/equivalence_isa.py"
        f" --caps {' '.join(args.caps)}` (OMP_NUM_THREADS=1 per process).",
        "",
        "Largest relative difference over the 20-step loss curves of the test problem (tests/conftest.py EQUIV).",
        "",
        "## Each pair under the same cap",
        "",
        "| pair | " + " | ".join(args.caps) + " |",
        "|---|" + "---|" * len(args.caps),
    ]
    for a, b in PAIRS:
        lines.append(f"| {a} vs {b} | " + " | ".join(f"{max_rel(curves[c, a], curves[c, b]):.2e}" for c in args.caps) + " |")
    lines += ["", f"## The same run under another cap (vs cap {args.caps[0]})", "", "| run | " + " | ".join(args.caps[1:]) + " |",
              "|---|" + "---|" * (len(args.caps) - 1)]  # fmt: skip
    for name in RUNS:
        lines.append(f"| {name} | " + " | ".join(f"{max_rel(curves[c, name], curves[args.caps[0], name]):.2e}" for c in args.caps[1:]) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
