"""torchrun (``torch.distributed.run``) as stratbench's launcher starts it, with one difference: a rendezvous
that cannot complete (a node that never joins within --dist-timeout-s, node 0 unreachable, its port taken)
ends with exit code RENDEZVOUS_FAILED and the error's first line in the launcher's private folder (the path in
ERROR_FILE_ENV), rather than the agent's 40-line traceback: the launcher turns it into its one-line error. A
worker whose set-up failed notes why in the folder SETUP_ERRORS_ENV names; then the agent ends quietly with
SETUP_FAILED and the launcher says why, once. And where the workers that failed
each said why in one line (a stratbench error's exit code; the others stopped by torchrun), torchrun exits 1
without its own traceback and failure table: the launcher names the cause; so too when the launcher forwarded a
signal (it says "stopped by SIGTERM")."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from stratbench.core.errors import ConfigError, DivergedError, UnsupportedError

RENDEZVOUS_FAILED = 75
SETUP_FAILED = 76
ERROR_FILE_ENV = "STRATBENCH_TORCHRUN_ERROR_FILE"
SETUP_ERRORS_ENV = "STRATBENCH_SETUP_ERRORS"
"""A folder where a worker whose set-up failed (bad input, before it wrote anything) notes why; once one has,
the agent's account of the failure (its log lines, its ChildFailedError) is left out: the launcher says why."""


class _QuietAfterSetupError(logging.Filter):
    """Drops torch's log records once a worker has noted a set-up error in ``folder``."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return not _setup_error_noted(self.folder)


def _setup_error_noted(folder: str | None) -> bool:
    return bool(folder) and any(Path(folder).glob("rank*.json"))


ONE_LINE_EXITS = frozenset(cls.exit_code for cls in (ConfigError, UnsupportedError, DivergedError))
"""A worker's exit code after stratbench printed its one-line error (``cli.main``)."""
STOPPED = frozenset({-signal.SIGTERM, -signal.SIGKILL})
"""A worker torchrun stopped because another one failed."""


def main() -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    setup_errors = os.environ.get(SETUP_ERRORS_ENV)
    if setup_errors:
        for handler in logging.getLogger("torch").handlers + logging.getLogger("torch.distributed").handlers:
            handler.addFilter(_QuietAfterSetupError(setup_errors))
    try:
        torchrun()
    except (DistError, RendezvousError) as exc:  # raised by the agent's rendezvous, before any worker starts
        text = str(exc).strip()
        line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]
        path = os.environ.get(ERROR_FILE_ENV)
        if path:
            Path(path).write_text(line + "\n")
        else:
            print(line, file=sys.stderr)
        return RENDEZVOUS_FAILED
    except ChildFailedError as exc:
        if _setup_error_noted(setup_errors):
            return SETUP_FAILED
        codes = {failure.exitcode for failure in exc.failures.values()}
        if codes & ONE_LINE_EXITS and codes <= ONE_LINE_EXITS | STOPPED:
            return 1  # torchrun's own exit code for a failed worker
        raise
    except SignalException as exc:  # the launcher forwarded a signal and says so in one line
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
