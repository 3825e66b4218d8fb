"""docs/projection.md's example projection table (ResNet-50 on 2 x 8 H100, no --calibrate) with each row's basis and
the held-out error band that basis quotes (src/stratbench/measuring/error_bands.json), from `stratbench estimate
--json` as a user runs it, written between the doc's markers:

    PYTHONPATH=src python benchmarks/projection_doc_example.py

Nothing is measured: the projection prices counted FLOPs and bytes on the built-in h100-sxm profile.
tests/predicting/test_heldout.py checks that the band cells are error_bands.json's.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from stratbench.cli import main as cli
from stratbench.commands.estimate import fmt_seconds
from stratbench.core.tables import fmt_bytes

DOC = Path(__file__).resolve().parent.parent / "docs" / "projection.md"
BEGIN = "<!-- rendered by benchmarks/projection_doc_example.py: begin -->"
END = "<!-- rendered by benchmarks/projection_doc_example.py: end -->"
ARGS = ["estimate", "--model", "resnet50", "--image-size", "224", "--batch-size", "512", "--precision", "bf16-mixed",
        "--strategy", "all", "--time", "--hardware", "h100-sxm", "--nodes", "2", "--gpus-per-node", "8", "--json"]  # fmt: skip
"""The doc's first command, as JSON."""
METHODS = ("fsdp", "ddp", "deepspeed", "ddp-zero")
"""The rows the doc shows, in its order."""


def band_cell(band: dict[str, Any]) -> str:
    """A projection's held-out band, short: median and 80th percentile of the absolute error over its rows."""
    if not band:
        return "none"
    return f"median {band['median']:.1%}, 80th pct. {band['p80']:.1%}; over {band['rows']} {band['over']}"


def lines(results: list[dict[str, Any]]) -> list[str]:
    """The table: the doc's columns, then the basis and its band."""
    by = {r["strategy"]: r for r in results}
    out = ["| method | step | samples/s | scaling eff. | comm (exposed) | dominant | memory/device | basis | held-out "
           "band of the basis |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for m in METHODS:
        p, e = by[m]["projection"], by[m]["estimate"]
        out.append(f"| {m} | {fmt_seconds(p['step_s'])} | {p['throughput']:,.0f} | {p['scaling_efficiency']:.0%} | "
                   f"{fmt_seconds(p['comm_s'])} ({fmt_seconds(p['comm_exposed_s'])}) | {p['dominant']} | "
                   f"{fmt_bytes(e['total_bytes'])} | {p['basis']} | {band_cell(p['error_band'])} |")  # fmt: skip
    return out


def main() -> None:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        if cli(ARGS) != 0:
            raise SystemExit(f"stratbench {' '.join(ARGS)} failed")
    table = "\n".join(lines(json.loads(buf.getvalue())["results"]))
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    print(table)


if __name__ == "__main__":
    main()
