"""The report's PNG charts, one bar per completed cell of a sweep: a bar chart per column that has one
(``columns.Column.chart``: peak memory, on a CPU beside the model state each rank holds; throughput, train time,
accuracy), where each step's time goes, the loss and accuracy curves, and speed against memory
(``tradeoff_chart``).
On the charts of times, a cell timed on a busy machine (``Row.busy``) is hatched and its value says so.
Each is written under a temporary name and renamed into place; a chart with nothing to show is removed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stratbench.compare.rows import Row
from stratbench.compare.tradeoff_chart import tradeoff_chart
from stratbench.core.files import atomic_output


def _num(v: float) -> str:
    """Three significant figures without scientific notation (chart labels)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


BUSY_HATCH = "///"
BUSY_LABEL = "busy machine: time inflated"
"""How a chart of times marks a cell timed on a busy machine: its bar hatched, its value suffixed, a legend entry."""


def _mark_busy(bars, rows: list[Row]) -> bool:
    """Hatch the bars of the rows timed on a busy machine; whether there was one (then the legend names it)."""
    busy = False
    for bar, row in zip(bars, rows, strict=True):
        if row.busy:
            bar.set_hatch(BUSY_HATCH)
            bar.set_edgecolor("#333333")
            busy = True
    return busy


def _busy_suffix(row: Row) -> str:
    """What a busy cell's value label adds (nothing for the others)."""
    return " (busy)" if row.busy else ""


PRECISION_COLOURS = {"fp32": "#4c72b0", "bf16-mixed": "#dd8452", "bf16-true": "#c44e52", "fp16-mixed": "#55a868",
                     "fp16-true": "#8172b3"}  # fmt: skip


@dataclass(frozen=True)
class BarChart:
    """A column's bar chart (``columns.Column.chart``): one bar per completed cell of the column's raw value."""

    name: str
    """The chart's name: chart_NAME.png, and its name in the report."""
    place: int
    """Its place among the bar charts (the report lists them in this order, after the curves)."""
    heading: str
    xlabel: str | Callable[[list[Row]], str]
    """The axis label, or a function of the completed rows that makes it."""
    scale: Callable[[float], float] = lambda x: x
    """The raw value -> the plotted one (bytes -> MiB, a fraction -> %)."""
    spec: str = ""
    """The format of the printed value ('': three significant figures)."""
    zoom: bool = False
    """The axis spans the data (91% vs 93% visible), not 0 to the top."""
    timed: bool = False
    """A time or a speed: a cell timed on a busy machine is hatched."""
    with_state: bool = False
    """On a CPU, the model state each rank holds is drawn beside it (RSS is mostly the Python runtime)."""


def memory_kind(ok: list[Row]) -> str:
    """What the peak memory of the completed rows is: the GPU allocator peak, the CPU process RSS, or both."""
    cpu = any(r.raw.get("peak_memory_kind") == "cpu_peak_rss" for r in ok)
    gpu = any(r.raw.get("peak_memory_kind") == "cuda_max_allocated" for r in ok)
    return (
        "GPU allocator peak"
        if gpu and not cpu
        else "process peak RSS on CPU"
        if cpu and not gpu
        else "GPU allocator peak / CPU process RSS"
    )


