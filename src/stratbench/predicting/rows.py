"""The rows of `stratbench estimate`: one per method, its memory estimate (or the largest batch that fits) and,
with a hardware system, its step-time projection. The command parses the flags and prints; this computes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import System
from stratbench.predicting import estimate as est
from stratbench.predicting.projection import project
from stratbench.strategies.base import baseline_name, get_strategy
from stratbench.strategies.costs import NoMemoryModel


@dataclass(frozen=True)
class RowSettings:
    """What every row of one table shares."""

    world_size: int
    """The devices the table is for; a method that does not span devices (``Strategy.spans_devices``) uses one."""
    device_type: str
    """The device whose per-process overhead and allocator rounding the estimate adds (cuda, cpu)."""
    every_method: bool
    """One row per method (``--strategy all``): a method that cannot be built for this model and world is an n/a
    row with the reason, and its options are completed for the world (``Strategy.options_for_world``); with one
    method its error is raised."""
    max_batch: bool = False
    """Solve for the largest global batch that fits ``device_memory`` instead of estimating the given one."""
    device_memory: int | None = None
    system: System | None = None
    """With a system, each row also holds its projection (step time, throughput, scaling)."""
    calibration: dict | None = None
    nodes: int = 1
    gpus_per_node: int | None = None
    basis: str = "efficiency"
    """The projection's compute basis (``projection.BASES``): one efficiency, or the per-op roofline."""


def method_rows(
    names: Iterable[str], config_for: Callable[[str], TrainConfig], settings: RowSettings
) -> list[dict]:
    """One row per method in ``names``; ``config_for(name)`` is its TrainConfig (a ConfigError there is an n/a row
    with ``every_method``). With a system, each projection also has its speed-up over the baseline method."""
    rows = [method_row(name, config_for, settings) for name in names]
    if settings.system is not None:
        add_speedups(rows)
    return rows


def method_row(name: str, config_for: Callable[[str], TrainConfig], settings: RowSettings) -> dict:
    """One method's row: {"strategy", "estimate" (a dict or None), "max_global_batch" with ``max_batch``, "options"
    where it has any, "projection" with a system, and "na" (why it cannot run) or "no_model" (why it cannot be
    estimated) with ``every_method``}."""
    strategy = get_strategy(name)
    world = strategy.devices_for_world(settings.world_size)
    try:
        cfg = config_for(name)
        if settings.every_method:
            cfg = cfg.replace(strategy_options=strategy.options_for_world(cfg, world))
            strategy.parse_options(cfg.strategy_options)
        row = _memory(name, cfg, world, settings)
    except NoMemoryModel as exc:
        if not settings.every_method:
            raise
        row = {"strategy": name, "estimate": None, "no_model": str(exc)}
    except ConfigError as exc:
        if not settings.every_method:
            raise
        return {"strategy": name, "estimate": None, "na": str(exc), "projection": None}
    if settings.system is not None:
        s = settings
        row["projection"] = project(
            cfg, s.system, s.nodes, s.gpus_per_node, s.calibration, memory=False, basis=s.basis
        ).to_dict()
    return row


def _memory(name: str, cfg: TrainConfig, world: int, settings: RowSettings) -> dict:
    """The memory part of a row: the estimate, or the largest global batch that fits and its estimate."""
    if settings.max_batch:
        batch, e = est.max_batch(cfg, world, settings.device_memory, settings.device_type)
        row = {"strategy": name, "max_global_batch": batch, "estimate": e.to_dict() if e else None}
    else:
        row = {"strategy": name, "estimate": est.estimate(cfg, world, settings.device_type).to_dict()}
    if cfg.strategy_options:
        row["options"] = cfg.strategy_options
    return row


def answered(row: dict) -> bool:
    """Whether a row holds an answer: an estimate, a largest batch (0 where none fits) or a projection."""
    projected = (row.get("projection") or {}).get("status") == "ok"
    return row.get("estimate") is not None or "max_global_batch" in row or projected


def none_answered(rows: list[dict]) -> str | None:
    """One line saying why, where no row holds an answer (every method n/a); None where one does."""
    if not rows or any(answered(r) for r in rows):
        return None
    reasons: dict[str, list[str]] = {}
    for r in rows:
        p = r.get("projection") or {}
        why = r.get("na") or r.get("no_model") or p.get("reason") or "no estimate"
        reasons.setdefault(why, []).append(r["strategy"])
    if len(reasons) == 1:
        return f"no method could be estimated: {next(iter(reasons))}"
    return "no method could be estimated: " + "; ".join(
        f"{', '.join(m)}: {why}" for why, m in reasons.items()
    )


def add_speedups(rows: list[dict]) -> None:
    """Each projection's "speedup_vs_single": its throughput over the baseline method's at the same global batch
    (strong scaling), where the baseline has a projected throughput."""
    base = baseline_name()
    reference = next((r["projection"] for r in rows if r["strategy"] == base), None)
    if not (reference and reference.get("throughput")):
        return
    for r in rows:
        if r.get("projection"):
            t = r["projection"].get("throughput")
            r["projection"]["speedup_vs_single"] = t / reference["throughput"] if t else None


def hardware_summary(
    system: System, nodes: int, gpus_per_node: int | None, calibration: dict | None
) -> dict[str, Any]:
    """The system a projection ran on, its links, overlap and calibration: the JSON output's "hardware"."""
    return {
        "system": system.key,
        "source": system.source,
        "gpu": system.gpu.name,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "intra_node": system.intra_node.key,
        "inter_node": system.inter_node.key if system.inter_node else None,
        "overlap": system.overlap,
        "overlap_source": system.overlap_source,
        "calibration": None if calibration is None else {
            k: {"efficiency": c.efficiency, "overhead_s": c.overhead_s, "source": c.source, "points": c.points}
            for k, c in calibration.items()
        },
    }  # fmt: skip
