"""The report people read: curves chart, zoomed accuracy, sortable HTML with full reasons, model-state bytes on
CPU, whole method names in piped tables, and compare --repeats (median and spread)."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import markupsafe
import pytest
import yaml

from conftest import cli, fails, md_section, run_stratbench
from stratbench.cli import main
from stratbench.compare import charts
from stratbench.compare import report as report_mod
from stratbench.compare import runner as runner_mod
from stratbench.compare.matrix import Plan, build_matrix
from stratbench.compare.runner import SweepRunner, aggregate_repeats

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
    assert str(markupsafe.escape(LONG_REASON)) in page and "…" not in page
    # numbers sort by value: the throughput cells carry the raw number
    assert "data-v='7000.0'" in page and "data-v='1400.0'" in page
    md = paths["md"].read_text()
    assert LONG_REASON in md and "…" not in md


def test_charts_curves_zoomed_accuracy_and_state_bytes(records, tmp_path, monkeypatch):
    calls = {}
    real_bar, real_mem = charts._bar_chart, charts._memory_and_state_chart

    def bar(data, path, *a, zoom=False, **kw):
        calls[path.name] = zoom
        return real_bar(data, path, *a, zoom=zoom, **kw)

    def mem(data, path, *a, **kw):
        calls[path.name] = "state"
        return real_mem(data, path, *a, **kw)

    monkeypatch.setattr(charts, "_bar_chart", bar)
    monkeypatch.setattr(charts, "_memory_and_state_chart", mem)
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), tmp_path)
    assert calls["chart_accuracy.png"] is True and calls["chart_memory.png"] == "state"
    assert calls["chart_throughput.png"] is False
    for name in ("curves", "memory", "accuracy"):
        assert paths[f"chart:{name}"].read_bytes()[:4] == b"\x89PNG"
    lo, hi = charts._zoom([91.09, 92.48, 92.76])
    assert 89.5 < lo < 91.09 and 92.76 < hi < 94  # around the data, not 0-100
    rows = report_mod.build_rows(records, report_mod.Footnotes())
    assert charts._state_bytes(rows[1]) == {"param_bytes": 49_000, "grad_bytes": 49_000,
                                                "optimizer_state_bytes": 49_000, "master_param_bytes": 0}  # fmt: skip


def test_piped_tables_keep_method_names_whole(records, tmp_path, capsys, monkeypatch):
    """stdout not a terminal (capsys: as a pipe or a CI log) and no COLUMNS: tables keep every name whole."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def printed(*argv: str) -> str:
        assert main(list(argv)) == 0
        return capsys.readouterr().out

    text = printed("report", str(out))
    assert "accelerate-fsdp" in text and "deepspeed-z3" in text and "…" not in text
    est = printed("estimate", "--model", "resnet18", "--strategy", "all", "--world-size", "2")
    for name in ("ddp-zero", "deepspeed", "fsdp"):
        assert name in est
    assert "…" not in est
    assert "…" not in printed("advise", "--model", "resnet18", "--devices", "2", "--device-memory", "8GiB")


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


def test_compare_refuses_fewer_than_one_repeat(tmp_path, capsys):
    """--repeats 0 is one line before any work. (compare --repeats end to end: the manual's `compare --repeats
    3` line, whose record and report tests/readme/test_readme_tour.py checks.)"""
    mfile = tmp_path / "m.yaml"
    matrix = {"name": "rep", "base": {"model": "tinynet"}, "cells": [{"method": "single"}]}
    mfile.write_text(yaml.safe_dump(matrix))
    err = fails(capsys, "compare", "--matrix", mfile, "--output", tmp_path / "sweep", "--repeats", "0")
    assert "--repeats must be >= 1, got 0" in err
    assert not (tmp_path / "sweep").exists()


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


# ---- the report opens with the answer: What to use, a compact table, one line per cell that did not complete ----

MiB = 2**20


def _with_alloc(rec: dict, alloc_mib: float) -> dict:
    """``rec`` with a measured allocator peak (compare's --measure-alloc) of ``alloc_mib`` MiB on every rank."""
    rec["metrics"]["cpu_alloc_peak_bytes"] = [int(alloc_mib * MiB)] * rec["world_size"]
    return rec


