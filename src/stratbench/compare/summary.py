"""The top of the report: which method to use (the fastest, the leanest in memory, what each costs against the
`single` fp32 baseline), a compact table of the completed cells, and one line per cell that did not complete.
No speed ranking rests on a cell timed on a busy machine (``Row.busy``): where a machine's cells hold one, no
fastest is named and the box says why; a sweep that stopped before its last cell says it is partial.

Everything is derived from the rows ``columns.build_rows`` made; a value a record lacks (or holds in a form that
is not a number) is ``n/a`` here, never an error: the full table below carries the why in its footnotes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stratbench.compare.rows import NOT_RUN, Row, is_baseline
from stratbench.core.tables import fmt_bytes
from stratbench.measuring.records import number

NA = "n/a"
CLOSE_PCT = 10.0
"""A runner-up this close to the fastest (in %) is named beside it: on a shared CPU that is often noise."""
BUSY = " (busy machine)"
"""After a time or a speed taken on a busy machine, where the report quotes one."""
BUSY_SHORT = " (busy)"
"""The same in a compact-table cell."""
NAMED = 5
"""Cells named in a sentence that lists cells; the rest are counted."""


@dataclass
class AdviceLine:
    """One "What to use" line: its label (Fastest, ...), the cell it names ('' when none) and the rest."""

    label: str
    subject: str
    detail: str


@dataclass
class AdviceGroup:
    """The "What to use" lines of one machine (``machine`` None when the report holds one machine only)."""

    machine: str | None
    lines: list[AdviceLine] = field(default_factory=list)


@dataclass
class Problem:
    """A cell that did not complete: its name (``method precision xN``, ``... on MACHINE`` in a report of several
    machines), status, reason and log (None: no log)."""

    name: str
    status: str
    reason: str
    log: str | None

    @property
    def line(self) -> str:
        """``method precision xN: status — reason (log: PATH)``."""
        return f"{self.name}: {self.status} — {self.reason}" + (f" (log: {self.log})" if self.log else "")


@dataclass
class Cell:
    """One compact-table cell: its text, the raw value it sorts by (None: no value), and whether it is the pick
    (the fastest row's throughput, the leanest row's memory), which the report shows in bold."""

    text: str
    sort: str | None = None
    pick: bool = False


@dataclass
class CompactTable:
    """At most 8 columns over the completed rows: what a reader compares first."""

    columns: list[tuple[str, str]]
    rows: list[list[Cell]]


# ------------------------------------------------------------------------------------------------
# picks


def memory_measure(rows: list[Row]) -> tuple[str, str]:
    """The memory figure to compare rows by: the allocator peak (what the tensors need; on a GPU the same figure
    as the peak memory column) where the rows have it, else the peak memory per device (process RSS on a CPU)."""
    with_alloc = sum(number(r.raw.get("alloc_peak")) is not None for r in rows)
    with_peak = sum(number(r.raw.get("peak_memory")) is not None for r in rows)
    if with_alloc and with_alloc >= with_peak:
        return "alloc_peak", "allocator peak"
    return "peak_memory", "peak memory"


def fastest(rows: list[Row]) -> Row | None:
    """The completed row with the highest throughput (the lowest median step time where none has a throughput;
    every row trains the same global batch, so the two rank alike)."""
    timed = [r for r in rows if number(r.raw.get("throughput"))]
    if timed:
        return max(timed, key=lambda r: number(r.raw["throughput"]) or 0.0)
    stepped = [r for r in rows if number(r.raw.get("step_time"))]
    return min(stepped, key=lambda r: number(r.raw["step_time"]) or 0.0) if stepped else None


def leanest(rows: list[Row], key: str) -> Row | None:
    """The completed row with the lowest ``key`` memory figure (the first in the table among equals)."""
    measured = [r for r in rows if number(r.raw.get(key))]
    return min(measured, key=lambda r: number(r.raw[key]) or 0.0) if measured else None


def _baseline(rows: list[Row]) -> Row | None:
    """The `single` fp32 x1 row among ``rows`` (None: the sweep has none that completed)."""
    return next((r for r in rows if is_baseline(r.rec)), None)


def _ratio(value: Any, base: Any) -> float | None:
    """``value / base``, None where either is missing or the base is 0 (shown as n/a)."""
    v, b = number(value), number(base)
    return v / b if v is not None and b else None


# ------------------------------------------------------------------------------------------------
# "What to use"


def advice(rows: list[Row]) -> list[AdviceGroup]:
    """The "What to use" block: one group per machine (cells are only compared within a machine), opened by a
    "Partial report" line where the sweep stopped before some of its cells."""
    groups = machine_groups(rows)
    if not groups:
        out = [AdviceGroup(None, [AdviceLine("Nothing to compare", "", "no cell ran to completion; the cells "
                                             "that did not complete are listed below, each with its reason")])]  # fmt: skip
    else:
        out = [AdviceGroup(machine, _advice_lines(ok)) for machine, ok in groups]
    partial = _partial_line(rows)
    if partial is not None and out[0].machine is None:
        out[0].lines.insert(0, partial)
    elif partial is not None:
        out.insert(0, AdviceGroup(None, [partial]))
    return out


def _names(rows: list[Row]) -> str:
    """``a, b, c and 4 more``: the cells of ``rows`` named, the first NAMED of them."""
    names = [r.name for r in rows[:NAMED]]
    return ", ".join(names) + (f" and {len(rows) - NAMED} more" if len(rows) > NAMED else "")


def _partial_line(rows: list[Row]) -> AdviceLine | None:
    """``Partial report``: the cells the sweep has still to run (never reached, or lost with their node), named;
    None when it ran every cell."""
    left = [r for r in rows if r.unfinished]
    if not left:
        return None
    never = sum(r.raw.get("status") == NOT_RUN for r in left)
    how = (f"the sweep stopped before {never} of its {len(rows)} cells" if never == len(left) else
           f"{len(left)} of the sweep's {len(rows)} cells are still to run ({never} never reached, "
           f"{len(left) - never} lost with their node)")  # fmt: skip
    return AdviceLine("Partial report", "", f"{how}: {_names(left)}, listed below under the cells that did not "
                      "complete. Rerun the same stratbench compare command to run them; the cells it finished "
                      "are kept")  # fmt: skip


def machine_groups(rows: list[Row]) -> list[tuple[str | None, list[Row]]]:
    """The completed rows by machine, in table order; the machine is None when there is only one."""
    ok = [r for r in rows if r.ok]
    machines = list(dict.fromkeys(str(r.raw.get("machine")) for r in ok))
    if len(machines) <= 1:
        return [(None, ok)] if ok else []
    return [(m, [r for r in ok if str(r.raw.get("machine")) == m]) for m in machines]


def _advice_lines(ok: list[Row]) -> list[AdviceLine]:
    """Fastest, leanest, the baseline they are measured against (or why there is none) and the accuracy spread."""
    base = _baseline(ok)
    key, what = memory_measure(ok)
    lines = [_fastest_line(ok, base, key, what), _leanest_line(ok, base, key, what)]
    if base is None:
        lines.append(AdviceLine("No baseline", "", "no completed single fp32 x1 row on this machine, so no "
                                                   "speed-up or memory ratio can be given"))  # fmt: skip
    else:
        acc = f", val accuracy {_accuracy(base)}" if _accuracy(base) != NA else ""
        busy = BUSY if base.busy else ""
        lines.append(
            AdviceLine(
                "Baseline", base.name, f"{_throughput(base)}{busy}, {what} {_memory(base, key)} per device{acc}"
            )
        )
    spread = _spread_text(ok)
    if spread:
        lines.append(AdviceLine("Accuracy", "", spread))
    return lines


def _fastest_line(ok: list[Row], base: Row | None, key: str, what: str) -> AdviceLine:
    """``X: N samples/s, 1.03x the baseline; step 12.0 ms; allocator peak M per device (0.85x)``, and the
    runner-up where it is within CLOSE_PCT."""
    busy = [r for r in ok if r.busy]
    if busy:
        return AdviceLine("Fastest", "", f"none named: {len(busy)} of {len(ok)} cells ran on a busy machine "
                          f"({_names(busy)}): their times are inflated by other work, so no ranking by speed "
                          "holds. Rerun the sweep into a new --output on an otherwise idle machine (each cell's "
                          "load is host_load_mean in report.csv)")  # fmt: skip
    top = fastest(ok)
    if top is None:
        return AdviceLine("Fastest", "", f"{NA}: no completed row recorded a throughput or a step time")
    compared = base is not None and top is not base
    text = ("the baseline itself; " if top is base else "") + _throughput(top)
    if compared:
        text += f", {_times(_ratio(top.raw.get('throughput'), base.raw.get('throughput')))} the baseline"
    if number(top.raw.get("step_time")):
        text += f"; step {_step(top)}"
    text += f"; {what} {_memory(top, key)} per device"
    if compared:
        text += f" ({_times(_ratio(top.raw.get(key), base.raw.get(key)))})"
    return AdviceLine("Fastest", top.name, text + _runner_up(ok, top))


def _runner_up(ok: list[Row], top: Row) -> str:
    """``. Runner-up: Y, 1% slower; their repeat ranges overlap, so no clear winner`` when Y is within CLOSE_PCT."""
    others = [r for r in ok if r is not top and number(r.raw.get("throughput"))]
    best = number(top.raw.get("throughput"))
    if not others or not best:
        return ""
    second = max(others, key=lambda r: number(r.raw["throughput"]) or 0.0)
    gap = (1 - (number(second.raw["throughput"]) or 0.0) / best) * 100
    if gap > CLOSE_PCT:
        return ""
    lo_top, hi_second = number(top.raw.get("throughput_min")), number(second.raw.get("throughput_max"))
    overlap = lo_top is not None and hi_second is not None and hi_second >= lo_top
    return (f". Runner-up: {second.name}, {gap:.0f}% slower"
            + ("; their repeat ranges overlap, so there is no clear winner" if overlap else ""))  # fmt: skip


def _leanest_line(ok: list[Row], base: Row | None, key: str, what: str) -> AdviceLine:
    """``X: allocator peak M per device, 0.51x the baseline; N samples/s (0.39x)``; on a CPU it adds the range
    of process RSS, which the Python runtime dominates."""
    low = leanest(ok, key)
    if low is None:
        return AdviceLine("Leanest memory", "", f"{NA}: no completed row recorded a memory peak")
    compared = base is not None and low is not base
    text = ("the baseline itself; " if low is base else "") + f"{what} {_memory(low, key)} per device"
    if compared:
        text += f", {_times(_ratio(low.raw.get(key), base.raw.get(key)))} the baseline"
    text += f"; {_throughput(low)}"
    if compared:
        text += f" ({_times(_ratio(low.raw.get('throughput'), base.raw.get('throughput')))})"
    if low.busy or (compared and base.busy):
        text += BUSY
    rss = [number(r.raw.get("peak_memory")) for r in ok if r.raw.get("peak_memory_kind") == "cpu_peak_rss"]
    rss = [v for v in rss if v]
    if key == "alloc_peak" and rss:
        lo, hi = fmt_bytes(int(min(rss))), fmt_bytes(int(max(rss)))
        text += (f". Process RSS is {lo + ' in every row' if lo == hi else f'{lo}–{hi} across the rows'}, mostly "
                 "the Python runtime, so the allocator peak is what separates the methods")  # fmt: skip
    return AdviceLine("Leanest memory", low.name, text)


def _spread_text(ok: list[Row]) -> str:
    """Where the completed rows reached different accuracies or losses: the range and who is at each end."""
    accs = [(number(r.raw.get("val_accuracy")), r) for r in ok]
    accs = sorted(((a, r) for a, r in accs if a is not None), key=lambda x: x[0])
    losses = [v for v in (number(r.raw.get("final_loss")) for r in ok) if v is not None]
    acc_differs = len(accs) > 1 and f"{accs[0][0] * 100:.2f}" != f"{accs[-1][0] * 100:.2f}"
    loss_differs = len(losses) > 1 and f"{min(losses):.4f}" != f"{max(losses):.4f}"
    if not acc_differs and not loss_differs:
        return ""
    parts = []
    if acc_differs:
        parts.append(f"val accuracy {accs[0][0] * 100:.2f}–{accs[-1][0] * 100:.2f}% across {len(accs)} rows "
                     f"(lowest: {accs[0][1].name}, highest: {accs[-1][1].name})")  # fmt: skip
    if loss_differs:
        parts.append(f"final loss {min(losses):.4f}–{max(losses):.4f}")
    return "; ".join(parts) + (". Every row trains the same data, global batch and seed, so the spread comes from "
                               "the numerics (precision, reduction order), not from what the method trains")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# compact table and the cells that did not complete


def compact_table(rows: list[Row]) -> CompactTable:
    """method, precision, devices, throughput, speed-up, step time, memory per device, val accuracy: the
    completed rows only, without footnote marks (the full table has them). Several machines: the machine
    replaces the step time, so that the table keeps 8 columns."""
    ok = [r for r in rows if r.ok]
    key, what = memory_measure(ok)
    multi = len({str(r.raw.get("machine")) for r in ok}) > 1
    columns = [("method", "method"), ("precision", "precision"), ("devices", "devices"),
               ("throughput", "throughput (samples/s)"), ("speedup", "speed-up vs single fp32"),
               ("step_time", "step time (median)"), ("memory", f"{what} / device"), ("val_accuracy", "val accuracy")]  # fmt: skip
    if multi:
        columns = [("machine", "machine"), *[c for c in columns if c[0] != "step_time"]]
    picks = set()
    for _, group in machine_groups(rows):
        if not any(r.busy for r in group):  # as What to use: no fastest from a busy machine
            picks.add(("throughput", id(fastest(group))))
        picks.add(("memory", id(leanest(group, key))))
    table_rows = []
    for r in ok:
        cells = _compact_cells(r, key)
        table_rows.append([Cell(*cells[k], pick=(k, id(r)) in picks) for k, _ in columns])
    return CompactTable(columns, table_rows)


def _compact_cells(row: Row, memory_key: str) -> dict[str, tuple[str, str | None]]:
    """Each compact column's (text, sort value) for one completed row."""
    raw = row.raw

    def sort(v: Any) -> str | None:
        """The raw number a column sorts by (None: no value, sorted last)."""
        n = number(v)
        return None if n is None else repr(n)

    speedup = number(raw.get("speedup"))

    def timed(text: str) -> str:
        """A time or a speed, marked where a busy machine inflated it."""
        return text + BUSY_SHORT if row.busy and text != NA else text

    return {
        "machine": (str(raw.get("machine")), str(raw.get("machine"))),
        "method": (str(raw.get("method")), str(raw.get("method"))),
        "precision": (str(raw.get("precision")), str(raw.get("precision"))),
        "devices": (row.text.get("devices", str(raw.get("devices"))), sort(raw.get("devices"))),
        "throughput": (timed(_num(raw.get("throughput"), ".1f")), sort(raw.get("throughput"))),
        "speedup": (timed(NA if speedup is None else f"{speedup:.2f}x"), sort(speedup)),
        "step_time": (timed(_step(row)), sort(raw.get("step_time"))),
        "memory": (_memory(row, memory_key), sort(raw.get(memory_key))),
        "val_accuracy": (_accuracy(row), sort(raw.get("val_accuracy"))),
    }


