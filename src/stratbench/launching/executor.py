"""Where a run's processes start: the one small interface every executor implements (``submit`` / ``poll`` /
``cancel``), the job it is given and the outcome it returns.

A ``Job`` is a command (``python -m stratbench train --config FILE [--nproc N]``) to run on ``nodes`` machines,
``procs_per_node`` processes each; for several nodes the executor adds ``--nnodes/--node-rank/--master-addr/
--master-port`` (stratbench's own launcher then starts torchrun on each node). ``local`` runs it on this machine
(``launching.local_executor``), ``ray`` on a Ray cluster (``launching.ray_executor``), ``slurm`` as SLURM batch
jobs (``launching.slurm_executor``); ``launching.executors`` names them. The sweep (``compare.runner``) and ``stratbench train --executor`` only
call this interface, so neither knows which executor runs a job.

This module imports the standard library only: the Ray node side (``launching.ray_node``) uses it on nodes
without paying for torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class Shape:
    """What one job needs: ``nodes`` machines, each with ``procs_per_node`` CPUs (one per process) and
    ``gpus_per_node`` GPUs."""

    nodes: int = 1
    procs_per_node: int = 1
    gpus_per_node: int = 0

    def __str__(self) -> str:
        gpus = f" and {self.gpus_per_node} GPU(s)" if self.gpus_per_node else ""
        return f"{self.nodes} node(s) with {self.procs_per_node} CPU(s){gpus} each"


@dataclass(frozen=True)
class Job:
    """One run to start. ``command`` is the whole command line on this machine (its first word this Python);
    ``log`` receives node 0's output, ``log``'s ``.nodeN`` sibling node N's; ``env`` is added to the
    environment of every node's command."""

    name: str
    command: tuple[str, ...]
    log: Path
    shape: Shape = Shape()
    env: Mapping[str, str] = field(default_factory=dict)
    key: str = ""
    """Its durable name on the cluster (``launching.submissions.job_key``: its folder and its name), carried by
    what the executor makes of it (SLURM's job comment, Ray's placement group and actor names), so that a later
    run of the same folder finds it even when this process died before it wrote the job's id down."""

    def node_command(
        self, rank: int, master_addr: str, master_port: int, python: str | None = None
    ) -> list[str]:
        """The command node ``rank`` runs (``python``: that node's interpreter in place of this one)."""
        cmd = list(self.command)
        if python and cmd and cmd[0] == sys.executable:
            cmd[0] = python
        if self.shape.nodes > 1:
            cmd += ["--nnodes", str(self.shape.nodes), "--node-rank", str(rank),
                    "--master-addr", master_addr, "--master-port", str(master_port)]  # fmt: skip
        return cmd

    def node_log(self, rank: int) -> Path:
        return self.log if rank == 0 else self.log.with_name(f"{self.log.stem}.node{rank}{self.log.suffix}")


@dataclass
class Outcome:
    """How a job ended. ``reason`` is set when the executor ended it (its node died, it could not start), and
    ``lost`` when that was no fault of the run (a rerun of the sweep runs it again)."""

    returncode: int | None
    elapsed_s: float
    reason: str = ""
    lost: bool = False
    loads: list[float] = field(default_factory=list)
    """1-minute load averages seen on node 0 while it ran (the report flags timings taken on a busy machine)."""
    cpu_count: int | None = None
    """CPU cores of node 0."""
    timed_out: bool = False
    """A time limit ended it: the caller's (the caller cancelled it) or the executor's own (SLURM's --time, with
    ``reason`` saying so)."""


@dataclass(frozen=True)
class Found:
    """A job of an earlier run of a folder that the cluster still knows (``Executor.find``)."""

    key: str
    ref: Mapping[str, Any]
    """The executor's own id of it (JSON), as ``Executor.ref`` gives it."""
    state: str
    """``queued``, ``running`` (both: live), or ``ended`` (it reported how it ended: its outcome can be read)."""
    what: str
    """How the cluster calls it, for messages ("SLURM job 123 (RUNNING)")."""

    @property
    def live(self) -> bool:
        return self.state != "ended"


@dataclass
class Handle:
    """A submitted job; ``started_at`` (time.monotonic) is None while it waits for resources."""

    job: Job
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    state: Any = None
    """The executor's own record of the job (processes, Ray actors, a SLURM job id)."""


