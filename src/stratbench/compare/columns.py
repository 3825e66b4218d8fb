"""The report's columns, each one record (``Column``): its header, its cell (``cells``: raw value, text and
footnotes), its fields in report.csv, its sort and alignment in report.html, its header in the terminal table,
its spread over repeated runs and its bar chart. ``COLUMNS`` lists them in table order; the markdown and HTML
tables, report.csv's header and rows, the terminal table and the bar charts are all derived from it, so adding a
column is one record here (and its cell function in ``cells``).

report.csv keeps every column's fields, in ``COLUMNS`` order; a column with no header (``header`` None) is in
report.csv only. Old sweeps re-render byte-identically: tests/compare/test_report_columns.py.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratbench.compare import cells
from stratbench.compare.cells import Context, Fill, Finish, Spread
from stratbench.compare.charts import BarChart, memory_kind
from stratbench.compare.rows import DASH, Footnotes, Row, is_baseline
from stratbench.core.files import atomic_output
from stratbench.core.tables import fmt_bytes
from stratbench.measuring.records import CalibrationRecord, RunRecord, as_run_record, number


@dataclass(frozen=True)
class CsvField:
    """One field of report.csv: its name and its raw value of a row."""

    name: str
    value: Callable[[Row], Any]
    na: bool = True
    """A missing value (None) is ``n/a`` on a completed row ('' on one that did not complete); False: always ''."""


def raw(key: str, default: Any = None) -> Callable[[Row], Any]:
    """The CSV value ``row.raw[key]``."""
    return lambda r: r.raw.get(key, default)


@dataclass(frozen=True)
class Column:
    """One column of the report: everything each output needs of it, in one place."""

    key: str
    """Its key in ``Row.raw`` and ``Row.text``."""
    header: str | None
    """The header of report.md's and report.html's full table; None: a column of report.csv only."""
    csv: tuple[CsvField, ...]
    """Its fields in report.csv, in order."""
    fill: Fill | None = None
    """Its cell (``cells``): writes the raw value and the text, marking the footnotes it needs."""
    names: Callable[[RunRecord], Any] | None = None
    """A column naming the cell by one value of its record (instead of ``fill``): the value and its text."""
    measure: bool = True
    """A measure (n/a or – where a cell did not complete), not a name of the cell (filled for every row)."""
    finish: Finish | None = None
    """A pass over every row once each is filled, for what needs the other rows (``cells``)."""
    also: tuple[str, ...] = ()
    """Other raw keys its fill writes, blanked with it on a row that did not complete."""
    fill_order: int = 0
    """Cells are filled, and their footnotes numbered, in column order within the same ``fill_order``; not compute
    fills after the comm column (1), as every report has numbered their notes."""
    shown: Callable[[list[Row]], bool] | None = None
    """Whether the tables show it for these rows (None: always)."""
    by_value: bool = False
    """report.html sorts it by its raw number (False: by its text)."""
    align: str = ""
    """report.html's class of its cells: '' (right-aligned number), 'l' (a name), 'reason' (wrapped text)."""
    terminal: str | None = None
    """Its header in the terminal table at the end of a sweep (None: not there)."""
    whole: bool = False
    """The terminal table never wraps it (a name)."""
    terminal_raw: bool = False
    """The terminal shows its raw value, not its text (the status without the reason, listed below the table)."""
    spread: Spread | None = None
    """How it shows the smallest and largest of repeated runs (compare --repeats)."""
    chart: BarChart | None = None
    """Its bar chart, one bar per completed cell."""


def _several_machines(rows: list[Row]) -> bool:
    """The machine column only where the rows come from more than one machine."""
    return len({r.raw["machine"] for r in rows}) > 1


def _pretrainable(rows: list[Row]) -> bool:
    """init (imagenet | random) matters where pretrained weights exist or were used: torchvision models."""
    return any(
        r.raw.get("init") not in (None, "random") or str(r.rec.model_name).startswith("resnet") for r in rows
    )


