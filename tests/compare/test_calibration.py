"""compare --calibrate (stratbench.compare.calibration): the plan of calibration runs for a matrix, their
running and records (fake processes: no training), the report's prediction from calibration records (synthetic
records), and one small real sweep (slow)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch

from stratbench.compare import calibration as cal_mod
from stratbench.compare import runner as runner_mod
from stratbench.compare.calibration import (
    CALIBRATION,
    basis_for,
    check_results_file,
    load_calibration_records,
    plan_calibration,
    run_calibration,
)
from stratbench.compare.matrix import Plan, build_matrix, plan
from stratbench.compare.report import Report, render_sweeps, write_report
from stratbench.compare.runner import SweepRunner, load_records
from stratbench.core.errors import ConfigError
from stratbench.launching.launch import threads_per_process
from stratbench.measuring.records import CalibrationRecord, RunRecord
from stratbench.predicting import projection

BASE = {"model": "tinynet", "width": 8, "data": "digits", "image_size": 16, "epochs": 1, "max_steps": 3,
        "batch_size": 32, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False}  # fmt: skip


def _matrix(**kw):
    return build_matrix({"base": BASE, "world_size": 2, "cells": [
        {"method": "single", "precision": ["fp32", "bf16-mixed", "fp16-true"]},
        {"method": "ddp", "precision": ["fp32", "bf16-mixed"]},
        {"method": "ddp", "precision": "fp32", "config": {"grad_accum": 2}, "label": "ddp-accum"},
        {"method": "deepspeed", "precision": "fp32", "options": {"zero_stage": 3}, "label": "deepspeed-z3"},
        {"method": "pipeline", "precision": "fp32", "options": {"schedule": "gpipe", "microbatches": 4},
         "label": "pipeline-gpipe"}]}, **kw)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the plan


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="plans a CPU calibration (threads, probe sizes, fp16 skipped)"
)
def test_plan_calibrates_each_multi_process_method_with_a_cell_process_threads(monkeypatch):
    """The probe of the world size, `single` at the per-process and global batch per precision, each method
    once on one process at the per-process batch (ZeRO-3 with its stage, grad_accum kept), pipelines left out
    with a note, every train run with the threads a 2-process cell's process gets, capped at the cells' steps."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    m = _matrix()
    plans = plan(m)
    cell = {(p.cell.name, p.cell.precision): p.cell for p in plans}
    runnable = {p.cell.id for p in plans if p.status is None}
    fp16 = cell["single", "fp16-true"].id
    calib = plan_calibration(m, plans)
    t = threads_per_process(2)
    assert t == max(1, (os.cpu_count() or 1) // 2)
    probe, *train = calib.runs
    assert (probe.kind, probe.nproc, probe.device, probe.sizes) == (
        "probe",
        2,
        "cpu",
        cal_mod.PROBE_SIZES_CPU,
    )
    assert fp16 not in runnable and set(probe.for_cells) == runnable
    singles = {(r.cell.precision, r.cell.batch_size): r for r in train if r.kind == "single"}
    assert set(singles) == {("fp32", 16), ("fp32", 32), ("bf16-mixed", 16), ("bf16-mixed", 32)}
    for r in singles.values():
        assert (r.cell.method, r.cell.world_size, r.threads, r.status) == ("single", 1, t, None)
        assert r.cell.config["max_steps"] == 3 and "grad_accum" not in r.cell.config  # the cells' 3 < 30
        assert (
            r.id.endswith(f"_t{t}") and r.cell.config["breakdown"] is True
        )  # what a cell records, it records
    fp32 = {c.id for (n, p), c in cell.items() if p == "fp32"}
    assert set(singles["fp32", 16].for_cells) == fp32 & runnable  # single, ddp, ddp-accum, z3, pipeline
    methods = {(r.cell.name, r.cell.precision): r for r in train if r.kind == "method"}
    assert set(methods) == {
        ("ddp", "fp32"),
        ("ddp", "bf16-mixed"),
        ("ddp-accum", "fp32"),
        ("deepspeed-z3", "fp32"),
    }
    for (name, precision), r in methods.items():
        assert (r.cell.world_size, r.cell.batch_size, r.threads) == (1, 16, t)
        assert r.for_cells == (cell[name, precision].id,)
    assert methods["deepspeed-z3", "fp32"].cell.options == {"zero_stage": 3}
    assert methods["ddp-accum", "fp32"].cell.config["grad_accum"] == 2
    assert (
        len(calib.notes) == 1
        and "pipeline-gpipe fp32: no one-process run (a pipeline on one device" in calib.notes[0]
    )
    # threads follow the user's OMP_NUM_THREADS, as the launcher's do; --calibrate of a sweep without
    # multi-process cells plans nothing and says so
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert {r.threads for r in plan_calibration(m, plans).runs if r.kind != "probe"} == {3}
    only_single = [p for p in plans if p.cell.method == "single"]
    empty = plan_calibration(m, only_single)
    assert empty.runs == [] and "nothing to calibrate" in empty.notes[0]


def test_plan_records_what_cannot_run_here_instead_of_running_it(monkeypatch):
    """A calibration run that this machine refuses (``matrix.plan_cell``, as for cells) is planned with that
    status and reason, never started; the steps are capped."""
    m = build_matrix({"base": {**BASE, "max_steps": 50}, "world_size": 2, "cells": [{"method": "ddp"}]})
    calib = plan_calibration(m, [Plan(c, None) for c in m.cells], max_steps=20)
    assert all(r.status is None for r in calib.runs)
    assert {r.cell.config["max_steps"] for r in calib.runs if r.cell} == {20}

    def refuse(cell, matrix, allow_slow=False):
        return (
            Plan(cell, "skipped", f"{cell.method} cannot run here")
            if cell.method == "ddp"
            else Plan(cell, None)
        )

    monkeypatch.setattr(cal_mod, "plan_cell", refuse)
    calib = plan_calibration(m, [Plan(c, None) for c in m.cells])
    method = next(r for r in calib.runs if r.kind == "method")
    assert (method.status, method.reason) == ("skipped", "ddp cannot run here")
    assert {r.status for r in calib.runs if r.kind != "method"} == {None}


# ------------------------------------------------------------------------------------------------
# running: fake processes

FAKE = textwrap.dedent(
    """
    import json, os, sys, yaml
    cfg = yaml.safe_load(open(sys.argv[1]))
    if cfg["strategy"] == "deepspeed" and cfg["nproc"] == 1:
        print("stratbench train: error: boom in deepspeed", flush=True)
        sys.exit(2)
    # a fixed 4 ms, 0.5 ms per sample, 2 ms more for a method's own work
    step = 0.004 + 0.0005 * cfg["batch_size"] + (0.002 if cfg["strategy"] != "single" else 0.0)
    res = {"status": "ok", "config": cfg, "world_size": cfg["nproc"],
           "environment": {"device_type": "cpu", "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
                           "cpu_count": 2},
           "metrics": {"step_time_median_s": step, "train_time_s": 1.0, "throughput_samples_per_s": 100.0,
                       "final_loss": 0.5, "loss_curve": [1.0, 0.5]}}
    open(cfg["output"] + "/result.json", "w").write(json.dumps(res))
    """
)


def _probe_yaml(path: Path) -> None:
    """A probe profile of a 2-core CPU (the shape `stratbench probe` writes)."""
    from stratbench.commands.probe import build_profile
    from stratbench.measuring.hardware import dump

    rows = [{"payload_bytes": b, "seconds": 3e-4 + b / 1e9} for b in (1024, 1 << 20)]
    data = {"ranks": 2, "device": "cpu", "cpu": "test", "cpu_count": 2, "threads_per_process": 1, "overlap": 0.2,
            "memory_bandwidth": 1.6e10, "collectives": {k: rows for k in ("all_reduce", "all_gather",
                                                                          "reduce_scatter", "broadcast")},
            "matmul_alone": {"fp32": 1e11, "bf16": 3e11}, "matmul_alone_per_process": {"fp32": 5.5e10, "bf16": 1.7e11},
            "matmul_together": {"fp32": 5e10, "bf16": 1.6e11}}  # fmt: skip
    profile, _ = build_profile(data, "box-probe")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(profile))


