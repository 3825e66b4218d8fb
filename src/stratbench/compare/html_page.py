"""report.html: one self-contained page from templates/report.html.j2 (autoescaped), the same sections as
report.md, the full table (``columns``) sortable by each column."""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any

import jinja2

from stratbench.compare import summary
from stratbench.compare.columns import shown_columns, sort_value
from stratbench.compare.document import (
    ALL_MEASUREMENTS,
    AT_A_GLANCE,
    HOW_TO_READ,
    NOT_COMPLETED,
    WHAT_TO_USE,
    Report,
    machines,
    settings,
)
from stratbench.compare.rows import Footnotes, Row, footnote_mark

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
        "settings": settings(report.records),
        "started_from": report.started_from,
        "machines": machines(report.records),
        "command": report.command,
        "full": _html_full_table(rows),
        "footnotes": [f"{footnote_mark(i)} {t}" for i, t in enumerate(notes.texts)],
        "how_to_read": HOW_TO_READ.replace("`", ""),  # markdown's code marks; plain words on the page
        "charts": [
            {"name": name, "data": base64.b64encode(p.read_bytes()).decode()} for name, p in charts.items()
        ],
        "sources": ", ".join(report.sources),
    }


def _html_full_table(rows: list[Row]) -> dict[str, Any]:
    """The full table's header and completed rows: per cell its class, its sort value, its text and (compare
    --repeats) the range shown below it."""
    cols = shown_columns(rows)
    heads = [{"text": c.header, "cls": "sortable l" if c.align else "sortable"} for c in cols]
    body = []
    for n, r in enumerate(r for r in rows if r.ok):
        cells = []
        for c in cols:
            k = c.key
            spread = f"{k}__spread" in r.text  # compare --repeats: the median, and the range below it
            cells.append({"cls": c.align, "sort": sort_value(r, c), "main": r.text[k + "__main"] if spread else r.text[k],
                          "spread": r.text[k + "__spread"] if spread else ""})  # fmt: skip
        body.append({"cls": str(r.raw["status"]).replace(" ", "-"), "index": n, "cells": cells})
    return {"heads": heads, "rows": body}