def _fine_tuning(rows: list[Row]) -> bool:
    """The fine-tuning columns where some completed row trained only part of its model (LoRA's adapters)."""
    return any(r.ok and r.raw.get("trainable") is not None and r.raw["trainable"] < (r.raw.get("parameters_total") or 0)
               for r in rows)  # fmt: skip


def _moe(rows: list[Row]) -> bool:
    """The MoE columns where some completed row trained a mixture of experts."""
    return any(r.ok and r.raw.get("moe_active") is not None for r in rows)


def _per_device(r: Row) -> str:
    """Each rank's (each device's) peak, ';'-separated."""
    return ";".join(str(p) for p in r.raw.get("peak_memory_per_device") or [])


def _pct(v: float) -> str:
    """A fraction as a percentage with two decimals (the accuracy's cell)."""
    return f"{v * 100:.2f}%"


COLUMNS: tuple[Column, ...] = (
    Column("machine", "machine", (CsvField("machine", raw("machine"), na=False),),
           names=lambda rec: rec.machine.name, measure=False, shown=_several_machines, align="l",
           terminal="machine"),
    Column("id", None, (CsvField("id", lambda r: r.rec.id, na=False),), measure=False),
    Column("method", "method", (CsvField("method", lambda r: r.rec.method, na=False),
                                CsvField("label", raw("method"), na=False)),
           names=lambda rec: rec.name, measure=False, align="l", terminal="method", whole=True),
    Column("precision", "precision", (CsvField("precision", raw("precision"), na=False),),
           names=lambda rec: rec.precision, measure=False, align="l", terminal="precision", whole=True),
    Column("init", "init", (CsvField("init", lambda r: r.raw["init"] or "", na=False),),
           names=cells.init_of, measure=False, shown=_pretrainable, align="l"),
    Column("devices", "devices", (CsvField("devices", raw("devices"), na=False),
                                  CsvField("world_size", lambda r: r.rec.world_size, na=False)),
           fill=cells.devices_cell, measure=False, by_value=True, terminal="dev"),
    Column("batch_device", "batch / device", (CsvField("batch_device", raw("batch_device"), na=False),),
           names=lambda rec: rec.per_device_batch, measure=False, by_value=True, terminal="batch/dev"),
    Column("batch_global", "global batch", (CsvField("batch_global", raw("batch_global"), na=False),),
           names=lambda rec: rec.global_batch, measure=False, by_value=True),
    Column("peak_memory", "peak memory / device (max over ranks)",
           (CsvField("peak_memory_bytes", raw("peak_memory")),
            CsvField("peak_memory_bytes_per_device", _per_device, na=False),
            CsvField("peak_memory_kind", raw("peak_memory_kind", ""), na=False)),
           fill=cells.peak_memory_cell, by_value=True, terminal="peak mem/dev",
           spread=Spread("peak_memory_bytes", fmt_bytes, fmt_bytes),
           chart=BarChart("memory", 1, "Peak memory per device (lower is better)",
                          lambda ok: f"peak memory per device, MiB (largest rank; {memory_kind(ok)})",
                          scale=lambda x: x / 2**20, spec=".0f", with_state=True)),
    Column("gpu_util", "GPU util mean / peak", (CsvField("gpu_util_mean_pct", raw("gpu_util")),
                                                CsvField("gpu_util_peak_pct", raw("gpu_util_peak"))),
           fill=cells.gpu_util_cell, by_value=True),
    Column("epoch_time", "time / epoch", (CsvField("time_per_epoch_s", raw("epoch_time")),),
           fill=cells.epoch_time_cell, by_value=True),
    Column("train_time", "train time (eval excluded)", (CsvField("train_time_s", raw("train_time")),),
           fill=cells.train_time_cell, by_value=True, terminal="train time",
           spread=Spread("train_time_s", lambda v: f"{v:.2f} s", lambda v: f"{v:.2f}"),
           chart=BarChart("train_time", 3, "Time to train (lower is better)",
                          "train time, seconds (evaluation and checkpoints excluded)", timed=True)),
    Column("throughput", "throughput (samples/s)", (CsvField("throughput_samples_per_s", raw("throughput")),),
           fill=cells.throughput_cell, by_value=True, terminal="samples/s",
           spread=Spread("throughput_samples_per_s", lambda v: f"{v:.1f}", lambda v: f"{v:.1f}"),
           chart=BarChart("throughput", 2, "Training throughput (higher is better)",
                          "throughput, samples/s (global batch / step time)", timed=True)),
    Column("speedup", "speed-up vs single fp32", (CsvField("speedup", raw("speedup")),),
           fill=cells.speedup_cell, by_value=True, terminal="speed-up"),
    Column("predicted_step", "predicted step (error)",
           (CsvField("step_time_median_s", raw("step_time")), CsvField("predicted_step_s", raw("predicted_step")),
            CsvField("predicted_step_error_pct", raw("step_error_pct")),
            CsvField("predicted_dominant", lambda r: r.raw.get("predicted_dominant") or "", na=False),
            CsvField("predicted_step_basis", lambda r: r.raw.get("predicted_basis") or "", na=False)),
           fill=cells.step_time_cell, finish=cells.predicted_step_finish, also=("step_time",)),
    Column("alloc_peak", "allocator peak, measured (max over ranks)",
           (CsvField("alloc_peak_bytes", raw("alloc_peak")), CsvField("alloc_import_bytes", raw("alloc_imports"))),
           fill=cells.alloc_peak_cell, by_value=True),
    Column("predicted", "predicted peak (error)",
           (CsvField("predicted_peak_bytes", raw("predicted")),
            CsvField("prediction_error_pct", raw("prediction_error_pct"))),
           fill=cells.predicted_peak_cell, by_value=True),
    Column("mfu", "MFU", (CsvField("mfu", raw("mfu")),), fill=cells.mfu_cell, by_value=True),
    Column("not_compute", "not compute (data wait + other)", (CsvField("not_compute_share", raw("not_compute")),),
           fill=cells.not_compute_cell, fill_order=1, by_value=True),
    Column("comm", "comm / step (wire, per rank; vs ddp)",
           (CsvField("comm_wire_bytes_per_step", raw("comm")), CsvField("comm_vs_ddp", raw("comm_vs_ddp")),
            CsvField("comm_formula_error_pct", raw("comm_formula_error_pct"))),
           fill=cells.comm_cell, finish=cells.comm_ratio_finish, by_value=True),
    Column("val_accuracy", "val accuracy", (CsvField("val_accuracy", raw("val_accuracy")),),
           fill=cells.accuracy_cell, by_value=True, terminal="val acc",
           spread=Spread("val_accuracy", _pct, lambda v: f"{v * 100:.2f}"),
           chart=BarChart("accuracy", 4, "Validation accuracy (higher is better)",
                          "validation accuracy, % (after the last epoch)", scale=lambda x: x * 100, spec=".2f",
                          zoom=True)),
    Column("final_loss", "final loss", (CsvField("final_loss", raw("final_loss")),), fill=cells.loss_cell,
           by_value=True, spread=Spread("final_loss", lambda v: f"{v:.4f}", lambda v: f"{v:.4f}")),
    # fine-tuning rows (shown where some row trains part of the model): what trains, and each rank's model states
    Column("trainable", "trainable parameters", (CsvField("trainable_parameters", raw("trainable"), na=False),
                                                CsvField("total_parameters", raw("parameters_total"), na=False)),
           fill=cells.trainable_cell, also=("parameters_total",), shown=_fine_tuning, by_value=True),
    Column("model_states", "model states / rank: frozen / trainable weights / grads / optimizer (largest rank)",
           tuple(CsvField(f"states_{key}_bytes", raw(f"states_{key}"), na=False)
                 for key, _ in cells.MODEL_STATES),
           fill=cells.model_states_cell, also=tuple(f"states_{key}" for key, _ in cells.MODEL_STATES),
           shown=_fine_tuning, by_value=True),
    # mixture-of-experts rows (shown where some row trained an MoE): parameters per token of total, the routing
    Column("moe_active", "MoE: active / total parameters",
           (CsvField("moe_active_parameters", raw("moe_active"), na=False),
            CsvField("moe_total_parameters", raw("moe_total"), na=False)),
           fill=cells.moe_params_cell, also=("moe_total",), shown=_moe, by_value=True),
    Column("moe_balance", "MoE load: busiest expert / mean (worst layer), dropped",
           (CsvField("moe_load_imbalance", raw("moe_imbalance"), na=False),
            CsvField("moe_dropped_fraction", raw("moe_dropped"), na=False)),
           fill=cells.moe_balance_cell, also=("moe_imbalance", "moe_dropped"), shown=_moe),
    Column("status", "status", (CsvField("status", raw("status"), na=False), CsvField("reason", raw("reason"), na=False)),
           fill=cells.status_cell, measure=False, align="reason", terminal="status", terminal_raw=True),
    Column("host_load", None, (CsvField("host_load_mean", lambda r: r.rec.load[0], na=False),
                               CsvField("host_cpu_count", lambda r: r.rec.load[1], na=False),
                               CsvField("host_others_share", lambda r: r.rec.metrics.host_others_share, na=False)),
           measure=False),
    Column("repeats", None, (CsvField("repeats", raw("repeats", 1), na=False),
                             *(CsvField(f"{key}_{end}{unit}", raw(f"{key}_{end}"), na=False)
                               for key, unit in (("train_time", "_s"), ("throughput", ""), ("val_accuracy", ""))
                               for end in ("min", "max"))), measure=False),
    # language-model rows only (filled by the throughput and accuracy cells)
    Column("throughput_tokens", None, (CsvField("throughput_tokens_per_s", raw("throughput_tokens"), na=False),),
           measure=False),
    Column("val_perplexity", None, (CsvField("val_perplexity", raw("val_perplexity"), na=False),), measure=False),
    # the method's named mesh ("dpxtp"), blank where it reports none
    Column("mesh", None, (CsvField("mesh", lambda r: r.rec.layout.replace(" ", ""), na=False),), measure=False),
)  # fmt: skip
"""Every column, in table order (which is also report.csv's order of fields)."""


