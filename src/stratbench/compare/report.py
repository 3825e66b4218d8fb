"""Records of a sweep (or several merged sweeps) -> report.md, report.csv, report.html and PNG charts.

Every number comes from the cells' own result.json (copied into results.jsonl), read as typed records
(``measuring.records.RunRecord``); each column of the table is one small function of the record, and ``charts``
draws the PNGs. The report opens with the answer (``summary``: what to use, a compact table, one line per cell
that did not complete), then the full table. What a machine cannot measure (GPU utilisation on a CPU, MFU
without a known peak FLOP/s) is written ``n/a`` with a footnote saying why; a cell that did not complete is one
line with its reason (empty in the csv, ``–`` in the terminal table); neither is ever shown as 0.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import functools
import json
import platform
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from stratbench.compare import summary
from stratbench.compare.calibration import basis_for, load_calibration_records
from stratbench.compare.charts import write_charts
from stratbench.compare.rows import DASH, NOT_RUN, Row, is_baseline, is_baseline_run, is_comm_reference
from stratbench.compare.runner import SWEEP, load_run_records
from stratbench.core.errors import ConfigError
from stratbench.core.files import atomic_output, atomic_write
from stratbench.core.tables import fmt_bytes, table_console
from stratbench.measuring.records import (
    CalibrationRecord,
    Machine,
    RunRecord,
    as_run_record,
    number,
    record_problem,
)
from stratbench.models.zoo import describe_init
from stratbench.predicting.estimate import predict_peak_bytes
from stratbench.predicting.projection import (
    RecordPrediction,
    precision_key,
    predict_calibrated,
    predict_record,
)

SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"

COLUMNS: list[tuple[str, str]] = [
    ("machine", "machine"),
    ("method", "method"),
    ("precision", "precision"),
    ("init", "init"),
    ("devices", "devices"),
    ("batch_device", "batch / device"),
    ("batch_global", "global batch"),
    ("peak_memory", "peak memory / device (max over ranks)"),
    ("gpu_util", "GPU util mean / peak"),
    ("epoch_time", "time / epoch"),
    ("train_time", "train time (eval excluded)"),
    ("throughput", "throughput (samples/s)"),
    ("speedup", "speed-up vs single fp32"),
    ("predicted_step", "predicted step (error)"),
    ("alloc_peak", "allocator peak, measured (max over ranks)"),
    ("predicted", "predicted peak (error)"),
    ("mfu", "MFU"),
    ("not_compute", "not compute (data wait + other)"),
    ("comm", "comm / step (wire, per rank; vs ddp)"),
    ("val_accuracy", "val accuracy"),
    ("final_loss", "final loss"),
    ("status", "status"),
]


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
# rows


class Footnotes:
    """Numbered footnotes, numbered in order of first use; the same text reuses its number."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        """The superscript of ``text``'s note, adding the note at its first use."""
        if text not in self.texts:
            self.texts.append(text)
        return footnote_mark(self.texts.index(text))


def footnote_mark(i: int) -> str:
    """The mark of the ``i``-th note (0-based): a superscript digit, then [10], [11], ..."""
    return SUPERSCRIPTS[i] if i < len(SUPERSCRIPTS) else f"[{i + 1}]"


def _mean(xs: list[Any]) -> float | None:
    """The mean of the values present (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


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
    rows = [_readable_row(rec, notes, baselines) for rec in runs]
    _add_comm_ratio(rows)
    if predict:
        _add_predicted_step(rows, notes, hardware, calibration or [])
    return rows


def _readable_row(rec: RunRecord, notes: Footnotes, baselines: dict[str, float]) -> Row:
    """``_row``, or, for a record whose fields have a shape nothing above foresaw, its identity with every measure
    n/a and a footnote naming the error: one unreadable record must not stop the report of the others."""
    try:
        return _row(rec, notes, baselines)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
        row = _identity(rec)
        na = "n/a" + notes.mark(f"n/a: this record could not be read ({type(exc).__name__}: {exc})")
        for k in METRIC_KEYS:
            row.raw[k] = None
            row.text[k] = na
        row.raw["unreadable"] = True
        return row


# ------------------------------------------------------------------------------------------------
# the predicted step


def _calibration_key(rec: RunRecord) -> tuple[str, str, str]:
    """Machine, precision and model: a GPU row's prediction is calibrated on the baseline run sharing them."""
    return (
        rec.machine.name,
        precision_key(str(rec.precision), bool(rec.config.get("tf32"))),
        str(rec.model_name),
    )


UNCALIBRATED_CPU = (
    "n/a (predicted step): uncalibrated. On a CPU the projection needs this machine's probe and calibration runs "
    "made with the threads of a cell's process before the cells (`stratbench compare --calibrate`, the same "
    "command otherwise: it resumes and adds them); calibrated instead on the sweep's own all-core single run with "
    "another machine's probe, this column was 35-80% off (docs/projection.md)"
)


def _add_predicted_step(
    rows: list[Row], notes: Footnotes, hardware: str | None, calibration: list[CalibrationRecord]
) -> None:
    """Beside each measured median step, what stratbench.predicting.projection predicts for it on the machine it ran on.
    Where the sweep calibrated itself (compare --calibrate) from its calibration runs and probe profile, made
    for that cell before it ran; otherwise on a GPU from the device's profile, calibrated on the sweep's own
    `single` run of the same machine, precision and model; on a CPU not at all (docs/projection.md)."""
    singles: dict[tuple[str, str, str], RunRecord] = {}
    for r in rows:
        if r.rec.ok and is_baseline_run(r.rec) and r.rec.metrics.step_time_median_s:
            singles.setdefault(_calibration_key(r.rec), r.rec)
    for r in rows:
        r.raw["predicted_step"] = r.raw["step_error_pct"] = None
        r.raw["step_time"] = r.rec.metrics.step_time_median_s
        if r.raw["status"] != "ok" or r.raw.get("unreadable"):
            r.text["predicted_step"] = r.text.get("speedup", DASH)
            continue
        _predicted_step_cell(r, notes, hardware, calibration, singles)


