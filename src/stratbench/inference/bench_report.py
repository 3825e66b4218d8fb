"""The answer bench-infer opens with, as `compare`'s "What to use" does: the fastest backend within a stated quality
loss (``--max-quality-loss``: points of top-1 accuracy for a classifier, percent of perplexity for a language model,
both against eager fp32 on the validation batches), the one with the most throughput, the smallest, and the rows
over the loss; then the Markdown report (the answer, the table, the rows that did not run) and its latency-vs-quality
chart.

The picks: "fastest" is the lowest p50 latency at the smallest batch size measured (batch 1 by default: serving
one request), "most throughput" the highest samples/s at the largest batch size, "smallest" the smallest file the
backend loads (the faster of equal sizes). A row without quality (no validation data, as with ``--model``'s random
weights) is ranked by speed and size alone, and the answer says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stratbench.core.errors import ConfigError
from stratbench.core.tables import fmt_bytes
from stratbench.inference.bench import Row

DEFAULT_MAX_LOSS = {False: 1.0, True: 2.0}
"""The default --max-quality-loss: 1 point of top-1 for a classifier (False), 2% perplexity for a language model."""
MAX_LOSS_RANGE = (0.0, 100.0)
REFERENCE = "eager-fp32"
CLOSE_PCT = 10.0
"""A second-fastest row this close (in %) is named beside the fastest, as `compare` does."""


def check_max_loss(value: float | None) -> None:
    """One line where ``--max-quality-loss`` is out of range (or not a number): before any work."""
    lo, hi = MAX_LOSS_RANGE
    if value is not None and not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(
            f"--max-quality-loss must be between {lo:g} and {hi:g} (points of top-1 accuracy for a classifier, "
            f"percent of perplexity for a language model), got {value:g}"
        )


def quality_loss(row: Row) -> float | None:
    """How much worse than eager fp32 ``row`` scored: top-1 points lost, or perplexity percent gained (negative:
    better); None where it was not scored."""
    if row.top1_delta_pts is not None:
        return 0.0 - row.top1_delta_pts  # 0.0 - 0.0: no "-0.00" where nothing was lost
    return row.perplexity_delta_pct


def loss_unit(language: bool) -> str:
    return "% perplexity" if language else " pts top-1"


@dataclass
class Answer:
    """The opening lines (label, text), the picked rows by label, and the limit they were picked within."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    picks: dict[str, Row] = field(default_factory=dict)
    max_loss: float = 0.0
    scored: bool = False


def answer(rows: list[Row], max_loss: float, language: bool, unscored_reason: str = "") -> Answer:
    """The picks among the completed rows within ``max_loss`` (all of them where none was scored)."""
    ok = [r for r in rows if r.status == "ok" and r.p50_ms is not None]
    scored = any(quality_loss(r) is not None for r in ok)
    out = Answer(max_loss=max_loss, scored=scored)
    if not ok:
        out.lines.append(("Nothing to compare", "no backend ran here; each row below says why"))
        return out
    unit = loss_unit(language)
    within = [
        r for r in ok if not scored or (quality_loss(r) is not None and quality_loss(r) <= max_loss + 1e-9)
    ]
    where = f"within {max_loss:g}{unit} of eager fp32" if scored else "(quality not measured)"
    small, large = min(r.batch_size for r in ok), max(r.batch_size for r in ok)
    at = {bs: [r for r in within if r.batch_size == bs] for bs in (small, large)}
    base = {
        bs: next((r for r in ok if r.backend == REFERENCE and r.batch_size == bs), None)
        for bs in (small, large)
    }
    fast = min(at[small], key=lambda r: r.p50_ms or math.inf, default=None)
    busy = max(at[large], key=lambda r: r.throughput_samples_per_s or 0.0, default=None)
    sizes = [r for r in at[small] if r.size_bytes]
    small_row = min(sizes, key=lambda r: (r.size_bytes, r.p50_ms or math.inf), default=None)
    for key, label, row, text in (
        ("fastest", "Fastest", fast, lambda r: _latency(r, base[small])),
        ("throughput", "Most throughput", busy, lambda r: _throughput(r, base[large])),
        ("smallest", "Smallest", small_row, lambda r: _size(r, base[small])),
    ):
        if row is not None:
            out.picks[key] = row
        text = f"{row.backend}: {text(row)}{_quality(row, unit)}" if row else "no completed row"
        close = _runner_up(at[small], fast) if key == "fastest" and fast else ""
        out.lines.append((f"{label} {where}", text + close))
    out.lines.append(("Quality", _quality_line(ok, within, scored, max_loss, unit, unscored_reason)))
    return out


