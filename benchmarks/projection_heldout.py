"""The held-out validation of the step-time projection (issue 49 item 3) and the error band of each basis (item 4):
every projectable published figure of src/stratbench/measuring/published.yaml outside the multi-node sharded table
(that one is benchmarks/projection_published.py's), projected on each basis, the errors grouped, and the band of
each basis written for ``estimate --time`` to quote.

Per row: its role (*sets* a default of hardware.yaml ``default_efficiency``, or *held out*: sets none), the default
projection (the efficiency basis with hardware.yaml's defaults, no calibration: the family fallback), the roofline
projection (``--basis roofline``: per-op fractions from hardware.yaml, set by no row here), and for a multi-GPU row
the projection calibrated on its own 1-GPU (or smallest) figure of the same table beside the naive linear prediction
(that figure's rate per GPU x the row's GPUs).

    PYTHONPATH=src python benchmarks/projection_heldout.py            # projects every row (minutes), writes all
    PYTHONPATH=src python benchmarks/projection_heldout.py --render   # the results and bands from the rows file

Writes ``ROWS`` (every row's numbers: the slow part), ``RESULTS`` (the markdown, rendered from the rows only) and
``BANDS`` (src/stratbench/measuring/error_bands.json: per basis the median and 80th-percentile absolute error over
its held-out rows, read by ``estimate --time``). tests/predicting/test_heldout.py renders the rows again and checks
that both files are what it gives, and reprojects a row to check the rows file is today's.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import builtin
from stratbench.predicting import projection
from stratbench.predicting.projection import project

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import projection_published as pp  # noqa: E402  (configs, systems, units, the own-figure prediction)

ROWS = HERE / "projection_heldout_rows.json"
RESULTS = HERE / "projection_heldout_cpu_2026-11-28.md"
BANDS = HERE.parent / "src" / "stratbench" / "measuring" / "error_bands.json"
MACHINE = "the project's CPU VM (AMD EPYC, 2 cores), Python 3.11.7, torch 2.13.0+cpu"
GROUPS = (("8 GPUs", 8, 8), ("16-32 GPUs", 9, 63), (">= 64 GPUs", 64, 10**9))
"""The multi-GPU groups: label, fewest and most GPUs."""
FAMILIES = ("efficientnet", "bert-large-squad", "bert-large", "se-resnext", "resnext", "resnet", "llama", "mpt",
            "gpt")  # fmt: skip
"""The model families the 1-GPU rows are summarised by: a model name's prefix (the first that fits)."""
BASES = {"default": "family fallback", "roofline": "roofline with published fractions", "own": "calibrated run"}  # fmt: skip
"""A row's projection column -> the basis ``MethodProjection.basis`` names it by (the band's key)."""