def _predicted_step_cell(r: Row, notes: Footnotes, hardware: str | None, calibration: list[CalibrationRecord],
                         singles: dict[tuple[str, str, str], RunRecord]) -> None:  # fmt: skip
    """One completed row's prediction: from the calibration runs made for it, else (on a GPU) from its device's
    profile and the sweep's own baseline run; n/a with the reason where there is none."""
    basis = basis_for(r.rec, calibration) if calibration else None
    if basis is not None and basis.problem:
        r.text["predicted_step"] = "n/a" + notes.mark(f"n/a (predicted step): {basis.problem}")
    elif basis is not None:
        pred = predict_calibrated(
            r.rec, basis.runs, basis.profile or "", hardware, [str(c.id) for c in basis.runs]
        )
        _show_prediction(r, pred, _calibrated_note(hardware, basis.nproc), notes)
    elif not r.rec.on_gpu:
        r.text["predicted_step"] = "n/a" + notes.mark(UNCALIBRATED_CPU)
    else:
        cal = singles.get(_calibration_key(r.rec))
        pred = predict_record(r.rec, cal, hardware)
        _show_prediction(r, pred, _profile_note(pred), notes, calibration_row=cal is r.rec)


def _calibrated_note(hardware: str | None, nproc: int | None) -> str:
    """The footnote of a step predicted from the sweep's own calibration runs."""
    where = (f"the {hardware} profile given with --hardware" if hardware else
             f"this machine's probe profile (`stratbench probe --nproc {nproc}`, calibration/probe-w{nproc}/probe.yaml)")  # fmt: skip
    return (
        f"predicted step: stratbench.predicting.projection on {where}, calibrated by this sweep's calibration runs "
        "(compare --calibrate; calibration.jsonl): `single` at the per-process and the global batch with the "
        "threads of a cell's process, and each method once on one process for its own overhead per step "
        "(report.csv: predicted_step_basis). No measurement of the row itself enters its prediction; "
        "error = predicted / measured median step - 1 (docs/projection.md)"
    )


def _profile_note(pred: RecordPrediction) -> str:
    """The footnote of a GPU row's step predicted from its device's profile."""
    return (
        f"predicted step: stratbench.predicting.projection on the {pred.system} profile, "
        + ("calibrated on this sweep's single run of the same precision" if pred.calibrated
           else "at the profile's default efficiency for the model's family, uncalibrated (no single run of this "
                "precision in the sweep; report.csv: predicted_step_basis names the default's evidence)")
        + "; error = predicted / measured median step - 1 (docs/projection.md)"
    )  # fmt: skip


def _show_prediction(
    r: Row, pred: RecordPrediction, note: str, notes: Footnotes, calibration_row: bool = False
) -> None:
    """The predicted step and its error against the measured median step (none for the row the prediction was
    calibrated on), or n/a with the projection's reason."""
    r.raw["predicted_dominant"] = pred.dominant
    r.raw["predicted_basis"] = pred.basis
    if pred.step_s is None:
        r.text["predicted_step"] = "n/a" + notes.mark(f"n/a (predicted step): {pred.reason}")
        return
    r.raw["predicted_step"] = pred.step_s
    measured = r.raw["step_time"]
    text = f"{pred.step_s * 1e3:.1f} ms"
    if calibration_row:
        text += " (calibration)"
    elif measured:
        r.raw["step_error_pct"] = (pred.step_s / measured - 1) * 100
        text += f" ({r.raw['step_error_pct']:+.0f}%)"
    r.text["predicted_step"] = text + notes.mark(note)


def _add_comm_ratio(rows: list[Row]) -> None:
    """Each row's measured bytes on the wire per step as a multiple of the reference method's (``ddp``; same
    machine and precision)."""
    reference = {
        (r.rec.machine.name, r.raw["precision"]): r.raw["comm"]
        for r in rows
        if is_comm_reference(r.rec) and r.raw.get("comm")
    }
    for r in rows:
        base = reference.get((r.rec.machine.name, r.raw["precision"]))
        if r.raw.get("comm") is not None and base:
            r.raw["comm_vs_ddp"] = r.raw["comm"] / base
            r.text["comm"] = r.text["comm"].replace(" MiB", f" MiB ({r.raw['comm_vs_ddp']:.2f}x)", 1)


# ------------------------------------------------------------------------------------------------
# the columns of one row: each reads the record and writes its raw value and text into the row


METRIC_KEYS = ("peak_memory", "gpu_util", "epoch_time", "train_time", "throughput", "speedup", "alloc_peak",
               "predicted", "mfu", "not_compute", "comm", "val_accuracy", "final_loss", "step_time")  # fmt: skip


def _identity(rec: RunRecord) -> Row:
    """A row with the columns that name the cell (machine, method, precision, init, devices, batches, status)."""
    raw: dict[str, Any] = {
        "machine": rec.machine.name,
        "method": rec.name,
        "precision": rec.precision,
        "init": _init_of(rec),
        "devices": rec.devices,
        "batch_device": rec.per_device_batch,
        "batch_global": rec.global_batch,
        "status": rec.status,
        "reason": rec.reason,
    }
    text = {k: str(v) if v is not None else DASH for k, v in raw.items()}
    raw["busy"] = rec.busy  # its times were taken on a busy machine (measuring.load)
    if rec.node_count > 1:
        text["devices"] = f"{rec.devices} on {rec.node_count} nodes"
    if rec.layout:
        text["devices"] += f" ({rec.layout})"
    status = str(rec.status)
    text["status"] = (
        status if not raw["reason"] or status == "ok" else f"{status}: {' '.join(raw['reason'].split())}"
    )
    if status == "ok" and raw["reason"]:
        text["status"] = f"ok ({raw['reason']})"
    return Row(rec, raw, text)


