"""What one run recorded, as typed records parsed once where they are read: ``RunRecord`` (a line of a sweep's
results.jsonl: a compare cell, its outcome, its result.json) and ``CalibrationRecord`` (a line of calibration.jsonl:
a run made before the cells to calibrate their predicted step).

A record is JSON written by one version of stratbench and read by later ones: a missing field is its default
(records from before the field existed have the same shape as version 1; ``schema`` says which shape a record
has), and a value not recorded (null, NaN) reads as not recorded. A field of the wrong type (a string or a bool
for a number, a list holding a string, a negative byte count) is no record stratbench wrote: it is refused, in
one line naming the field (``record_problem``; the readers of a file add its path and line), rather than shown
as a number it is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stratbench.core.errors import ConfigError
from stratbench.measuring.load import is_busy

SCHEMA = 1
"""The shape of the records written today (``schema`` in each line; absent: 1)."""

CALIBRATION_KINDS = ("probe", "single", "method")
"""What a calibration run measures: the machine's probe, ``single`` at a batch size, or a method on one process."""


def number(x: Any) -> float | None:
    """``x`` as a finite float, or None for a missing or unreadable value (a string, a bool, NaN), so that one
    bad field of a record shows as n/a instead of stopping the report."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def _num(x: Any) -> Any:
    """``x`` as recorded (an int stays an int: the csv writes it as it was) where it is a finite number, else None."""
    return x if number(x) is not None else None


def _text(x: Any) -> str | None:
    return None if x is None else str(x)


def _numbers(x: Any) -> list[Any]:
    """The numbers of a recorded list, its entries not recorded (null, NaN: a rank that measured nothing) left out."""
    return [v for v in x if number(v) is not None] if isinstance(x, list) else []


def _dict(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, dict) else {}


class RecordError(ConfigError, ValueError):
    """A line that is no record of its kind, or a field of the wrong type (it says which)."""


# ------------------------------------------------------------------------------------------------
# a run


@dataclass(frozen=True)
class Machine:
    """Where a record ran: hostname and a one-line device description (``?`` where not recorded)."""

    hostname: str = "?"
    device: str = "?"

    @classmethod
    def from_dict(cls, d: Any) -> Machine:
        d = _dict(d)
        return cls(str(d.get("hostname", "?")), str(d.get("device", "?")))

    @property
    def name(self) -> str:
        """``hostname (device)``: records are only compared within one machine."""
        return f"{self.hostname} ({self.device})"


@dataclass(frozen=True)
class Metrics:
    """The measures of a run's result.json the report computes with; each None (or empty) where not recorded.
    Every other measure stays in ``RunRecord.fields['metrics']``."""

    train_time_s: float | None = None
    throughput_samples_per_s: float | None = None
    step_time_median_s: float | None = None
    step_time_mean_s: float | None = None
    """What the projection's calibration takes where a run recorded no readable median."""
    val_accuracy: float | None = None
    final_loss: float | None = None
    mfu: float | None = None
    flops_per_sample: float | None = None
    peak_memory_bytes: list[float] = field(default_factory=list)
    """Per rank (a process driving several GPUs: per device)."""
    peak_memory_kind: str = ""
    """``cpu_peak_rss`` or ``cuda_max_allocated``."""
    gpu_util_mean_pct: list[float] = field(default_factory=list)
    gpu_util_peak_pct: list[float] = field(default_factory=list)
    epoch_time_s: list[float] = field(default_factory=list)
    cpu_alloc_peak_bytes: list[float] = field(default_factory=list)
    cpu_alloc_import_bytes: list[float] = field(default_factory=list)
    breakdown: dict[str, Any] | None = None
    """Phase times per step (``per_rank_s``, ``not_compute_share``): metrics.breakdown."""
    comm: dict[str, Any] | None = None
    """Bytes on the wire per step and the formula's check (``wire_bytes_per_step``, ``check``)."""
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    loss_curve: list[float] = field(default_factory=list)
    """Per optimizer step; a value not recorded is NaN (a gap in the chart)."""
    host_load_mean: float | None = None
    """``train``'s own reading of the machine's load while it trained (``measuring.load``)."""
    host_cpu_count: int | None = None
    host_others_share: float | None = None
    """Other processes' share of the machine's CPU time while it trained (``measuring.load.others_share``)."""

    @classmethod
    def from_dict(cls, m: Any) -> Metrics:
        """A result.json's ``metrics`` (checked by ``record_problem``), each measure not recorded read as None."""
        m = _clean_metrics(_dict(m))
        kind = m.get("peak_memory_kind", "")
        return cls(
            **{k: _num(m.get(k)) for k in NUMBER_METRICS},
            **{k: list(m.get(k) or []) for k in NUMBER_LIST_METRICS},
            peak_memory_kind="" if kind is None else str(kind),
            breakdown=m.get("breakdown"),
            comm=m.get("comm"),
            evaluations=list(m.get("evaluations") or []),
            loss_curve=list(m.get("loss_curve") or []),
        )


