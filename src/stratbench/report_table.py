"""A one-run result table for the terminal (the comparison report builds on the same formatting)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def table_console(**kwargs: Any):
    """A rich Console for printed tables: the terminal's width, or 220 columns when stdout is a file or a pipe
    (rich would assume 80 and cut method names to "deep…")."""
    import sys

    from rich.console import Console

    if "width" not in kwargs and not sys.stdout.isatty():
        kwargs["width"] = 220
    return Console(**kwargs)


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
        ("throughput", fmt_num(m.get("throughput_samples_per_s"), ".1f", " samples/s")),
        (f"peak memory per rank ({kind})", ", ".join(fmt_bytes(p) for p in peaks) or "n/a"),
        ("GPU utilisation mean", ", ".join(fmt_num(u, ".0f", "%") for u in util) or "n/a (no NVIDIA GPU)"),
        ("MFU", fmt_num(m.get("mfu") and m["mfu"] * 100, ".1f", "%") if m.get("mfu") is not None else "n/a"),
        ("final train loss", fmt_num(m.get("final_loss"), ".4f")),
        ("val accuracy", fmt_num(m.get("val_accuracy") and m["val_accuracy"] * 100, ".2f", "%")),
    ]
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
