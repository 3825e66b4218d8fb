"""stratbench compare / report: a real 3-cell sweep with one failing cell, resume, dry-run, re-render and merge;
plus the runner's timeout / Ctrl-C / resume logic on fake cells (fast, no training)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import cli, fails, md_section, run_stratbench
from stratbench.compare import runner as runner_mod
from stratbench.compare.matrix import build_matrix, plan, select
from stratbench.compare.report import render_sweeps
from stratbench.compare.runner import (
    FINISHED,
    Interrupted,
    SweepRunner,
    classify,
    last_error_line,
    load_records,
)
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import ConfigError
from stratbench.predicting.estimate import estimate

BASE = {"model": "tinynet", "width": 8, "data": "digits", "image_size": 16, "epochs": 1, "max_steps": 3,
        "batch_size": 32, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    """single fp32 + single bf16-mixed + a cell whose weights file fits no tensor of the model (a readable
    weights-only file, so it passes the checks before any work and fails at run time, in the cell)."""
    root = tmp_path_factory.mktemp("compare")
    bad = root / "bad_weights.pt"
    torch.save({"not.a.layer": torch.ones(3)}, bad)
    matrix = {
        "name": "three",
        "base": BASE,
        "cells": [
            {"method": "single", "precision": ["fp32", "bf16-mixed"]},
            {"method": "single", "precision": "fp32", "config": {"weights": str(bad)}, "label": "single-badweights"},
        ],
    }
    mfile = root / "matrix.yaml"
    mfile.write_text(yaml.safe_dump(matrix))
    out = root / "sweep"
    args = ("compare", "--matrix", str(mfile), "--output", str(out), "--timeout", "240")
    first = run_stratbench(*args, timeout=600, check=False)
    return {"root": root, "out": out, "args": args, "first": first, "matrix": mfile}


def test_sweep_records_failed_cell_and_completes_others(sweep):
    first, out = sweep["first"], sweep["out"]
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # one cell failed
    recs = load_records(out)
    assert len(recs) == 3
    by_label = {(r["label"], r["precision"]): r for r in recs.values()}
    for prec in ("fp32", "bf16-mixed"):
        r = by_label[("single", prec)]
        assert r["status"] == "ok", r["reason"]
        assert r["metrics"]["steps"] == 3 and r["metrics"]["throughput_samples_per_s"] > 0
        assert r["machine"]["hostname"]
        assert "CPU" in r["machine"]["device"] or "x " in r["machine"]["device"], r["machine"]["device"]
    badrec = by_label[("single-badweights", "fp32")]
    assert badrec["status"] == "failed"
    assert "has no tensor that fits this model" in badrec["reason"]
    # The failure happened in the cell's own process and its log says so.
    assert "no tensor that fits" in Path(badrec["log"]).read_text()

    md = (out / "report.md").read_text()
    failed = [ln for ln in md.splitlines() if ln.startswith("- single-badweights fp32 x1: failed — ")]
    assert len(failed) == 1 and "no tensor that fits" in failed[0]  # one line, with the reason
    assert not [ln for ln in md.splitlines() if ln.startswith("| single-badweights")]  # not a row of empties (or 0s)
    ok_rows = [ln for ln in md_section(md, "All measurements") if ln.startswith("| single |")]
    assert len(ok_rows) == 2 and all(ln.rstrip().endswith("| ok |") for ln in ok_rows)
    assert "1.00x (baseline)" in ok_rows[0]
    if not torch.cuda.is_available():
        assert "n/a²" in md or "n/a¹" in md  # GPU utilisation: n/a with a footnote
        assert "no NVIDIA GPU" in md
    with open(out / "report.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert float(rows[0]["throughput_samples_per_s"]) > 0 and rows[2]["throughput_samples_per_s"] == ""
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "single-badweights" in page
    for name in ("memory", "throughput", "train_time", "accuracy"):
        png = out / f"chart_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_cells(sweep):
    out = sweep["out"]
    before = (out / "results.jsonl").read_text()
    stamps = {p: p.stat().st_mtime_ns for p in (out / "cells").glob("*/result.json")}
    t0 = time.monotonic()
    again = run_stratbench(*sweep["args"], timeout=300, check=False)
    assert again.returncode == 1  # the recorded failure still counts
    assert again.stdout.count("done before") == 3, again.stdout[-3000:]
    assert (out / "results.jsonl").read_text() == before
    assert {p: p.stat().st_mtime_ns for p in (out / "cells").glob("*/result.json")} == stamps
    assert time.monotonic() - t0 < 120


def test_dry_run_lists_cells_and_reasons(tmp_path):
    mfile = tmp_path / "m.yaml"
    mfile.write_text(yaml.safe_dump({"base": BASE, "cells": [
        {"method": ["single", "no-such-method"], "precision": ["fp32", "fp16-mixed"]},
        {"method": "ddp", "precision": "fp32", "world_size": 2}]}))  # fmt: skip
    out = tmp_path / "never"
    proc = run_stratbench("compare", "--matrix", str(mfile), "--output", str(out), "--dry-run", timeout=300)
    text = proc.stdout
    assert "5 cells" in text
    assert "strategy no-such-method is not available in this install" in text
    if not torch.cuda.is_available():
        assert "fp16-mixed on CPU is ~100x slower" in text
    assert not out.exists()  # a dry run writes nothing
    proc = run_stratbench("compare", "--matrix", str(mfile), "--output", str(out), "--dry-run",
                          "--only", "single", "--skip", "fp16-mixed", timeout=300)  # fmt: skip
    assert "1 cells" in proc.stdout and "single_fp32" in proc.stdout


def test_nodes_times_gpus_per_node_is_each_cells_processes(tmp_path, capsys):
    out = tmp_path / "never"
    text = cli("compare", "--only", "single,ddp", "--only", "fp32", "--nodes", "2", "--gpus-per-node", "2",
               "--output", out, "--dry-run")  # fmt: skip
    assert "x4 on 2 nodes" in text and "single" in text and not out.exists()
    err = fails(capsys, "compare", "--nodes", "2", "--gpus-per-node", "2", "--world-size", "2", "--dry-run")
    assert err.endswith("--world-size 2 disagrees with --nodes 2 x --gpus-per-node 2 = 4: give one of them")
    assert fails(capsys, "compare", "--procs-per-node", "0", "--dry-run").endswith("--gpus-per-node must be >= 1, got 0")


def test_report_rerender_and_merge(sweep, tmp_path):
    from stratbench.cli import main

    out = sweep["out"]
    (out / "report.md").unlink()
    render_sweeps([out], out)  # what `stratbench report DIR` does, in-process
    assert "single-badweights" in (out / "report.md").read_text()
    # A second "machine": the same records under another hostname.
    other = tmp_path / "other"
    shutil.copytree(out, other)
    lines = []
    for line in (other / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec["machine"]["hostname"] = "other-host"
        rec["environment"]["hostname"] = "other-host"
        lines.append(json.dumps(rec))
    (other / "results.jsonl").write_text("\n".join(lines) + "\n")
    merged = tmp_path / "merged"
    cli("report", out, other, "--output", merged)
    md = (merged / "report.md").read_text()
    full = md_section(md, "All measurements")
    header = next(ln for ln in full if ln.startswith("| machine"))
    assert "| method |" in header
    rows = [ln for ln in full if ln.startswith("| ") and not ln.startswith("| machine")]
    assert len(rows) == 4  # the completed cells; the failed one of each machine is a line of its own
    assert sum("other-host" in r for r in rows) == 2
    failed = [ln for ln in md_section(md, "Cells that did not complete") if ln.startswith("- single-badweights")]
    assert len(failed) == 2 and sum(" on other-host " in ln for ln in failed) == 1
    # Each machine's rows are compared with that machine's own baseline.
    assert sum("1.00x (baseline)" in r for r in rows) == 2
    assert main(["report", str(out), str(other)]) == 2  # merging needs --output


# ---- fast unit tests of the matrix and the runner (fake cells, no training) ------------------------------


def test_matrix_expansion_ids_and_filters():
    spec = {"base": BASE, "world_size": 2, "cells": [
        {"method": "single", "precision": ["fp32", "bf16-mixed"]},
        {"method": "deepspeed", "options": [{"zero_stage": 1}, {"zero_stage": 3}], "label": "deepspeed-z{zero_stage}"},
        {"method": "ddp", "batch_size": [32, 64]}]}  # fmt: skip
    m = build_matrix(spec)
    assert [(c.name, c.precision, c.world_size, c.batch_size) for c in m.cells] == [
        ("single", "fp32", 1, 32), ("single", "bf16-mixed", 1, 32), ("deepspeed-z1", "fp32", 2, 32),
        ("deepspeed-z3", "fp32", 2, 32), ("ddp", "fp32", 2, 32), ("ddp", "fp32", 2, 64)]  # fmt: skip
    assert len({c.id for c in m.cells}) == 6
    assert [c.id for c in build_matrix(spec).cells] == [c.id for c in m.cells]  # stable across runs
    changed = build_matrix(spec, overrides={"epochs": 2})
    assert not {c.id for c in changed.cells} & {c.id for c in m.cells}  # a different run is a different cell
    assert [c.name for c in select(m.cells, ["deepspeed*,single", "fp32"], ["w1"])] == ["deepspeed-z1", "deepspeed-z3"]
    with pytest.raises(ConfigError, match="left no cells"):
        select(m.cells, ["nothing"], None)
    with pytest.raises(ConfigError, match="unknown option"):
        build_matrix({"base": {"modle": "tinynet"}, "cells": [{"method": "single"}]})
    with pytest.raises(ConfigError, match="set per cell"):
        build_matrix({"base": {"precision": "fp32"}, "cells": [{"method": "single"}]})
    every = build_matrix(spec, precision="64-true")  # --precision: every cell at it (Lightning's name too)
    assert [(c.name, c.precision, c.batch_size) for c in every.cells] == [
        ("single", "fp64", 32), ("deepspeed-z1", "fp64", 32), ("deepspeed-z3", "fp64", 32), ("ddp", "fp64", 32),
        ("ddp", "fp64", 64)]  # fmt: skip
    with pytest.raises(ConfigError, match="unknown precision 'fp8'; choose one of: fp32, .*fp64"):
        build_matrix(spec, precision="fp8")


def test_plan_marks_unavailable_and_invalid_cells():
    m = build_matrix({"base": BASE, "cells": [{"method": "not-installed"}, {"method": "single", "batch_size": 0},
                                              {"method": "single"}]})  # fmt: skip
    plans = plan(m)
    assert plans[0].status == "skipped" and plans[0].reason == "strategy not-installed is not available in this install"
    assert plans[1].status == "failed" and "batch_size" in plans[1].reason
    assert plans[2].status is None


def test_cells_over_the_device_memory_budget_are_marked_and_not_run(tmp_path):
    """A budget between ddp's estimate and fsdp's: ddp (states replicated) is planned as 'does not fit
    (estimate X of Y per device)', fsdp (states sharded over 2 ranks) runs; the budget comes from the matrix
    or from compare's --device-memory (a bad size: one line, nothing written)."""
    base = {**BASE, "optimizer": "adamw", "width": 32}
    totals = {}
    for method in ("ddp", "fsdp"):
        cfg = from_dict(TrainConfig, {**base, "strategy": method, "nproc": 2})
        totals[method] = estimate(cfg, 2, "cpu").total_bytes
    assert totals["fsdp"] < totals["ddp"], totals
    budget = (totals["fsdp"] + totals["ddp"]) // 2
    m = build_matrix({"base": base, "device_memory": budget, "cells": [{"method": ["ddp", "fsdp"]}]})
    ddp, fsdp = plan(m)
    assert ddp.status == "skipped" and ddp.reason.startswith("does not fit (estimate "), ddp.reason
    assert ddp.reason.endswith(" per device)") and " of " in ddp.reason
    assert fsdp.status is None, fsdp.reason
    mfile = tmp_path / "m.yaml"
    mfile.write_text(yaml.safe_dump({"base": base, "cells": [{"method": ["ddp", "fsdp"]}]}))
    out = tmp_path / "never"
    proc = run_stratbench("compare", "--matrix", str(mfile), "--output", str(out), "--dry-run",
                          "--device-memory", str(budget), timeout=300)  # fmt: skip
    assert "ddp" in proc.stdout and "does not fit (estimate" in proc.stdout and "1 to run" in proc.stdout
    proc = run_stratbench("compare", "--matrix", str(mfile), "--output", str(out), "--device-memory", "lots",
                          check=False, timeout=300)  # fmt: skip
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(err) == 1 and "'lots'" in err[0], proc.stderr
    assert not out.exists()


