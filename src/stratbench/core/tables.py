"""A one-run result table for the terminal (the comparison report builds on the same formatting)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COMPACT_WIDTH = 120
"""Columns of a table printed to a file or a pipe (a CI log) when COLUMNS is not set: rich would assume 80."""
WIDE_WIDTH = 220
"""The least width of a --wide table: every column at its natural width, wider than the terminal if need be."""


def output_width() -> int | None:
    """The width printed tables should fit: None on a terminal (rich reads its size, or COLUMNS), else COLUMNS if
    set, else COMPACT_WIDTH."""
    import os
    import sys

    if sys.stdout.isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else COMPACT_WIDTH


def table_console(wide: bool = False, **kwargs: Any):
    """A rich Console for printed tables, as wide as the terminal, or output_width() on a file or a pipe, so
    that the compact tables fit an 80-120 column terminal or CI log. ``wide``: at least WIDE_WIDTH columns, for
    the --wide tables that show every column (their lines may be longer than the terminal)."""
    from rich.console import Console

    if "width" not in kwargs:
        kwargs["width"] = output_width()
    console = Console(**kwargs)
    if wide:
        console.width = max(console.width, WIDE_WIDTH)
    return console


def name_column(table, header: str) -> None:
    """A column of method or precision names: never wrapped nor cut ("deep…"), the other columns give way."""
    table.add_column(header, no_wrap=True, overflow="fold")


def text_column(table, header: str, justify: str = "left") -> None:
    """A column that wraps (and folds a word longer than the column) instead of cutting with an ellipsis."""
    table.add_column(header, justify=justify, overflow="fold")


def fit_table(console, build: Callable[[tuple[str, ...]], Any], optional: Sequence[str] = ()):
    """``build(dropped_headers)`` -> a rich Table, fitted to ``console.width`` without cutting a name or a
    number; returns (table, dropped headers). Too wide at its natural width: headers wrap at their spaces and
    every cell keeps its width (rich alone shrinks the widest columns evenly and folds "compute" into
    "compu|te"); still too wide: the ``optional`` columns go, first listed first, until it fits (or none is
    left: then rich wraps and folds)."""
    dropped: list[str] = []
    while True:
        table = build(tuple(dropped))
        natural, need, extra = _column_widths(console, table)
        if sum(natural) + extra <= console.width:
            return table, dropped
        headers = [str(c.header) for c in table.columns]
        left = [h for h in optional if h in headers]
        if sum(need) + extra <= console.width or not left:
            break
        dropped.append(left[0])
    spare = console.width - extra - sum(need)
    if spare >= 0:  # fixed widths: each column its widest cell, headers wrapped, the spare to the first ones
        for col, nat, nd in zip(table.columns, natural, need, strict=True):
            give = min(spare, nat - nd)
            col.width, spare = nd + give, spare - give
    return table, dropped


def _column_widths(console, table) -> tuple[list[int], list[int], int]:
    """Each column's natural width (header on one line) and the width it needs (its widest cell, its header
    wrapped at spaces), and the table's padding and borders: what fit_table chooses from."""
    from rich.measure import Measurement

    natural, need = [], []
    for col in table.columns:
        cells = [Measurement.get(console, console.options, c).maximum for c in col.cells]
        header = str(col.header)
        natural.append(max([len(header), *cells]))
        need.append(max([*map(len, header.split()), *cells, 1]))
    unbounded = console.options.update_width(1_000_000)
    return natural, need, Measurement.get(console, unbounded, table).maximum - sum(natural)


NOTE_WIDTH = 24
"""The least width a note under a name (name_cell) wraps to."""


def note_width(labels: list[str]) -> int:
    """The width notes under names wrap to: the name column's own (its longest name), at least NOTE_WIDTH."""
    return max([NOTE_WIDTH, *map(len, labels)])


def name_cell(label: str, note: str | None, width: int):
    """A name cell, with a note under the name (e.g. "n/a: why" on a row without numbers) wrapped to ``width``:
    the name column never wraps, so the note widens no column, however long, and the numbers keep theirs."""
    import textwrap

    from rich.text import Text

    if not note:
        return label
    text = Text(label)
    for line in textwrap.wrap(note, width):
        text.append("\n" + line, style="dim")
    return text


class NaNotes:
    """Why rows have no numbers, said once under the table (its caption) instead of wrapped under each name: a
    row is its name and "n/a (k)"; rows that share a reason share its note."""

    def __init__(self) -> None:
        self.notes: dict[str, list[str]] = {}

    def mark(self, label: str, why: str) -> str:
        """The short note under ``label``'s name: "n/a (k)", k the number of the reason's note."""
        self.notes.setdefault(why, []).append(label)
        return f"n/a ({list(self.notes).index(why) + 1})"

    def attach(self, table) -> None:
        """The notes as the table's caption, left-aligned, one per reason."""
        if self.notes:
            table.caption = "\n".join(f"({k}) {', '.join(labels)}: n/a: {why}"
                                       for k, (why, labels) in enumerate(self.notes.items(), 1))  # fmt: skip
            table.caption_justify = "left"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_num(x: float | None, spec: str = ".3g", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def result_rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    m = res.get("metrics", {})
    peaks = m.get("peak_memory_bytes") or []
    kind = m.get("peak_memory_kind", "")
    util = m.get("gpu_util_mean_pct") or []
    text = bool(m.get("tokens_per_sample"))  # a language model: tokens/s, next-token accuracy and perplexity
    tokens = f" ({fmt_num(m.get('throughput_tokens_per_s'), ',.0f')} tokens/s)" if text else ""
    rows = [
        ("status", res.get("status", "?") + (f" ({res['reason']})" if res.get("reason") else "")),
        ("method", f"{res.get('strategy')} / {res.get('precision')}"),
        ("model / data", f"{res.get('model')} / {res.get('data')}"),
        ("devices (world size)", str(res.get("world_size"))),
        ("global / per-device batch", f"{res.get('global_batch_size')} / {res.get('per_device_batch_size')}"),
        ("train time (eval excluded)", fmt_num(m.get("train_time_s"), ".2f", " s")),
        (
            "step time (mean, warm-up excluded)",
            fmt_num(m.get("step_time_mean_s") and m["step_time_mean_s"] * 1e3, ".1f", " ms"),
        ),
        ("throughput", fmt_num(m.get("throughput_samples_per_s"), ".1f", " samples/s") + tokens),
        (f"peak memory per rank ({kind})", ", ".join(fmt_bytes(p) for p in peaks) or "n/a"),
        ("GPU utilisation mean", ", ".join(fmt_num(u, ".0f", "%") for u in util) or "n/a (no NVIDIA GPU)"),
        ("MFU", fmt_num(m.get("mfu") and m["mfu"] * 100, ".1f", "%") if m.get("mfu") is not None else "n/a"),
        ("final train loss", fmt_num(m.get("final_loss"), ".4f")),
        (
            "val next-token accuracy" if text else "val accuracy",
            fmt_num(m.get("val_accuracy") and m["val_accuracy"] * 100, ".2f", "%"),
        ),
    ]
    if text:
        rows.append(("val perplexity", fmt_num(m.get("val_perplexity"), ".2f")))
    return rows


def print_result(output: str | Path, result: dict[str, Any] | None = None) -> None:
    from rich.table import Table

    if result is None:
        path = Path(output) / "result.json"
        if not path.exists():
            return
        result = json.loads(path.read_text())
    table = Table(title=f"stratbench result ({Path(output) / 'result.json'})", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for k, v in result_rows(result):
        table.add_row(k, v)
    table_console().print(table)