def _row(rec: RunRecord, notes: Footnotes, baselines: dict[str, float]) -> Row:
    """Every column of one record, each measure with the footnote saying how it was measured or why it is n/a.
    Notes are numbered in order of first use, so the order of the cells below is the order of the notes."""
    row = _identity(rec)
    if not row.ok:
        # nothing was measured: the report lists the cell on one line, the csv leaves its cells empty
        for k in METRIC_KEYS:
            row.raw[k] = None
            row.text[k] = DASH
        return row
    _peak_memory_cell(rec, row, notes)
    _gpu_util_cell(rec, row, notes)
    _epoch_time_cell(rec, row, notes)
    _train_time_cell(rec, row, notes)
    _throughput_cell(rec, row, notes)
    _speedup_cell(rec, row, notes, baselines.get(rec.machine.name))
    _alloc_peak_cell(rec, row, notes)
    _predicted_peak_cell(rec, row, notes)
    _mfu_cell(rec, row, notes)
    _comm_cell(rec, row, notes)
    _not_compute_cell(rec, row, notes)
    _accuracy_cell(rec, row)
    _loss_cell(rec, row)
    row.raw["step_time"] = rec.metrics.step_time_median_s
    _add_spread(rec, row, notes)
    return row


def _peak_memory_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Peak memory per device: the max over ranks; a process that drives several GPUs (DataParallel) lists each."""
    peaks = [p for p in rec.metrics.peak_memory_bytes if p is not None]
    kind = rec.metrics.peak_memory_kind
    row.raw["peak_memory"] = max(peaks) if peaks else None
    row.raw["peak_memory_per_device"] = peaks
    row.raw["peak_memory_kind"] = kind
    if not peaks:
        row.text["peak_memory"] = "n/a" + notes.mark("n/a: the run recorded no memory peak")
        return
    shown = " / ".join(fmt_bytes(p) for p in peaks) if len(peaks) > rec.world else fmt_bytes(max(peaks))
    if kind == "cpu_peak_rss":
        shown += notes.mark(
            "on CPU the peak is the process's peak resident memory (RSS: weights, activations, optimizer "
            "state plus the Python runtime and libraries, ~0.3-0.5 GiB), the largest over the ranks; on a GPU "
            "it is torch.cuda.max_memory_allocated"
        )
    row.text["peak_memory"] = shown


def _gpu_util_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """GPU utilisation mean / peak over the run (NVML), n/a with the reason where it could not be read."""
    utils = [u for u in rec.metrics.gpu_util_mean_pct if u is not None]
    upeaks = [u for u in rec.metrics.gpu_util_peak_pct if u is not None]
    raw, text = row.raw, row.text
    if utils:
        raw["gpu_util"] = _mean(utils)
        raw["gpu_util_peak"] = max(upeaks) if upeaks else None
        text["gpu_util"] = (
            f"{raw['gpu_util']:.0f}% / {raw['gpu_util_peak']:.0f}%" if upeaks else f"{raw['gpu_util']:.0f}%"
        )
        return
    raw["gpu_util"] = None
    why = "NVML (nvidia-ml-py) was not available" if rec.on_gpu else "no NVIDIA GPU on this machine"
    text["gpu_util"] = "n/a" + notes.mark(f"n/a: GPU utilisation is read from NVML: {why}")


def _busy_mark(rec: RunRecord, notes: Footnotes) -> str:
    """The "machine was busy" mark the times and the speed-up carry ('' when it was not)."""
    if not rec.busy:
        return ""
    return notes.mark(
        "the machine was busy with other work while this cell ran (mean 1-minute load average above 1.5x its "
        "cores; each cell's value is host_load_mean in report.csv): its times are inflated and its speed-up "
        "is not a property of the method, so What to use names no fastest from it, and the charts hatch it"
    )


def _epoch_time_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Train time over the epochs evaluated (the mean recorded epoch time where there is none)."""
    m = rec.metrics
    epochs_done = number(m.evaluations[-1].get("epoch")) if m.evaluations else None
    epoch_time = m.train_time_s / epochs_done if m.train_time_s and epochs_done else _mean(m.epoch_time_s)
    row.raw["epoch_time"] = epoch_time
    row.text["epoch_time"] = _fmt(epoch_time, ".2f", " s") + _busy_mark(rec, notes)


def _train_time_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Seconds of training, evaluation and checkpoints excluded."""
    row.raw["train_time"] = rec.metrics.train_time_s
    row.text["train_time"] = _fmt(rec.metrics.train_time_s, ".2f", " s") + _busy_mark(rec, notes)


def _throughput_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Samples per second (global batch over the step time)."""
    row.raw["throughput"] = rec.metrics.throughput_samples_per_s
    row.text["throughput"] = _fmt(rec.metrics.throughput_samples_per_s, ".1f") + _busy_mark(rec, notes)
    metrics = rec.fields.get("metrics")
    tokens = number(metrics.get("throughput_tokens_per_s")) if isinstance(metrics, dict) else None
    row.raw["throughput_tokens"] = tokens
    if tokens is not None:  # a language model: its samples are windows of tokens
        row.text["throughput"] += f" ({tokens:,.0f} tokens/s)"


