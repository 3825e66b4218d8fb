"""The report people read: curves chart, zoomed accuracy, sortable HTML with full reasons, model-state bytes on
CPU, whole method names in piped tables, and compare --repeats (median and spread)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import yaml

from conftest import run_stratbench
from stratbench.compare import report as report_mod
from stratbench.compare import runner as runner_mod
from stratbench.compare.matrix import Plan, build_matrix
from stratbench.compare.runner import SweepRunner, aggregate_repeats, load_records

LONG_REASON = (
    "accelerate's FSDP plugin needs a CUDA GPU: on CPU FSDP1 stops with 'no available devices' and FSDP2 silently "
    "becomes DDP, so this cell is not run here; run it on a machine with GPUs (stratbench compare --only "
    "accelerate-fsdp) and merge the sweeps with stratbench report"
)


def _record(label: str, precision: str, world: int, acc: float, tp: float, shard: int, **extra) -> dict:
    steps = 30
    return {
        "id": f"{label}_{precision}_w{world}",
        "method": label.split("-z")[0],
        "label": label,
        "precision": precision,
        "world_size": world,
        "batch_size": 64,
        "status": "ok",
        "reason": "",
        "machine": {"hostname": "box", "device": "CPU: test (2 cores)"},
        "environment": {"device_type": "cpu", "torch": "x", "python": "3"},
        "config": {"model": "tinynet", "width": 8, "data": "digits", "batch_size": 64, "epochs": 2},
        "metrics": {
            "train_time_s": 64 * steps / tp,
            "throughput_samples_per_s": tp,
            "peak_memory_bytes": [500 << 20] * world,
            "peak_memory_kind": "cpu_peak_rss",
            "val_accuracy": acc,
            "final_loss": 0.4,
            "loss_curve": [2.3 * 0.9**i for i in range(steps)],
            "evaluations": [{"epoch": 1, "val_accuracy": acc - 0.02}, {"epoch": 2, "val_accuracy": acc}],
        },
        "sharding": {
            "param_bytes": [shard] * world,
            "grad_bytes": [shard] * world,
            "optimizer_state_bytes": [shard] * world,
        },  # fmt: skip
        **extra,
    }


@pytest.fixture()
def records() -> list[dict]:
    return [
        _record("single", "fp32", 1, 0.9276, 7000.0, 98_000),
        _record("deepspeed-z3", "fp32", 2, 0.9248, 1400.0, 49_000),
        _record("ddp", "bf16-mixed", 2, 0.9109, 4800.0, 98_000),
        {
            **_record("accelerate-fsdp", "fp32", 2, 0, 1, 0),
            "status": "skipped",
            "reason": LONG_REASON,
            "metrics": {},
        },
    ]


def test_html_table_sortable_and_reasons_whole(records, tmp_path):
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), tmp_path)
    page = paths["html"].read_text()
    assert "<script>" in page and "addEventListener('click'" in page and "th class='sortable'" in page
    assert "src=" not in page.split("<script>")[1].split("</script>")[0]  # inline, no CDN
    assert "http" not in page.split("<script>")[1].split("</script>")[0]
    assert LONG_REASON.replace("'", "&#x27;") in page and "…" not in page
    # numbers sort by value: the throughput cells carry the raw number
    assert "data-v='7000.0'" in page and "data-v='1400.0'" in page
    md = paths["md"].read_text()
    assert LONG_REASON in md and "…" not in md


def test_charts_curves_zoomed_accuracy_and_state_bytes(records, tmp_path, monkeypatch):
    calls = {}
    real_bar, real_mem = report_mod._bar_chart, report_mod._memory_and_state_chart

    def bar(data, path, *a, zoom=False, **kw):
        calls[path.name] = zoom
        return real_bar(data, path, *a, zoom=zoom, **kw)

    def mem(data, path, *a, **kw):
        calls[path.name] = "state"
        return real_mem(data, path, *a, **kw)

    monkeypatch.setattr(report_mod, "_bar_chart", bar)
    monkeypatch.setattr(report_mod, "_memory_and_state_chart", mem)
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), tmp_path)
    assert calls["chart_accuracy.png"] is True and calls["chart_memory.png"] == "state"
    assert calls["chart_throughput.png"] is False
    for name in ("curves", "memory", "accuracy"):
        assert paths[f"chart:{name}"].read_bytes()[:4] == b"\x89PNG"
    lo, hi = report_mod._zoom([91.09, 92.48, 92.76])
    assert 89.5 < lo < 91.09 and 92.76 < hi < 94  # around the data, not 0-100
    rows = report_mod.build_rows(records, report_mod.Footnotes())
    assert report_mod._state_bytes(rows[1]) == {"param_bytes": 49_000, "grad_bytes": 49_000,
                                                "optimizer_state_bytes": 49_000, "master_param_bytes": 0}  # fmt: skip


def test_piped_tables_keep_method_names_whole(records, tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = run_stratbench("report", str(out), env={"COLUMNS": ""})  # stdout is a pipe here
    assert "accelerate-fsdp" in proc.stdout and "deepspeed-z3" in proc.stdout and "…" not in proc.stdout
    est = run_stratbench("estimate", "--model", "resnet18", "--strategy", "all", "--world-size", "2")
    for name in ("ddp-zero", "deepspeed", "fsdp"):
        assert name in est.stdout
    assert "…" not in est.stdout
    adv = run_stratbench("advise", "--model", "resnet18", "--devices", "2", "--device-memory", "8GiB")
    assert "…" not in adv.stdout


FAKE_REPEAT = textwrap.dedent(
    """
    import json, sys, yaml
    from pathlib import Path
    cfg = yaml.safe_load(open(sys.argv[1]))
    counter = Path(cfg["output"]).parents[1] / "count"
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    tp = {1: 300.0, 2: 100.0, 3: 200.0}[n]
    res = {"status": "ok", "config": cfg, "global_batch_size": 32, "per_device_batch_size": 32,
           "metrics": {"train_time_s": 3200.0 / tp, "throughput_samples_per_s": tp, "final_loss": 0.5 + n / 100,
                       "val_accuracy": 0.9 + n / 100, "loss_curve": [1.0, 0.5], "peak_memory_bytes": [n << 20],
                       "peak_memory_kind": "cpu_peak_rss", "run": n}}
    open(cfg["output"] + "/result.json", "w").write(json.dumps(res))
    """
)


def test_repeats_record_median_and_spread(tmp_path, monkeypatch):
    script = tmp_path / "fake_cell.py"
    script.write_text(FAKE_REPEAT)
    monkeypatch.setattr(runner_mod, "cell_command", lambda cell, cfg: [sys.executable, str(script), str(cfg)])
    matrix = build_matrix(
        {"base": {"model": "tinynet"}, "cells": [{"method": "single", "precision": "fp32"}]}
    )
    out = tmp_path / "sweep"
    recs = SweepRunner(matrix, out, timeout_s=60, repeats=3).run([Plan(c, None) for c in matrix.cells])
    rec = recs[matrix.cells[0].id]
    assert rec["status"] == "ok" and rec["repeats"]["n"] == 3
    tp = rec["repeats"]["metrics"]["throughput_samples_per_s"]
    assert tp == {"median": 200.0, "min": 100.0, "max": 300.0, "values": [300.0, 100.0, 200.0]}
    assert (
        rec["metrics"]["throughput_samples_per_s"] == 200.0 and rec["metrics"]["run"] == 3
    )  # the median run
    assert rec["metrics"]["train_time_s"] == 16.0
    assert rec["repeats"]["metrics"]["val_accuracy"]["min"] == pytest.approx(0.91)
    assert sorted(p.name for p in (out / "cells" / matrix.cells[0].id).iterdir()) == [
        "repeat-1",
        "repeat-2",
        "repeat-3",
    ]
    md = report_mod.render_sweeps([out], out)[0]["md"].read_text()
    assert "200.0 (100.0–300.0)" in md and "median of 3 runs" in md
    # resuming with the same --repeats keeps the cell; asking for more reruns it
    assert SweepRunner(matrix, out, timeout_s=60, repeats=3).run([Plan(c, None) for c in matrix.cells])
    assert len((out / "results.jsonl").read_text().splitlines()) == 1
    assert aggregate_repeats([rec])["repeats"]["n"] == 1


def test_compare_repeats_end_to_end(tmp_path):
    mfile = tmp_path / "m.yaml"
    mfile.write_text(yaml.safe_dump({"name": "rep", "base": {
        "model": "tinynet", "width": 8, "data": "digits", "image_size": 16, "epochs": 1, "max_steps": 3,
        "batch_size": 32, "measure_flops": False, "timing_warmup_steps": 1, "save_every_epoch": False},
        "cells": [{"method": "single", "precision": "fp32"}]}))  # fmt: skip
    out = tmp_path / "sweep"
    proc = run_stratbench(
        "compare", "--matrix", str(mfile), "--output", str(out), "--repeats", "2", timeout=300
    )
    (rec,) = load_records(out).values()
    assert rec["status"] == "ok" and rec["repeats"]["n"] == 2
    assert len(rec["repeats"]["metrics"]["throughput_samples_per_s"]["values"]) == 2
    assert "repeat 2/2" in proc.stdout
    assert "median of 2 runs" in (out / "report.md").read_text()
    bad = run_stratbench(
        "compare", "--matrix", str(mfile), "--output", str(out), "--repeats", "0", check=False
    )
    assert bad.returncode != 0 and "--repeats must be >= 1, got 0" in bad.stderr


def test_reasons_with_brackets_print(tmp_path, capsys):
    """A failure quoting gloo ("[/path/pair.cc:553] Connection closed") must not break the terminal output."""
    from rich.console import Console

    from stratbench.compare.report import print_table
    from stratbench.compare.runner import Display

    reason = (
        "RuntimeError: [/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    cell = build_matrix({"cells": [{"method": "single", "precision": "fp32"}]}).cells[0]
    console = Console(width=200)
    Display(1, console).finish(cell, "failed", reason, 1.0, ran=True)
    print_table([{**_record("ddp", "fp32", 2, 0.9, 1.0, 1), "status": "failed", "reason": reason}], console)
    assert capsys.readouterr().out.count("pair.cc:553] Connection closed") == 2