def selected(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows checked here: every projectable 1-GPU figure and every multi-GPU one with a 1-GPU baseline or an
    anchor of the same table, the multi-node sharded table's excepted."""
    return [e for e in entries if not e.get("not_projectable") and e.get("check") != pp.MULTI_NODE
            and (e["gpus"] == 1 or e.get("baseline") or e.get("anchor"))]  # fmt: skip


def model_group(e: dict[str, Any]) -> str:
    """The model family a single-GPU row is summarised under: the model name without its size."""
    m = e["model"]
    for prefix in FAMILIES:
        if m.startswith(prefix):
            return prefix
    return m


def on_basis(e: dict[str, Any], basis: str) -> tuple[float | None, str]:
    """(entry ``e`` projected with no calibration on ``basis`` in its unit, why none)."""
    try:
        cfg = pp.config(e, "single", 1) if e["gpus"] == 1 else pp.config(e)
        pipeline = builtin().input_pipeline(e["input_pipeline"]) if e.get("input_pipeline") else None
        p = project(cfg, pp.system_of(e), e["nodes"], e["gpus"] // e["nodes"], memory=False,
                    input_pipeline=pipeline, basis=basis)  # fmt: skip
    except ConfigError as exc:
        return None, str(exc)
    if p.status != "ok" or not p.throughput:
        return None, p.reason or p.status
    return pp.in_unit(e, p.throughput), ""


def row_of(e: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row's numbers: the published figure, each basis' projection (None: n/a, with why), and for a multi-GPU
    row its own-figure projection and the naive linear prediction."""
    row = {"id": e["id"], "model": e["model"], "group": model_group(e), "family": e["family"], "gpu": e["gpu"],
           "precision": e["precision"], "gpus": e["gpus"], "unit": e["unit"], "role": "sets" if pp.role(e) == "sets" else "held out",
           "published": float(e["throughput"]), "why": {}}  # fmt: skip
    for column, basis in (("default", "efficiency"), ("roofline", "roofline")):
        row[column], why = on_basis(e, basis)
        if why:
            row["why"][column] = why
    if e["gpus"] > 1:
        ref = by_id[e.get("baseline") or e.get("anchor")]
        row["reference"] = ref["id"]
        row["naive"] = pp.in_unit(e, pp.samples_per_s(ref) / ref["gpus"] * e["gpus"])
        r = pp.predict(e, by_id)
        row["own"] = r.predicted
        if r.reason:
            row["why"]["own"] = r.reason
    return row


def project_rows() -> list[dict[str, Any]]:
    """Every selected row projected (the slow part), in published.yaml's order; each traced micro-batch once (a
    table's 1- to 64-GPU rows share one, and the roofline's scaling efficiency traces it again)."""
    projection.trace_ops = functools.lru_cache(maxsize=None)(projection.trace_ops)
    entries = pp.load_published()
    by_id = {e["id"]: e for e in entries}
    rows = []
    for e in selected(entries):
        rows.append(row_of(e, by_id))
        print(f"{len(rows)} {e['id']}", file=sys.stderr, flush=True)  # progress: minutes in all
    return rows


def err(row: dict[str, Any], column: str) -> float | None:
    """The signed error of ``row``'s ``column`` against its published figure (None: no projection)."""
    v = row.get(column)
    return None if v is None else v / row["published"] - 1


def stats(errors: list[float]) -> dict[str, Any]:
    """Count, median and 80th-percentile absolute error, signed mean and the worst of ``errors``."""
    a = sorted(abs(x) for x in errors)
    p80 = a[0] if len(a) == 1 else statistics.quantiles(a, n=10, method="inclusive")[7]
    return {"rows": len(a), "median": statistics.median(a), "p80": p80, "mean": statistics.fmean(errors),
            "worst": max(errors, key=abs)}  # fmt: skip


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _num(row: dict[str, Any], column: str) -> str:
    v = row.get(column)
    return f"{v:,.0f}" if v is not None else f"n/a ({row['why'].get(column, '-')})"


def _summary(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label}: no rows"
    s = stats(errors)
    return (f"{label}: {s['rows']} rows, median |error| {s['median']:.1%}, 80th percentile {s['p80']:.1%}, "
            f"worst {s['worst']:+.1%}, signed mean {s['mean']:+.1%}")  # fmt: skip


def single_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The 1-GPU table and its medians per model family and role, each basis."""
    out = ["| entry | role | model | GPU | precision | published | default projection | error | roofline | error |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in (x for x in rows if x["gpus"] == 1):
        out.append(f"| {r['id']} | {r['role']} | {r['model']} | {r['gpu']} | {r['precision']} | "
                   f"{r['published']:,g} {r['unit']} | {_num(r, 'default')} | {_pct(err(r, 'default'))} | "
                   f"{_num(r, 'roofline')} | {_pct(err(r, 'roofline'))} |")  # fmt: skip
    out.append("")
    one = [x for x in rows if x["gpus"] == 1]
    for role in ("held out", "sets"):
        for group in ["all", *sorted({x["group"] for x in one})]:
            sel = [x for x in one if x["role"] == role and group in ("all", x["group"])]
            for column in ("default", "roofline"):
                errors = [e for e in (err(x, column) for x in sel) if e is not None]
                if errors:
                    out.append("- " + _summary(f"{role}, {group}, {column}", errors))
    return out


def multi_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The multi-GPU table and its medians per GPU-count group, each projection beside the naive linear one."""
    out = ["| entry | role | model | GPU | precision | GPUs | published | from its own figure | error | naive linear |"
           " error | default projection | error | roofline | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    multi = [x for x in rows if x["gpus"] > 1]
    for r in multi:
        out.append(f"| {r['id']} | {r['role']} | {r['model']} | {r['gpu']} | {r['precision']} | {r['gpus']} | "
                   f"{r['published']:,g} {r['unit']} | {_num(r, 'own')} ({r['reference']}) | "
                   f"{_pct(err(r, 'own'))} | {_num(r, 'naive')} | {_pct(err(r, 'naive'))} | "
                   f"{_num(r, 'default')} | {_pct(err(r, 'default'))} | {_num(r, 'roofline')} | "
                   f"{_pct(err(r, 'roofline'))} |")  # fmt: skip
    out.append("")
    for label, lo, hi in GROUPS:
        sel = [x for x in multi if lo <= x["gpus"] <= hi]
        for column, name in (("own", "from its own figure"), ("naive", "naive linear"), ("default", "default"),
                             ("roofline", "roofline")):  # fmt: skip
            errors = [e for e in (err(x, column) for x in sel) if e is not None]
            out.append("- " + _summary(f"{label}, {name}", errors))
    return out


def defaults_lines() -> list[str]:
    """Which published figure (or run) set which default: hardware.yaml's default_efficiency."""
    out = ["| GPU | precision | model family | default | set by |", "|---|---|---|---|---|"]
    for (gpu, family, key), d in sorted(builtin().evidence.items()):
        out.append(f"| {gpu} | {key} | {family} | {d.value:.1%} | {', '.join(d.evidence)} |")
    return out


MIN_FAMILY_ROWS = 3
"""A model family's own band needs this many scored rows; fewer: the projection quotes the basis' band over all."""


def bands(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per basis the held-out error band: the default and roofline projections over the held-out 1-GPU rows, the
    calibrated projection over the multi-GPU rows predicted from their own figure (none of them set a default);
    and the same per model family where it has ``MIN_FAMILY_ROWS`` rows."""
    one = [x for x in rows if x["gpus"] == 1 and x["role"] == "held out"]
    out = {}
    for column, basis in BASES.items():
        sel = one if column != "own" else [x for x in rows if x["gpus"] > 1]
        errors = [e for e in (err(x, column) for x in sel) if e is not None]
        what = ("held-out 1-GPU figures" if column != "own" else
                "multi-GPU figures, each calibrated on its own 1-GPU (or smallest) figure")  # fmt: skip
        out[basis] = {k: round(v, 4) for k, v in stats(errors).items()} | {"over": what}
        families = {}  # the same rows by model family (convnet, transformer): a projection quotes its own
        for family in sorted({x["family"] for x in sel}):
            mine = [e for e in (err(x, column) for x in sel if x["family"] == family) if e is not None]
            if len(mine) >= MIN_FAMILY_ROWS:
                families[family] = {k: round(v, 4) for k, v in stats(mine).items()} | {"over": f"{what} ({family}s)"}
        out[basis]["families"] = families
    return {"source": f"benchmarks/{RESULTS.name}, written by benchmarks/projection_heldout.py", "bands": out}


INTRO = """\
# Held-out validation of the step-time projection, per basis (issue 49 items 3 and 4)

**What**: [projection_heldout.py](projection_heldout.py): every projectable figure of
[published.yaml](../src/stratbench/measuring/published.yaml) but the multi-node sharded ones (those are
[projection_published.py](projection_published.py)'s), each projected with hardware.yaml's defaults (the family
fallback: no calibration), on the roofline basis (per-op fractions from hardware.yaml `roofline`, which no row here
set), and each multi-GPU row from its own 1-GPU (or smallest) figure of the same table beside the naive linear
prediction (that figure's rate per GPU x the GPUs). Role: *sets* = a figure a default was set from (the table at
the end); *held out* = sets none. The multi-GPU rows set no default; the own-figure column is calibrated on the
row's reference, never on the row. Nothing measured: published numbers, traced shapes, hardware.yaml.

**Command**: `PYTHONPATH=src python benchmarks/projection_heldout.py` on {machine}; this file and
`src/stratbench/measuring/error_bands.json` are rendered from `benchmarks/projection_heldout_rows.json`
(`--render`), which tests/predicting/test_heldout.py checks.
"""


def render(rows: list[dict[str, Any]]) -> str:
    """The results file from the rows."""
    lines = [INTRO.format(machine=MACHINE), "## One GPU", "", *single_lines(rows), "", "## Multi-GPU", "",
             *multi_lines(rows), "", "## Error band per basis (error_bands.json; `estimate --time` quotes it)", "",
             "| basis | over | rows | median abs. error | 80th percentile | worst |", "|---|---|---|---|---|---|"]  # fmt: skip
    for basis, b in bands(rows)["bands"].items():
        lines.append(f"| {basis} | {b['over']} | {b['rows']} | {b['median']:.1%} | {b['p80']:.1%} | "
                     f"{b['worst']:+.1%} |")  # fmt: skip
    lines += ["", "## Which figure set which default (hardware.yaml default_efficiency)", ""]
    lines += defaults_lines()
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    if "--render" in argv:
        rows = json.loads(ROWS.read_text())
    else:
        rows = project_rows()
        ROWS.write_text(json.dumps(rows, indent=1) + "\n")
    RESULTS.write_text(render(rows))
    BANDS.write_text(json.dumps(bands(rows), indent=1) + "\n")
    print(RESULTS.read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
