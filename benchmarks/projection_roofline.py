"""The roofline basis (issue 49 item 1) against the published single-GPU figures of
src/stratbench/measuring/published.yaml, beside today's default basis (the family fallback efficiency): each 1-GPU
row of benchmarks/projection_published.py projected both ways (the same config, system and CPU data loader), the
error of each, and the median absolute error per model family and per model. Nothing here changes
projection_published.py or its results; nothing is measured: the inputs are the published numbers, the traced ops
of each model and hardware.yaml.

    PYTHONPATH=src python benchmarks/projection_roofline.py

The roofline's fractions are assumptions (hardware.yaml ``roofline``), and no figure here set them; the default
basis' efficiencies were set by the ResNet-50 and BERT pre-training rows (``role``), so its error on those rows is
its fit, not a check.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import builtin
from stratbench.predicting.projection import project

sys.path.insert(0, str(Path(__file__).resolve().parent))
import projection_published as pp  # noqa: E402  (the benchmark's own helpers: configs, systems, units)


def projected(e: dict[str, Any], basis: str) -> tuple[float | None, str]:
    """(1-GPU entry ``e``'s projected throughput in its unit on ``basis``, why none)."""
    try:
        cfg = pp.config(e, "single", 1)
        pipeline = builtin().input_pipeline(e["input_pipeline"]) if e.get("input_pipeline") else None
        p = project(cfg, pp.system_of(e), 1, 1, memory=False, input_pipeline=pipeline, basis=basis)
    except ConfigError as exc:
        return None, str(exc)
    if p.status != "ok" or not p.throughput:
        return None, p.reason or p.status
    return pp.in_unit(e, p.throughput), ""


def main() -> None:
    rows = [e for e in pp.load_published() if e["gpus"] == 1 and not e.get("not_projectable")]
    errors: dict[tuple[str, str], list[float]] = {}
    print("| entry | model | GPU | precision | role | published | default basis | error | roofline | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in rows:
        cells = []
        for basis in ("efficiency", "roofline"):
            value, why = projected(e, basis)
            err = None if value is None else value / float(e["throughput"]) - 1
            cells += [f"{value:,.0f}" if value else f"n/a ({why})", "n/a" if err is None else f"{err:+.1%}"]
            for group in (e["family"], e["model"], f"role: {pp.role(e)}", "all"):
                if err is not None:
                    errors.setdefault((group, basis), []).append(err)
        print(f"| {e['id']} | {e['model']} | {e['gpu']} | {e['precision']} | {pp.role(e)} | "
              f"{e['throughput']:,g} {e['unit']} | " + " | ".join(cells) + " |")  # fmt: skip
    print()
    for group in sorted({g for g, _ in errors}):
        line = []
        for basis, label in (("efficiency", "default basis"), ("roofline", "roofline basis")):
            xs = errors.get((group, basis), [])
            if xs:
                med = statistics.median(map(abs, xs))
                mean = statistics.fmean(xs)
                line.append(f"{label} median |error| {med:.1%} (signed mean {mean:+.1%}, {len(xs)} rows)")
        print(f"- {group}: " + "; ".join(line))


if __name__ == "__main__":
    main()
