"""The node side of the SLURM executor: what each task of a job's ``srun`` runs (one task per node).

``python -m stratbench.launching.slurm_node --log LOG --nodes N --procs P [--env K=V ...] -- COMMAND...`` runs
node ``$SLURM_NODEID``'s launcher command (``Job.node_command``) with the allocation's first node
(``scontrol show hostnames $SLURM_JOB_NODELIST``) as the master, at the address SLURM itself reaches it (its
``NodeAddr``), and a port derived from the job id, its output in the node's log, and writes how it ended (exit
code, load averages seen, cores, host and SLURM node, the job's id, the launcher's time) to ``slurm/nodeI.json``
beside the log: JSON the submitting side reads, so that nothing the nodes write is unpickled there. SIGTERM
(``scancel``, the time limit) stops the launcher's whole tree. Standard library and psutil only, like
``ray_node``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stratbench.core.files import atomic_write
from stratbench.launching.executor import (
    Job,
    Shape,
    kill_tree,
    start_command,
    threads_per_process,
    wait_sampling_load,
)

PORT_BASE = 15000
"""Node 0's master port is PORT_BASE + the job id's last 4 digits (as Lightning's SLURM environment does): every
node computes the same port without talking to the others, and two jobs on one node rarely share it."""


ADDR_TRIES = 5
"""How many times a node asks ``scontrol`` for the first node's address before it takes its name as it is."""
STOP_GRACE_S = 3.0
"""How long the launcher's tree gets after SIGTERM before it is killed: within SLURM's KillWait (5 s on the
local SLURM, 30 s by default), after which slurmd kills this task and would orphan what it had not stopped."""


def master_port(job_id: str) -> int:
    return PORT_BASE + int(job_id[-4:] or 0) % 10000


def node_hosts(nodelist: str) -> list[str]:
    """The allocation's hosts in order (``scontrol show hostnames`` expands ``node[01-04]``)."""
    if not nodelist:
        return [socket.gethostname()]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split() or [nodelist]


def node_addr(host: str) -> str:
    """The address SLURM reaches ``host`` at: its ``NodeAddr`` (the host name itself on most clusters; 127.0.0.1
    for the nodes of scripts/local_slurm.sh, whose names ``node1``, ``node2`` resolve nowhere); ``host`` when
    scontrol does not say. A busy controller is asked again (a name that resolves nowhere would leave the
    node's rendezvous waiting for its whole timeout)."""
    for attempt in range(ADDR_TRIES):
        out = subprocess.run(["scontrol", "show", "node", "--oneliner", host], capture_output=True, text=True)
        found = re.search(r"\bNodeAddr=(\S+)", out.stdout) if out.returncode == 0 else None
        if found:
            return found.group(1)
        if attempt + 1 < ADDR_TRIES:
            time.sleep(1.0)
    return host


def outcome_path(log: Path, rank: int) -> Path:
    """Where node ``rank`` of a job whose node 0 logs to ``log`` writes how it ended."""
    return log.parent / "slurm" / f"node{rank}.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m stratbench.launching.slurm_node")
    ap.add_argument("--log", required=True)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        ap.error("no command after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("SLURM_NODEID", "0"))
    job = Job(os.environ.get("SLURM_JOB_NAME", "job"), tuple(args.command), Path(args.log), Shape(args.nodes))
    started: list[subprocess.Popen] = []

    def stop(signum: int, frame: object) -> None:  # before anything starts: a cancel in between stops it too
        for proc in started:
            kill_tree(proc, grace_s=STOP_GRACE_S)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    master = node_addr(node_hosts(nodelist)[0]) if args.nodes > 1 else "127.0.0.1"
    command = job.node_command(rank, master, master_port(os.environ.get("SLURM_JOB_ID", "0")))
    env = dict(item.split("=", 1) for item in args.env)
    # One thread per process of the CPUs SLURM reserved (--cpus-per-task), as the Ray executor does.
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", args.procs))
    env.setdefault("OMP_NUM_THREADS", threads_per_process(cpus, args.procs))
    began = time.monotonic()
    proc = start_command(command, job.node_log(rank), env)
    started.append(proc)
    loads = wait_sampling_load(proc)
    # the job's id: a rerun that adopts a job SLURM has since forgotten knows this report is that job's
    record = {"returncode": proc.returncode, "loads": loads, "cpu_count": os.cpu_count(),
              "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME", ""),
              "job_id": os.environ.get("SLURM_JOB_ID", ""), "elapsed_s": time.monotonic() - began}  # fmt: skip
    atomic_write(outcome_path(job.log, rank), json.dumps(record))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