def _speedup_cell(rec: RunRecord, row: Row, notes: Footnotes, base: float | None) -> None:
    """Throughput over the single fp32 row's on the same machine."""
    tp = row.raw["throughput"]
    if tp and base:
        row.raw["speedup"] = tp / base
        row.text["speedup"] = (f"{row.raw['speedup']:.2f}x" + (" (baseline)" if is_baseline(rec) else "")
                               + _busy_mark(rec, notes))  # fmt: skip
    else:
        row.raw["speedup"] = None
        row.text["speedup"] = "n/a" + notes.mark(
            "n/a: no completed single fp32 row on this machine to compare with"
        )


def _alloc_peak_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """The allocator peak (what the estimate predicts), measured: torch.cuda.max_memory_allocated on a GPU (the
    peak memory column itself), --measure-alloc's glibc reading on a CPU."""
    raw, text = row.raw, row.text
    allocs = [a for a in rec.metrics.cpu_alloc_peak_bytes if a]
    if raw["peak_memory_kind"] == "cuda_max_allocated" and raw["peak_memory"]:
        raw["alloc_peak"] = raw["peak_memory"]
        text["alloc_peak"] = fmt_bytes(raw["alloc_peak"]) + notes.mark(
            "allocator peak on a GPU: torch.cuda.max_memory_allocated, the same figure as the peak memory column"
        )
    elif allocs:
        raw["alloc_peak"] = max(allocs)
        imports = [b for b in rec.metrics.cpu_alloc_import_bytes if b]
        text["alloc_peak"] = fmt_bytes(raw["alloc_peak"]) + notes.mark(
            "allocator peak on a CPU: the bytes glibc's malloc handed out during step 2 (mallinfo2 after every op, "
            "above a baseline read before the model was built; --measure-alloc), the largest over the ranks: the "
            "quantity the estimate predicts, which process RSS hides under the runtime's ~0.4 GiB. Python modules "
            "the method imported after the baseline are measured apart and left out (report.csv: "
            "alloc_import_bytes; docs/memory.md)"
        )
        raw["alloc_imports"] = max(imports) if imports else 0
    else:
        raw["alloc_peak"] = None
        text["alloc_peak"] = "n/a" + notes.mark(
            "n/a: no allocator measurement (on a CPU it needs --measure-alloc, on by default in compare cells, "
            "and glibc's mallinfo2)"
        )


def _predicted_peak_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """stratbench.predicting.estimate's peak for the cell's config, and its error against the measured allocator peak."""
    raw, text = row.raw, row.text
    pred = _predict(rec)
    raw["predicted"] = pred
    raw["prediction_error_pct"] = None
    if pred is None:
        text["predicted"] = "n/a" + notes.mark("n/a: the predictor gave no estimate for this cell")
    elif raw["alloc_peak"]:
        raw["prediction_error_pct"] = (pred - raw["alloc_peak"]) / raw["alloc_peak"] * 100
        text["predicted"] = f"{fmt_bytes(pred)} ({raw['prediction_error_pct']:+.0f}%)" + notes.mark(
            "predicted peak: stratbench.predicting.estimate for the cell's config, the busiest rank; error = predicted / "
            "allocator peak - 1"
        )
    else:
        text["predicted"] = fmt_bytes(pred) + notes.mark(
            "the prediction is of tensor memory; on CPU the measured peak is process RSS, so no error % is given"
        )


def _predict(rec: RunRecord) -> int | None:
    """The estimator's peak for this cell's config (None where it has none; it never raises)."""
    if not rec.config:
        return None
    return predict_peak_bytes(dict(rec.config), rec.world, "cuda" if rec.on_gpu else "cpu", rec.environment)


def _mfu_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Model FLOPs utilisation, n/a with the reason where it would mislead (a CPU, an unknown GPU, no FLOPs)."""
    mfu = rec.metrics.mfu
    row.raw["mfu"] = mfu
    metrics = rec.fields.get("metrics") or {}
    if mfu is not None:
        given = metrics.get("peak_flops_source") == "--peak-tflops"
        row.text["mfu"] = f"{mfu * 100:.1f}%" + (notes.mark(
            "MFU against the peak FLOP/s per device given with --peak-tflops: the model's FLOPs per sample x "
            "samples/s, shared by every device the run occupies"
        ) if given else "")  # fmt: skip
    elif not rec.on_gpu:
        row.text["mfu"] = "n/a" + notes.mark(
            "n/a: MFU needs the peak FLOP/s of a known GPU; a CPU has none in the table (give one with "
            "--peak-tflops)"
        )
    elif not rec.metrics.flops_per_sample:
        row.text["mfu"] = "n/a" + notes.mark("n/a: FLOPs were not counted (--measure-flops false)")
    else:
        row.text["mfu"] = "n/a" + notes.mark(
            "n/a: no peak FLOP/s known for this GPU model (stratbench.measuring.metrics.PEAK_FLOPS)"
        )


def _comm_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """Measured MiB on the wire per rank and step (ring model over the measured payloads), and the largest
    error of the method's formula over its collective kinds."""
    raw, text = row.raw, row.text
    comm = rec.metrics.comm
    raw["comm"] = raw["comm_formula_error_pct"] = None
    if not comm or "wire_bytes_per_step" not in comm:
        text["comm"] = "n/a" + notes.mark("n/a: collectives were not recorded (--comm-volume false)")
        return
    raw["comm"] = comm["wire_bytes_per_step"]
    text["comm"] = f"{raw['comm'] / 2**20:.2f} MiB"
    errors = [
        abs(c["error_pct"]) for c in (comm.get("check") or {}).values() if c.get("error_pct") is not None
    ]
    if errors:
        raw["comm_formula_error_pct"] = max(errors)
        text["comm"] += f", formula {raw['comm_formula_error_pct']:.1f}%"
    text["comm"] += notes.mark(
        "comm / step: bytes each rank sends per optimizer step under the ring model, from every collective "
        "torch.profiler recorded in step 3 (docs/communication.md); x: its multiple of ddp's; formula: the "
        "largest error of the method's comm_model over its collective kinds"
    )


