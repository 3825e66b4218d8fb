"""How busy the machine was while a run trained: the 1-minute load average, sampled as it ran, and the one rule
that says when times taken under it are not the method's own (a mean load above ``BUSY_FACTOR`` times the
cores). ``compare`` judges its cells by this rule (the report's busy mark), and ``train`` records and warns by it.
"""

from __future__ import annotations

import os
import time

BUSY_FACTOR = 1.5
"""A mean 1-minute load average above this many times the cores: the run shared its cores with other work (its
own processes count once per core they keep busy, so a run that fills the machine stays below it)."""


def load_average() -> float | None:
    """The machine's 1-minute load average; None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_count() -> int:
    """The machine's cores, as compare's executors record them (``os.cpu_count``)."""
    return os.cpu_count() or 1


def is_busy(load_mean: float | None, cores: int | None) -> bool:
    """Whether a run whose mean 1-minute load average was ``load_mean`` on ``cores`` cores ran on a busy machine
    (False where the load was not recorded)."""
    return load_mean is not None and load_mean > BUSY_FACTOR * (cores or 1)


def busy_text(load_mean: float, cores: int | None) -> str:
    """``mean 1-minute load average 5.3 on 2 cores, above 1.5x the cores``: the numbers behind a busy flag."""
    return (
        f"mean 1-minute load average {load_mean:.1f} on {cores or 1} cores, above {BUSY_FACTOR:g}x the cores"
    )


class LoadSampler:
    """The load average seen while a run trains, sampled at most every ``every_s`` seconds (reading it costs a
    read of /proc/loadavg, so a per-step call is cheap, and the rate limit keeps fast steps from over-sampling)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._last = float("-inf")

    def sample(self) -> None:
        """Take a sample unless the last one is younger than ``every_s``."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        load = load_average()
        if load is not None:
            self.samples.append(load)

    def mean(self) -> float | None:
        """The mean of the samples (None: none was taken)."""
        return sum(self.samples) / len(self.samples) if self.samples else None