NUMBER_FIELDS = ("world_size", "nodes", "data_parallel_size", "batch_size", "global_batch_size", "per_device_batch_size",
                 "host_load_mean", "host_cpu_count")  # fmt: skip
NUMBER_METRICS = ("train_time_s", "throughput_samples_per_s", "step_time_median_s", "step_time_mean_s",
                  "val_accuracy", "final_loss", "mfu", "flops_per_sample", "host_load_mean", "host_cpu_count",
                  "host_others_share")  # fmt: skip
NUMBER_LIST_METRICS = ("peak_memory_bytes", "gpu_util_mean_pct", "gpu_util_peak_pct", "epoch_time_s",
                       "cpu_alloc_peak_bytes", "cpu_alloc_import_bytes")  # fmt: skip
DICT_FIELDS = ("machine", "environment", "config", "metrics", "repeats", "sharding", "mesh")


def _mesh(x: Any) -> dict[str, int]:
    """A record's ``mesh``: its dimensions whose size is a positive integer, in their order."""
    items = x.items() if isinstance(x, dict) else ()
    return {str(k): v for k, v in items if isinstance(v, int) and not isinstance(v, bool) and v > 0}


@dataclass(frozen=True)
class RunRecord:
    """One line of results.jsonl: a cell (method, precision, world size, batch), its outcome and what it measured.
    The numbers are as recorded (an int stays an int) or None where absent or unreadable."""

    id: str | None = None
    method: str | None = None
    label: str | None = None
    """The cell's name: the method's (also where the record has none), or a variant such as ``deepspeed-z3``."""
    precision: str | None = None
    status: str | None = None
    """ok, failed, oom, timeout, nan, skipped, or ``not run`` (a cell the sweep never reached)."""
    reason: str = ""
    world_size: int | None = None
    nodes: int | None = None
    """Machines the processes spread over (compare --nodes; 1 where not recorded)."""
    data_parallel_size: int | None = None
    batch_size: int | None = None
    global_batch_size: int | None = None
    per_device_batch_size: int | None = None
    host_load_mean: float | None = None
    """The mean 1-minute load average while the cell ran (its times are inflated above 1.5x the cores)."""
    host_cpu_count: int | None = None
    machine: Machine = field(default_factory=Machine)
    environment: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    repeats: dict[str, Any] = field(default_factory=dict)
    """compare --repeats: ``n`` runs, and ``metrics``: per measure its median, min, max over the runs."""
    sharding: dict[str, list[float | None]] = field(default_factory=dict)
    """Model-state bytes per rank by part (param_bytes, grad_bytes, optimizer_state_bytes, master_param_bytes)."""
    mesh: dict[str, int] = field(default_factory=dict)
    """The method's named device-mesh dimensions (dp, pp, tp) and their sizes, where it reports one."""
    transforms: list[str] = field(default_factory=list)
    """The model transforms the run applied, in order (``models.transforms``; empty in a record from before
    they were recorded, or where none applied)."""
    model: str | None = None
    log: str | None = None
    schema: int = SCHEMA
    fields: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The whole line, each value not recorded (NaN, a null entry of a per-rank list) as None or left out: what
    readers of the JSON take."""

    @classmethod
    def from_dict(cls, d: Any) -> RunRecord:
        """Parse one line (a JSON object); a RecordError naming the first field of the wrong type."""
        why = record_problem(d)
        if why:
            raise RecordError(why)
        rec = _clean(d)
        m = rec["metrics"]
        return cls(
            id=_text(rec.get("id")), method=_text(rec.get("method")), label=_text(rec["label"] if "label" in rec else rec.get("method")),
            precision=_text(rec.get("precision")), status=_text(rec.get("status")), reason=str(rec.get("reason") or ""),
            **{k: rec.get(k) for k in NUMBER_FIELDS},
            machine=Machine.from_dict(rec.get("machine")), environment=rec.get("environment") or {},
            config=rec.get("config") or {}, metrics=Metrics.from_dict(m), repeats=rec.get("repeats") or {},
            sharding=rec.get("sharding") or {}, mesh=_mesh(rec.get("mesh")), transforms=list(rec.get("transforms") or []),
            model=_text(rec.get("model")),
            log=str(rec["log"]) if rec.get("log") else None, schema=_schema(rec.get("schema")), fields=rec,
        )  # fmt: skip

    @property
    def name(self) -> str | None:
        """What the report calls the cell: its label, else its method."""
        return self.label or self.method

    @property
    def world(self) -> int:
        """The number of processes (1 where not recorded)."""
        return int(self.world_size or 1)

    @property
    def layout(self) -> str:
        """The mesh as the report names it ("dp2 x tp2"), "" where the method reports none."""
        return " x ".join(f"{k}{v}" for k, v in self.mesh.items())

    @property
    def node_count(self) -> int:
        return int(self.nodes or 1)

    @property
    def devices(self) -> int:
        """How many devices share the global batch (a DataParallel process drives several)."""
        return max(self.world, int(self.data_parallel_size or 0))

    @property
    def global_batch(self) -> Any:
        return self.global_batch_size or self.batch_size

    @property
    def per_device_batch(self) -> Any:
        gbatch = self.global_batch
        return self.per_device_batch_size or (gbatch // self.devices if gbatch else None)

    @property
    def on_gpu(self) -> bool:
        """Whether the run trained on CUDA devices (its environment says so)."""
        return self.environment.get("device_type") == "cuda"

    @property
    def gpu_name(self) -> str:
        """The name of the first GPU the run's environment lists ('' where none is, or the list is unreadable)."""
        gpus = self.environment.get("gpus")
        return str(gpus[0]) if isinstance(gpus, list) and gpus and gpus[0] is not None else ""

    @property
    def model_name(self) -> str | None:
        """The model trained: the config's, else the record's own field."""
        return _text(self.config.get("model") or self.model)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def load(self) -> tuple[float | None, int | None]:
        """(mean 1-minute load average, cores) while it ran: compare's reading of the cell (``host_load_mean``),
        else the run's own (``metrics.host_load_mean``); (None, None) where neither was recorded."""
        if self.host_load_mean is not None:
            return self.host_load_mean, self.host_cpu_count
        if self.metrics.host_load_mean is not None:
            return self.metrics.host_load_mean, self.metrics.host_cpu_count
        return None, None

    @property
    def busy(self) -> bool:
        """Whether it ran on a busy machine (``measuring.load.is_busy``): its times are not the method's own."""
        return is_busy(*self.load, self.metrics.host_others_share)