def _filled() -> list[Fill]:
    """The measures' cells, in the order they are filled (and their footnotes numbered)."""
    return [c.fill for c in sorted(COLUMNS, key=lambda c: c.fill_order) if c.fill and c.measure]


def _spreads() -> list[tuple[str, Spread]]:
    """(key, spread) of each column shown as a median and a range over repeated runs."""
    return [(c.key, c.spread) for c in COLUMNS if c.spread]


def bar_charts() -> list[tuple[str, BarChart]]:
    """(key, chart) of each column that has a bar chart."""
    return [(c.key, c.chart) for c in COLUMNS if c.chart]


def csv_fields() -> list[str]:
    """report.csv's header: every column's fields, in column order."""
    return [f.name for c in COLUMNS for f in c.csv]


# ------------------------------------------------------------------------------------------------
# rows


def build_rows(
    records: list[RunRecord] | list[dict[str, Any]], notes: Footnotes, hardware: str | None = None,
    predict: bool = True, calibration: list[CalibrationRecord] | None = None,
) -> list[Row]:  # fmt: skip
    """Raw values and display strings for every record; baseline = the ok `single` fp32 row of the same machine.
    ``hardware``: the profile the predicted step uses (default: the sweep's probe, else the one of each record's
    device); ``calibration``: the sweeps' calibration records (compare --calibrate)."""
    runs = [as_run_record(rec) for rec in records]
    baselines: dict[str, float] = {}
    for rec in runs:
        tp = rec.metrics.throughput_samples_per_s
        if rec.ok and is_baseline(rec) and tp:
            baselines.setdefault(rec.machine.name, tp)
    ctx = Context(baselines, hardware, calibration or [], predict)
    rows = [_readable_row(rec, notes, ctx) for rec in runs]
    for col in COLUMNS:
        if col.finish:
            col.finish(rows, notes, ctx)
    return rows


