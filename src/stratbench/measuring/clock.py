"""Time, honestly: a step timer read after the device is synchronised (warm-up excluded) and the per-phase
clock of ``--breakdown`` (data, forward, backward, optimizer, other; what no span covers is reported)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class StepTimer:
    """Per-step wall time read after ``sync()``; the first ``warmup`` steps are excluded from statistics."""

    def __init__(self, sync: Callable[[], None], warmup: int) -> None:
        self.sync = sync
        self.warmup = warmup
        self.times: list[float] = []
        self.seen = 0
        self._t0 = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self.sync()
        dt = time.perf_counter() - self._t0
        self.seen += 1
        if self.seen > self.warmup:
            self.times.append(dt)
        return dt

    def summary(self) -> dict[str, float | None]:
        t = self.times
        if not t:
            return {
                "step_time_mean_s": None,
                "step_time_median_s": None,
                "step_time_p90_s": None,
                "measured_steps": 0,
            }
        q = statistics.quantiles(t, n=10)[-1] if len(t) >= 2 else t[0]
        return {
            "step_time_mean_s": statistics.fmean(t),
            "step_time_median_s": statistics.median(t),
            "step_time_p90_s": q,
            "measured_steps": len(t),
        }


PHASES = ("data", "forward", "backward", "optimizer", "other")
"""The parts of a step: waiting for the batch, forward, backward (with the communication overlapped with it),
the optimizer step (with ZeRO's gathers after it), and the rest (loss bookkeeping, the LR schedule, the
state-bytes count): each timed as its own spans."""
COMPUTE_PHASES = ("forward", "backward", "optimizer")


class PhaseClock:
    """Times the named spans of each step on the step timer's synchronised clock, each phase on its own clock
    reads (nothing is derived from the step time), so that the phases adding up to the step time the
    ``StepTimer`` measured is a check: a part of the step no span covers, or spans timed twice (nested), show as
    ``unattributed`` (step - sum of phases; its median over the steps as well, which one preempted step does not
    move). Warm-up and traced steps are left out. Each span is also a
    ``record_function`` range, so it shows by name in a profiler trace."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def phase(self, name: str) -> _Span:
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}; allowed: {', '.join(PHASES)}")
        return _Span(self, name)

    def end_step(self, step_s: float, measured: bool) -> None:
        row = {p: self.current.get(p, 0.0) for p in PHASES}
        row["step"] = step_s
        row["unattributed"] = step_s - sum(row[p] for p in PHASES)
        if measured:
            self.steps.append(row)
        self.current = {}

    def summary(self) -> dict[str, Any] | None:
        if not self.steps:
            return None
        means = {k: statistics.fmean(r[k] for r in self.steps) for k in (*PHASES, "step", "unattributed")}
        # A step the scheduler preempted between two spans puts its lost time in that step's unattributed part
        # only; a span missing (or timed twice) puts it in every step's. The median step tells them apart.
        return means | {
            "unattributed_median": statistics.median(r["unattributed"] for r in self.steps),
            "step_median": statistics.median(r["step"] for r in self.steps),
            "measured_steps": len(self.steps),
        }


class _Span:
    """One timed span of a phase. The clock reads are its first and last acts, the profiler range and the
    device synchronisations inside them, so that the time between two spans is only the caller's own code:
    what ``unattributed`` measures."""

    __slots__ = ("clock", "name", "range", "t0")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.range = torch.profiler.record_function(f"phase:{self.name}")
        self.range.__enter__()
        self.clock.sync()  # work queued before the span (none: the previous span ended synchronised)

    def __exit__(self, *exc: object) -> None:
        try:
            self.clock.sync()
            self.range.__exit__(*exc)
        finally:
            current = self.clock.current
            current[self.name] = current.get(self.name, 0.0) + time.perf_counter() - self.t0


def breakdown_report(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """``metrics.breakdown``: per rank the mean seconds of each phase per step and of the step itself; over
    ranks the mean share of each phase, of the part no phase covered (``unattributed``; also on each rank's
    median step, which a step preempted by another process does not move), and the share that is
    not compute (everything but forward, backward and the optimizer step)."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return None
    timed = [r for r in ranks if r["step"] > 0]
    share = {p: statistics.fmean(r[p] / r["step"] for r in timed) for p in PHASES} if timed else {}
    unattributed = statistics.fmean(r.get("unattributed", 0.0) / r["step"] for r in timed) if timed else 0.0
    median = [r["unattributed_median"] / r["step_median"] for r in timed if r.get("step_median")]
    return {
        "phases": list(PHASES),
        "per_rank_s": per_rank,
        "share": share,
        "unattributed_share": unattributed,
        "unattributed_median_share": statistics.fmean(median) if median else None,
        "not_compute_share": 1.0 - sum(share.get(p, 0.0) for p in COMPUTE_PHASES) if share else None,
    }
