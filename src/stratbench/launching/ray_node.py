"""The node side of the Ray executor: one ``NodeRunner`` actor per node of a job runs that node's launcher
command and stops it on request. Standard library and psutil only, so that an actor starts without importing
torch (the command it runs does)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from stratbench.launching.executor import kill_tree, start_command, threads_per_process, wait_sampling_load


class NodeRunner:
    """Created by ``ray_executor`` as a Ray actor in one bundle of the job's placement group."""

    def __init__(self) -> None:
        self.proc = None
        self.stopped = False

    def address(self) -> tuple[str, int, str]:
        """This node's IP, a free port on it (node 0's becomes the job's master port), and its Python."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port, sys.executable

    def run(self, command: list[str], log: str, env: dict[str, str], cpus: int, procs: int) -> dict:
        """Run ``command`` with its output in ``log``; return its exit code, the load averages seen and this
        node's cores. The log's folder must be the compare folder, shared with the machine that runs compare."""
        folder = Path(log).parent
        if not folder.is_dir():
            return {"returncode": None, "loads": [], "cpu_count": os.cpu_count(), "reason":
                    f"the output folder {folder} is not on this Ray node ({_ip()}): a Ray cluster needs the "
                    "sweep's folder on a filesystem every node shares (docs/cluster.md)"}  # fmt: skip
        env = dict(env)
        # Ray sets OMP_NUM_THREADS to the actor's CPUs; each process gets its share of the CPUs reserved for it.
        env.setdefault("OMP_NUM_THREADS", threads_per_process(cpus, procs))
        if self.stopped:
            return {"returncode": None, "loads": [], "cpu_count": os.cpu_count(), "reason": "cancelled"}
        self.proc = start_command(command, Path(log), env)
        loads = wait_sampling_load(self.proc)
        return {"returncode": self.proc.returncode, "loads": loads, "cpu_count": os.cpu_count(), "reason": ""}

    def stop(self) -> None:
        """Stop the command and every process under it (torchrun and its workers)."""
        self.stopped = True
        if self.proc is not None:
            kill_tree(self.proc)


def _ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