def _identity(rec: RunRecord, notes: Footnotes, ctx: Context) -> Row:
    """A row with the columns that name the cell (machine, method, precision, init, devices, batches, status)."""
    row = Row(rec, {}, {})
    for col in COLUMNS:
        if col.names:
            row.raw[col.key] = value = col.names(rec)
            row.text[col.key] = str(value) if value is not None else DASH
        elif col.fill and not col.measure:
            col.fill(rec, row, notes, ctx)
    return row


def _blank(row: Row, text: str) -> None:
    """Every measure of ``row`` missing, shown as ``text``."""
    for col in COLUMNS:
        if col.measure:
            for key in (col.key, *col.also):
                row.raw[key] = None
                row.text[key] = text


def _row(rec: RunRecord, notes: Footnotes, ctx: Context) -> Row:
    """Every column of one record, each measure with the footnote saying how it was measured or why it is n/a.
    Notes are numbered in order of first use, so the order of the cells is the order of the notes."""
    row = _identity(rec, notes, ctx)
    if not row.ok:
        # nothing was measured: the report lists the cell on one line, the csv leaves its cells empty
        _blank(row, DASH)
        return row
    for fill in _filled():
        fill(rec, row, notes, ctx)
    cells.add_spread(rec, row, notes, _spreads())
    return row


