"""How busy the machine was while a run trained, and the rule that says when times taken under it are not the
method's own. Two readings, either of which marks a run busy:

- the 1-minute load average, sampled as it ran: a mean above ``BUSY_FACTOR`` times the cores. It lags by about a
  minute, so a run of a few seconds beside other work can stay under it;
- the share of the machine's CPU time that went to other processes over the run's own window (``CpuShare``: the
  machine's busy CPU seconds from /proc/stat less what the run's processes and their children used): above
  ``OTHERS_LIMIT``. It sees at once what the load average learns a minute late.

``compare`` judges its cells by this rule (the report's busy mark), and ``train`` records and warns by it.
"""

from __future__ import annotations

import os
import time

BUSY_FACTOR = 1.5
"""A mean 1-minute load average above this many times the cores: the run shared its cores with other work (its
own processes count once per core they keep busy, so a run that fills the machine stays below it)."""


OTHERS_LIMIT = 0.25
"""Other processes' share of the machine's CPU time (cores x the run's window) above which the run was not alone.
Measured on this project's 2-core VM (2026-11-28, `train --model tinynet --width 8 --synthetic-samples 2048`):
0.004-0.008 idle (3 runs; 0.0 under ddp on 2 processes), 0.32-0.35 beside one spinning process, whose train
time it inflated from 1.2-1.4 s to 3.2-4.7 s while the mean load average stayed 1.5-1.6, under 1.5x the cores."""


def load_average() -> float | None:
    """The machine's 1-minute load average; None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_count() -> int:
    """The machine's cores, as compare's executors record them (``os.cpu_count``)."""
    return os.cpu_count() or 1


def is_busy(load_mean: float | None, cores: int | None, others: float | None = None) -> bool:
    """Whether a run whose mean 1-minute load average was ``load_mean`` on ``cores`` cores, and whose machine gave
    ``others`` of its CPU time to other processes, ran on a busy machine (False where neither was recorded)."""
    return (load_mean is not None and load_mean > BUSY_FACTOR * (cores or 1)) or (
        others is not None and others > OTHERS_LIMIT
    )


def busy_text(load_mean: float | None, cores: int | None, others: float | None = None) -> str:
    """``mean 1-minute load average 5.3 on 2 cores, above 1.5x the cores``, or ``other processes took 46% of
    the 2 cores' time``: the numbers behind a busy flag."""
    if others is not None and others > OTHERS_LIMIT:
        return f"other processes took {others:.0%} of the {cores or 1} cores' time, above {OTHERS_LIMIT:.0%}"
    return f"mean 1-minute load average {load_mean or 0:.1f} on {cores or 1} cores, above {BUSY_FACTOR:g}x the cores"


def _machine_busy_s() -> float | None:
    """The machine's busy CPU seconds since boot, all cores (/proc/stat: every state but idle and iowait; steal
    counts, as a neighbour's use of the host's cores slows this run too); None where psutil cannot read it."""
    import psutil

    try:
        t = psutil.cpu_times()
    except (OSError, AttributeError):
        return None
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_cpu_s() -> float:
    """CPU seconds of this process, the children it has reaped and the ones alive (data loader workers, compile
    workers): all of this run's work on this process's side."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended between the listing and the read
            continue
        total += c.user + c.system
    return total


class CpuShare:
    """The machine's busy CPU seconds and this process's own over a window (from the first ``sample`` to the
    last). The ranks on one machine add their own seconds up (``others_share``): what is left is other work."""

    def __init__(self) -> None:
        self.first: tuple[float, float, float] | None = None
        self.last: tuple[float, float, float] | None = None

    def sample(self) -> None:
        machine = _machine_busy_s()
        if machine is None:
            return
        reading = (time.monotonic(), machine, _own_cpu_s())
        if self.first is None:
            self.first = reading
        self.last = reading

    def summary(self) -> dict[str, float] | None:
        """``window_s``, ``machine_cpu_s`` and ``own_cpu_s`` over the window; None where it was not read."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        w, m, o = (b - a for a, b in zip(self.first, self.last, strict=True))
        return {"window_s": w, "machine_cpu_s": m, "own_cpu_s": o}


def others_share(readings: list[dict[str, float]], cores: int) -> float | None:
    """Other processes' share of one machine's CPU time over its ranks' windows, from each rank's ``CpuShare``
    summary: the busiest machine reading (the ranks read the same machine over nearly the same window) less the
    ranks' own seconds, over cores x the longest window. None where no rank read it."""
    if not readings:
        return None
    window = max(r["window_s"] for r in readings)
    others = max(r["machine_cpu_s"] for r in readings) - sum(r["own_cpu_s"] for r in readings)
    return max(0.0, others) / (window * max(1, cores)) if window > 0 else None


class LoadSampler:
    """The load average seen while a run trains, sampled at most every ``every_s`` seconds (reading it costs a
    read of /proc/loadavg, so a per-step call is cheap, and the rate limit keeps fast steps from over-sampling),
    and the machine's CPU time beside the run's own (``cpu``, read at most every ``cpu_every_s``: it lists the
    process's children; ``sample(force=True)`` at a phase's ends)."""

    def __init__(self, every_s: float = 0.5, cpu_every_s: float = 2.0) -> None:
        self.every_s = every_s
        self.cpu_every_s = cpu_every_s
        self.samples: list[float] = []
        self.cpu = CpuShare()
        self._last = float("-inf")
        self._last_cpu = float("-inf")

    def sample(self, force: bool = False) -> None:
        """Take a sample unless the last one is younger than ``every_s`` (``force``: take both readings now)."""
        now = time.monotonic()
        if force or now - self._last_cpu >= self.cpu_every_s:
            self._last_cpu = now
            self.cpu.sample()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        load = load_average()
        if load is not None:
            self.samples.append(load)

    def mean(self) -> float | None:
        """The mean of the samples (None: none was taken)."""
        return sum(self.samples) / len(self.samples) if self.samples else None
