"""Training progress: a live tqdm bar on a terminal, plain lines on a file or a pipe, nothing when it is off.

The three share tqdm's interface as the engine uses it (``update``, ``set_postfix``, ``write``, ``close``), so the
training loop calls them without asking which it has."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

LINE_EVERY_S = 10.0
"""A progress line on a non-terminal at least this often (seconds)..."""
LINE_EVERY_FRACTION = 0.1
"""...and at least every this fraction of the steps, whichever comes first; the last step always has one."""


def progress_bar(enabled: bool, total: int, initial: int, desc: str, stream: TextIO | None = None):
    """The progress display for a training loop of ``total`` steps starting at ``initial``: tqdm where ``stream``
    (stderr by default) is a terminal, LineProgress where it is a file or a pipe (tqdm's carriage-return redraws
    would make one endless line of a CI log), NullProgress where ``enabled`` is false (off, or not rank 0)."""
    if not enabled:
        return NullProgress()
    stream = stream or sys.stderr
    if not _isatty(stream):
        return LineProgress(total, initial, desc, stream)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=stream,
                mininterval=0.1, maxinterval=10.0)  # fmt: skip


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed file
        return False


class NullProgress:
    """No progress display (turned off, or a rank other than 0); ``write`` still prints, as without a bar."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


class LineProgress:
    """Progress as whole lines, for a file or a pipe: ``train ddp/fp32: step 120/400 (30%), loss 0.4123, 3.2
    step/s, eta 1m27s``, one every ``every_s`` seconds or ``every_fraction`` of the steps, whichever comes
    first, and one for the last step (at ``update`` reaching ``total``, else at ``close``)."""

    def __init__(self, total: int, initial: int, desc: str, stream: TextIO | None = None,
                 every_s: float = LINE_EVERY_S, every_fraction: float = LINE_EVERY_FRACTION,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.total, self.n, self.desc = max(1, total), initial, desc
        self.stream = stream
        self.every_s = every_s
        self.every_steps = max(1, math.ceil(self.total * every_fraction))
        self.clock = clock
        self.postfix: dict[str, Any] = {}
        self._t0 = self._last_t = clock()
        self._n0 = self._last_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if (
            self.n >= self.total
            or self.n - self._last_n >= self.every_steps
            or now - self._last_t >= self.every_s
        ):
            self._emit(now)

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None:
        """What the next line shows after the step count, e.g. {"loss": "0.4123"} (refresh: tqdm's, ignored)."""
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        if self.n != self._last_n:
            self._emit(self.clock())

    def _emit(self, now: float) -> None:
        self._last_t, self._last_n = now, self.n
        rate = (self.n - self._n0) / (now - self._t0) if now > self._t0 else 0.0
        eta = fmt_eta((self.total - self.n) / rate) if rate > 0 else "?"
        fields = [*(f"{k} {v}" for k, v in self.postfix.items()), f"{rate:.3g} step/s", f"eta {eta}"]
        line = (
            f"train {self.desc}: step {self.n}/{self.total} ({self.n / self.total:.0%}), {', '.join(fields)}"
        )
        print(line, file=self.stream or sys.stderr, flush=True)


def fmt_eta(seconds: float) -> str:
    """A duration for a progress line: 45s, 1m27s, 2h03m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"