def _not_compute_cell(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """The share of the step outside forward, backward and the optimizer (metrics.breakdown)."""
    share = number((rec.metrics.breakdown or {}).get("not_compute_share"))
    row.raw["not_compute"] = share
    if share is None:
        row.text["not_compute"] = "n/a" + notes.mark(
            "n/a: the step's phases were not timed (--breakdown false)"
        )
        return
    row.text["not_compute"] = f"{share * 100:.1f}%" + notes.mark(
        "not compute: the share of the step outside forward, backward and the optimizer step: waiting for the "
        "batch, bookkeeping, and any gap no phase covers (metrics.breakdown; each phase timed on its own "
        "clock reads; the chart chart_breakdown.png splits the step). Communication that DDP/FSDP overlap "
        "with backward counts in backward"
    )


def _accuracy_cell(rec: RunRecord, row: Row) -> None:
    """Validation accuracy after the last epoch, in %; a language model's is next-token accuracy, and its
    validation perplexity follows it."""
    acc = rec.metrics.val_accuracy
    row.raw["val_accuracy"] = acc
    row.text["val_accuracy"] = _fmt(acc * 100 if acc is not None else None, ".2f", "%")
    metrics = rec.fields.get("metrics")
    ppl = number(metrics.get("val_perplexity")) if isinstance(metrics, dict) else None
    row.raw["val_perplexity"] = ppl
    if ppl is not None:
        row.text["val_accuracy"] += f" (perplexity {ppl:.2f})"


def _loss_cell(rec: RunRecord, row: Row) -> None:
    """The training loss of the last step."""
    row.raw["final_loss"] = rec.metrics.final_loss
    row.text["final_loss"] = _fmt(rec.metrics.final_loss, ".4f")


# column -> (measure in the record's ``repeats``, the cell's text of a value, the bracket's text of a value)
SPREAD = {
    "train_time": ("train_time_s", lambda v: f"{v:.2f} s", lambda v: f"{v:.2f}"),
    "throughput": ("throughput_samples_per_s", lambda v: f"{v:.1f}", lambda v: f"{v:.1f}"),
    "peak_memory": ("peak_memory_bytes", fmt_bytes, fmt_bytes),
    "val_accuracy": ("val_accuracy", lambda v: f"{v * 100:.2f}%", lambda v: f"{v * 100:.2f}"),
    "final_loss": ("final_loss", lambda v: f"{v:.4f}", lambda v: f"{v:.4f}"),
}


def _add_spread(rec: RunRecord, row: Row, notes: Footnotes) -> None:
    """A cell run N times (compare --repeats): its values are medians; show the smallest and largest run."""
    raw, text = row.raw, row.text
    n = int(rec.repeats.get("n") or 1)
    raw["repeats"] = n
    if n < 2:
        return
    mark = notes.mark(
        f"median of {n} runs of the cell (compare --repeats {n}); the smallest-largest run in brackets "
        "(in the HTML table below the value; none: every run gave the same value)"
    )
    for col, (key, cell, short) in SPREAD.items():
        s = (rec.repeats.get("metrics") or {}).get(key)
        if not s or raw.get(col) is None:
            continue
        raw[f"{col}_min"], raw[f"{col}_max"] = s["min"], s["max"]
        old = cell(raw[col])
        raw[col] = s["median"]  # peak memory: the median over runs of each run's largest rank
        rest = text[col][len(old) :] if text[col].startswith(old) else ""  # footnote marks after the value
        lo, hi = short(s["min"]), short(s["max"])
        text[col] = f"{cell(s['median'])}" + (f" ({lo}–{hi})" if lo != hi else "") + f"{rest}{mark}"
        if lo != hi:  # the HTML table shows the range on a second line of the cell
            text[f"{col}__main"], text[f"{col}__spread"] = f"{cell(s['median'])}{rest}{mark}", f"{lo}–{hi}"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` and ``suffix``, or n/a where it was not measured."""
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


# ------------------------------------------------------------------------------------------------
# writing


@dataclass
class Report:
    title: str
    records: list[RunRecord]
    """The rows, in table order (a record given as JSON is parsed)."""
    sources: list[str]
    description: str = ""
    command: str = ""
    hardware: str | None = None
    """The profile of the predicted-step column (a system name or probe file); None: the sweep's probe, else each
    record's device's."""
    calibration: list[CalibrationRecord] = field(default_factory=list)
    """The sweeps' calibration records (compare --calibrate), which the predicted-step column rests on."""

    def __post_init__(self) -> None:
        self.records = [as_run_record(rec) for rec in self.records]


def columns_for(rows: list[Row]) -> list[tuple[str, str]]:
    multi = len({r.raw["machine"] for r in rows}) > 1
    # init (imagenet | random) matters where pretrained weights exist or were used: torchvision models
    pretrainable = any(
        r.raw.get("init") not in (None, "random") or str(r.rec.model_name).startswith("resnet") for r in rows
    )
    return [c for c in COLUMNS if (c[0] != "machine" or multi) and (c[0] != "init" or pretrainable)]


def _init_of(rec: RunRecord) -> str | None:
    """imagenet (a torchvision ImageNet weights file), random, or the weights file's name; None when unknown."""
    return describe_init(rec.config.get("weights")) if rec.config else None


def _settings(records: list[RunRecord]) -> str:
    """One line naming what every cell trained (from the first record that ran)."""
    for rec in records:
        cfg = rec.config
        if cfg.get("model"):
            bits = [f"model {cfg['model']}" + (f" (width {cfg.get('width')})" if cfg.get("model") == "tinynet" else ""),
                    f"data {cfg.get('data')}" + (f" at {cfg['image_size']}x{cfg['image_size']}" if cfg.get("image_size") else ""),
                    f"{cfg.get('epochs')} epochs" + (f" (max {cfg['max_steps']} steps)" if cfg.get("max_steps") else ""),
                    f"optimizer {cfg.get('optimizer')} lr {cfg.get('lr')}", f"seed {cfg.get('seed')}"]  # fmt: skip
            return ", ".join(bits)
    return ""


def _machines(records: list[RunRecord]) -> list[str]:
    """One line per machine: its name, torch, python, CUDA and the versions of the libraries methods wrap."""
    out: list[str] = []
    for rec in records:
        env = rec.environment
        pk = env.get("packages") or {}
        line = (f"{rec.machine.name}; torch {env.get('torch')}, python {env.get('python')}"
                + (f", CUDA {env['cuda']}" if env.get("cuda") and env.get("device_type") == "cuda" else "")
                + "".join(f", {k} {v}" for k, v in pk.items() if v and k in ("deepspeed", "accelerate")))  # fmt: skip
        if env and line not in out:
            out.append(line)
    return out


def write_report(report: Report, out: Path) -> dict[str, Path]:
    """Write report.md, report.csv, report.html and the PNG charts into ``out``; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notes = Footnotes()
    rows = build_rows(report.records, notes, report.hardware, calibration=report.calibration)
    charts = write_charts(rows, out, report.title)
    paths = {"md": out / "report.md", "csv": out / "report.csv", "html": out / "report.html"}
    # Each written under a temporary name and renamed into place: a failed render keeps the previous report.
    atomic_write(paths["md"], render_markdown(report, rows, notes, charts))
    write_csv(rows, paths["csv"])
    atomic_write(paths["html"], render_html(report, rows, notes, charts))
    return {**paths, **{f"chart:{k}": p for k, p in charts.items()}}


def _problems(rows: list[Row]) -> list[Row]:
    """The rows of cells that did not complete."""
    return [r for r in rows if r.raw["status"] != "ok"]


HOW_TO_READ = (
    "Each row is one run of the same model and data with one method and precision, in its own processes. "
    "`devices` is how many devices (GPUs, or CPU processes) share the global batch, with the method's device "
    "mesh where it splits more than the data (dp2 x tp2: 2 data-parallel groups of 2 tensor-parallel ranks); the global batch is the "
    "same for every row, so all rows train the same problem and their accuracies are comparable (the test suite "
    "checks that every data-parallel method trains the same model as single: loss curves over 20 steps within "
    "1e-9 relative in fp64, and within 1e-5 in fp32 against a single-device run with the same micro-batch "
    "shapes, which is how DeepSpeed, having no fp64 mode, is checked). "
    "Peak memory is per device (the largest rank), which is what decides whether a run fits. Train time and "
    "throughput exclude evaluation and checkpointing; the speed-up is throughput divided by the single fp32 "
    "row's. Sharded methods (ddp-zero, fsdp, deepspeed ZeRO) trade memory for communication: on one machine's "
    "CPU cores their extra communication usually costs time, on GPUs with fast links it buys memory."
)

WHAT_TO_USE = "What to use"
AT_A_GLANCE = "Completed cells at a glance"
NOT_COMPLETED = "Cells that did not complete"
ALL_MEASUREMENTS = "All measurements"


MD_MARKUP = re.compile(r"([\\`*_\[\]<>|~&])")
"""The characters markdown (CommonMark with GitHub's tables) reads as markup inside a line: emphasis, code, links,
HTML tags and entities, strikethrough, table cells."""