def problems(rows: list[Row]) -> list[Problem]:
    """Each cell that did not complete, for one line each: status, reason, and its log where it ran and failed."""
    multi = len({str(r.raw.get("machine")) for r in rows}) > 1
    out = []
    for r in rows:
        if r.ok:
            continue
        status = str(r.raw.get("status"))
        reason = " ".join(str(r.raw.get("reason") or "no reason recorded").split())
        log = r.rec.log if status not in ("skipped", NOT_RUN) else None
        name = r.name + (f" on {r.raw.get('machine')}" if multi else "")
        out.append(Problem(name, status, reason, str(log) if log else None))
    return out


# ------------------------------------------------------------------------------------------------
# formatting (n/a for what a row lacks)


def _num(v: Any, spec: str) -> str:
    """``v`` formatted with ``spec``, or n/a."""
    n = number(v)
    return NA if n is None else format(n, spec)


def _throughput(row: Row) -> str:
    """The row's throughput as ``N samples/s`` (n/a when missing)."""
    n = number(row.raw.get("throughput"))
    return f"{NA} samples/s" if n is None else f"{n:.1f} samples/s"


def _step(row: Row) -> str:
    """The row's median step time in ms (n/a when missing)."""
    n = number(row.raw.get("step_time"))
    return NA if n is None else f"{n * 1e3:.1f} ms"


def _memory(row: Row, key: str) -> str:
    """The row's ``key`` memory figure in binary units (n/a when missing)."""
    n = number(row.raw.get(key))
    return NA if n is None else fmt_bytes(int(n))


def _accuracy(row: Row) -> str:
    """The row's validation accuracy in % (n/a when missing)."""
    n = number(row.raw.get("val_accuracy"))
    return NA if n is None else f"{n * 100:.2f}%"


def _times(ratio: float | None) -> str:
    """A ratio as ``0.85x`` (n/a when missing)."""
    return NA if ratio is None else f"{ratio:.2f}x"
