"""A real two-node Ray cluster on this machine: a head and a worker node, two `ray start` processes on the
loopback side of this host, each node in a process group of its own (so that one node can be killed as a VM
dies, and `down` stops exactly what `up` started, never another Ray on the machine).

    python scripts/local_ray.py up      # prints the address: stratbench compare --executor ray --ray-address ADDR
    python scripts/local_ray.py status
    python scripts/local_ray.py down

The tests import it (``start``/``stop``/``kill_node``/``add_worker``). Node death is detected within ~3 s (the
GCS health check is shortened through Ray's RAY_health_check_* variables, read by the head's GCS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = "cluster.json"
DEFAULT_DIR = Path(tempfile.gettempdir()) / "stratbench-ray"
FAST_HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "2",
}
"""A node that stops answering is declared dead after ~3 s rather than Ray's default ~30 s."""


def _ray() -> str:
    """The `ray` command beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("ray")
    found = str(here) if here.exists() else shutil.which("ray")
    if not found:
        raise SystemExit('local_ray: the `ray` command is not installed; pip install "stratbench[cluster]"')
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start one `ray start` in a new session: its daemons keep that process group (the Popen's pid)."""
    with open(log, "ab") as fh:
        return subprocess.Popen([_ray(), "start", *args], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip


def _started(proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> int:
    """Wait for a `ray start` to return; its process group id, or the group killed and an error."""
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        _kill_group(proc.pid)
        raise RuntimeError(f"`{' '.join(map(str, proc.args))}` did not start (exit {code}); see {log}")
    return proc.pid


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the head's GCS listens (a worker node can join then, while the head still starts its dashboard)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() in (None, 0):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)


def _env() -> dict[str, str]:
    """Every node in one authentication mode: the user's RAY_AUTH_MODE, else disabled (the nodes listen on
    loopback only). Left to Ray 2.60, a head started while ~/.ray/auth_token exists (any `ray.init()` of a local
    Ray writes it) turns token authentication on, while a joining `ray start --address` and a client's
    `ray.init(address=...)` stay without it unless RAY_AUTH_MODE=token is set for them: the worker node and then
    compare were refused ("InvalidAuthToken") on every machine where ray.init() had ever run."""
    mode = os.environ.get("RAY_AUTH_MODE", "disabled")
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE=mode, **FAST_HEALTH_CHECK)


def start(root: Path = DEFAULT_DIR, head_cpus: int = 2, worker_cpus: int = 2) -> dict:
    """Start the head and one worker node; returns (and writes to ROOT/cluster.json) the address and the nodes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    port, dashboard, client = _free_port(), _free_port(), _free_port()
    # The head's temporary folder holds the session's sockets: a short path (a socket path has ~107 bytes).
    temp = Path(tempfile.mkdtemp(prefix="sbray-", dir="/tmp"))
    head = ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={head_cpus}",
            f"--temp-dir={temp}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}", "--disable-usage-stats"]  # fmt: skip
    state = {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard}",
             "client": f"ray://127.0.0.1:{client}", "temp": str(temp), "root": str(root), "nodes": []}  # fmt: skip
    head_proc = _start_node(head, root / "head.log", _env())
    state["nodes"].append({"role": "head", "pgid": head_proc.pid, "cpus": head_cpus})
    _write(state)
    try:
        _wait_port(port, head_proc)
        worker = add_worker(state, worker_cpus, wait=False)
        _started(head_proc, root / "head.log")
        _started(worker, Path(root) / "worker0.log")
    except BaseException:
        stop(state)
        raise
    return state


def add_worker(state: dict, cpus: int = 2, wait: bool = True):
    """Join one more worker node to the cluster (also after `kill_node`: a node that comes back); ``wait``:
    until it has joined (else its `ray start` process is returned)."""
    n = sum(node["role"] == "worker" for node in state["nodes"])
    args = [f"--address={state['address']}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
            f"--node-manager-port={_free_port()}", f"--temp-dir={state['temp']}"]  # fmt: skip
    log = Path(state["root"]) / f"worker{n}.log"
    proc = _start_node(args, log, _env())
    node = {"role": "worker", "pgid": proc.pid, "cpus": cpus}
    state["nodes"].append(node)
    _write(state)
    if not wait:
        return proc
    _started(proc, log)
    return node


def kill_node(state: dict, role: str = "worker") -> None:
    """SIGKILL every process of the last live node of ``role`` at once, as when its machine dies."""
    node = [n for n in state["nodes"] if n["role"] == role and not n.get("dead")][-1]
    with _quiet():
        os.killpg(node["pgid"], signal.SIGKILL)
    node["dead"] = True
    _write(state)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError | PermissionError)


def _kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it after ``grace_s``."""
    with _quiet():
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)
    with _quiet():
        os.killpg(pgid, signal.SIGKILL)


def stop(state: dict) -> None:
    """Stop every node that `start`/`add_worker` started (workers first) and remove the session's files."""
    for node in reversed(state["nodes"]):
        _kill_group(node["pgid"], grace_s=0 if node.get("dead") else 5.0)
    shutil.rmtree(state["temp"], ignore_errors=True)
    (Path(state["root"]) / STATE).unlink(missing_ok=True)


def _write(state: dict) -> None:
    path = Path(state["root"]) / STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def _read(root: Path) -> dict | None:
    try:
        return json.loads((Path(root) / STATE).read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"state and logs (default {DEFAULT_DIR})"
    )
    parser.add_argument("--head-cpus", type=int, default=2)
    parser.add_argument("--worker-cpus", type=int, default=2)
    args = parser.parse_args(argv)
    state = _read(args.dir)
    if args.action == "up":
        if state is not None:
            print(
                f"local_ray: a cluster is already up at {state['address']} ({args.dir / STATE}); `down` first"
            )
            return 1
        state = start(args.dir, args.head_cpus, args.worker_cpus)
        print(f"Ray cluster up: head + 1 worker node at {state['address']} (dashboard {state['dashboard']}, Ray "
              f"Client {state['client']})")  # fmt: skip
        print(f"  stratbench compare --executor ray --ray-address {state['address']} ...")
        return 0
    if state is None:
        print(f"local_ray: no cluster recorded in {args.dir / STATE}")
        return 0 if args.action == "down" else 1
    if args.action == "status":
        subprocess.run([_ray(), "status", f"--address={state['address']}"], check=False)
        return 0
    stop(state)
    print(f"Ray cluster at {state['address']} stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