def md_text(text: Any) -> str:
    """``text`` as literal markdown, as report.html escapes it for HTML: each markup character backslash-escaped
    (CommonMark's escape for any ASCII punctuation; GitHub's tables take ``\\|`` as a literal bar) and line
    breaks as spaces, so that a label or a reason shows as written and stays in its table cell or list item."""
    return MD_MARKUP.sub(r"\\\1", " ".join(str(text).split()))


def md_code(text: Any) -> str:
    """``text`` as a markdown code span, fenced by more backticks than it holds in a row."""
    text = " ".join(str(text).split())
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_markdown(report: Report, rows: list[Row], notes: Footnotes, charts: dict[str, Path]) -> str:
    """report.md: the answer first (what to use, a compact table, one line per cell that did not complete), then
    the setup, the full table with its footnotes, how to read it, and the charts. Every label, reason, name and
    path is escaped (``md_text``); the footnotes and how-to-read are stratbench's own markdown."""
    lines = [f"# {md_text(report.title)}", ""]
    lines += _markdown_advice(rows)
    lines += _markdown_compact(rows)
    lines += _markdown_problems(rows)
    lines += _markdown_setup(report)
    lines += _markdown_full_table(rows, notes)
    lines += ["## How to read this table", "", HOW_TO_READ, ""]
    if charts:
        lines += ["## Charts", ""]
        for name, p in charts.items():
            lines += [f"![{name}]({p.name})", ""]
    return "\n".join(lines)


def _markdown_advice(rows: list[Row]) -> list[str]:
    """## What to use: one bullet per pick, under a bold machine line when the report holds several."""
    lines = [f"## {WHAT_TO_USE}", ""]
    for group in summary.advice(rows):
        if group.machine:
            lines += [f"**On {md_text(group.machine)}:**", ""]
        lines += [f"- **{md_text(line.label)}:** " + (f"{md_code(line.subject)} — " if line.subject else "")
                  + md_text(line.detail) for line in group.lines]  # fmt: skip
        lines.append("")
    return lines


