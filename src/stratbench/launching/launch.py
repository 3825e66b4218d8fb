"""Starting several processes: stratbench re-runs itself under torchrun (``torch.distributed.run``, through
``stratbench.launching._torchrun``, which reports a failed rendezvous in one line).

The same ``stratbench train`` command also works when the user starts it under torchrun, the deepspeed
launcher or SLURM: then RANK/LOCAL_RANK/WORLD_SIZE are already set and this process is one worker. Under SLURM
two patterns work (docs/multinode.md): ``srun`` one task per device (each task is a worker, ranks from
SLURM_PROCID/SLURM_LOCALID), or ``srun`` one task per node with ``--nproc N`` (each task launches torchrun).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stratbench.core import errors
from stratbench.core.config import TrainConfig, dump_yaml
from stratbench.core.dist import free_port
from stratbench.core.errors import StratbenchError
from stratbench.launching._torchrun import ERROR_FILE_ENV, SETUP_ERRORS_ENV


def threads_per_process(nproc: int, environ: dict[str, str] | None = None) -> int:
    """The intra-op threads each of ``nproc`` local worker processes gets: the user's OMP_NUM_THREADS when set,
    else the cores shared out (torchrun would set 1 and warn). `compare --calibrate` runs its one-process
    calibration runs with the same count, so that they measure what a cell's process has."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def torchrun_error_path(scratch: Path) -> Path:
    """Where ``stratbench.launching._torchrun`` writes why this node's rendezvous failed."""
    return Path(scratch) / "torchrun_error"


def setup_errors_path(scratch: Path) -> Path:
    """The folder where each worker whose set-up failed, before it wrote anything, says why (``rankN.json``)."""
    return Path(scratch) / "setup_errors"


def record_setup_error(exc: BaseException) -> None:
    """In a worker of stratbench's launcher: note why this rank's set-up failed (its class, exit code and first
    line), so that the launcher says it once instead of every rank, and writes nothing into the output folder.
    A no-op in a process that stratbench's launcher did not start."""
    folder = os.environ.get(SETUP_ERRORS_ENV)
    if not folder:
        return
    text = str(exc).strip() if isinstance(exc, StratbenchError) else f"{type(exc).__name__}: {exc}".strip()
    record = {
        "error": type(exc).__name__,
        "exit_code": getattr(exc, "exit_code", 1) if isinstance(exc, StratbenchError) else 1,
        "message": (text.splitlines() or [type(exc).__name__])[0][:1000],
        "rank": int(os.environ.get("RANK", "0")),
    }
    path = Path(folder) / f"rank{record['rank']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # whole or absent: torchrun's agent reads the folder while ranks write


def setup_error_recorded() -> bool:
    """Whether this worker noted a set-up error for its launcher (``record_setup_error``)."""
    folder = os.environ.get(SETUP_ERRORS_ENV)
    return bool(folder) and (Path(folder) / f"rank{os.environ.get('RANK', '0')}.json").is_file()


def read_setup_error(scratch: Path) -> dict[str, Any] | None:
    """The set-up error a worker of this node noted: a refusal of the input (a stratbench error) before another
    exception, then the lowest rank; None when no worker noted one. A rank that only saw its peer leave is
    the last choice."""
    records = []
    for path in setup_errors_path(scratch).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    if not records:
        return None
    return min(records, key=lambda r: (_error_class(r) is None, r.get("rank", 0)))


def setup_error(record: dict[str, Any]) -> StratbenchError:
    """The exception the launcher raises for a worker's noted set-up error: the same stratbench error class and
    exit code (a refusal stays exit 2, an unsupported method exit 3), or a StratbenchError naming the exception."""
    cls = _error_class(record)
    message = str(record.get("message", ""))
    err = cls(message) if cls is not None else StratbenchError(f"training did not start: {message}")
    err.exit_code = int(record.get("exit_code", err.exit_code))
    return err


def _error_class(record: dict[str, Any]) -> type[StratbenchError] | None:
    cls = getattr(errors, str(record.get("error", "")), None)
    return cls if isinstance(cls, type) and issubclass(cls, StratbenchError) else None


MULTI_NODE_PORT = 29500
"""The static rendezvous port of a multi-node run without --master-port (torchrun's own default): every node
must agree on it, so it cannot be a free port picked on one of them."""


