"""The local executor: each job's command runs on this machine in a session of its own; a job of several
nodes runs one launcher per node here, on loopback (what a multi-node run does, without the machines)."""

from __future__ import annotations

import os
import subprocess
import time

from stratbench.launching.executor import (
    Executor,
    Handle,
    Job,
    Outcome,
    kill_tree,
    load_average,
    start_command,
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalExecutor(Executor):
    """Runs jobs on this machine, ``slots`` at a time (1 unless --max-concurrent-cells: concurrent cells share
    the cores and disturb each other's timings)."""

    name = "local"
    runs_here = True

    def submit(self, job: Job) -> Handle:
        port = _free_port() if job.shape.nodes > 1 else 0
        procs = [start_command(job.node_command(rank, "127.0.0.1", port), job.node_log(rank), job.env)
                 for rank in range(job.shape.nodes)]  # fmt: skip
        now = time.monotonic()
        return Handle(job, submitted_at=now, started_at=now, state={"procs": procs, "loads": []})

    def poll(self, handle: Handle) -> Outcome | None:
        procs: list[subprocess.Popen] = handle.state["procs"]
        load = load_average()
        if load is not None:
            handle.state["loads"].append(load)
        codes = [p.poll() for p in procs]
        if any(c is None for c in codes):
            return None
        code = next((c for c in codes if c), 0)
        elapsed = time.monotonic() - (handle.started_at or handle.submitted_at)
        return Outcome(code, elapsed, loads=handle.state["loads"], cpu_count=os.cpu_count())

    def cancel(self, handle: Handle) -> None:
        for proc in handle.state["procs"]:
            kill_tree(proc)
