"""The step-time projection against the project's own H200 runs (issue 49): every run of
benchmarks/gpu_h200_2026-11-28/ (two repeats of eight families, eager bf16-mixed; one compiled and one fp32 run of
some) projected on each basis, none of them fitted to these runs:

- *default*: the efficiency basis with hardware.yaml's defaults (the family fallback; the H200 inherits the H100's);
- *roofline, published*: ``--basis roofline`` with hardware.yaml's Hopper fractions;
- *roofline, measured*: ``--basis roofline`` with the fractions `calibrate-hw` measured on the same H200 before
  these runs (micro-benchmarks of single ops: calibrate_hw.yaml), the basis a user with a lent GPU gets.

    PYTHONPATH=src python benchmarks/projection_h200.py        # writes projection_h200_2026-11-28.md (~1 min)

The measured throughput is each run's ``throughput_samples_per_s`` (timed steps after 10 warm-up steps, on the
device pipeline for images); where two repeats exist, their mean, with the spread beside it.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from stratbench.core.config import TrainConfig, from_dict
from stratbench.measuring.hardware import builtin, resolve
from stratbench.predicting.projection import model_family, project

HERE = Path(__file__).resolve().parent
RUNS = HERE / "gpu_h200_2026-11-28"
PROFILE = RUNS / "calibrate_hw.yaml"
RESULTS = HERE / "projection_h200_2026-11-28.md"
ROWS = HERE / "projection_h200_rows.json"
"""Every run's numbers (``row``): benchmarks/projection_heldout.py reads them for the measured-fraction basis' band."""
TRACES = RUNS / "traces"
GROUPS = (("batch norm", r"batch_norm|bn_fw|bn_bw", ("batch_norm",)),  # torch's own kernels (bf16); cuDNN's (fp32)
          ("depthwise conv", r"conv_depthwise", ("depthwise_convolution",)),
          ("attention", r"sdpa|flash|fmha|attention", ("attention",)),
          ("GEMM, conv, layout", r"gemm|nvjet|xmma|cutlass|conv|dgrad|wgrad|fprop|Nhwc|Nchw",
           ("large_gemm", "small_gemm", "convolution")),
          ("the rest", r"", ("elementwise", "reduction", "other")))  # fmt: skip
"""Kernel groups of the diagnosis: name, the kernel-name pattern (first match wins; "" takes the rest), the
roofline classes priced against it."""
COLUMNS = (("default", "efficiency", False), ("roofline, published", "roofline", False),
           ("roofline, measured", "roofline", True))  # fmt: skip
"""(column, basis, with the measured fractions)."""


def systems() -> tuple[Any, Any]:
    """(the H200 node with calibrate-hw's fractions, the same node with hardware.yaml's published ones)."""
    measured = resolve(str(PROFILE))
    return measured, dataclasses.replace(measured, gpu=builtin().gpus[measured.gpu.key])


def measured_runs() -> dict[str, list[dict[str, Any]]]:
    """Run name -> its result.json per repeat (run1, run2)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(RUNS.glob("run*/*/result.json")):
        runs.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    return runs


def row(name: str, results: list[dict[str, Any]], on: tuple[Any, Any]) -> dict[str, Any]:
    """One run's measured rate (mean of repeats), spread, and each basis' projection and error."""
    rates = [r["metrics"]["throughput_samples_per_s"] for r in results]
    cfg = from_dict(TrainConfig, dict(results[0]["config"]))
    out = {"run": name, "model": cfg.model, "family": model_family(cfg), "batch": cfg.batch_size,
           "precision": cfg.precision, "compile": cfg.compile, "measured": statistics.mean(rates),
           "spread": (max(rates) - min(rates)) / statistics.mean(rates) if len(rates) > 1 else None}  # fmt: skip
    for column, basis, with_measured in COLUMNS:
        system = on[0] if with_measured else on[1]
        p = project(cfg, system, 1, 1, memory=False, basis=basis)
        out[column] = p.throughput if p.status == "ok" else None
        out[column + " basis"] = p.basis
    return out


def kernel_ms(trace: Path, steps: int = 2) -> tuple[dict[str, float], int]:
    """(group -> GPU milliseconds per step, kernels per step) of a `train --profile 2` trace."""
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("cat") == "kernel"]
    ms = dict.fromkeys((g for g, _, _ in GROUPS), 0.0)
    for e in events:
        group = next(g for g, pattern, _ in GROUPS if re.search(pattern, e["name"]))
        ms[group] += e["dur"] / 1e3 / steps
    return ms, len(events) // steps