def _runner_up(rows: list[Row], top: Row) -> str:
    """``. Runner-up: X, 6% slower ...`` where the second-fastest row is within CLOSE_PCT of ``top``."""
    others = [r for r in rows if r is not top and r.p50_ms]
    second = min(others, key=lambda r: r.p50_ms or math.inf, default=None)
    if second is None or not top.p50_ms or second.p50_ms > top.p50_ms * (1 + CLOSE_PCT / 100):
        return ""
    gap = 100 * (second.p50_ms / top.p50_ms - 1)
    return f". Runner-up: {second.backend}, {gap:.0f}% slower; on a shared machine that is within the noise"


def _ratio(value: float | None, base: float | None) -> str:
    return f" ({value / base:.2f}x eager-fp32's)" if value and base else ""


def _latency(r: Row, base: Row | None) -> str:
    faster = (
        f" ({base.p50_ms / r.p50_ms:.2f}x as fast as eager-fp32)"
        if base and base.p50_ms and r is not base
        else ""
    )
    return f"p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms at batch {r.batch_size}{faster}"


def _throughput(r: Row, base: Row | None) -> str:
    tokens = f", {r.throughput_tokens_per_s:,.0f} tokens/s" if r.throughput_tokens_per_s else ""
    ratio = (
        _ratio(r.throughput_samples_per_s, base.throughput_samples_per_s) if base and r is not base else ""
    )
    return f"{r.throughput_samples_per_s:,.1f} samples/s{tokens} at batch {r.batch_size}{ratio}"


def _size(r: Row, base: Row | None) -> str:
    ratio = _ratio(r.size_bytes, base.size_bytes if base else None) if base and r is not base else ""
    return f"{fmt_bytes(r.size_bytes or 0)}{ratio}, p50 {r.p50_ms:.2f} ms at batch {r.batch_size}"


def _quality(r: Row, unit: str) -> str:
    loss = quality_loss(r)
    return "" if loss is None else f"; quality loss {loss:+.2f}{unit}"


def _quality_line(
    ok: list[Row], within: list[Row], scored: bool, max_loss: float, unit: str, reason: str
) -> str:
    """Which backends were over the limit (named with their loss), or why quality was not measured."""
    if not scored:
        return f"not measured ({reason or 'no validation data'}), so no backend is held back for its quality"
    kept = {r.backend for r in within}
    over = {r.backend: quality_loss(r) for r in ok if r.backend not in kept}
    if not over:
        return f"every backend that ran is within {max_loss:g}{unit} of eager fp32"
    named = ", ".join(f"{b} ({'unscored' if v is None else f'{v:+.2f}{unit}'})" for b, v in over.items())
    return f"over the {max_loss:g}{unit} limit, so not picked: {named}"


# ------------------------------------------------------------------------------------------------
# the Markdown report and its chart


def peak_memory(r: Row) -> str:
    """``608.7 MiB (+12.3 MiB)``: the cell's peak and what the cell added over its start."""
    if r.peak_memory_bytes is None:
        return "-"
    added = (
        ""
        if r.memory_start_bytes is None
        else f" (+{fmt_bytes(max(0, r.peak_memory_bytes - r.memory_start_bytes))})"
    )
    return fmt_bytes(r.peak_memory_bytes) + added