def write_charts(rows: list[Row], out: Path, title: str, bars: list[tuple[str, BarChart]]) -> dict[str, Path]:
    """One horizontal bar chart per (column key, chart) of ``bars``, in their places, one bar per completed cell,
    coloured by precision, values printed; then the step breakdown, and the curves (listed first)."""
    ok = [r for r in rows if r.raw["status"] == "ok"]
    multi = len({r.raw["machine"] for r in rows}) > 1
    cpu = any(r.raw.get("peak_memory_kind") == "cpu_peak_rss" for r in ok)
    cfg = ok[0].rec.config if ok else {}
    machines = sorted({r.raw["machine"] for r in ok})
    where = machines[0] if len(machines) == 1 else f"{len(machines)} machines"
    subtitle = f"{title} - {cfg.get('model', '?')} on {cfg.get('data', '?')}, global batch {cfg.get('batch_size', '?')} - {where}"
    paths: dict[str, Path] = {}
    for key, chart in sorted(bars, key=lambda b: b[1].place):
        data = [(r, chart.scale(r.raw[key])) for r in ok if r.raw.get(key) is not None]
        path = out / f"chart_{chart.name}.png"
        if not data:
            path.unlink(missing_ok=True)
            continue
        xlabel = chart.xlabel if isinstance(chart.xlabel, str) else chart.xlabel(ok)
        heading = f"{chart.heading}\n{subtitle}"
        if chart.with_state and cpu and any(_state_bytes(r) for r, _ in data):
            # On CPU the RSS is mostly the Python runtime: show what each rank really holds beside it.
            _memory_and_state_chart(data, path, xlabel, heading, multi)
        else:
            _bar_chart(data, path, xlabel, heading, chart.spec, multi, zoom=chart.zoom, timed=chart.timed)
        paths[chart.name] = path
    path = out / "chart_breakdown.png"
    if _breakdown_chart(
        ok, path, f"Where each step's time goes (mean per step, slowest rank)\n{subtitle}", multi
    ):
        paths["breakdown"] = path
    else:
        path.unlink(missing_ok=True)
    path = out / "chart_tradeoff.png"
    if tradeoff_chart(ok, path, f"Speed against memory per device\n{subtitle}", PRECISION_COLOURS, multi):
        paths = {"tradeoff": path, **paths}  # second: the trade-off "What to use" names
    else:
        path.unlink(missing_ok=True)
    path = out / "chart_curves.png"
    if _curves_chart(ok, path, f"Training loss and validation accuracy per method\n{subtitle}", multi):
        paths = {"curves": path, **paths}  # first in the report: how each method trained
    else:
        path.unlink(missing_ok=True)
    return paths


STATE_PARTS = (("param_bytes", "parameters", "#4c72b0"), ("grad_bytes", "gradients", "#dd8452"),
               ("optimizer_state_bytes", "optimizer state", "#55a868"),
               ("master_param_bytes", "fp32 master copy", "#8172b3"))  # fmt: skip


def _state_bytes(row: Row) -> dict[str, int] | None:
    """Model-state bytes (result.json ``sharding``) of the rank that holds the most, by part; None if absent."""
    sharding = row.rec.sharding
    per_rank = [sum((sharding.get(k) or [0] * (i + 1))[i] or 0 for k, _, _ in STATE_PARTS)
                for i in range(max((len(v) for v in sharding.values() if isinstance(v, list)), default=0))]  # fmt: skip
    if not per_rank:
        return None
    top = max(range(len(per_rank)), key=per_rank.__getitem__)
    return {k: int((sharding.get(k) or [0] * (top + 1))[top] or 0) for k, _, _ in STATE_PARTS}


def _label(row: Row, multi: bool) -> str:
    lab = f"{row.raw['method']} · {row.raw['precision']} · {row.raw['devices']} dev"
    if multi:
        lab += f"\n{row.rec.machine.hostname}"
    return lab


