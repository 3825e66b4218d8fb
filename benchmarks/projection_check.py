"""Prediction before measurement, on this machine: calibrate on `single`, probe 2 local processes, predict the
step time of every 2-process method of the quick preset, then measure them; report predicted vs measured per
method, the median absolute error and the Spearman rank correlation. One script, so that it can be re-run on a
quiet machine:

    PYTHONPATH=src python benchmarks/projection_check.py --repeats 3 --out /tmp/projcheck \
        --report benchmarks/projection_check_cpu_$(date +%F).md

Each repeat runs the whole loop again (calibration, probe, prediction, measurement), so the spread of the
predictions is reported as well as that of the measurements. Calibration: the runs `stratbench compare
--calibrate` makes (``stratbench.compare.calibration``, into REP/calibration/): the probe, `single` at the
preset's global batch and at the per-process batch of the 2-process runs, per precision (two batch sizes fit a
fixed per-step overhead as well as the efficiency), and each method once on one process, each with the threads
a 2-process cell's process has (OMP_NUM_THREADS=1, `--calibration-threads`), counted against the probe's
all-core peak, and capped at `--method-steps` steps. The 2-process cells are the preset's own configurations,
run with `stratbench train` as the compare sweep runs them (without the sweep's extra profilers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sh(cmd: list[str], log: Path) -> int:
    with log.open("w") as fh:
        return subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)


def stratbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratbench", *args]


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


# What compare cells record besides the step time (in warm-up steps); the check measures the plain run.
EXTRAS = ("breakdown", "comm_volume", "measure_alloc")


def cells():
    """The quick preset's 2-process cells that run on a CPU (without compare's extra recorders), and its base."""
    import dataclasses

    from stratbench.compare.matrix import build_matrix, plan
    from stratbench.compare.presets import preset_quick

    matrix = build_matrix(preset_quick())
    matrix.base = {k: v for k, v in matrix.base.items() if k not in EXTRAS}
    matrix.cells = [
        dataclasses.replace(c, config={k: v for k, v in c.config.items() if k not in EXTRAS})
        for c in matrix.cells
    ]
    runnable = [p.cell for p in plan(matrix) if p.status is None and p.cell.world_size == 2]
    return matrix, runnable


def one_repeat(rep: int, out: Path, args: argparse.Namespace) -> dict:
    import yaml
    from rich.console import Console

    from stratbench.compare.calibration import CAL_DIR, plan_calibration, run_calibration
    from stratbench.compare.matrix import Plan
    from stratbench.compare.runner import SweepRunner
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.hardware import resolve
    from stratbench.measuring.records import RunRecord
    from stratbench.predicting.projection import calibrate, method_key, project

    matrix, todo = cells()
    if args.only:
        todo = [c for c in todo if c.name in args.only.split(",")]
    d = out / f"rep{rep}"
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # 1-2. the calibration `compare --calibrate` makes (stratbench.compare.calibration): the probe of 2 processes;
    # `single` per precision at the global and the per-process batch; each method once on one process at the
    # per-process batch (its own host work per step, which the calibration adds to that method's projection on
    # any world size; pipelines are left out). Each with the threads a 2-process cell's process gets
    # (OMP_NUM_THREADS=1; --calibration-threads), counted against the probe's all-core peak.
    plan = plan_calibration(matrix, [Plan(c, None) for c in todo], threads=args.calibration_threads,
                            max_steps=args.method_steps, probe_sizes=args.sizes)  # fmt: skip
    runs = [r for r in plan.runs if args.method_calibration or r.kind != "method"]
    runner = SweepRunner(matrix, d, timeout_s=900, console=Console(stderr=True))
    records = run_calibration(runner, runs)
    by_kind = {k: [records[r.id] for r in runs if r.kind == k] for k in ("probe", "single", "method")}
    for rec in by_kind["probe"] + by_kind["single"]:
        if rec["status"] != "ok":
            raise SystemExit(f"calibration run {rec['id']} {rec['status']}: {rec['reason']} (see {d / CAL_DIR})")
    method_runs = {}
    for rec in by_kind["method"]:  # a failed one: that method is projected without its own overhead
        mkey = f"{method_key(from_dict(TrainConfig, rec['config']))} {rec['precision']}"
        method_runs[mkey] = rec["cell_dir"] + "/result.json" if rec["status"] == "ok" else \
            f"not calibrated: {rec['reason'][:160]}"  # fmt: skip
    system = resolve(by_kind["probe"][0]["cell_dir"] + "/probe.yaml")
    ok = [rec for rec in by_kind["single"] + by_kind["method"] if rec["status"] == "ok"]
    calibration = calibrate([RunRecord.from_dict(rec) for rec in ok], system, [rec["id"] for rec in ok])
    # 3. predictions, written before anything is measured
    predictions = {}
    for cell in todo:
        cfg = from_dict(TrainConfig, cell.train_config("unused"))
        p = project(cfg, system, 1, 2, calibration, memory=False, label=cell.name)
        predictions[f"{cell.name} {cell.precision}"] = p.to_dict()
    (d / "predictions.json").write_text(json.dumps(predictions, indent=2))
    # 4. measurements
    rows = {}
    for cell in todo:
        key = f"{cell.name} {cell.precision}"
        cfg_path = d / f"{cell.id}.yaml"
        cfg_path.write_text(yaml.safe_dump(cell.train_config(d / cell.id, progress=False)))
        rc = sh(stratbench("train", "--config", str(cfg_path)), d / f"{cell.id}.log")
        result = d / cell.id / "result.json"
        measured = None
        if rc == 0 and result.exists():
            measured = json.loads(result.read_text())["metrics"]["step_time_median_s"]
        p = predictions[key]
        rows[key] = {
            "predicted_s": p["step_s"], "measured_s": measured, "status": p["status"],
            "compute_s": p["compute_s"], "comm_s": p["comm_s"], "comm_exposed_s": p["comm_exposed_s"],
            "optimizer_s": p["optimizer_s"], "dominant": p["dominant"],
        }  # fmt: skip
        print(
            f"rep {rep} {key:28s} predicted {p['step_s'] or float('nan'):.4f} s measured {measured} s",
            flush=True,
        )
    cal = {
        k: {"efficiency": c.efficiency, "overhead_s": c.overhead_s, "points": c.points,
            "method_overhead_s": c.method_overhead_s}  # fmt: skip
        for k, c in calibration.items()
    }
    probe_summary = {"overlap": system.overlap, "compute_share": system.compute_share,
                     "fits": {k: {"latency_s": f.latency, "bandwidth": f.bandwidth} for k, f in system.intra_node.collectives.items()}}  # fmt: skip
    rep_out = {"rows": rows, "calibration": cal, "probe": probe_summary, "method_runs": method_runs,
               "seconds": time.time() - t0}  # fmt: skip
    (d / "rep.json").write_text(json.dumps(rep_out, indent=2))
    return rep_out


def summarise(reps: list[dict]) -> dict:
    keys = list(reps[0]["rows"])
    per_method = {}
    for k in keys:
        pred = [r["rows"][k]["predicted_s"] for r in reps if r["rows"][k]["predicted_s"]]
        meas = [r["rows"][k]["measured_s"] for r in reps if r["rows"][k]["measured_s"]]
        errs = [
            (r["rows"][k]["predicted_s"] - r["rows"][k]["measured_s"]) / r["rows"][k]["measured_s"]
            for r in reps
            if r["rows"][k]["predicted_s"] and r["rows"][k]["measured_s"]
        ]
        per_method[k] = {
            "predicted": pred,
            "measured": meas,
            "errors": errs,
            "dominant": reps[-1]["rows"][k]["dominant"],
        }
    per_rep = []
    for r in reps:
        ok = [v for v in r["rows"].values() if v["predicted_s"] and v["measured_s"]]
        errs = [abs(v["predicted_s"] - v["measured_s"]) / v["measured_s"] for v in ok]
        per_rep.append({
            "median_abs_error": statistics.median(errs) if errs else None,
            "spearman": spearman([v["predicted_s"] for v in ok], [v["measured_s"] for v in ok]) if len(ok) > 2 else None,
            "n": len(ok),
        })  # fmt: skip
    return {"per_method": per_method, "per_rep": per_rep}


def mmm(xs: list[float], scale: float = 1e3, fmt: str = "{:.1f}") -> str:
    if not xs:
        return "-"
    return "/".join(fmt.format(v * scale) for v in (min(xs), statistics.median(xs), max(xs)))


def report(summary: dict, reps: list[dict], args: argparse.Namespace) -> str:
    import platform

    import torch

    from stratbench.measuring.environment import cpu_name

    lines = [
        "# Projection checked on this machine: predicted before measured (quick preset, 2 gloo processes)",
        "",
        f"Command: `PYTHONPATH=src python benchmarks/projection_check.py {' '.join(sys.argv[1:])}`",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.platform()}; "
        f"{len(reps)} repeat(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. " + (args.note or ""),
        "",
        "Each repeat: `single` calibration runs (fp32 and bf16-mixed, global batch and per-process batch), "
        + ("each method once on one device (`--nproc 1`, per-process batch: its own overhead per step), "
           if args.method_calibration else "")
        + "`stratbench probe --nproc 2`, the projection of every cell, then the cells measured (median step time of "
        "the measured steps). Times in ms as min/median/max over repeats; error = predicted/measured - 1 "
        "(median over repeats).",
        "",
        "| method | precision | predicted ms | measured ms | error | dominant term |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in summary["per_method"].items():
        name, precision = k.rsplit(" ", 1)
        err = f"{statistics.median(v['errors']):+.0%}" if v["errors"] else "-"
        lines.append(
            f"| {name} | {precision} | {mmm(v['predicted'])} | {mmm(v['measured'])} | {err} | {v['dominant']} |"
        )
    lines += [
        "",
        "| repeat | methods | median abs error | Spearman (predicted vs measured) |",
        "|---|---|---|---|",
    ]
    for i, r in enumerate(summary["per_rep"]):
        mae = f"{r['median_abs_error']:.0%}" if r["median_abs_error"] is not None else "-"
        rho = f"{r['spearman']:.2f}" if r["spearman"] is not None else "-"
        lines.append(f"| {i} | {r['n']} | {mae} | {rho} |")
    maes = [r["median_abs_error"] for r in summary["per_rep"] if r["median_abs_error"] is not None]
    rhos = [r["spearman"] for r in summary["per_rep"] if r["spearman"] is not None]
    lines += [
        "",
        f"Median absolute error min/median/max over repeats: {mmm(maes, 100, '{:.0f}')} %; "
        f"Spearman min/median/max: {mmm(rhos, 1, '{:.2f}')}.",
        "",
        "Calibration and probe per repeat (efficiency = share of the probe's matmul rate; overhead = fixed per step):",
        "",
    ]
    for i, r in enumerate(reps):
        cal = ", ".join(
            f"{k}: {c['efficiency']:.1%} + {c['overhead_s'] * 1e3:.1f} ms"
            for k, c in r["calibration"].items()
        )
        fits = ", ".join(
            f"{k} {f['latency_s'] * 1e6:.0f} us + B/{f['bandwidth'] / 1e9:.2f} GB/s"
            for k, f in r["probe"]["fits"].items()
        )
        methods = "; ".join(
            f"{m_key} {prec} {m * 1e3:+.1f} ms"
            for prec, c in r["calibration"].items()
            for m_key, m in c.get("method_overhead_s", {}).items()
        )
        skipped = [f"{k} ({v})" for k, v in r.get("method_runs", {}).items() if v.startswith("not calibrated")]
        lines.append(
            f"- repeat {i}: {cal}; overlap {r['probe']['overlap']:.2f}, compute share {r['probe']['compute_share']:.2f}; {fits}"
            + (f"; one-device method overhead per step: {methods}" if methods else "")
            + (f"; not calibrated: {', '.join(skipped)}" if skipped else "")
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="projection_check_out", help="working folder (runs, logs, probe files)")
    ap.add_argument("--report", default=None, help="write the markdown report here")
    ap.add_argument("--only", default=None, help="comma-separated cell names (e.g. ddp,fsdp)")
    ap.add_argument("--calibration-threads", type=int, default=1,
                    help="threads of the calibration runs (default 1, as each process of a torchrun cell)")
    ap.add_argument("--method-calibration", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each method on one device (--nproc 1) to calibrate its own overhead per step")
    ap.add_argument("--method-steps", type=int, default=20, help="steps of each calibration run")
    ap.add_argument("--sizes", default="1KiB,16KiB,128KiB,1MiB,4MiB", help="probe sizes")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from OUT/reps.json, run nothing")
    ap.add_argument("--note", default="", help="a sentence for the report (e.g. 'the machine was shared')")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # the report again from a finished check's reps.json (no runs)
        reps = json.loads((out / "reps.json").read_text())
    else:
        reps = []
        for rep in range(args.repeats):
            reps.append(one_repeat(rep, out, args))
            (out / "reps.json").write_text(json.dumps(reps, indent=2))
    summary = summarise(reps)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = report(summary, reps, args)
    print(text)
    if args.report:
        Path(args.report).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
