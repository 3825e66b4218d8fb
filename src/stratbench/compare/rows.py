"""The report's unit: one row per record (raw values and display strings), the numbered footnotes its cells
point to, and what the report asks of a record's method (is it the baseline every ratio is relative to, the
reference of communication). A leaf of ``compare``: ``columns`` builds the rows, ``summary`` and ``charts`` read
them; all import this module, so that none of them imports ``report``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stratbench.measuring.records import RunRecord
from stratbench.strategies.base import baseline_name, comm_reference_name

DASH = "–"
"""A value the cell never measured because it did not run to completion (never shown as 0)."""
NOT_RUN = "not run"
"""The status of a cell of the sweep's matrix that has no record: the sweep stopped before it."""
SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


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


@dataclass
class Row:
    """One record of the sweep: the record itself, its raw numbers, and each column's display text."""

    rec: RunRecord
    raw: dict[str, Any]
    text: dict[str, str]

    @property
    def ok(self) -> bool:
        """Whether the cell ran to completion (only such rows are compared)."""
        return self.raw.get("status") == "ok"

    @property
    def busy(self) -> bool:
        """A completed cell whose times a busy machine inflated (``RunRecord.busy``): no speed ranking rests on it."""
        return self.ok and self.rec.busy

    @property
    def unfinished(self) -> bool:
        """A cell the sweep has still to run: never reached (``not run``), or lost with its node (a rerun of the
        same command runs it)."""
        return self.raw.get("status") == NOT_RUN or bool(self.rec.fields.get("lost"))

    @property
    def name(self) -> str:
        """``method precision xN`` (``xN on M nodes``): how the report names a cell in a sentence or a list."""
        nodes = f" on {self.rec.node_count} nodes" if self.rec.node_count > 1 else ""
        return f"{self.raw.get('method')} {self.raw.get('precision')} x{self.raw.get('devices')}{nodes}"


def is_baseline_run(rec: RunRecord) -> bool:
    """A run of the baseline method (``Strategy.baseline``: `single`) under its own name (not a variant of it), on
    one process, in any precision."""
    return rec.method == baseline_name() and rec.label == rec.method and rec.world == 1


def is_baseline(rec: RunRecord) -> bool:
    """The row every speed-up and memory ratio is relative to: the baseline method, fp32, one device."""
    return is_baseline_run(rec) and rec.precision == "fp32"


def is_comm_reference(rec: RunRecord) -> bool:
    """A run of the method every row's communication is compared with (``Strategy.comm_reference``: `ddp`)."""
    return rec.method == comm_reference_name()