@pytest.fixture()
def fake_runs(monkeypatch, tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    template = tmp_path / "template.yaml"
    _probe_yaml(template)
    probe_script = tmp_path / "fake_probe.py"
    probe_script.write_text(f"import shutil, sys\nshutil.copy({str(template)!r}, sys.argv[1])\n")
    monkeypatch.setattr(runner_mod, "cell_command", lambda cell, cfg: [sys.executable, str(script), str(cfg)])
    monkeypatch.setattr(
        cal_mod, "probe_command", lambda run, profile: [sys.executable, str(probe_script), str(profile)]
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    m = build_matrix({"base": BASE, "world_size": 2, "cells": [
        {"method": ["single", "ddp"]}, {"method": "deepspeed", "options": {"zero_stage": 3}}]})  # fmt: skip
    plans = [Plan(c, None) for c in m.cells]
    return m, plans, plan_calibration(m, plans)


def test_calibration_runs_first_apart_from_the_cells_and_resume(fake_runs, tmp_path):
    m, plans, calib = fake_runs
    out = tmp_path / "sweep"
    SweepRunner(m, out, timeout_s=60).run(plans, partial(run_calibration, runs=calib.runs))
    cells, cal = load_records(out), load_records(out, CALIBRATION)
    assert set(cells) == {c.id for c in m.cells} and set(cal) == {r.id for r in calib.runs}
    assert not set(cells) & set(cal)  # calibration runs are not rows of the table
    ds = next(r for r in calib.runs if r.kind == "method" and r.cell.method == "deepspeed")
    assert cal[ds.id]["status"] == "failed" and cal[ds.id]["reason"] == "boom in deepspeed"
    for r in calib.runs:
        rec = cal[r.id]
        assert rec["calibration"]["kind"] == r.kind and rec["calibration"]["for"] == list(r.for_cells)
        if r.kind != "probe":
            assert Path(rec["cell_dir"]).parent == out / "calibration"
            if rec["status"] == "ok":  # the run had the threads of a cell's process
                assert rec["environment"]["torch_threads"] == 1 and rec["world_size"] == 1
    assert (out / cal["probe-w2"]["calibration"]["profile"]).is_file()
    # calibration ran before the first cell
    first_cell = min(rec["recorded_at"] for rec in cells.values())
    assert max(rec["recorded_at"] for rec in cal.values()) <= first_cell
    # a rerun keeps what finished (the failed run too, as cells) and runs nothing
    stamps = {p: p.stat().st_mtime_ns for p in (out / "calibration").glob("*/*")}
    SweepRunner(m, out, timeout_s=60).run(plans, partial(run_calibration, runs=calib.runs))
    assert {p: p.stat().st_mtime_ns for p in (out / "calibration").glob("*/*")} == stamps
    # --retry reruns the failed one only
    SweepRunner(m, out, timeout_s=60, retry=True).run(plans, partial(run_calibration, runs=calib.runs))
    changed = [p for p in (out / "calibration").glob("*/*") if p.stat().st_mtime_ns != stamps.get(p)]
    assert changed and {p.parent.name for p in changed} == {ds.id}
    # the report: ddp predicted from its runs; deepspeed-z3's says why not
    paths, _ = render_sweeps([out], out)
    rows = {r["label"]: r for r in csv.DictReader(paths["csv"].open())}
    assert float(rows["ddp"]["predicted_step_s"]) > 0 and "ddp: " in rows["ddp"]["predicted_step_basis"]
    assert rows["deepspeed"]["predicted_step_s"] == "n/a"
    assert "is failed: boom in deepspeed" in paths["md"].read_text()


# ------------------------------------------------------------------------------------------------
# the report, from synthetic records

RUN_ENV = {"device_type": "cpu", "torch_threads": 1, "cpu_count": 2, "hostname": "box"}


def _rec(id_: str, method: str, world: int, step_s: float, batch: int = 32, precision: str = "fp32",
         threads: int = 2, **config) -> dict:  # fmt: skip
    cfg = BASE | {"strategy": method, "precision": precision, "nproc": world, "batch_size": batch} | config
    return {"id": id_, "method": method, "label": method, "precision": precision, "world_size": world,
            "batch_size": batch, "status": "ok", "reason": "", "machine": {"hostname": "box", "device": "CPU"},
            "environment": RUN_ENV | {"torch_threads": threads}, "config": cfg,
            "metrics": {"step_time_median_s": step_s, "throughput_samples_per_s": batch / step_s,
                        "train_time_s": 1.0}}  # fmt: skip


def _calibrated_sweep(
    folder: Path, method_status: str = "ok", **method_run
) -> tuple[list[dict], list[CalibrationRecord]]:
    """single and ddp cells (fp32), and the calibration compare --calibrate records for them: a probe, single at
    batches 16 and 32 (1 thread), ddp on one process at 16 (``method_run``: fields of its line replaced),
    written to FOLDER as a sweep would."""
    cells = [_rec("single_c", "single", 1, 0.012), _rec("ddp_c", "ddp", 2, 0.015)]
    served = ["ddp_c", "single_c"]
    runs = [
        _rec("s16", "single", 1, 0.020, 16, threads=1) | {"calibration": {"kind": "single", "for": served}},
        _rec("s32", "single", 1, 0.030, 32, threads=1) | {"calibration": {"kind": "single", "for": served}},
        _rec("d16", "ddp", 1, 0.024, 16, threads=1) | {"calibration": {"kind": "method", "for": ["ddp_c"]},
                                                       "status": method_status,
                                                       "reason": "exited with code 1", **method_run},
        {"id": "probe-w2", "status": "ok", "reason": "", "machine": {"hostname": "box"},
         "calibration": {"kind": "probe", "for": served, "nproc": 2, "profile": "calibration/probe-w2/probe.yaml"}},
    ]  # fmt: skip
    _probe_yaml(folder / "calibration/probe-w2/probe.yaml")
    for rec in cells:
        runner_mod.append_record(folder, rec)
    for rec in runs:
        runner_mod.append_record(folder, rec, CALIBRATION)
    (folder / "sweep.json").write_text(json.dumps({"name": "t", "cells": [{"id": c["id"]} for c in cells]}))
    return cells, load_calibration_records(folder)


def test_report_predicts_from_the_calibration_runs_and_probe(tmp_path):
    cells, cal = _calibrated_sweep(tmp_path)
    profile = str(tmp_path / "calibration/probe-w2/probe.yaml")
    basis = basis_for(RunRecord.from_dict(cells[1]), cal)
    assert (
        basis
        and not basis.problem
        and basis.profile == profile
        and [r.id for r in basis.runs] == ["s16", "s32", "d16"]
    )
    # by hand: calibrate on the runs, project ddp on 2 processes of the probe's system
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.hardware import resolve

    system = resolve(profile)
    cals = projection.calibrate(basis.runs, system)
    assert cals["fp32"].method_overhead_s["ddp"] == pytest.approx(0.024 - 0.020, rel=1e-6)
    want = projection.project(
        from_dict(TrainConfig, cells[1]["config"]), system, 1, 2, cals, memory=False
    ).step_s
    paths = write_report(Report("t", cells, ["x"], calibration=cal), tmp_path / "r")
    rows = {r["method"]: r for r in csv.DictReader(paths["csv"].open())}
    assert float(rows["ddp"]["predicted_step_s"]) == pytest.approx(want)
    assert float(rows["ddp"]["predicted_step_error_pct"]) == pytest.approx((want / 0.015 - 1) * 100)
    assert "ddp: +4.0 ms per step beyond `single`" in rows["ddp"]["predicted_step_basis"]
    # the sweep's own single cell is predicted too (not its own calibration any more)
    assert (
        float(rows["single"]["predicted_step_s"]) > 0 and rows["single"]["predicted_step_error_pct"] != "n/a"
    )
    md = paths["md"].read_text()
    assert "this machine's probe profile (`stratbench probe --nproc 2`" in md and "(calibration)" not in md
    # re-rendering the folder (`stratbench report DIR`), also after it moved: the same numbers
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    shutil.copytree(tmp_path, moved)
    from stratbench.cli import main

    assert main(["report", str(moved)]) == 0
    again = {r["method"]: r for r in csv.DictReader((moved / "report.csv").open())}
    assert float(again["ddp"]["predicted_step_s"]) == pytest.approx(want)
    # --hardware replaces the probe (and names it in the footnote)
    paths = write_report(Report("t", cells, ["x"], hardware="cpu-gloo", calibration=cal), tmp_path / "h")
    assert "the cpu-gloo profile given with --hardware" in paths["md"].read_text()


def test_failed_or_missing_calibration_gives_a_reason_not_a_number(tmp_path):
    cells, cal = _calibrated_sweep(tmp_path, method_status="failed")
    paths = write_report(Report("t", cells, ["x"], calibration=cal), tmp_path / "r")
    rows = {r["method"]: r for r in csv.DictReader(paths["csv"].open())}
    assert rows["ddp"]["predicted_step_s"] == "n/a" and float(rows["single"]["predicted_step_s"]) > 0
    md = paths["md"].read_text()
    assert "n/a (predicted step): its calibration run (d16) is failed: exited with code 1" in md
    # the probe file gone: every row says so
    (tmp_path / "calibration/probe-w2/probe.yaml").unlink()
    paths = write_report(
        Report("t", cells, ["x"], calibration=load_calibration_records(tmp_path)), tmp_path / "r"
    )
    assert "probe-w2/probe.yaml is missing" in paths["md"].read_text()
    assert {r["predicted_step_s"] for r in csv.DictReader(paths["csv"].open())} == {"n/a"}
    # a cell that no calibration run names (added later), and a CPU sweep without calibration: uncalibrated
    late = _rec("late", "fsdp", 2, 0.03)
    assert basis_for(RunRecord.from_dict(late), cal) is None
    paths = write_report(Report("t", [*cells, late], ["x"]), tmp_path / "u")
    assert {r["predicted_step_s"] for r in csv.DictReader(paths["csv"].open())} == {"n/a"}
    assert "uncalibrated" in paths["md"].read_text() and "--calibrate" in paths["md"].read_text()
    # a method run with no run at all of its method (only singles name it): the missing run is named
    _probe_yaml(tmp_path / "calibration/probe-w2/probe.yaml")
    no_method = [c for c in cal if c.run.id != "d16"]
    ddp = RunRecord.from_dict(cells[1])
    assert "no one-process calibration run of ddp" in basis_for(ddp, no_method).problem
    # another machine's calibration runs are not this machine's
    assert basis_for(RunRecord.from_dict(cells[1] | {"machine": {"hostname": "elsewhere"}}), cal) is None


def test_a_calibration_run_with_a_field_of_the_wrong_type_is_refused_and_one_not_recorded_is_n_a(tmp_path):
    """A calibration line whose measure has the wrong type (its step time a string) is refused in one line naming
    the file, the line and the field, as a cell's line is. One whose step time was not recorded (null, and no
    environment) parses: the row that run serves says so (n/a and the reason) while the rows it does not serve
    keep their prediction; the report is written, not stopped."""
    _calibrated_sweep(tmp_path / "bad", metrics={"step_time_median_s": "fast"})
    with pytest.raises(ConfigError, match=r"calibration.jsonl line 3 .*metrics.step_time_median_s is 'fast', not"):
        check_results_file(tmp_path / "bad")
    cells, cal = _calibrated_sweep(tmp_path, metrics={"step_time_median_s": None}, environment=None)
    d16 = next(c.run for c in cal if c.run.id == "d16")
    assert d16.metrics.step_time_median_s is None and d16.environment == {}
    paths = write_report(Report("t", cells, ["x"], calibration=cal), tmp_path / "r")
    rows = {r["method"]: r for r in csv.DictReader(paths["csv"].open())}
    assert rows["ddp"]["predicted_step_s"] == "n/a" and float(rows["single"]["predicted_step_s"]) > 0
    why = "n/a (predicted step): d16: no measured step time (metrics.step_time_median_s)"
    assert why in paths["md"].read_text()
    # the same run with its mean step recorded (where it has no readable median) calibrates the row
    mean = {"step_time_median_s": None, "step_time_mean_s": 0.024}
    cells, cal = _calibrated_sweep(tmp_path / "mean", metrics=mean)
    paths = write_report(Report("t", cells, ["x"], calibration=cal), tmp_path / "mean-r")
    rows = {r["method"]: r for r in csv.DictReader(paths["csv"].open())}
    assert "ddp: +4.0 ms per step beyond `single`" in rows["ddp"]["predicted_step_basis"]
    assert float(rows["ddp"]["predicted_step_s"]) > 0