def _schema(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 1 else 1


def _clean(rec: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``rec`` (checked by ``record_problem``) with each value not recorded (null, NaN) as None."""
    rec = dict(rec)
    for k in DICT_FIELDS:
        if rec.get(k) is None and k in rec:
            rec[k] = {}
    for k in NUMBER_FIELDS:
        if k in rec:
            rec[k] = _num(rec[k])
    rec["metrics"] = _clean_metrics(_dict(rec.get("metrics")))
    return rec


def _clean_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """``m`` (a copy) with each measure not recorded as None, and a list's entries not recorded left out (a loss
    curve's kept as NaN: a gap in the chart)."""
    for k in NUMBER_METRICS:
        if k in m:
            m[k] = _num(m[k])
    for k in NUMBER_LIST_METRICS:
        if k in m:
            m[k] = _numbers(m[k])
    if m.get("loss_curve") is not None:
        m["loss_curve"] = [x if number(x) is not None else math.nan for x in m["loss_curve"]]
    return m


# ------------------------------------------------------------------------------------------------
# what a field may hold: a record stratbench wrote has each field of its kind, or absent, or null


KINDS: dict[str, str] = {
    "text": "a string",
    "count": "a whole number >= 0",
    "amount": "a number >= 0",
    "number": "a number",
    "amounts": "a list of numbers >= 0",
    "numbers": "a list of numbers",
    "mapping": "an object",
    "mappings": "a list of objects",
    "texts": "a list of strings",
}
"""Each kind of field and how a refusal names it."""

TOP_KINDS: dict[str, str] = {
    **dict.fromkeys(("id", "method", "label", "precision", "status", "reason", "model", "log"), "text"),
    **dict.fromkeys(NUMBER_FIELDS, "count"), "host_load_mean": "amount", "schema": "count",
    **dict.fromkeys(DICT_FIELDS, "mapping"), "transforms": "texts",
}  # fmt: skip
METRIC_KINDS: dict[str, str] = {
    **dict.fromkeys(NUMBER_METRICS, "amount"), "final_loss": "number", "host_cpu_count": "count",
    "throughput_tokens_per_s": "amount", "val_perplexity": "amount",
    **dict.fromkeys(NUMBER_LIST_METRICS, "amounts"), "loss_curve": "numbers", "peak_memory_kind": "text",
    # differences from a baseline read before the model was built: below it where the run freed memory
    "cpu_alloc_peak_bytes": "numbers", "cpu_alloc_import_bytes": "numbers",
    "breakdown": "mapping", "comm": "mapping", "evaluations": "mappings",
}  # fmt: skip


def _fits(value: Any, kind: str) -> bool:
    """Whether ``value`` (not None) is of ``kind``; NaN is a number not recorded, as json writes a diverged loss."""
    if kind == "text":
        return isinstance(value, str)
    if kind == "texts":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind in ("mapping", "mappings"):
        return isinstance(value, dict) if kind == "mapping" else isinstance(value, list) and all(
            isinstance(v, dict) for v in value)  # fmt: skip
    if kind in ("amounts", "numbers"):
        single = "amount" if kind == "amounts" else "number"
        return isinstance(value, list) and all(v is None or _fits(v, single) for v in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if kind == "count":
        return isinstance(value, int) and value >= 0
    return math.isnan(value) or kind == "number" or value >= 0


def _show(value: Any) -> str:
    """A value as a refusal quotes it (cut at 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_problem(d: dict[str, Any], kinds: dict[str, str], where: str) -> str | None:
    """``FIELD is VALUE, not KIND`` for the first field of ``d`` whose value is not of its kind; None: none."""
    for name, kind in kinds.items():
        value = d.get(name)
        if value is not None and not _fits(value, kind):
            return f"{where}{name} is {_show(value)}, not {KINDS[kind]}"
    return None


def _nested_problem(d: dict[str, Any]) -> str | None:
    """The fields inside a record's objects that the report reads: machine, sharding, mesh, repeats."""
    why = _fields_problem(_dict(d.get("machine")), {"hostname": "text", "device": "text"}, "machine.")
    why = why or _fields_problem(_dict(d.get("sharding")), dict.fromkeys(_dict(d.get("sharding")), "amounts"), "sharding.")
    why = why or _fields_problem(_dict(d.get("mesh")), dict.fromkeys(_dict(d.get("mesh")), "count"), "mesh.")
    repeats = _dict(d.get("repeats"))
    why = why or _fields_problem(repeats, {"n": "count", "metrics": "mapping", "elapsed_s": "amounts",
                                           "host_load_mean": "amounts"}, "repeats.")  # fmt: skip
    for key, spread in _dict(repeats.get("metrics")).items():
        if why:
            break
        where = f"repeats.metrics.{key}"
        why = (f"{where} is {_show(spread)}, not {KINDS['mapping']}" if not isinstance(spread, dict) else
               _fields_problem(spread, {"median": "number", "min": "number", "max": "number", "values": "numbers"},
                               where + "."))  # fmt: skip
    return why


def record_problem(d: Any) -> str | None:
    """What makes ``d`` (a line of results.jsonl, a result.json) no record stratbench wrote: the first field of
    the wrong type, named (``metrics.peak_memory_bytes is ['1', 2], not a list of numbers >= 0``); None: every
    field it has is of its kind. The readers of a file add its path and line."""
    if not isinstance(d, dict):
        return f"not a JSON object but {_show(d)}"
    return (
        _fields_problem(d, TOP_KINDS, "")
        or _fields_problem(_dict(d.get("metrics")), METRIC_KINDS, "metrics.")
        or _nested_problem(d)
    )


def as_run_record(rec: RunRecord | dict[str, Any]) -> RunRecord:
    """``rec`` itself, or a record a caller holds as JSON parsed."""
    return rec if isinstance(rec, RunRecord) else RunRecord.from_dict(rec)


# ------------------------------------------------------------------------------------------------
# a calibration run


@dataclass(frozen=True)
class CalibrationRecord:
    """One line of calibration.jsonl: a run made before the cells (``kind``: the machine's probe, ``single`` at a
    batch size, or a method on one process) for the cells it names, with its outcome and result (``run``)."""

    run: RunRecord
    kind: str
    for_cells: list[str]
    """The ids of the cells whose predicted step rests on this run."""
    nproc: int = 1
    """The processes of the probe (a cell's world size)."""
    threads: int | None = None
    """The threads of the run's process (a cell's process's share of the cores)."""
    profile: str = ""
    """A probe's profile, relative to the sweep folder."""
    what: str = ""
    """How the sweep names the run (``single fp32 batch 32``, ...)."""
    profile_path: str | None = None
    """``profile`` made absolute by the reader that knows the sweep folder (``compare.calibration``), so that a
    report merging several folders finds each one's file; None where not resolved."""

    @classmethod
    def from_dict(cls, d: Any) -> CalibrationRecord:
        """Parse one line; a RecordError saying why where it is no calibration record (its train results are
        checked where they are used: a bad one is a row's n/a)."""
        why = calibration_problem(d)
        if why:
            raise RecordError(why)
        cal = d["calibration"]
        threads = cal.get("threads")
        return cls(
            RunRecord.from_dict(d), cal["kind"], list(cal["for"]), cal.get("nproc", 1),
            threads if isinstance(threads, int) else None, cal.get("profile", ""), str(cal.get("what") or ""),
        )  # fmt: skip


def calibration_problem(d: Any) -> str | None:
    """What makes ``d`` (a line of calibration.jsonl) no calibration record the report can read; None: it is one."""
    cal = d.get("calibration") if isinstance(d, dict) else None
    if not isinstance(d, dict) or "id" not in d or not isinstance(cal, dict):
        return "not a calibration record (no 'id' and 'calibration')"
    if cal.get("kind") not in CALIBRATION_KINDS:
        return f"calibration kind {cal.get('kind')!r} is not one of {', '.join(CALIBRATION_KINDS)}"
    if not isinstance(cal.get("for"), list) or not all(isinstance(c, str) for c in cal["for"]):
        return "its calibration 'for' is not a list of cell ids"
    if not isinstance(cal.get("nproc", 1), int) or not isinstance(cal.get("profile", ""), str):
        return "its calibration 'nproc' is not a whole number or its 'profile' not a path"
    return record_problem(d)