def _memory_and_state_chart(
    data: list[tuple[Row, float]], path: Path, xlabel: str, title: str, multi: bool
) -> None:
    """Two panels with the same rows: process peak RSS (left) and the model-state bytes per rank (right,
    stacked: parameters, gradients, optimizer state), where ZeRO/FSDP's savings show even when RSS hides them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_label(r, multi) for r, _ in data]
    colours = [PRECISION_COLOURS.get(str(r.raw["precision"]), "#937860") for r, _ in data]
    states = [_state_bytes(r) or {} for r, _ in data]
    top_state = max((sum(s.values()) for s in states), default=0)
    unit, div = ("MiB", 2**20) if top_state >= 2**20 else ("KiB", 2**10)
    height = max(3.2, 1.7 + 0.38 * len(data) * (1.6 if multi else 1.0))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, height), dpi=110, sharey=True,
                                   gridspec_kw={"width_ratios": [1, 1.15]})  # fmt: skip
    y = list(range(len(data)))
    values = [v for _, v in data]
    ax1.barh(y, values, color=colours)
    ax1.set_yticks(y, labels, fontsize=9)
    ax1.invert_yaxis()
    top = max(values) if values else 1.0
    ax1.set_xlim(0, top * 1.2 if top > 0 else 1)
    for yi, v in zip(y, values, strict=True):
        ax1.text(v + top * 0.01, yi, f"{v:.0f}", va="center", fontsize=8.5)
    ax1.set_xlabel(xlabel, fontsize=9)
    ax1.set_title("process peak RSS (incl. ~0.4 GiB runtime)", fontsize=10)
    left = [0.0] * len(data)
    for key, name, colour in STATE_PARTS:
        part = [s.get(key, 0) / div for s in states]
        if not any(part):
            continue
        ax2.barh(y, part, left=left, color=colour, label=name)
        left = [a + b for a, b in zip(left, part, strict=True)]
    top2 = max(left) if left else 1.0
    ax2.set_xlim(0, top2 * 1.22 if top2 > 0 else 1)
    for yi, v in zip(y, left, strict=True):
        ax2.text(v + top2 * 0.01, yi, _num(v), va="center", fontsize=8.5)
    ax2.set_xlabel(f"{unit} held by the largest rank (result.json 'sharding')", fontsize=9)
    ax2.set_title("model state per rank: what ZeRO / FSDP shard", fontsize=10)
    from matplotlib.patches import Patch

    parts = ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="model state",
                       title_fontsize=8)  # fmt: skip
    ax2.add_artist(parts)
    seen = list(dict.fromkeys(str(r.raw["precision"]) for r, _ in data))
    ax2.legend(handles=[Patch(color=PRECISION_COLOURS.get(p, "#937860"), label=p) for p in seen],
               title="precision (left bars)", fontsize=8, title_fontsize=8, loc="lower left",
               bbox_to_anchor=(1.01, 0.0))  # fmt: skip
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    sup = fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    with atomic_output(Path(path), ".png") as tmp:
        fig.savefig(tmp, bbox_inches="tight", bbox_extra_artists=[parts, sup])  # legends sit outside the axes
    plt.close(fig)


PHASE_COLOURS = {"data": "#937860", "forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
                 "other": "#c7c7c7"}  # fmt: skip


def _breakdown_chart(rows: list[Row], path: Path, title: str, multi: bool) -> bool:
    """One stacked bar per cell: its step time split into data wait, forward, backward, optimizer and other
    (metrics.breakdown, the rank with the longest step). False when no cell recorded a breakdown."""
    data = []
    for r in rows:
        b = r.rec.metrics.breakdown or {}
        ranks = [x for x in b.get("per_rank_s") or [] if x]
        if ranks:
            data.append((r, max(ranks, key=lambda x: x["step"])))
    if not data:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, max(3.2, 1.7 + 0.38 * len(data))), dpi=110)
    y = list(range(len(data)))
    left = [0.0] * len(data)
    busy = False
    for phase, colour in PHASE_COLOURS.items():
        part = [x.get(phase, 0.0) * 1000 for _, x in data]
        bars = ax.barh(y, part, left=left, color=colour, label=phase)
        busy = _mark_busy(bars, [r for r, _ in data]) or busy
        left = [a + b for a, b in zip(left, part, strict=True)]
    if busy:  # both legends beside the axes, clear of the bars' labels
        from matplotlib.patches import Patch

        ax.add_artist(ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0)))
        ax.legend(handles=[Patch(facecolor="white", edgecolor="#333333", hatch=BUSY_HATCH, label=BUSY_LABEL)],
                  fontsize=8, loc="lower left", bbox_to_anchor=(1.01, 0.0))  # fmt: skip
    top = max(left) or 1.0
    for yi, (r, x), v in zip(y, data, left, strict=True):
        compute = sum(x.get(p, 0) for p in ("forward", "backward", "optimizer"))
        not_compute = (1 - compute / x["step"]) * 100 if x["step"] else 0
        ax.text(
            v + top * 0.01,
            yi,
            f"{x['step'] * 1000:.1f} ms ({not_compute:.0f}% not compute){_busy_suffix(r)}",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(y, [_label(r, multi) for r, _ in data], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("ms per optimizer step (synchronised phase clocks; warm-up excluded)", fontsize=9)
    if not busy:
        ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with atomic_output(Path(path), ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return True


LINESTYLES = {
    "fp32": "-",
    "bf16-mixed": "--",
    "fp16-mixed": "-.",
    "bf16-true": ":",
    "fp16-true": (0, (5, 1, 1, 1)),
}


def _curves_chart(rows: list[Row], path: Path, title: str, multi: bool) -> bool:
    """Training loss per optimizer step (left) and validation accuracy per epoch (right), one line per completed
    cell: colour = method, line style = precision. Returns False when no cell recorded a curve."""
    curves = [(r, r.rec.metrics.loss_curve, r.rec.metrics.evaluations) for r in rows]
    curves = [c for c in curves if c[1] or c[2]]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(str(r.raw["method"]) for r, _, _ in curves))
    palette = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors
    colour = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), dpi=110)
    longest = max(len(loss) for _, loss, _ in curves)
    window = max(1, longest // 25)  # a light moving average: per-step losses of small batches are noisy
    accs: list[float] = []
    for r, loss, evals in curves:
        style = dict(color=colour[str(r.raw["method"])], linestyle=LINESTYLES.get(str(r.raw["precision"]), "-"),
                     linewidth=1.4, alpha=0.9, label=_label(r, multi).replace("\n", " "))  # fmt: skip
        if loss:
            smooth = [sum(loss[max(0, i - window + 1): i + 1]) / len(loss[max(0, i - window + 1): i + 1])
                      for i in range(len(loss))]  # fmt: skip
            ax1.plot(range(1, len(loss) + 1), smooth, **style)
        pts = [(e.get("epoch"), e.get("val_accuracy")) for e in evals if e.get("val_accuracy") is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ys = [v * 100 for v in ys]
            accs.extend(ys)
            ax2.plot(xs, ys, marker="o", markersize=4, **style)
    ax1.set_xlabel("optimizer step", fontsize=9)
    ax1.set_ylabel(
        "training loss" + (f" (moving average over {window} steps)" if window > 1 else ""), fontsize=9
    )
    ax1.set_title("training loss", fontsize=10)
    ax2.set_xlabel("epoch", fontsize=9)
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("validation accuracy, %", fontsize=9)
    ax2.set_title("validation accuracy (axis zoomed to the data)", fontsize=10)
    if accs:
        lo, hi = _zoom(accs)
        ax2.set_ylim(lo, hi)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels() if ax1.lines else ax2.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False,
               title="method · precision · devices (colour = method, line style = precision)", title_fontsize=8)  # fmt: skip
    fig.suptitle(title, fontsize=11)
    rows_of_legend = (len(labels) + 3) // 4
    fig.tight_layout(rect=(0, min(0.45, 0.05 + 0.045 * rows_of_legend), 1, 1))
    with atomic_output(Path(path), ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    return True


def _zoom(values: list[float], lo_cap: float = 0.0, hi_cap: float = 100.0) -> tuple[float, float]:
    """Axis limits around the data (a percentage), with margins, so that 91 vs 93% is visible."""
    lo, hi = min(values), max(values)
    pad = max(0.5, (hi - lo) * 0.25)
    return max(lo_cap, lo - pad), min(hi_cap + pad * 0.5, hi + pad)


def _bar_chart(data: list[tuple[Row, float]], path: Path, xlabel: str, title: str, spec: str, multi: bool,
               zoom: bool = False, timed: bool = False) -> None:  # fmt: skip
    """One bar per cell, coloured by precision, its value printed; ``timed`` (a time or a speed): the cells timed
    on a busy machine hatched, their values suffixed, and a legend entry saying why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = [_label(r, multi) for r, _ in data]
    values = [v for _, v in data]
    colours = [PRECISION_COLOURS.get(str(r.raw["precision"]), "#937860") for r, _ in data]
    height = max(2.8, 1.5 + 0.38 * len(data) * (1.6 if multi else 1.0))
    fig, ax = plt.subplots(figsize=(10, height), dpi=110)
    y = list(range(len(data)))
    bars = ax.barh(y, values, color=colours)
    busy = timed and _mark_busy(bars, [r for r, _ in data])
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()  # first cell at the top, as in the table
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_title(title, fontsize=11)
    top = max(values) if values else 1.0
    ax.set_xlim(0, top * 1.18 if top > 0 else 1)
    step = top * 0.01
    if zoom and values:  # accuracy: the axis spans the data, so that 91% vs 93% is visible (not 0-100)
        lo, hi = _zoom(values)
        hi += (hi - lo) * 0.12  # room for the labels
        ax.set_xlim(lo, hi)
        step = (hi - lo) * 0.01
        ax.set_xlabel(f"{xlabel} - axis starts at {lo:.1f}%", fontsize=10)
    for yi, (r, v) in zip(y, data, strict=True):
        label = (format(v, spec) if spec else _num(v)) + (_busy_suffix(r) if timed else "")
        ax.text(v + step, yi, label, va="center", fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    seen = list(dict.fromkeys(str(r.raw["precision"]) for r, _ in data))
    handles = [Patch(color=PRECISION_COLOURS.get(p, "#937860"), label=p) for p in seen]
    if busy:
        handles.append(Patch(facecolor="white", edgecolor="#333333", hatch=BUSY_HATCH, label=BUSY_LABEL))
    ax.legend(handles=handles, title="precision", fontsize=8, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    fig.tight_layout()
    with atomic_output(Path(path), ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