def _markdown_compact(rows: list[Row]) -> list[str]:
    """The compact table of the completed cells (the picks of What to use in bold); nothing when none completed."""
    table = summary.compact_table(rows)
    if not table.rows:
        return []
    lines = [f"## {AT_A_GLANCE}", "", "| " + " | ".join(md_text(h) for _, h in table.columns) + " |",
             "|" + "|".join("---" for _ in table.columns) + "|"]  # fmt: skip
    for cells in table.rows:
        texts = [f"**{md_text(c.text)}**" if c.pick else md_text(c.text) for c in cells]
        lines.append("| " + " | ".join(texts) + " |")
    return [*lines, ""]


def _markdown_problems(rows: list[Row]) -> list[str]:
    """One bullet per cell that did not complete, with its status and reason."""
    problems = summary.problems(rows)
    if not problems:
        return []
    return [f"## {NOT_COMPLETED} ({len(problems)})", "", *(f"- {md_text(p.line)}" for p in problems), ""]


def _markdown_setup(report: Report) -> list[str]:
    """What was trained, on which machines, by which command, from which folders."""
    lines = ["## Setup", ""]
    if report.description:
        lines += [report.description, ""]
    settings = _settings(report.records)
    if settings:
        lines += [f"**Trained:** {md_text(settings)}", ""]
    machines = _machines(report.records)
    lines += [f"- **Machine:** {md_text(m)}" for m in machines]
    if machines:
        lines.append("")
    if report.command:
        lines += [f"**Command:** {md_code(report.command)}", ""]
    return [*lines, f"**Sources:** {md_text(', '.join(report.sources))}", ""]


