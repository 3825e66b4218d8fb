"""Records of a sweep (or several merged sweeps) -> report.md, report.csv, report.html and PNG charts.

Every number comes from the cells' own result.json (copied into results.jsonl), read as typed records
(``measuring.records.RunRecord``); each column of the table is one record in ``columns`` (its cell in ``cells``),
from which the tables, report.csv and the bar charts are derived; ``charts`` draws the PNGs, ``markdown_page`` and
``html_page`` render the pages. The report opens with the answer (``summary``: what to use, a compact table, one
line per cell that did not complete), then the full table. What a machine cannot measure (GPU utilisation on a
CPU, MFU without a known peak FLOP/s) is written ``n/a`` with a footnote saying why; a cell that did not complete
is one line with its reason (empty in the csv, ``–`` in the terminal table); neither is ever shown as 0.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratbench.compare.calibration import load_calibration_records
from stratbench.compare.charts import write_charts
from stratbench.compare.columns import bar_charts, build_rows, columns_for, terminal_columns, write_csv
from stratbench.compare.document import Report
from stratbench.compare.html_page import render_html
from stratbench.compare.markdown_page import render_markdown
from stratbench.compare.pretrain import describe_pretrain
from stratbench.compare.rows import NOT_RUN, Footnotes, Row, footnote_mark
from stratbench.compare.runner import SWEEP, load_run_records
from stratbench.core.errors import ConfigError
from stratbench.core.files import atomic_write
from stratbench.core.tables import table_console
from stratbench.measuring.records import CalibrationRecord, Machine, RunRecord, record_problem

__all__ = [
    "Footnotes", "Report", "Sweep", "build_rows", "columns_for", "load_sweep", "load_sweeps", "print_table",
    "render_loaded", "render_sweeps", "sweep_meta_problem", "write_report",
]  # fmt: skip
"""``Footnotes``, ``Report``, ``build_rows`` and ``columns_for`` live in ``rows``, ``document`` and ``columns``;
callers of this module keep finding them here."""


# ------------------------------------------------------------------------------------------------
# loading


@dataclass
class Sweep:
    """The records of one output folder, in the order of its matrix; cells never reached are ``not run``."""

    path: Path
    records: list[RunRecord]
    meta: dict[str, Any] = field(default_factory=dict)
    calibration: list[CalibrationRecord] = field(default_factory=list)
    """Its calibration runs (compare --calibrate: calibration.jsonl), not rows of the table."""


def load_sweep(path: str | Path) -> Sweep:
    """Read DIR/results.jsonl (+ DIR/sweep.json for order and the cells not run yet)."""
    path = Path(path)
    records = load_run_records(path)
    meta = _sweep_meta(path)
    if not records and not meta:
        raise ConfigError(
            f"{path} holds no sweep (no results.jsonl or sweep.json); run `stratbench compare --output {path}`"
        )
    return Sweep(path, _in_matrix_order(records, meta), meta, load_calibration_records(path))


def _sweep_meta(path: Path) -> dict[str, Any]:
    """DIR/sweep.json (the matrix's cells, name, description, command); empty where absent. One line naming the
    file and what is wrong where it is no sweep.json stratbench wrote (compare rewrites it on a rerun)."""
    file = path / SWEEP
    if not file.exists():
        return {}
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        why: str | None = f"cannot be read ({str(exc).splitlines()[0][:120]})"
    else:
        why = sweep_meta_problem(meta)
    if why:
        raise ConfigError(f"{file}: {why}; rerun the sweep's `stratbench compare` command to rewrite it, or delete "
                          "the file to report results.jsonl alone")  # fmt: skip
    return meta


def sweep_meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` no sweep.json a sweep wrote: ``cells`` not a list of cell objects with a string id, a
    cell field of the wrong type, ``latest`` not a list of ids; None: it is one."""
    if not isinstance(meta, dict):
        return f"it holds {type(meta).__name__}, not a JSON object"
    cells = meta.get("cells", [])
    if not isinstance(cells, list):
        return f"'cells' is {type(cells).__name__} {json.dumps(cells)[:40]}, not a list of cells"
    for i, cell in enumerate(cells):
        if not isinstance(cell, dict) or not isinstance(cell.get("id"), str):
            return f"cells[{i}] is not a cell (an object with a string 'id')"
        why = record_problem(cell)
        if why:
            return f"cells[{i}].{why}"
    latest = meta.get("latest")
    if latest is not None and not (isinstance(latest, list) and all(isinstance(c, str) for c in latest)):
        return "'latest' is not a list of cell ids"
    for key in ("name", "description"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"'{key}' is not a string"
    command = meta.get("command")
    if command is not None and not (isinstance(command, list) and all(isinstance(c, str) for c in command)):
        return "'command' is not a list of words"
    return None


def _in_matrix_order(records: dict[str, RunRecord], meta: dict[str, Any]) -> list[RunRecord]:
    """The records in the order of the matrix's cells, a ``not run`` record for each cell of the latest matrix the
    sweep never reached, then the cells of an earlier matrix in the same folder."""
    records = dict(records)
    ordered: list[RunRecord] = []
    machine = next(iter(records.values())).machine if records else Machine(platform.node(), "unknown")
    latest = set(meta.get("latest") or [c["id"] for c in meta.get("cells", [])])
    for cell in meta.get("cells", []):
        rec = records.pop(cell["id"], None)
        if rec is None and cell["id"] not in latest:
            continue  # a cell of an earlier, different matrix in this folder that never ran
        if rec is None:
            rec = RunRecord.from_dict({
                **cell, "status": NOT_RUN, "reason": "the sweep stopped before this cell (rerun the same command to resume)",
                "machine": dataclasses.asdict(machine), "metrics": {}, "config": {}, "environment": {}})  # fmt: skip
        ordered.append(rec)
    ordered.extend(records.values())  # cells of an earlier matrix in the same folder
    return ordered


# ------------------------------------------------------------------------------------------------
# writing


def write_report(report: Report, out: Path) -> dict[str, Path]:
    """Write report.md, report.csv, report.html and the PNG charts into ``out``; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notes = Footnotes()
    rows = build_rows(report.records, notes, report.hardware, calibration=report.calibration)
    charts = write_charts(rows, out, report.title, bar_charts())
    paths = {"md": out / "report.md", "csv": out / "report.csv", "html": out / "report.html"}
    # Each written under a temporary name and renamed into place: a failed render keeps the previous report.
    atomic_write(paths["md"], render_markdown(report, rows, notes, charts))
    write_csv(rows, paths["csv"])
    atomic_write(paths["html"], render_html(report, rows, notes, charts))
    return {**paths, **{f"chart:{k}": p for k, p in charts.items()}}


# ------------------------------------------------------------------------------------------------
# terminal


def print_table(records: list[RunRecord] | list[dict[str, Any]], console=None) -> None:
    """A compact version of the table for the terminal at the end of a sweep (``Column.terminal``)."""
    from rich.table import Table  # as core.tables: rich only where a table is printed

    console = console or table_console()
    notes = Footnotes()
    rows = build_rows(records, notes, predict=False)  # the terminal table has no predicted-step column
    cols = terminal_columns(rows)
    table = Table(title="stratbench compare")
    for c in cols:  # names whole (no_wrap), long reasons folded
        table.add_column(c.terminal, no_wrap=c.whole, overflow="fold")
    shown = ""
    for r in rows:
        cells = [str(r.raw[c.key]) if c.terminal_raw else r.text[c.key] for c in cols]
        shown += "".join(cells)
        table.add_row(*cells)
    console.print(table)
    for i, t in enumerate(notes.texts):  # only the footnotes this narrower table uses
        mark = footnote_mark(i)
        if mark in shown:
            console.print(f"{mark} {t}", highlight=False, soft_wrap=True)
    for r in _problems(rows):
        console.print(f"- {r.raw['method']} {r.raw['precision']} x{r.raw['devices']}: {r.raw['status']}: {r.raw['reason']}",
                      highlight=False, soft_wrap=True, markup=False)  # fmt: skip


def _problems(rows: list[Row]) -> list[Row]:
    """The rows of cells that did not complete."""
    return [r for r in rows if r.raw["status"] != "ok"]


def load_sweeps(dirs: list[Path]) -> list[Sweep]:
    """The sweeps of ``dirs``, refused in one line where two would be merged wrong: the same folder twice, or
    two folders holding the same cell of the same machine (a sweep copied or rerun into another folder), whose
    rows would be set against one folder's baseline and shown twice."""
    resolved = [Path(d).resolve() for d in dirs]
    for i, folder in enumerate(resolved):
        if folder in resolved[:i]:
            raise ConfigError(f"{dirs[resolved.index(folder)]} and {dirs[i]} are the same sweep folder; name each "
                              "folder once")  # fmt: skip
    sweeps = [load_sweep(d) for d in dirs]
    owner: dict[tuple[str, str | None], Path] = {}
    for sweep in sweeps:
        for rec in sweep.records:
            key = (rec.machine.name, rec.id)
            other = owner.setdefault(key, sweep.path)
            if other != sweep.path:
                raise ConfigError(
                    f"{other} and {sweep.path} both hold cell {rec.id} of {rec.machine.name}: the same cell of the "
                    "same machine twice, so one folder's rows would be set against the other's baseline; report "
                    "each folder on its own (merge folders of different machines or different cells)"
                )
    return sweeps


def render_sweeps(
    dirs: list[Path], out: Path, title: str | None = None, hardware: str | None = None
) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Re-render one sweep folder, or merge several (e.g. two machines) into one report in ``out``; returns its
    paths and the records as JSON (what ``api.Sweep.records`` holds)."""
    return render_loaded(load_sweeps(dirs), out, title, hardware)


def render_loaded(
    sweeps: list[Sweep], out: Path, title: str | None = None, hardware: str | None = None
) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """``render_sweeps`` of sweeps already loaded (``load_sweeps``: `stratbench report` checks them before it
    makes its output folder)."""
    records = [r for s in sweeps for r in s.records]
    if title is None:
        names = list(dict.fromkeys(s.meta.get("name", s.path.name) for s in sweeps))
        title = "stratbench compare: " + " + ".join(names)
    description = sweeps[0].meta.get("description", "") if len(sweeps) == 1 else ""
    command = " ".join(sweeps[0].meta.get("command") or []) if len(sweeps) == 1 else ""
    calibration = [c for s in sweeps for c in s.calibration]
    started = describe_pretrain(sweeps[0].meta.get("pretrain")) if len(sweeps) == 1 else ""
    report = Report(
        title, records, [str(s.path) for s in sweeps], description, command, hardware, calibration, started
    )
    return write_report(report, out), [rec.fields for rec in records]
