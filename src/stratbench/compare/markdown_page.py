"""report.md: the answer first (what to use, a compact table, one line per cell that did not complete), then the
setup, the full table (``columns``) with its footnotes, how to read it, and the charts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stratbench.compare import summary
from stratbench.compare.columns import shown_columns
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
    trained = settings(report.records)
    if trained:
        lines += [f"**Trained:** {md_text(trained)}", ""]
    if report.started_from:
        lines += [f"**Started from:** {md_text(report.started_from)}", ""]
    names = machines(report.records)
    lines += [f"- **Machine:** {md_text(m)}" for m in names]
    if names:
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
    cols = shown_columns(rows)
    lines.append("| " + " | ".join(md_text(c.header) for c in cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for r in ok:
        lines.append("| " + " | ".join(md_text(r.text[c.key]) for c in cols) + " |")
    lines.append("")
    lines += [f"{footnote_mark(i)} {t}  " for i, t in enumerate(notes.texts)]
    return [*lines, ""]