def _markdown_full_table(rows: list[Row], notes: Footnotes) -> list[str]:
    """Every column of every completed cell, with the footnotes its cells point to."""
    ok = [r for r in rows if r.ok]
    lines = [f"## {ALL_MEASUREMENTS}", ""]
    if not ok:
        return [*lines, "No cell ran to completion, so nothing was measured.", ""]
    cols = columns_for(rows)
    lines.append("| " + " | ".join(md_text(h) for _, h in cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for r in ok:
        lines.append("| " + " | ".join(md_text(r.text[k]) for k, _ in cols) + " |")
    lines.append("")
    lines += [f"{footnote_mark(i)} {t}  " for i, t in enumerate(notes.texts)]
    return [*lines, ""]


CSV_FIELDS = ["machine", "id", "method", "label", "precision", "init", "devices", "world_size", "batch_device", "batch_global",
              "peak_memory_bytes", "peak_memory_bytes_per_device", "peak_memory_kind", "gpu_util_mean_pct",
              "gpu_util_peak_pct", "time_per_epoch_s", "train_time_s", "throughput_samples_per_s", "speedup",
              "step_time_median_s", "predicted_step_s", "predicted_step_error_pct", "predicted_dominant", "predicted_step_basis",
              "alloc_peak_bytes", "alloc_import_bytes", "predicted_peak_bytes", "prediction_error_pct", "mfu", "not_compute_share", "comm_wire_bytes_per_step", "comm_vs_ddp",
              "comm_formula_error_pct", "val_accuracy", "final_loss", "status", "reason",
              "host_load_mean", "host_cpu_count", "repeats", "train_time_min_s", "train_time_max_s",
              "throughput_min", "throughput_max", "val_accuracy_min", "val_accuracy_max", "throughput_tokens_per_s",
              "val_perplexity", "mesh"]  # fmt: skip


def write_csv(rows: list[Row], path: Path) -> None:
    """Raw numbers (bytes, seconds, fractions); ``n/a`` where not measurable, empty where the cell did not run."""
    with atomic_output(Path(path), ".csv") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_FIELDS)
        for r in rows:
            missing = "n/a" if r.raw["status"] == "ok" else ""

            def v(x: Any, missing: str = missing) -> Any:
                return missing if x is None else x

            raw = r.raw
            w.writerow([
                raw["machine"], r.rec.id, r.rec.method, raw["method"], raw["precision"], raw["init"] or "",
                raw["devices"],
                r.rec.world_size, raw["batch_device"], raw["batch_global"], v(raw.get("peak_memory")),
                ";".join(str(p) for p in raw.get("peak_memory_per_device") or []), raw.get("peak_memory_kind", ""),
                v(raw.get("gpu_util")), v(raw.get("gpu_util_peak")), v(raw.get("epoch_time")), v(raw.get("train_time")),
                v(raw.get("throughput")), v(raw.get("speedup")), v(raw.get("step_time")), v(raw.get("predicted_step")),
                v(raw.get("step_error_pct")), raw.get("predicted_dominant") or "", raw.get("predicted_basis") or "",
                v(raw.get("alloc_peak")),
                v(raw.get("alloc_imports")), v(raw.get("predicted")),
                v(raw.get("prediction_error_pct")), v(raw.get("mfu")), v(raw.get("not_compute")), v(raw.get("comm")), v(raw.get("comm_vs_ddp")),
                v(raw.get("comm_formula_error_pct")), v(raw.get("val_accuracy")),
                v(raw.get("final_loss")), raw["status"], raw["reason"],
                *r.rec.load, raw.get("repeats", 1),
                raw.get("train_time_min", ""), raw.get("train_time_max", ""), raw.get("throughput_min", ""),
                raw.get("throughput_max", ""), raw.get("val_accuracy_min", ""), raw.get("val_accuracy_max", ""),
                v(raw.get("throughput_tokens"), ""), v(raw.get("val_perplexity"), ""),  # language-model rows only
                r.rec.layout.replace(" ", ""),  # the method's named mesh ("dpxtp"), blank where it reports none
            ])  # fmt: skip


TEMPLATE = "report.html.j2"
"""The HTML page's jinja2 template, a package data file beside this module (templates/)."""


def render_html(report: Report, rows: list[Row], notes: Footnotes, charts: dict[str, Path]) -> str:
    """One self-contained page from templates/report.html.j2 (autoescaped): the same sections as report.md, the
    full table folded in a <details> element, every table in its own horizontally scrolling box, the charts
    embedded as base64 PNG."""
    template = _html_environment().get_template(TEMPLATE)
    return template.render(**_html_context(report, rows, notes, charts))


@functools.cache
def _html_environment() -> jinja2.Environment:
    """Autoescaping everywhere (a reason or a path may hold <, &, quotes); an unknown name in the template is an
    error, not an empty string."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("stratbench.compare", "templates"), autoescape=True,
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )  # fmt: skip


def _html_context(
    report: Report, rows: list[Row], notes: Footnotes, charts: dict[str, Path]
) -> dict[str, Any]:
    """Everything the template shows, as plain strings and lists (no markup: the template escapes all of it)."""
    return {
        "title": report.title,
        "headings": {
            "what": WHAT_TO_USE,
            "glance": AT_A_GLANCE,
            "problems": NOT_COMPLETED,
            "all": ALL_MEASUREMENTS,
        },
        "advice": summary.advice(rows),
        "compact": summary.compact_table(rows),
        "problems": summary.problems(rows),
        "description": report.description,
        "settings": _settings(report.records),
        "machines": _machines(report.records),
        "command": report.command,
        "full": _html_full_table(rows),
        "footnotes": [f"{footnote_mark(i)} {t}" for i, t in enumerate(notes.texts)],
        "how_to_read": HOW_TO_READ.replace("`", ""),  # markdown's code marks; plain words on the page
        "charts": [
            {"name": name, "data": base64.b64encode(p.read_bytes()).decode()} for name, p in charts.items()
        ],
        "sources": ", ".join(report.sources),
    }


LEFT = {"machine", "method", "precision", "init"}


def _html_full_table(rows: list[Row]) -> dict[str, Any]:
    """The full table's header and completed rows: per cell its class, its sort value, its text and (compare
    --repeats) the range shown below it."""
    cols = columns_for(rows)
    heads = [{"text": h, "cls": "sortable l" if k in LEFT or k == "status" else "sortable"} for k, h in cols]
    body = []
    for n, r in enumerate(r for r in rows if r.ok):
        cells = []
        for k, _ in cols:
            spread = f"{k}__spread" in r.text  # compare --repeats: the median, and the range below it
            cells.append({"cls": "reason" if k == "status" else "l" if k in LEFT else "",
                          "sort": _sort_key(r, k), "main": r.text[k + "__main"] if spread else r.text[k],
                          "spread": r.text[k + "__spread"] if spread else ""})  # fmt: skip
        body.append({"cls": str(r.raw["status"]).replace(" ", "-"), "index": n, "cells": cells})
    return {"heads": heads, "rows": body}


SORT_RAW = {"peak_memory": "peak_memory", "gpu_util": "gpu_util", "epoch_time": "epoch_time", "train_time": "train_time",
            "throughput": "throughput", "speedup": "speedup", "alloc_peak": "alloc_peak", "predicted": "predicted", "mfu": "mfu", "comm": "comm", "not_compute": "not_compute",
            "val_accuracy": "val_accuracy", "final_loss": "final_loss", "devices": "devices",
            "batch_device": "batch_device", "batch_global": "batch_global"}  # fmt: skip


def _sort_key(row: Row, key: str) -> str | None:
    """The value a column sorts by: the raw number for measures, the text for names; None = no value."""
    if key in SORT_RAW:
        v = number(row.raw.get(SORT_RAW[key]))
        return None if v is None else repr(v)
    text = row.text.get(key)
    return None if text in (None, DASH, "") else str(text)


# ------------------------------------------------------------------------------------------------
# terminal


def print_table(records: list[RunRecord] | list[dict[str, Any]], console=None) -> None:
    """A compact version of the table for the terminal at the end of a sweep."""
    from rich.table import Table

    console = console or table_console()
    notes = Footnotes()
    rows = build_rows(records, notes, predict=False)  # the terminal table has no predicted-step column
    keys = [("method", "method"), ("precision", "precision"), ("devices", "dev"), ("batch_device", "batch/dev"),
            ("peak_memory", "peak mem/dev"), ("train_time", "train time"), ("throughput", "samples/s"),
            ("speedup", "speed-up"), ("val_accuracy", "val acc"), ("status", "status")]  # fmt: skip
    if len({r.raw["machine"] for r in rows}) > 1:
        keys.insert(0, ("machine", "machine"))
    table = Table(title="stratbench compare")
    for k, h in keys:  # names whole (no_wrap), long reasons folded
        table.add_column(h, no_wrap=k in ("method", "precision"), overflow="fold")
    shown = ""
    for r in rows:
        cells = [r.text[k] if k != "status" else str(r.raw["status"]) for k, _ in keys]
        shown += "".join(cells)
        table.add_row(*cells)
    console.print(table)
    for i, t in enumerate(notes.texts):  # only the footnotes this narrower table uses
        mark = SUPERSCRIPTS[i] if i < len(SUPERSCRIPTS) else f"[{i + 1}]"
        if mark in shown:
            console.print(f"{mark} {t}", highlight=False, soft_wrap=True)
    for r in _problems(rows):
        console.print(f"- {r.raw['method']} {r.raw['precision']} x{r.raw['devices']}: {r.raw['status']}: {r.raw['reason']}",
                      highlight=False, soft_wrap=True, markup=False)  # fmt: skip


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
    report = Report(
        title, records, [str(s.path) for s in sweeps], description, command, hardware, calibration
    )
    return write_report(report, out), [rec.fields for rec in records]