@pytest.fixture()
def picks() -> list[dict]:
    """single fp32 (the baseline), ddp the fastest, fsdp the leanest, deepspeed-z3 in between; one cell skipped
    (its reason holds markup), one failed with a log. Process RSS is 500 MiB everywhere, as on a CPU."""
    return [
        _with_alloc(_record("single", "fp32", 1, 0.93, 1000.0, 98_000), 8),
        _with_alloc(_record("ddp", "fp32", 2, 0.92, 1800.0, 98_000), 6),
        _with_alloc(_record("fsdp", "fp32", 2, 0.91, 700.0, 49_000), 2),
        _with_alloc(_record("deepspeed-z3", "fp32", 2, 0.92, 500.0, 49_000), 4),
        {**_record("accelerate-fsdp", "fp32", 2, 0, 1, 0), "status": "skipped", "reason": "needs a <GPU> & CUDA",
         "metrics": {}},
        {**_record("pipeline-1f1b", "bf16-mixed", 2, 0, 1, 0), "status": "failed",
         "reason": "RuntimeError: boom\n  at step 3", "metrics": {}, "log": "/x/train.log"},
    ]  # fmt: skip


def _render(records: list[dict], out) -> tuple[str, str]:
    """report.md and report.html of ``records``, written into ``out``."""
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), out)
    return paths["md"].read_text(), paths["html"].read_text()


def _line(lines: list[str], start: str) -> str:
    """The first of ``lines`` that starts with ``start``."""
    return next(ln for ln in lines if ln.startswith(start))


def test_md_and_html_open_with_what_to_use_naming_the_fastest_and_leanest(picks, tmp_path):
    md, page = _render(picks, tmp_path)
    assert md.startswith("# t\n") and [ln for ln in md.splitlines()[1:] if ln.strip()][0] == "## What to use"
    what = md_section(md, "What to use")
    fastest = _line(what, "- **Fastest:**")
    assert "`ddp fp32 x2` — 1800.0 samples/s, 1.80x the baseline" in fastest
    assert "allocator peak 6.00 MiB per device (0.75x)" in fastest and "Runner-up" not in fastest  # 1000 is 44% slower
    leanest = _line(what, "- **Leanest memory:**")
    assert "`fsdp fp32 x2` — allocator peak 2.00 MiB per device, 0.25x the baseline; 700.0 samples/s (0.70x)" in leanest
    assert "Process RSS is 500.00 MiB in every row" in leanest  # why the allocator peak, not RSS, ranks them
    assert _line(what, "- **Baseline:**").startswith("- **Baseline:** `single fp32 x1` — 1000.0 samples/s")
    accuracy = _line(what, "- **Accuracy:**")
    assert "val accuracy 91.00–93.00% across 4 rows (lowest: fsdp fp32 x2, highest: single fp32 x1)" in accuracy
    # HTML: the same block first, before any table
    assert re.findall(r"<h2>(.*?)</h2>", page)[0] == "What to use"
    assert page.index('id="what-to-use"') < page.index("<table")
    answer = page.split('id="what-to-use"')[1].split("</section>")[0]
    assert '<b>Fastest:</b> <span class="cell">ddp fp32 x2</span> — 1800.0 samples/s, 1.80x the baseline' in answer
    assert '<b>Leanest memory:</b> <span class="cell">fsdp fp32 x2</span>' in answer


def test_compact_table_and_one_line_per_cell_that_did_not_complete(picks, tmp_path):
    md, page = _render(picks, tmp_path)
    glance = [ln for ln in md_section(md, "Completed cells at a glance") if ln.startswith("| ")]
    header = [c.strip() for c in glance[0].strip("|").split("|")]
    assert len(header) <= 8 and header[:3] == ["method", "precision", "devices"] and "val accuracy" in header
    assert [ln.split("|")[1].strip() for ln in glance[1:]] == ["single", "ddp", "fsdp", "deepspeed-z3"]
    assert "| **1800.0** |" in glance[2] and "| **2.00 MiB** |" in glance[3]  # the picks, in bold
    assert "¹" not in "".join(glance)  # no footnote marks in the compact table
    assert [ln for ln in md_section(md, "Cells that did not complete (2)") if ln.strip()] == [
        "- accelerate-fsdp fp32 x2: skipped — needs a \\<GPU\\> \\& CUDA",  # escaped: shown as written
        "- pipeline-1f1b bf16-mixed x2: failed — RuntimeError: boom at step 3 (log: /x/train.log)",
    ]
    assert not [ln for ln in md.splitlines() if ln.startswith(("| accelerate-fsdp", "| pipeline-1f1b"))]
    full = [ln for ln in md_section(md, "All measurements") if ln.startswith("| ")]
    assert len(full) == 5 and len(full[0].split("|")) - 2 > 8  # the full table: every column, completed rows
    # HTML: the compact table has the same <= 8 columns; the skipped cells are list items, escaped, never rows
    compact = page.split('id="summary"')[1].split("</table>")[0]
    assert 3 <= len(re.findall(r"<th[ >]", compact)) <= 8
    problems = page.split('id="not-completed"')[1].split("</section>")[0]
    assert problems.count("<li>") == 2 and "needs a &lt;GPU&gt; &amp; CUDA" in problems and "<GPU>" not in page
    assert not [r for r in re.findall(r"<tr[ >].*?</tr>", page, re.S) if "accelerate-fsdp" in r or "pipeline-1f1b" in r]