def _readable_row(rec: RunRecord, notes: Footnotes, ctx: Context) -> Row:
    """``_row``, or, for a record whose fields have a shape nothing above foresaw, its identity with every measure
    n/a and a footnote naming the error: one unreadable record must not stop the report of the others."""
    try:
        return _row(rec, notes, ctx)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        row = _identity(rec, notes, ctx)
        _blank(row, "n/a" + notes.mark(f"n/a: this record could not be read ({type(exc).__name__}: {exc})"))
        row.raw["unreadable"] = True
        return row


# ------------------------------------------------------------------------------------------------
# which columns a table shows, and report.csv


def shown_columns(rows: list[Row]) -> list[Column]:
    """The columns of the full table (report.md, report.html) for these rows."""
    return [c for c in COLUMNS if c.header is not None and (c.shown is None or c.shown(rows))]


def columns_for(rows: list[Row]) -> list[tuple[str, str]]:
    """(key, header) of each column the full table shows for these rows."""
    return [(c.key, c.header or "") for c in shown_columns(rows)]


def terminal_columns(rows: list[Row]) -> list[Column]:
    """The columns of the terminal table at the end of a sweep."""
    return [c for c in COLUMNS if c.terminal is not None and (c.shown is None or c.shown(rows))]


def sort_value(row: Row, col: Column) -> str | None:
    """The value a column sorts by in report.html: the raw number for measures, the text for names; None = no
    value."""
    if col.by_value:
        v = number(row.raw.get(col.key))
        return None if v is None else repr(v)
    text = row.text.get(col.key)
    return None if text in (None, DASH, "") else str(text)


def csv_row(row: Row) -> list[Any]:
    """One row of report.csv: raw numbers (bytes, seconds, fractions); ``n/a`` where not measurable, empty where
    the cell did not run."""
    missing = "n/a" if row.ok else ""
    out: list[Any] = []
    for col in COLUMNS:
        for f in col.csv:
            value = f.value(row)
            out.append(value if value is not None else missing if f.na else "")
    return out


def write_csv(rows: list[Row], path: Path) -> None:
    """report.csv: a header of every column's fields, then one line per row."""
    with atomic_output(Path(path), ".csv") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(csv_fields())
        for r in rows:
            w.writerow(csv_row(r))