def torchrun_command(cfg: TrainConfig, config_path: Path, command: tuple[str, ...] = ("train",)) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "stratbench.launching._torchrun",
        f"--nproc-per-node={cfg.nproc}",
        f"--nnodes={cfg.nnodes}",
        f"--max-restarts={cfg.max_restarts}",
    ]
    # A rendezvous that cannot complete (a node that never comes) fails after --dist-timeout-s, not torchrun's
    # default 600 s.
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}", "--rdzv-id=stratbench"]
        cmd += [f"--rdzv-conf=join_timeout={cfg.dist_timeout_s}"]
    elif cfg.max_restarts > 0 and cfg.nnodes == 1:
        # Elastic restarts re-rendezvous: the c10d backend does that reliably, the static one can hang.
        port = cfg.master_port or free_port()
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=stratbench"]
        cmd += [f"--rdzv-conf=join_timeout={cfg.dist_timeout_s}"]
    else:
        port = cfg.master_port or (free_port() if cfg.nnodes == 1 else MULTI_NODE_PORT)
        cmd += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}", f"--master-port={port}"]
        cmd += [f"--rdzv-conf=timeout={cfg.dist_timeout_s}"]
    return [*cmd, "-m", "stratbench", *command, "--config", str(config_path)]


GRACE_S = 8.0
"""After SIGTERM/SIGINT is forwarded, how long torchrun and the workers get before they are killed."""


def _child_setup() -> None:  # pragma: no cover - runs in the forked child before exec
    """torchrun dies with the launcher (SIGTERM, which torchrun forwards to its workers)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class _Tree:
    """torchrun and every process below it, remembered while they run: torchrun starts each worker in a
    session of its own, so killing torchrun's process group alone would miss them."""

    def __init__(self, root: subprocess.Popen) -> None:
        import psutil

        self.root = root
        self.known: dict[int, psutil.Process] = {}
        self.refresh()

    def refresh(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root.pid)
            for p in [root, *root.children(recursive=True)]:
                self.known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def alive(self) -> list:
        import psutil

        found = []
        for p in self.known.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def signal(self, sig: int) -> None:
        import psutil

        self.refresh()
        for p in self.alive():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def kill_all(self, grace_s: float) -> None:
        """SIGTERM everything still running, then SIGKILL what is left after ``grace_s``."""
        import psutil

        self.signal(signal.SIGTERM)
        _, left = psutil.wait_procs(self.alive(), timeout=grace_s)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5)


class StoppedBySignal(StratbenchError):
    """The launcher was sent SIGTERM, SIGINT or SIGHUP and stopped the run's processes (exit code 128 + signal)."""


def launch(cfg: TrainConfig, scratch: Path, command: tuple[str, ...] = ("train",)) -> int:
    """Write the resolved config into ``scratch`` (a folder of the caller's that it removes afterwards: a refused
    run leaves the output folder as it was), start torchrun on it (each worker runs ``stratbench COMMAND
    --config ...``; ``probe`` starts its workers the same way), and return torchrun's exit code. A worker's
    set-up error and a failed rendezvous are left in ``scratch`` (``read_setup_error``, ``torchrun_error_path``).

    The launcher owns the run's processes: torchrun runs in a session of its own and dies with the launcher
    (PR_SET_PDEATHSIG), each worker dies with torchrun (``dist.die_with_parent``), SIGTERM/SIGINT/SIGHUP are
    forwarded to torchrun (which stops its workers) and whatever is left after GRACE_S is killed, and no
    process of the run outlives this function."""
    scratch = Path(scratch)
    config_path = scratch / f"launch_config.node{cfg.node_rank}.yaml"
    dump_yaml(cfg, config_path)
    cmd = torchrun_command(cfg, config_path, command)
    error_path = torchrun_error_path(scratch)
    error_path.unlink(missing_ok=True)
    setup_errors_path(scratch).mkdir(exist_ok=True)
    env = dict(os.environ)
    env[ERROR_FILE_ENV] = str(error_path)
    env[SETUP_ERRORS_ENV] = str(setup_errors_path(scratch))
    # One thread per process unless the user said otherwise (torchrun would set 1 and warn about it).
    env["OMP_NUM_THREADS"] = str(threads_per_process(cfg.nproc))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["STRATBENCH_DIE_WITH_PARENT"] = "1"
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_child_setup)  # noqa: PLW1509
    tree = _Tree(proc)
    deadline = None
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            tree.refresh()
            if received and deadline is None:
                # torchrun handles SIGTERM by stopping its workers (SIGTERM, then SIGKILL) and exiting.
                tree.root.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
            elif deadline is not None and time.monotonic() > deadline:
                tree.kill_all(0)
    finally:
        tree.kill_all(2.0)  # nothing of this run outlives the launcher (no-op after a clean exit)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        name = signal.Signals(received[0]).name
        err = StoppedBySignal(f"stopped by {name}: the workers of this run were stopped")
        err.exit_code = 128 + received[0]
        raise err
    return code