def test_html_tables_scroll_in_their_own_box_and_the_full_table_folds(picks, tmp_path):
    _, page = _render(picks, tmp_path)
    css = page.split("<style>")[1].split("</style>")[0]
    assert re.search(r"\.scroll\{[^}]*overflow-x:auto", css) and re.search(r"img\{[^}]*max-width:100%", css)
    assert page.count("<table") == 2 and page.count('<div class="scroll">\n<table') == 2
    folded = page.split("<details")[1].split("</details>")[0]
    assert "<summary>All measurements" in folded and 'id="results"' in folded and "allocator peak, measured" in folded


def test_two_machines_keep_the_compact_table_at_8_columns(picks, tmp_path):
    other = [{**r, "id": r["id"] + "_2", "machine": {"hostname": "box2", "device": "CPU"}} for r in picks]
    md, _ = _render(picks + other, tmp_path)
    header = next(ln for ln in md_section(md, "Completed cells at a glance") if ln.startswith("| "))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert len(cols) == 8 and cols[0] == "machine"
    what = md_section(md, "What to use")
    assert "**On box (CPU: test (2 cores)):**" in what and "**On box2 (CPU):**" in what
    assert sum(ln.startswith("- **Fastest:** `ddp fp32 x2`") for ln in what) == 2  # each machine's own pick
    assert "- accelerate-fsdp fp32 x2 on box2 (CPU): skipped — needs a \\<GPU\\> \\& CUDA" in md


def test_what_to_use_says_so_in_one_line_without_completed_cells_or_baseline(picks, tmp_path):
    md, page = _render([r for r in picks if r["status"] != "ok"], tmp_path / "none")
    what = [ln for ln in md_section(md, "What to use") if ln.strip()]
    assert len(what) == 1 and what[0].startswith("- **Nothing to compare:** no cell ran to completion")
    assert "## Completed cells at a glance" not in md and "Nothing to compare" in page and 'id="summary"' not in page
    md, _ = _render(picks[1:4], tmp_path / "nobase")
    what = md_section(md, "What to use")
    assert _line(what, "- **No baseline:**") and "baseline" not in _line(what, "- **Fastest:**")
    assert _line(what, "- **Fastest:**").startswith("- **Fastest:** `ddp fp32 x2` — 1800.0 samples/s; ")
    close = _with_alloc(_record("ddp", "bf16-mixed", 2, 0.92, 1750.0, 98_000), 6)
    md, _ = _render([*picks[:2], close], tmp_path / "close")
    assert "Runner-up: ddp bf16-mixed x2, 3% slower" in _line(md_section(md, "What to use"), "- **Fastest:**")


def test_a_record_with_missing_fields_still_renders(tmp_path):
    bare = {"id": "bare", "method": "ddp", "status": "ok", "machine": {"hostname": "box", "device": "CPU: test (2 cores)"}}
    gaps = _record("fsdp", "fp32", 2, 0.9, 1.0, 1)
    gaps["metrics"] |= {"throughput_samples_per_s": None, "peak_memory_bytes": [None, None], "val_accuracy": None,
                        "final_loss": float("nan"), "loss_curve": [float("nan"), 1.0]}  # fmt: skip
    odd = _record("ddp-zero", "fp32", 2, 0.9, 800.0, 1, repeats={"n": 3, "metrics": {"throughput_samples_per_s": {"median": 800.0}}})
    good = _with_alloc(_record("single", "fp32", 1, 0.9, 900.0, 1), 5)
    md, page = _render([bare, gaps, odd, good], tmp_path)
    assert _line(md_section(md, "What to use"), "- **Fastest:**").startswith(
        "- **Fastest:** `single fp32 x1` — the baseline itself; 900.0 samples/s"
    )
    glance = {ln.split("|")[1].strip(): ln for ln in md_section(md, "Completed cells at a glance") if ln.startswith("| ")}
    assert "| n/a | n/a |" in glance["ddp"] and "| fsdp | fp32 | 2 | n/a |" in glance["fsdp"]
    assert "this record could not be read (KeyError" in md  # ddp-zero's repeats: every measure n/a, noted why
    assert page.count("<tr") >= 1 + 4