def test_classify_from_result_and_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1\r step 2\nTraceback (most recent call last):\nRuntimeError: boom in layer 3\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")  # fmt: skip
    assert last_error_line(log) == "RuntimeError: boom in layer 3"
    assert classify(1, None, log) == ("failed", "RuntimeError: boom in layer 3")
    assert classify(1, {"status": "oom", "reason": "out of memory: CUDA"}, log)[0] == "oom"
    assert classify(1, {"status": "failed", "reason": "FloatingPointError: loss became nan at step 4"}, log)[0] == "nan"
    assert classify(0, {"status": "ok", "metrics": {"final_loss": float("nan")}}, log)[0] == "nan"
    assert classify(0, {"status": "ok", "metrics": {"final_loss": 0.5, "loss_curve": [1.0, 0.5]}}, log) == ("ok", "")
    log.write_text("stratbench train: error: weights file not found: x.pt\n")
    assert classify(2, None, log) == ("failed", "weights file not found: x.pt")
    assert classify(3, None, log)[0] == "skipped"


FAKE_CELL = textwrap.dedent(
    """
    import json, subprocess, sys, time, yaml
    cfg = yaml.safe_load(open(sys.argv[1]))
    mode = cfg["strategy_options"].get("mode", "ok")
    if mode == "hang":  # a grandchild in its own session, like torchrun's workers
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        print("grandchild", child.pid, flush=True)
        time.sleep(120)
    res = {"status": "ok", "config": cfg, "global_batch_size": 32, "per_device_batch_size": 32,
           "metrics": {"train_time_s": 1.0, "throughput_samples_per_s": 100.0, "final_loss": 0.5,
                       "loss_curve": [1.0, 0.5], "peak_memory_bytes": [1 << 20], "peak_memory_kind": "cpu_peak_rss"}}
    open(cfg["output"] + "/result.json", "w").write(json.dumps(res))
    """
)


