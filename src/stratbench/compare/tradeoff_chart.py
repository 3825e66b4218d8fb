"""The report's speed-against-memory chart: one point per completed cell (x: the memory figure the "What to use"
block compares, y: throughput), coloured by precision, each named; the picks of "What to use" (the fastest and the
leanest) ringed and named in the key beside the plot (points are numbered there: 20-odd cells cluster where
their names would overlap), so the trade-off the table lists is seen at once. A cell timed on a busy machine is
drawn hollow, as the bar charts hatch it. One chart per report; several machines are told apart by their label."""

from __future__ import annotations

from pathlib import Path

from stratbench.compare.rows import Row
from stratbench.compare.summary import advice, memory_measure
from stratbench.core.files import atomic_output
from stratbench.measuring.records import number

PICKS = ("Fastest", "Leanest memory")
"""The "What to use" lines whose cells the chart rings."""


def _picked(rows: list[Row]) -> dict[str, list[str]]:
    """Each named cell of a pick line (``Row.name``, per machine), with the labels of the picks it is."""
    out: dict[str, list[str]] = {}
    for group in advice(rows):
        for line in group.lines:
            if line.label in PICKS and line.subject:
                out.setdefault(line.subject, []).append(line.label.lower())
    return out


def tradeoff_chart(rows: list[Row], path: Path, title: str, colours: dict[str, str], multi: bool) -> bool:
    """Write the chart to ``path``; False (nothing written) where fewer than two completed cells have both a
    throughput and a memory figure."""
    key, what = memory_measure(rows)
    points = [(r, number(r.raw.get(key)), number(r.raw.get("throughput"))) for r in rows]
    points = [(r, m / 2**20, t) for r, m, t in points if m and t]
    if len(points) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    picked = _picked(rows)
    height = max(6.2, 2.2 + 0.2 * len(points))
    fig, (ax, key) = plt.subplots(1, 2, figsize=(12.5, height), dpi=110, gridspec_kw={"width_ratios": [3, 1.15]})
    lines = []
    for n, (r, mem, speed) in enumerate(points, 1):
        colour = colours.get(str(r.raw["precision"]), "#937860")
        face = "white" if r.busy else colour
        ax.scatter([mem], [speed], s=70, facecolors=face, edgecolors=colour, linewidths=1.6, zorder=3)
        # numbers on the plot, names in the key beside it: 20-odd cells cluster where names would overlap
        ax.annotate(str(n), (mem, speed), textcoords="offset points", xytext=(6, 4), fontsize=7.5)
        name = r.name + (f" ({r.rec.machine.hostname})" if multi else "")
        pick = picked.get(r.name)
        if pick:
            ax.scatter([mem], [speed], s=360, facecolors="none", edgecolors="#222222", linewidths=1.4, zorder=4)
        lines.append((f"{n}. {name}" + (f"  <- {' + '.join(pick)}" if pick else ""), bool(pick), colour))
    mems = [m for _, m, _ in points]
    log = max(mems) > 20 * min(mems)  # one method's buffers (DeepSpeed's) would squash the rest into a corner
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(f"{what} per device, MiB{', log scale' if log else ''} (lower is leaner)", fontsize=10)
    ax.set_ylabel("throughput, samples/s (higher is faster)", fontsize=10)
    ax.set_title(title, fontsize=10.5)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    ax.margins(x=0.12, y=0.1)
    seen = list(dict.fromkeys(str(r.raw["precision"]) for r, _, _ in points))
    handles = [Line2D([], [], marker="o", linestyle="", color=colours.get(p, "#937860"), label=p) for p in seen]
    handles.append(Line2D([], [], marker="o", linestyle="", markersize=14, markerfacecolor="none",
                          markeredgecolor="#222222", label="a pick of What to use"))  # fmt: skip
    if any(r.busy for r, _, _ in points):
        handles.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor="#333333",
                              label="busy machine: speed understated"))  # fmt: skip
    ax.legend(handles=handles, fontsize=8, loc="best")
    key.axis("off")
    step = min(0.045, 0.95 / max(1, len(lines)))
    for i, (text, bold, colour) in enumerate(lines):
        key.text(0.0, 0.98 - i * step, text, fontsize=8, color=colour, va="top",
                 fontweight="bold" if bold else "normal", transform=key.transAxes)  # fmt: skip
    fig.tight_layout()
    with atomic_output(Path(path), ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return True