def diagnosis_lines(runs: dict[str, list[dict[str, Any]]], measured: Any) -> list[str]:
    """Per run with a trace: its step, the GPU's busy time, and per kernel group the trace's milliseconds against
    the measured-fraction roofline's; the bandwidth batch norm and depthwise convolutions reached (the roofline's
    bytes over the trace's time). Diagnosis only: nothing here sets a parameter."""
    lines = ["", "## Where the time goes: the traces against the roofline (diagnosis only)", "",
             "Each run's 2-step profiler trace ([traces/](gpu_h200_2026-11-28/traces/)): GPU milliseconds per step "
             "by kernel group (trace / roofline with measured fractions). Nothing below sets a parameter.", "",
             "| run | step (ms) | GPU busy (ms) | kernels | " + " | ".join(g for g, _, _ in GROUPS)
             + " | batch norm reached | depthwise reached |",
             "|---|---|---|---|" + "---|" * len(GROUPS) + "---|---|"]  # fmt: skip
    for name, results in runs.items():
        trace = TRACES / f"traces_{name}.json.gz"
        if not trace.exists():
            continue
        cfg = from_dict(TrainConfig, dict(results[0]["config"]))
        p = project(cfg, measured, 1, 1, memory=False, basis="roofline")
        by_class = p.roofline["by_class"] if p.roofline else {}
        ms, kernels = kernel_ms(trace)
        cells = [f"{ms[g]:.1f} / {1e3 * sum(by_class.get(c, {}).get('seconds', 0) for c in classes):.1f}"
                 for g, _, classes in GROUPS]  # fmt: skip
        reached = []
        for group, cls in (("batch norm", "batch_norm"), ("depthwise conv", "depthwise_convolution")):
            moved = by_class.get(cls, {}).get("bytes", 0)
            reached.append(f"{moved / (ms[group] / 1e3) / measured.gpu.memory_bandwidth:.3f}" if moved and ms[group]
                           else "")  # fmt: skip
        step = 1e3 * statistics.mean(r["metrics"]["step_time_median_s"] for r in results)
        lines.append(f"| {name} | {step:.1f} | {sum(ms.values()):.1f} | {kernels} | " + " | ".join(cells + reached)
                     + " |")  # fmt: skip
    return lines


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The projection against the project's own H200 runs (issue 49)", "",
        "**What**: [projection_h200.py](projection_h200.py) projects every run of",
        "[gpu_h200_2026-11-28/](gpu_h200_2026-11-28/) (single GPU, synthetic data on the device, 10 warm-up steps,",
        "40 steps; SGD for images, AdamW for text) on three bases. No parameter was set from these runs: the default",
        "basis uses hardware.yaml's family efficiencies (the H200 inherits the H100's), the published roofline its",
        "Hopper fractions, the measured roofline the fractions `stratbench calibrate-hw` measured on the same H200",
        "(single-op micro-benchmarks, [calibrate_hw.yaml](gpu_h200_2026-11-28/calibrate_hw.yaml)).", "",
        "**Machines**: the runs on one NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130, cuDNN 9.19), lent",
        "2026-11-28, commit 4396837 plus benchmarks/gpu_session.sh's `heldout` part; the projection on the",
        "project's CPU VM (`PYTHONPATH=src python benchmarks/projection_h200.py`).", "",
        "| run | model | batch | precision | compile | measured (samples/s) | repeat spread | default | error | "
        "roofline, published | error | roofline, measured | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors: dict[str, list[float]] = {c: [] for c, _, _ in COLUMNS}
    for r in rows:
        cells = []
        for column, _, _ in COLUMNS:
            e = r[column] / r["measured"] - 1 if r[column] else None
            if e is not None and not r["compile"] and r["precision"] == "bf16-mixed":
                errors[column].append(e)
            cells += [f"{r[column]:,.0f}" if r[column] else "n/a", pct(e)]
        lines.append(f"| {r['run']} | {r['model']} | {r['batch']} | {r['precision']} | {r['compile']} | "
                     f"{r['measured']:,.1f} | {pct(r['spread']) if r['spread'] is not None else ''} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "Eager bf16-mixed rows (the compiled and fp32 rows are shown, not summarised):", ""]
    for column, values in errors.items():
        if values:
            a = sorted(abs(v) for v in values)
            lines.append(f"- {column}: {len(a)} rows, median |error| {100 * statistics.median(a):.1f}%, "
                         f"worst {100 * max(values, key=abs):+.1f}%")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    on = systems()
    runs = measured_runs()
    rows = [row(name, results, on) for name, results in runs.items()]
    text = render(rows) + "\n".join(diagnosis_lines(runs, on[0])) + "\n"
    if "--print" not in argv:
        RESULTS.write_text(text)
        ROWS.write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