@pytest.fixture()
def fake_cells(monkeypatch, tmp_path):
    script = tmp_path / "fake_cell.py"
    script.write_text(FAKE_CELL)
    monkeypatch.setattr(runner_mod, "cell_command", lambda cell, cfg: [sys.executable, str(script), str(cfg)])
    # The fake cells carry a "mode" option that no real strategy has: build cells without planning them.
    return build_matrix({"base": BASE, "cells": [
        {"method": "single", "precision": "fp32", "options": {"mode": "ok"}},
        {"method": "single", "precision": "bf16-mixed", "options": {"mode": "hang"}},
        {"method": "single", "precision": "bf16-true", "options": {"mode": "ok"}}]})  # fmt: skip


def _plans(matrix):
    from stratbench.compare.matrix import Plan

    return [Plan(c, None) for c in matrix.cells]


def _grandchild(out: Path, cell_id: str) -> int:
    for line in (out / "cells" / cell_id / "train.log").read_text().splitlines():
        if line.startswith("grandchild"):
            return int(line.split()[1])
    raise AssertionError("the fake cell did not start its grandchild")


def test_timeout_kills_whole_tree_and_sweep_goes_on(fake_cells, tmp_path):
    out = tmp_path / "sweep"
    records = SweepRunner(fake_cells, out, timeout_s=4).run(_plans(fake_cells))
    statuses = [records[c.id]["status"] for c in fake_cells.cells]
    assert statuses == ["ok", "timeout", "ok"]
    assert "4 s limit" in records[fake_cells.cells[1].id]["reason"]
    pid = _grandchild(out, fake_cells.cells[1].id)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert set(FINISHED) >= set(statuses)