class Executor(ABC):
    """Runs jobs somewhere. ``slots``: how many jobs the caller keeps submitted at once."""

    name: ClassVar[str]
    runs_here: ClassVar[bool] = False
    """Its jobs run on this machine (what `compare --calibrate` measures must be where the cells run)."""
    options: ClassVar[tuple[str, ...]] = ()
    """The keyword options of its constructor beside ``max_concurrent`` (the command-line flags of its own)."""
    durable: ClassVar[bool] = False
    """Its jobs can outlive the process that submitted them (a SLURM job, a Ray actor kept by its cluster): the
    submissions are written down and a rerun reconciles with the cluster (``launching.submissions``)."""

    def __init__(self, max_concurrent: int = 0, cancel_stale: bool | None = None) -> None:
        self.slots = max_concurrent if max_concurrent > 0 else self.default_slots()
        self.cancel_stale = bool(cancel_stale)
        """--cancel-stale: a live job of an earlier run is cancelled rather than adopted."""

    def default_slots(self) -> int:
        return 1

    def check(self, shapes: Iterable[Shape]) -> None:
        """Raise a one-line ConfigError when these jobs cannot run here (no cluster, too few nodes), before any."""
        return None

    @abstractmethod
    def submit(self, job: Job) -> Handle:
        """Start (or queue) ``job``; returns at once."""

    @abstractmethod
    def poll(self, handle: Handle) -> Outcome | None:
        """The outcome once the job ended, else None; returns at once."""

    @abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Stop the job and every process it started, on every node; no outcome is recorded."""

    def cancel_all(self, handles: list[Handle]) -> None:
        """Cancel several jobs (Ctrl-C of a sweep); an executor may stop them all at once."""
        for handle in handles:
            self.cancel(handle)

    def ref(self, handle: Handle) -> dict[str, Any]:
        """The executor's own id of a submitted job, as JSON (what the submissions journal keeps)."""
        return {}

    def find(self, prefix: str, open_entries: Mapping[str, Mapping[str, Any]]) -> list[Found]:
        """The jobs on the cluster whose key starts with ``prefix`` (a folder's), live or ended with a report,
        newest first; ``open_entries``: the journal's submissions of that folder that were not seen to end, by
        key (their ``dir`` and ``ref``), for what the cluster itself no longer lists."""
        return []

    def adopt(self, job: Job, found: Found) -> Handle | None:
        """A handle on ``found`` (an earlier run's submission of ``job``) that ``poll`` follows like one of this
        run's; None where the executor cannot take a job over (it is then removed)."""
        return None

    def remove(self, found: list[Found]) -> None:
        """Cancel the live jobs in ``found`` and wait until the cluster has ended them."""
        return None

    def close(self) -> None:
        """Release what the executor holds (a Ray connection, a local Ray it started)."""
        return None

    def where(self) -> str:
        """Where the jobs run, for the sweep's first line."""
        return "this machine"


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a command and every process under it. torchrun starts its workers in their own sessions, so the
    process group alone is not enough: the descendants are listed first and signalled one by one."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    for p in procs:
        with suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with suppress(psutil.Error):
            p.kill()
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def die_with_parent_setup() -> None:  # pragma: no cover - runs in the forked child before exec
    """The command dies with the process that started it (PR_SET_PDEATHSIG: SIGTERM, which stratbench's
    launcher forwards to torchrun and its workers): a killed sweep, or a Ray worker whose node died."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def start_command(cmd: list[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (a timeout or Ctrl-C then kills its whole tree) with its output in
    ``log`` (the command line first) and ``env`` added to this process's environment."""
    full = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    with open(log, "wb") as fh:
        fh.write((" ".join(cmd) + "\n").encode())
        fh.flush()
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full,
                                start_new_session=True, preexec_fn=die_with_parent_setup)  # noqa: PLW1509  # fmt: skip


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def wait_sampling_load(proc: subprocess.Popen, every_s: float = 0.5) -> list[float]:
    """Wait for ``proc`` to end; the 1-minute load averages seen meanwhile (what a node reports with its outcome)."""
    loads: list[float] = []
    while proc.poll() is None:
        time.sleep(every_s)
        load = load_average()
        if load is not None:
            loads.append(load)
    return loads


def threads_per_process(cpus: int, procs: int) -> str:
    """OMP_NUM_THREADS for each of ``procs`` processes sharing the ``cpus`` a node reserved for them (at least 1)."""
    return str(max(1, cpus // max(1, procs)))
