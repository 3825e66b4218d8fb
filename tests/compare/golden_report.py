"""Committed sweeps rendered the way `stratbench report` renders them, as the text files the report-columns test
compares with its snapshots (tests/snapshots/report_columns/): report.md, report.csv, report.html with each
embedded PNG replaced by its chart's name, the terminal table, and what every bar chart was given (its rows'
labels and values, axis label, title). It uses only what the report module had before the column records, so
that the snapshots can be written with that code: ``python tests/compare/golden_report.py OUT`` (run from the
repository root).
"""

from __future__ import annotations

import io
import json
import re
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from stratbench.compare import charts
from stratbench.compare import report as report_mod

REPO = Path(__file__).resolve().parents[2]
SNAPSHOTS = REPO / "tests" / "snapshots" / "report_columns"
CASES = {
    # compare --repeats 3 --calibrate: medians with ranges, the calibrated predicted step, 28 cells of 14 methods
    "quick_repeats3": ["benchmarks/compare_quick_repeats3_cpu-avx512_2026-11-23"],
    # two machines merged: GPU rows (NVML, MFU, predicted step on a profile) beside a language model's CPU rows
    # (tokens/s, perplexity) and cells skipped as too big
    "llm-fit+h200": ["benchmarks/compare_llm-fit_cpu_2026-11-25", "benchmarks/gpu_h200_2026-11-26/methods_w1_part2_cells"],
}  # fmt: skip
PNG = re.compile(r"<img alt='([^']*)' src='data:image/png;base64,[^']*'>")


def render(dirs: list[str], out: Path, draw: bool = False) -> dict[str, str]:
    """The outputs of ``stratbench report DIRS --output OUT`` as text (run from the repository root, so that the
    Sources line names the folders as committed). The bar charts are recorded, not drawn (``draw``: drawn too):
    their pixels are matplotlib's, what each is given is the columns'."""
    drawn: list[dict] = []
    real_bar, real_memory = charts._bar_chart, charts._memory_and_state_chart

    def bar(data, path, xlabel, title, *args, **kwargs):
        drawn.append(_chart(data, path, xlabel, title))
        return real_bar(data, path, xlabel, title, *args, **kwargs) if draw else Path(path).write_bytes(b"")

    def memory(data, path, xlabel, title, *args, **kwargs):
        drawn.append(_chart(data, path, xlabel, title))
        return real_memory(data, path, xlabel, title, *args, **kwargs) if draw else Path(path).write_bytes(b"")

    charts._bar_chart, charts._memory_and_state_chart = bar, memory
    try:
        paths, records = report_mod.render_sweeps([Path(d) for d in dirs], out)
    finally:
        charts._bar_chart, charts._memory_and_state_chart = real_bar, real_memory
    terminal = io.StringIO()
    report_mod.print_table(records, console=Console(file=terminal, width=220, color_system=None))
    return {
        "report.md": paths["md"].read_text(),
        "report.csv": paths["csv"].read_text(),
        "report.html": PNG.sub(r"<img alt='\1' src='(chart_\1.png)'>", paths["html"].read_text()),
        "terminal.txt": terminal.getvalue(),
        "charts.json": json.dumps(drawn, indent=1) + "\n",
        "chart_files.txt": "".join(f"{k}: {p.name}\n" for k, p in paths.items() if k.startswith("chart:")),
    }


def _chart(data, path: Path, xlabel: str, title: str) -> dict:
    """What one bar chart was asked to draw."""
    return {"file": Path(path).name, "xlabel": xlabel, "title": title,
            "bars": [[charts._label(r, False), value] for r, value in data]}  # fmt: skip


if __name__ == "__main__":
    dest = Path(sys.argv[1])
    for case, dirs in CASES.items():
        folder = dest / case
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as out:  # the report's own files, PNGs included, are not kept
            for name, text in render(dirs, Path(out), draw=True).items():
                (folder / name).write_text(text)
        print(case, "written")
