"""A folder's submissions to a cluster, made durable, and a rerun's reconciliation with that cluster.

A SLURM job (and a Ray actor, for as long as its cluster keeps it) outlives the ``compare`` or ``train`` that
submitted it. So every job given to such an executor (``Executor.durable``) is written to
``OUTPUT/submissions.jsonl`` before it is submitted (its key and folder) and again as soon as the executor returns
(its id), and the job carries its key on the cluster itself (SLURM's job comment, Ray's placement group and actor
names), which covers a kill between the two lines. Before a rerun of the same folder submits anything,
``Submissions.reconcile`` asks the cluster for the jobs of this folder: a live one of a job about to run is
adopted (followed like one of this run's) or, with ``--cancel-stale`` or where the executor cannot take a job
over (Ray: an actor belongs to the driver that made it), cancelled and waited for; one that ended and reported
is adopted for its result. Nothing is submitted twice, and a job's folder is cleaned only once no live job of it
is left (docs/cluster.md).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stratbench.core.files import append_json_line, read_json_lines
from stratbench.launching.executor import Executor, Found, Handle, Job

JOURNAL = "submissions.jsonl"
ENDED = ("ended", "cancelled")
"""Journal events after which a submission is no longer the cluster's."""


def folder_key(folder: Path) -> str:
    """The prefix of the keys of every job whose outputs go under ``folder`` (its absolute path, hashed): the
    same folder gives the same key in every run, and a job that still writes there is found by it."""
    digest = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:10]
    return f"sb-{digest}"


def job_key(folder: Path, name: str) -> str:
    """The key of job ``name`` (a cell id; ``train`` for one run) of ``folder``."""
    return f"{folder_key(folder)}-{name}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Submissions:
    """The submissions of the jobs of ``folder`` through ``executor``; ``say`` prints a line for the user."""

    def __init__(
        self, folder: Path, executor: Executor, say: Callable[[str], None] = _stderr, journal: Path | None = None
    ) -> None:
        self.folder = Path(folder).resolve()
        self.path = Path(journal) if journal is not None else self.folder / JOURNAL
        self.executor = executor
        self.say = say

    def _write(self, event: str, key: str, name: str, **fields: Any) -> None:
        if self.executor.durable:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_json_line(self.path, {"event": event, "key": key, "name": name, "executor": self.executor.name,
                                         "at": time.time(), **fields})  # fmt: skip

    def open_entries(self) -> dict[str, dict[str, Any]]:
        """The latest submission of each key that was not seen to end: its ``dir`` and ``ref`` (the executor's
        id, empty when the run died before the executor returned)."""
        entries: dict[str, dict[str, Any]] = {}
        for rec in read_json_lines(self.path):
            key = rec.get("key")
            if not isinstance(key, str):
                continue
            event = rec.get("event")
            if event in ("submitting", "adopted"):
                entries[key] = {"dir": rec.get("dir"), "ref": rec.get("ref") or {}}
            elif event == "submitted" and key in entries:
                entries[key]["ref"] = rec.get("ref") or {}
            elif event in ENDED and key in entries:
                refs = rec.get("refs")  # a cancelled duplicate leaves the adopted job of its key open
                if refs is None or not entries[key]["ref"] or entries[key]["ref"] in refs:
                    del entries[key]
        return entries

    def submit(self, job: Job) -> Handle:
        """Submit ``job``: its key and folder are on disk before the executor is asked, its id right after."""
        self._write("submitting", job.key, job.name, dir=str(job.log.parent))
        handle = self.executor.submit(job)
        self._write("submitted", job.key, job.name, ref=self.executor.ref(handle))
        return handle

    def ended(self, job: Job, how: str) -> None:
        """The job ended (``how``: its status) or was cancelled: no longer one to look for."""
        self._write("cancelled" if how == "cancelled" else "ended", job.key, job.name, how=how)

    def reconcile(self, jobs: Mapping[str, Job], adopt: bool = True) -> dict[str, Handle]:
        """Before any submission: settle the jobs of earlier runs of this folder that the cluster still has.
        ``jobs``: the jobs this run is about to submit, by key. Returns handles on the ones adopted (not to be
        submitted again); every other live job of this folder is cancelled (when it is one of ``jobs``, or with
        --cancel-stale) and waited for, or named and left alone (a job this run does not run)."""
        if not self.executor.durable:
            return {}
        found: dict[str, list[Found]] = {}
        for item in self.executor.find(self.folder_prefix, self.open_entries()):
            found.setdefault(item.key, []).append(item)
        adopted: dict[str, Handle] = {}
        for key, items in found.items():
            job = jobs.get(key)
            kept = self._adopt(job, items) if job is not None and adopt else None
            if kept is not None:
                adopted[key] = kept
            stale = [f for f in items if f.live and (kept is None or f.ref != self.executor.ref(kept))]
            if stale:
                self._settle(key, job, stale, self._why(job, adopt, kept))
        return adopted

    @property
    def folder_prefix(self) -> str:
        return folder_key(self.folder)

    def _adopt(self, job: Job, items: list[Found]) -> Handle | None:
        """A handle on the newest job of ``items`` this run can take over (a live one unless --cancel-stale; an
        ended one for its result), else None."""
        for item in items:
            if item.live and self.executor.cancel_stale:
                continue
            handle = self.executor.adopt(job, item)
            if handle is not None:
                self._write("adopted", job.key, job.name, ref=dict(item.ref), dir=str(job.log.parent))
                how = "waiting for it" if item.live else "reading its result"
                self.say(f"{job.name}: adopted {item.what}, submitted by an earlier run of this folder: {how} "
                         "instead of submitting it again")  # fmt: skip
                return handle
        return None

    def _why(self, job: Job | None, adopt: bool, kept: Handle | None) -> str:
        """Why the live jobs of a key that were not adopted are cancelled."""
        if self.executor.cancel_stale:
            return "--cancel-stale"
        if job is not None and not adopt:
            return "a cell of several repeats starts over"
        if kept is not None:
            return "a second job of the same cell"
        return f"--executor {self.executor.name} cannot take over another run's job"

    def _settle(self, key: str, job: Job | None, stale: list[Found], why: str) -> None:
        """Cancel ``stale`` (live jobs of ``key`` not adopted) and wait until they ended; a job of a cell this run
        does not run is only named, unless --cancel-stale."""
        name = job.name if job is not None else key.removeprefix(self.folder_prefix + "-")
        what = ", ".join(f.what for f in stale)
        if job is None and not self.executor.cancel_stale:
            self.say(f"note: {what} of an earlier run of this folder ({name}) is still on the cluster; this run "
                     "does not run it and leaves it (--cancel-stale cancels it)")  # fmt: skip
            return
        self.say(f"{name}: cancelling {what}, left by an earlier run of this folder ({why}); waiting until it "
                 "has ended")  # fmt: skip
        self.executor.remove(stale)
        self._write("cancelled", key, name, how="cancelled", refs=[dict(f.ref) for f in stale])
