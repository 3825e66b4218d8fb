"""The report's unit: one row per record (raw values and display strings), and the helpers that read a record's
identity (its machine, whether it is the `single` fp32 baseline). A leaf of ``compare``: ``report`` builds the
rows and ``summary`` reads them; both import this module, so that ``summary`` never imports ``report``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DASH = "–"
"""A value the cell never measured because it did not run to completion (never shown as 0)."""


@dataclass
class Row:
    """One record of the sweep: the record itself, its raw numbers, and each column's display text."""

    rec: dict[str, Any]
    raw: dict[str, Any]
    text: dict[str, str]

    @property
    def ok(self) -> bool:
        """Whether the cell ran to completion (only such rows are compared)."""
        return self.raw.get("status") == "ok"

    @property
    def name(self) -> str:
        """``method precision xN``: how the report names a cell in a sentence or a list."""
        return f"{self.raw.get('method')} {self.raw.get('precision')} x{self.raw.get('devices')}"


def machine_name(rec: dict[str, Any]) -> str:
    """``hostname (device)`` of the machine a record ran on; rows are only compared within one machine."""
    m = rec.get("machine") if isinstance(rec.get("machine"), dict) else {}
    return f"{m.get('hostname', '?')} ({m.get('device', '?')})"


def number(x: Any) -> float | None:
    """``x`` as a finite float, or None for a missing or unreadable value (a string, a bool, NaN), so that one
    bad field of a record shows as n/a instead of stopping the report."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def is_baseline(rec: dict[str, Any]) -> bool:
    """The row every speed-up and memory ratio is relative to: plain `single`, fp32, one device."""
    world = number(rec.get("world_size")) or 1
    return rec.get("method") == "single" and rec.get("label", "single") == "single" and rec.get("precision") == "fp32" \
        and int(world) == 1  # fmt: skip