def test_a_rows_mesh_names_its_devices_in_the_table_and_the_csv(tmp_path):
    """A method that reports a named mesh (result.json "mesh") shows it beside its devices; the others show the
    devices alone (a mesh of a bad type is refused: tests/measuring/test_records.py)."""
    import csv

    tp = _record("fsdp", "fp32", 4, 0.9, 900.0, 1, mesh={"dp": 2, "tp": 2})
    bad = _record("tp", "fp32", 2, 0.9, 800.0, 1, mesh={})
    md, page = _render([_record("single", "fp32", 1, 0.9, 1000.0, 1), tp, bad], tmp_path)
    rows = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| 4 (dp2 x tp2) |" in rows["fsdp"] and "| 2 |" in rows["tp"] and "(" not in rows["tp"].split("|")[3]
    assert "4 (dp2 x tp2)" in page
    by_label = {r["label"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    assert by_label["fsdp"]["mesh"] == "dp2xtp2" and by_label["tp"]["mesh"] == "" and by_label["single"]["mesh"] == ""


def test_the_tensor_parallel_presets_plan_every_cell_to_run_here(monkeypatch):
    """llm-tp (the tp benchmark) and llm-quick's tp row: every cell's configuration passes the checks a sweep
    makes before any work on this CPU, 2D and 3D on 4 processes included; the GPU llm preset adds tp rows and an
    fsdp row with float8 Linears."""
    from stratbench.compare.matrix import plan
    from stratbench.compare.presets import PRESETS, preset_llm

    for name in ("llm-tp", "llm-quick"):
        matrix = build_matrix(PRESETS[name]())
        plans = {p.cell.name: p for p in plan(matrix)}
        assert "tp" in plans, sorted(plans)
        gpu_only = ("dp", "accelerate-fsdp", "accelerate-deepspeed", "accelerate-tp", "deepspeed-zero++")
        runnable = {k: p for k, p in plans.items() if k not in gpu_only}
        assert all(p.status is None for p in runnable.values()), {k: p.reason for k, p in runnable.items() if p.status}
    tp = build_matrix(PRESETS["llm-tp"]())
    assert {(c.name, c.world_size) for c in tp.cells} >= {("tp", 2), ("tp", 4), ("fsdp+tp", 4), ("pipeline+tp", 4)}
    from stratbench.compare import presets as presets_mod

    monkeypatch.setattr(presets_mod, "gpu_count", lambda: 4)
    cells = build_matrix(preset_llm()).cells
    gpu = {(c.name, c.world_size) for c in cells}
    assert {("tp", 4), ("fsdp+tp", 4), ("fsdp+fp8", 4)} <= gpu, gpu
    # torchtitan's recipe: float8 Linears, bf16 elsewhere
    fp8 = next(c for c in cells if c.name == "fsdp+fp8")
    assert (fp8.method, fp8.precision, fp8.config.get("float8")) == ("fsdp", "bf16-mixed", "tensorwise")


# ---- refused in one line, before anything is written: a bad sweep.json, a record of the wrong type, merged twins ----


def _sweep_folder(folder, records: list[dict], meta: dict | None = None):
    """A sweep folder as compare leaves it: results.jsonl, and sweep.json naming its cells (or ``meta``)."""
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cells = [{k: r[k] for k in ("id", "method", "label", "precision", "world_size", "batch_size")} for r in records]
    (folder / "sweep.json").write_text(json.dumps(meta if meta is not None else {"name": "s", "cells": cells}))
    return folder


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("cells-not-a-list", "sweep.json: 'cells' is str \"ddp\", not a list of cells; rerun the sweep's"),
        ("cell-without-id", "sweep.json: cells[0] is not a cell (an object with a string 'id')"),
        ("cell-of-wrong-type", "sweep.json: cells[0].world_size is 'two', not a whole number >= 0"),
        ("sweep-json-a-list", "sweep.json: it holds list, not a JSON object"),
        ("record-of-wrong-type", "results.jsonl line 2 is not a record stratbench can read (metrics.peak_memory_bytes "
                                 "is ['1', 2], not a list of numbers >= 0); fix or delete that line"),
        ("same-cells-twice", "both hold cell single_fp32_w1 of box (CPU: test (2 cores)): the same cell of the same "
                             "machine twice"),
        ("same-folder-twice", "are the same sweep folder; name each folder once"),
    ],
)  # fmt: skip
def test_report_refuses_in_one_line_before_writing(tmp_path, capsys, case, why):
    records = [_record("single", "fp32", 1, 0.9, 900.0, 1), _record("ddp", "fp32", 2, 0.9, 1500.0, 1)]
    meta = {"cells-not-a-list": {"cells": "ddp"}, "cell-without-id": {"cells": [{"method": "ddp"}]},
            "cell-of-wrong-type": {"cells": [{"id": "x", "world_size": "two"}]}, "sweep-json-a-list": []}.get(case)  # fmt: skip
    if case == "record-of-wrong-type":
        records[1]["metrics"]["peak_memory_bytes"] = ["1", 2]
    sweep = _sweep_folder(tmp_path / "sweep", records, meta)
    dirs = [sweep]
    if case == "same-cells-twice":
        dirs.append(_sweep_folder(tmp_path / "copy", records))
    if case == "same-folder-twice":
        dirs.append(tmp_path / "." / "sweep")
    out = tmp_path / "merged"
    err = fails(capsys, "report", *dirs, *(["--output", out] if len(dirs) > 1 else []))
    assert why in err and "Traceback" not in err
    assert not list(sweep.glob("report.*")) and not list(sweep.glob("chart_*")) and not out.exists()


def test_report_on_a_sweep_json_whose_cells_is_not_a_list_is_one_line(tmp_path):
    """The real CLI (a fresh interpreter), as a user meets it: one line and exit 2, not a traceback."""
    sweep = _sweep_folder(tmp_path / "sweep", [_record("single", "fp32", 1, 0.9, 900.0, 1)], {"cells": {"id": "x"}})
    proc = run_stratbench("report", str(sweep), check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"stratbench report: error: {sweep / 'sweep.json'}: 'cells' is dict {{\"id\": \"x\"}}, not a list of cells; rerun the sweep's "
        "`stratbench compare` command to rewrite it, or delete the file to report results.jsonl alone"
    ]
    assert not (sweep / "report.md").exists()


# ---- no winner from a busy machine; a partial sweep says so; report.md shows labels and reasons as written ----


def _busy(rec: dict) -> dict:
    """``rec`` as compare records a cell run on a busy machine: mean load 5 on 2 cores (above 1.5x the cores)."""
    return {**rec, "host_load_mean": 5.0, "host_cpu_count": 2}


def test_no_fastest_is_named_from_cells_timed_on_a_busy_machine(picks, tmp_path, monkeypatch):
    picks[1], picks[2] = _busy(picks[1]), _busy(picks[2])  # ddp (the fastest) and fsdp (the leanest)
    phases = {"step": 0.01, "data": 0.001, "forward": 0.003, "backward": 0.004, "optimizer": 0.001, "other": 0.001}
    for rec in picks[:2]:  # single and ddp timed their phases
        rec["metrics"]["breakdown"] = {"per_rank_s": [phases], "not_compute_share": 0.2}
    from matplotlib.figure import Figure

    drawn = {}

    real_savefig = Figure.savefig

    def savefig(fig, path, *a, **kw):  # what each chart shows: its hatched bars and its value labels
        ax = fig.axes[0]
        drawn[ax.get_title().split("\n")[0]] = (
            [p.get_hatch() for p in ax.patches], [t.get_text() for t in ax.texts],
            [t.get_text() for lg in fig.legends + [ax.get_legend()] if lg for t in lg.get_texts()],
        )  # fmt: skip
        return real_savefig(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    md, page = _render(picks, tmp_path)
    what = md_section(md, "What to use")
    fastest = _line(what, "- **Fastest:**")
    assert fastest.startswith("- **Fastest:** none named: 2 of 4 cells ran on a busy machine (ddp fp32 x2, fsdp fp32 x2)")
    assert "`" not in fastest and "Fastest:</b> none named: 2 of 4 cells ran on a busy machine" in page
    leanest = _line(what, "- **Leanest memory:**")  # memory is not a time: still named, its speed marked
    assert leanest.startswith("- **Leanest memory:** `fsdp fp32 x2`") and "(0.70x) (busy machine)" in leanest
    glance = {ln.split("|")[1].strip(): ln for ln in md_section(md, "Completed cells at a glance") if ln.startswith("| ")}
    assert "| 1800.0 (busy) | 1.80x (busy) |" in glance["ddp"] and "**1800.0" not in md  # no bold pick of a speed
    assert "| 1000.0 | 1.00x |" in glance["single"] and "| **2.00 MiB** |" in glance["fsdp"]
    hatches, labels, legend = drawn["Training throughput (higher is better)"]  # bars: single, ddp, fsdp, z3
    assert [bool(h) for h in hatches] == [False, True, True, False]
    assert [lb.endswith("(busy)") for lb in labels] == [False, True, True, False]
    assert "busy machine: time inflated" in legend
    hatches, _, _ = drawn["process peak RSS (incl. ~0.4 GiB runtime)"]  # the memory chart's left panel
    assert not any(hatches)  # memory: not a time, not hatched
    hatches, labels, legend = drawn["Where each step's time goes (mean per step, slowest rank)"]
    assert [bool(h) for h in hatches] == [False, True] * 5 and "busy machine: time inflated" in legend  # 5 phases
    assert labels == ["10.0 ms (20% not compute)", "10.0 ms (20% not compute) (busy)"]
    hatches, labels, _ = drawn["Time to train (lower is better)"]
    assert [bool(h) for h in hatches] == [False, True, True, False] and labels[1].endswith("(busy)")


def test_a_sweep_that_stopped_early_says_its_report_is_partial(picks, tmp_path):
    """sweep.json names 6 cells, results.jsonl holds 4: What to use opens with 'Partial report' naming the 2 never
    reached, which are also listed among the cells that did not complete."""
    done = picks[:4]
    cells = [{k: r[k] for k in ("id", "method", "label", "precision", "world_size", "batch_size")} for r in picks]
    sweep = _sweep_folder(tmp_path / "sweep", done, {"name": "s", "cells": cells})
    cli("report", sweep)
    md = (sweep / "report.md").read_text()
    what = [ln for ln in md_section(md, "What to use") if ln.strip()]
    assert what[0] == (
        "- **Partial report:** the sweep stopped before 2 of its 6 cells: accelerate-fsdp fp32 x2, pipeline-1f1b "
        "bf16-mixed x2, listed below under the cells that did not complete. Rerun the same stratbench compare "
        "command to run them; the cells it finished are kept"
    )
    assert "- **Fastest:** `ddp fp32 x2`" in what[1]  # the completed cells are still compared
    problems = [ln for ln in md_section(md, "Cells that did not complete (2)") if ln.strip()]
    assert all(": not run — the sweep stopped before this cell" in ln for ln in problems)
    assert "Partial report:</b> the sweep stopped before 2 of its 6 cells" in (sweep / "report.html").read_text()
    md_full, _ = _render(picks, tmp_path / "whole")  # every cell has its record: not partial
    assert "Partial report" not in md_full


def test_report_md_shows_labels_and_reasons_as_written(picks, tmp_path):
    """report.md escapes what markdown would read as markup (report.html escapes it for HTML): rendered with a
    CommonMark + GitHub-tables renderer, a label and a reason show as written and every table row keeps its cells."""
    from markdown_it import MarkdownIt

    label = "my*net_<b>|x"
    reason = "boom <script>alert(1)</script> | a_b *c* [link](http://x) ~~s~~ &amp; `code`"
    picks[1] = {**picks[1], "label": label}
    picks[5] = {**picks[5], "reason": reason}
    md, _ = _render(picks, tmp_path)
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<script>" not in html and "<b>" not in html and "<a href" not in html and "<s>" not in html
    assert "<em>" not in html.split("<h2>Setup</h2>")[0]
    assert f"{markupsafe.escape(label)} fp32 x2" in html  # the label as written, in What to use and the tables
    assert str(markupsafe.escape(f"pipeline-1f1b bf16-mixed x2: failed — {reason}")) in html
    for table in re.findall(r"<table>.*?</table>", html, re.S):
        widths = {len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr>.*?</tr>", table, re.S)}
        assert len(widths) == 1, widths  # the bar in the label split no row


def test_every_sweep_json_the_project_ships_reads():
    """The sweep.json rules refuse only what no sweep wrote: every one under benchmarks/ passes them."""
    from conftest import REPO

    found = list(REPO.glob("benchmarks/**/sweep.json"))
    assert found and all(report_mod.sweep_meta_problem(json.loads(p.read_text())) is None for p in found)