def test_ctrl_c_keeps_finished_cells_and_resume_runs_the_rest(fake_cells, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    hang = fake_cells.cells[1]
    real_tick = runner_mod.Display.tick

    def tick(self, line):  # "press Ctrl-C" once the hanging cell's grandchild is up
        real_tick(self, line)
        if self.cell.id == hang.id and "grandchild" in (out / "cells" / hang.id / "train.log").read_text():
            raise KeyboardInterrupt

    monkeypatch.setattr(runner_mod.Display, "tick", tick)
    with pytest.raises(Interrupted):
        SweepRunner(fake_cells, out, timeout_s=60).run(_plans(fake_cells))
    recs = load_records(out)
    assert list(recs) == [fake_cells.cells[0].id]  # the finished cell is kept, the interrupted one not recorded
    pid = _grandchild(out, hang.id)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # A partial sweep renders: the cells not reached are listed as such.
    paths, records = render_sweeps([out], out)
    md = paths["md"].read_text()
    assert md.count(": not run — the sweep stopped before this cell") == 2
    # Resume: the finished cell is not run again (its result stays), the others run.
    monkeypatch.setattr(runner_mod.Display, "tick", real_tick)
    first_result = out / "cells" / fake_cells.cells[0].id / "result.json"
    stamp = first_result.stat().st_mtime_ns
    records = SweepRunner(fake_cells, out, timeout_s=3).run(_plans(fake_cells))
    assert [records[c.id]["status"] for c in fake_cells.cells] == ["ok", "timeout", "ok"]
    assert first_result.stat().st_mtime_ns == stamp
    assert os.path.getsize(out / "results.jsonl") > 0


# ---- the report's issue-11 output, rendered from synthetic records (no training) ---------------------


def _synthetic_sweep(out: Path) -> dict[str, dict]:
    """single, ddp and fsdp fp32 cells (2 ranks) with made-up measurements in the shape result.json has:
    a step of 10 ms split 1 / 3 / 4 / 1 / 0.5 ms (data, forward, backward, optimizer, other; 0.5 ms in no
    phase), ddp sending 0.1 MiB per step and fsdp 0.15 MiB, and an allocator peak per rank."""
    from stratbench.compare.runner import SWEEP, append_record, local_environment, make_record
    from stratbench.measuring.clock import breakdown_report

    out.mkdir(parents=True)
    matrix = build_matrix({"base": BASE, "world_size": 2,
                           "cells": [{"method": ["single", "ddp", "fsdp"], "precision": "fp32"}]})  # fmt: skip
    env = local_environment(2)
    ms = 1e-3
    step = {"data": 1 * ms, "forward": 3 * ms, "backward": 4 * ms, "optimizer": 1 * ms, "other": 0.5 * ms,
            "step": 10 * ms, "unattributed": 0.5 * ms, "measured_steps": 2}  # fmt: skip
    comm = {"ddp": 0.1 * 2**20, "fsdp": 0.15 * 2**20}
    made = {}
    for i, cell in enumerate(matrix.cells):
        world = cell.world_size
        metrics = {
            "peak_memory_bytes": [400 * 2**20] * world, "peak_memory_kind": "cpu_peak_rss",
            "train_time_s": 1.0, "epoch_time_s": [1.0], "step_time_mean_s": 0.01, "step_time_median_s": 0.01,
            "throughput_samples_per_s": 3200.0 / (i + 1), "val_accuracy": 0.9, "final_loss": 0.4,
            "loss_curve": [2.0, 1.0, 0.4], "evaluations": [{"val_accuracy": 0.9, "val_loss": 0.4}],
            "breakdown": breakdown_report([step] * world),
            "cpu_alloc_peak_bytes": [(4 + i) * 2**20, (4 + i) * 2**20 - 1000][:world],
            "cpu_alloc_import_bytes": [i * 2**20] * world,
        }  # fmt: skip
        if cell.method in comm:
            metrics["comm"] = {"wire_bytes_per_step": comm[cell.method], "check": {"all_reduce": {"error_pct": 0.4}}}
        result = {"config": cell.train_config(out / cell.id), "environment": env, "metrics": metrics,
                  "global_batch_size": cell.batch_size}  # fmt: skip
        rec = make_record(cell, "ok", result=result)
        append_record(out, rec)
        made[cell.method] = rec
    (out / SWEEP).write_text(json.dumps({"cells": [{"id": c.id} for c in matrix.cells]}))
    return made


def test_report_shows_breakdown_comm_and_memory_error_from_records(tmp_path):
    from stratbench.predicting.estimate import predict_peak_bytes

    out = tmp_path / "sweep"
    recs = _synthetic_sweep(out)
    paths, _ = render_sweeps([out], out)
    chart = out / "chart_breakdown.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000
    md = (out / "report.md").read_text()
    assert "![breakdown](chart_breakdown.png)" in md
    full = md_section(md, "All measurements")
    header = next(ln for ln in full if ln.startswith("| method"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    for name in ("not compute (data wait + other)", "comm / step (wire, per rank; vs ddp)",
                 "allocator peak, measured (max over ranks)", "predicted peak (error)"):  # fmt: skip
        assert name in cols, cols
    assert cols.index("predicted peak (error)") == cols.index("allocator peak, measured (max over ranks)") + 1
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in full if ln.startswith("| ") and not ln.startswith("| method")}  # fmt: skip
    cell = {m: dict(zip(cols, rows[m], strict=True)) for m in ("single", "ddp", "fsdp")}
    # not compute = 1 - (forward + backward + optimizer) / step = 1 - 8/10, whatever "other" and the gap are
    assert all(cell[m]["not compute (data wait + other)"].startswith("20.0%") for m in cell)
    assert cell["ddp"]["comm / step (wire, per rank; vs ddp)"].startswith("0.10 MiB (1.00x), formula 0.4%")
    assert cell["fsdp"]["comm / step (wire, per rank; vs ddp)"].startswith("0.15 MiB (1.50x), formula 0.4%")
    assert cell["single"]["comm / step (wire, per rank; vs ddp)"].startswith("n/a")
    for i, m in enumerate(("single", "ddp", "fsdp")):
        pred = predict_peak_bytes(recs[m]["config"], recs[m]["world_size"], "cpu")
        err = (pred / ((4 + i) * 2**20) - 1) * 100
        assert cell[m]["allocator peak, measured (max over ranks)"].startswith(f"{4 + i}.00 MiB")
        assert f"({err:+.0f}%)" in cell[m]["predicted peak (error)"], (cell[m], err)
    # The same figures, raw, in the csv.
    csv_rows = {r["method"]: r for r in csv.DictReader(open(out / "report.csv", newline=""))}
    for i, m in enumerate(("single", "ddp", "fsdp")):
        r = csv_rows[m]
        alloc = (4 + i) * 2**20
        assert int(r["alloc_peak_bytes"]) == alloc and int(r["alloc_import_bytes"]) == i * 2**20
        pred = int(r["predicted_peak_bytes"])
        assert float(r["prediction_error_pct"]) == pytest.approx((pred - alloc) / alloc * 100)
        assert float(r["not_compute_share"]) == pytest.approx(0.2)
    assert float(csv_rows["ddp"]["comm_wire_bytes_per_step"]) == pytest.approx(0.1 * 2**20)
    assert float(csv_rows["fsdp"]["comm_vs_ddp"]) == pytest.approx(1.5)
    assert csv_rows["single"]["comm_vs_ddp"] == "n/a"
    html = (out / "report.html").read_text()
    assert "allocator peak, measured" in html and "data:image/png;base64," in html
