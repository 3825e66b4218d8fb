"""Warnings that libraries raise during a run (DeepSpeed's calls to torch's deprecated collectives: 14 of a
2-process, 3-step ZeRO-3 run's 52 lines on the CPU VM, 2026-11-28; 266 of 564 in issue 50's longer run) go to the
run's folder, not the terminal: each rank
keeps the ones Python's filters let through and, when its run ends, writes them to ``OUTPUT/warnings-rankR.log``;
rank 0 says in one line how many there were and where. stratbench's own warnings are shown as before. Nothing is
written where the run never made its folder (bad input changes nothing)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OWN = str(Path(__file__).resolve().parents[1])
"""Warnings raised from files under this folder are stratbench's own: shown, not filed."""


@contextmanager
def filed_library_warnings(output: str | os.PathLike, rank: int | None = None) -> Iterator[list[str]]:
    """For the block: third-party warnings collected (as Python would print them), written to the run's folder
    afterwards, one line saying so on rank 0. Yields the collected lines."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    caught: list[str] = []
    shown = warnings.showwarning

    def file_it(message, category, filename, lineno, file=None, line=None) -> None:
        if str(Path(filename).resolve()).startswith(OWN):
            shown(message, category, filename, lineno, file, line)
        else:
            caught.append(warnings.formatwarning(message, category, filename, lineno, line).rstrip())

    warnings.showwarning = file_it
    try:
        yield caught
    finally:
        warnings.showwarning = shown
        _write(Path(output), rank, caught)


def _write(folder: Path, rank: int, caught: list[str]) -> None:
    """The rank's warnings into ``folder`` (where the run made it) and rank 0's one line about them."""
    if not caught or not folder.is_dir():
        return
    path = folder / f"warnings-rank{rank}.log"
    with path.open("a") as f:
        f.write("\n".join(caught) + "\n")
    if rank == 0:
        heads = [entry.splitlines()[0] for entry in caught]
        first = next((h.split(": ", 1)[-1] for h in heads if "Warning: " in h), heads[0])[:140]
        print(f"{len(caught)} library warning(s) filed in {path} (the first: {first})", file=sys.stderr, flush=True)