def _cell(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    ("backend", lambda r: r.backend),
    ("dtype", lambda r: r.dtype),
    ("batch", lambda r: str(r.batch_size)),
    ("p50 ms", lambda r: _cell(r.p50_ms, ".2f")),
    ("p90 ms", lambda r: _cell(r.p90_ms, ".2f")),
    ("p99 ms", lambda r: _cell(r.p99_ms, ".2f")),
    ("samples/s", lambda r: _cell(r.throughput_samples_per_s, ",.1f")),
    ("tokens/s", lambda r: _cell(r.throughput_tokens_per_s, ",.0f")),
    ("peak mem (cell +)", lambda r: peak_memory(r)),
    ("size", lambda r: "-" if r.size_bytes is None else fmt_bytes(r.size_bytes)),
    ("start-up s", lambda r: _cell(r.startup_s, ".2f")),
    ("top-1 %", lambda r: _cell(None if r.top1 is None else 100 * r.top1, ".2f")),
    ("Δ pts", lambda r: _cell(r.top1_delta_pts, "+.2f")),
    ("ppl", lambda r: _cell(r.perplexity, ".3f")),
    ("Δ ppl %", lambda r: _cell(r.perplexity_delta_pct, "+.2f")),
    ("agree %", lambda r: _cell(None if r.argmax_agreement is None else 100 * r.argmax_agreement, ".2f")),
    ("max |Δlogit|", lambda r: _cell(r.max_abs_delta_logit, ".3g")),
]


def markdown(rows: list[Row], ans: Answer, title: str, about: list[str], chart: str | None) -> str:
    """The report: the answer first, then what was measured and how, the table of completed rows (columns no row
    has left out), the chart and the rows that did not run, each with its one-line reason."""
    ok = [r for r in rows if r.status == "ok"]
    cols = [(n, f) for n, f in COLUMNS if any(f(r) != "-" for r in ok)]
    lines = [f"# {title}", "", "## What to use", ""]
    lines += [f"- **{label}**: {text}" for label, text in ans.lines]
    lines += ["", "## How it was measured", "", *[f"- {a}" for a in about], "", "## Every row", ""]
    lines += ["| " + " | ".join(n for n, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r).replace("|", "\\|") for _, f in cols) + " |" for r in ok]
    if chart:
        lines += ["", f"![latency against quality loss]({chart})"]
    other = [r for r in rows if r.status != "ok"]
    if other:
        lines += ["", "## Rows that did not run", ""]
        lines += [f"- {r.backend} (batch {r.batch_size}): {r.status} — {r.reason}" for r in other]
    return "\n".join(lines) + "\n"


def chart(rows: list[Row], ans: Answer, language: bool, out: Path) -> bool:
    """Latency (p50 at the smallest batch, log scale) against quality loss, one point per backend, the limit as a
    dashed line and the picks ringed; written to ``out`` (PNG). False (nothing written) where no row was scored."""
    ok = [r for r in rows if r.status == "ok" and r.p50_ms and quality_loss(r) is not None]
    if not ok:
        return False
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    small = min(r.batch_size for r in ok)
    points = [r for r in ok if r.batch_size == small]
    picked = {id(r) for r in ans.picks.values()}
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(sorted(points, key=lambda r: r.p50_ms or 0.0)):
        ax.scatter(
            r.p50_ms, quality_loss(r), s=40, color="tab:red" if id(r) in picked else "tab:blue", zorder=3
        )
        # neighbours in latency get labels at alternating heights, so that close points stay readable
        ax.annotate(r.backend, (r.p50_ms, quality_loss(r)), textcoords="offset points", fontsize=8,
                    xytext=(4, (6, -12, 18, -24)[i % 4]), arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.5})  # fmt: skip
    ax.margins(y=0.15)
    ax.axhline(ans.max_loss, linestyle="--", color="grey", label=f"--max-quality-loss {ans.max_loss:g}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(f"p50 latency at batch {small} (ms, log scale)")
    ax.set_ylabel("perplexity increase (%)" if language else "top-1 points lost")
    ax.set_title("latency against quality loss vs eager fp32 (red: picked)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
