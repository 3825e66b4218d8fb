"""A report column is one record (compare/columns.py): committed sweeps re-render byte for byte as before the
records (snapshots written by the code before them, tests/compare/golden_report.py), every record has what each
output needs, report.csv's order is the records' order, and a column added to the list shows everywhere."""

from __future__ import annotations

import csv
import difflib
import io
from dataclasses import replace
from pathlib import Path

import pytest
from golden_report import CASES, REPO, SNAPSHOTS, render
from rich.console import Console

from stratbench.compare import columns
from stratbench.compare import report as report_mod
from stratbench.compare.columns import COLUMNS, Column, CsvField, csv_fields, csv_row
from stratbench.compare.rows import Footnotes


@pytest.mark.parametrize("case", list(CASES))
def test_committed_sweeps_render_as_before(case, tmp_path, monkeypatch):
    """report.md, report.csv, report.html (charts by name), the terminal table and every bar chart's data of a
    committed sweep equal the snapshot the renderer before the column records wrote."""
    monkeypatch.chdir(REPO)  # the Sources line names the folders as committed
    got = render(CASES[case], tmp_path / "out")
    for name, text in got.items():
        want = (SNAPSHOTS / case / name).read_text()
        if text != want:
            diff = difflib.unified_diff(want.splitlines(), text.splitlines(), "snapshot", "now", lineterm="", n=1)
            pytest.fail(f"{case}/{name} differs from its snapshot:\n" + "\n".join(list(diff)[:40]))


def test_every_column_has_a_header_a_csv_field_and_a_cell():
    keys = [c.key for c in COLUMNS]
    assert len(set(keys)) == len(keys)
    assert len(set(csv_fields())) == len(csv_fields())
    for c in COLUMNS:
        assert c.csv and all(f.name and callable(f.value) for f in c.csv), c.key
        if c.header is not None:  # a column of the tables: a header and a cell
            assert c.header.strip() and (c.fill or c.names), c.key
        else:  # report.csv only: nothing a table or a chart would show
            assert c.terminal is None and c.chart is None and c.spread is None, c.key
    # the order of report.csv is the records' order, and it is the order committed reports have
    assert csv_fields() == [f.name for c in COLUMNS for f in c.csv]
    for case in CASES:
        with open(SNAPSHOTS / case / "report.csv", newline="") as fh:
            assert next(csv.reader(fh)) == csv_fields()


def _records() -> list[dict]:
    """Two completed cells and one skipped, the least a report reads."""
    base = {"machine": {"hostname": "box", "device": "CPU: test (2 cores)"}, "environment": {"device_type": "cpu"},
            "config": {}, "batch_size": 8, "reason": ""}  # fmt: skip
    metrics = {"train_time_s": 1.0, "throughput_samples_per_s": 80.0, "step_time_median_s": 0.1}
    return [
        {**base, "id": "single_fp32_w1", "method": "single", "precision": "fp32", "world_size": 1,
         "status": "ok", "metrics": metrics},
        {**base, "id": "ddp_fp32_w2", "method": "ddp", "precision": "fp32", "world_size": 2, "status": "ok",
         "metrics": {**metrics, "throughput_samples_per_s": 120.0}},
        {**base, "id": "fsdp_fp32_w2", "method": "fsdp", "precision": "fp32", "world_size": 2,
         "status": "skipped", "reason": "too big", "metrics": {}},
    ]  # fmt: skip


def test_csv_fields_line_up_with_their_columns():
    """Each field's value sits under its own name in every row: no entry shifts the ones after it."""
    rows = columns.build_rows(_records(), Footnotes())
    names = csv_fields()
    for row in rows:
        line = dict(zip(names, csv_row(row), strict=True))
        assert line["id"] == row.rec.id and line["status"] == row.raw["status"]
        assert line["throughput_samples_per_s"] == (row.raw["throughput"] if row.ok else "")
        assert line["mesh"] == ""  # the last field: nothing shifted it


def test_a_column_added_to_the_list_shows_everywhere(tmp_path, monkeypatch):
    """One record, and the markdown and HTML tables, report.csv, the terminal table and the footnotes have it."""

    def fill(rec, row, notes, ctx):
        row.raw["probe"] = rec.world * 10
        row.text["probe"] = f"{rec.world * 10} probes" + notes.mark("probes: ten per process")

    added = Column("probe", "probes / run", (CsvField("probe_count", columns.raw("probe")),), fill=fill,
                   by_value=True, terminal="probes")  # fmt: skip
    at = [c.key for c in COLUMNS].index("speedup") + 1
    monkeypatch.setattr(columns, "COLUMNS", (*COLUMNS[:at], added, *COLUMNS[at:]))
    paths = report_mod.write_report(report_mod.Report("t", _records(), ["x"]), tmp_path)
    md = paths["md"].read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method | precision | devices | batch"))
    assert "| speed-up vs single fp32 | probes / run | predicted step (error) |" in header
    assert "| 20 probes" in md and "probes: ten per process" in md
    assert "probes / run</th>" in paths["html"].read_text()
    with open(paths["csv"], newline="") as fh:
        lines = list(csv.DictReader(fh))
    assert list(lines[0]).index("probe_count") == list(lines[0]).index("speedup") + 1
    assert [line["probe_count"] for line in lines] == ["10", "20", ""]  # the skipped cell: empty
    out = io.StringIO()
    report_mod.print_table(_records(), console=Console(file=out, width=200, color_system=None))
    assert "probes" in out.getvalue()


def test_a_column_of_the_csv_only_is_in_no_table(tmp_path, monkeypatch):
    """A record without a header adds a report.csv field and nothing to the tables."""
    extra = replace(COLUMNS[-1], key="seed", csv=(CsvField("seed", lambda r: 7, na=False),))
    monkeypatch.setattr(columns, "COLUMNS", (*COLUMNS, extra))
    paths = report_mod.write_report(report_mod.Report("t", _records(), ["x"]), tmp_path)
    assert Path(paths["csv"]).read_text().splitlines()[0].endswith(",mesh,seed")
    header = next(line for line in paths["md"].read_text().splitlines() if line.startswith("| method | precision | devices | batch"))
    assert header.endswith("| final loss | status |")
