"""Start `stratbench` runs as forks of one helper process (the zygote) that imported torch, stratbench, DeepSpeed
and accelerate once, instead of a launcher, torchrun and fresh worker interpreters (~7 s of imports per 2-process
run on 2 cores, ~1 s of training in a test run).

The zygote runs no torch operation (so no thread pool or process group exists to be copied into a fork) and
reports its thread count, which must be 1. Each run's ranks form a process group of their own; each rank gets
the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...) and calls ``stratbench.cli.main(argv)``, the entry a torchrun
worker runs (a 1-process run gets no rank variables: the CLI then trains in its own process, as `stratbench
train` does). What it skips is the launcher and torchrun, which tests/launching/test_launch.py and tests/checkpoints/test_safety.py run
as real processes. Each rank dies with the zygote (PR_SET_PDEATHSIG), and the zygote exits, killing what is
left, when its stdin closes.

Used by tests/conftest.py (``train``) and benchmarks/fault_injection.py (``--zygote``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = (
    "torch", "torch.distributed", "deepspeed",
    # imported by deepspeed.initialize (its muon optimizer pulls in torch._dynamo and inductor)
    "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.pipelining", "torch.nn.parallel", "accelerate",
    "torch.utils.flop_counter", "torch._subclasses.fake_tensor",
)  # fmt: skip
"""Modules the zygote imports before it forks anything (each only if it is installed)."""


class Zygote:
    def __init__(self, logs: Path, env: dict[str, str] | None = None) -> None:
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        # pyarrow (the ft extra's; pandas imports it where installed, and DeepSpeed imports pandas) starts jemalloc's
        # background thread at import unless its configuration says not to.
        env = dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", JE_ARROW_MALLOC_CONF="background_thread:false",
            **(env or {}),
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, __file__], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.logs / "zygote.log", "ab"), text=True,  # noqa: SIM115
        )  # fmt: skip
        self.runs = 0
        ready = self._read()
        if ready.get("threads") != 1:
            self.close()
            raise RuntimeError(f"the zygote runs {ready.get('threads')} threads after its imports; forking it is unsafe")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited: {(self.logs / 'zygote.log').read_text()[-2000:]}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def start(
        self, argv: list[str], nproc: int, env: dict[str, str] | None = None, name: str = "run", cwd: Path | None = None
    ) -> ZygoteRun:
        """Fork ``nproc`` ranks, each running ``stratbench ARGV`` with ``env`` added, in ``cwd`` where given (its
        output to a log)."""
        self.runs += 1
        log = self.logs / f"{name}-{self.runs}"
        cwd = str(cwd) if cwd is not None else None
        pids = self.ask(op="start", argv=argv, nproc=nproc, env=env or {}, log=str(log), cwd=cwd)["pids"]
        return ZygoteRun(self, pids, log)

    def checkpoint(self, out: Path) -> dict:
        """What ``--resume`` would pick in ``out``, loaded weights-only in a fork: {"path", "step", "model"} or
        {"error"}."""
        return self.ask(op="checkpoint", out=str(out))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the zygote kills what is left and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ZygoteRun:
    def __init__(self, zygote: Zygote, pids: list[int], log: Path) -> None:
        self.zygote, self.pids, self.log = zygote, pids, log

    def poll(self) -> int | None:
        """None while any rank runs, else the first non-zero exit (-N: killed by signal N), or 0."""
        codes = self.zygote.ask(op="poll", pids=self.pids)["codes"]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def kill(self) -> None:
        """SIGKILL every rank at once (their process group), then wait until the zygote reaped them."""
        try:
            os.killpg(self.pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(15)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                os.killpg(self.pids[0], signal.SIGKILL)
                self.wait(15)
                raise TimeoutError(f"the run did not end within {timeout} s: {self.log_tail()}")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        return code

    def log_tail(self, chars: int = 400) -> str:
        return " | ".join(
            f"{p.name}: {p.read_text(errors='replace')[-chars:]}"
            for p in sorted(self.log.parent.glob(f"{self.log.name}.rank*"))
        )


def check_checkpoint(out: Path) -> dict:
    """What ``--resume`` would pick in ``out``, loaded weights-only: {"path", "step", "model"} or {"error"}."""
    from stratbench.checkpoints import checkpoint as ckpt

    path = ckpt.resolve_resume(str(out), None)
    if path is None:
        return {"error": "no checkpoint to resume from"}
    try:
        state = ckpt.load_any(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return {"path": str(path), "error": f"{path.name} does not load: {type(exc).__name__}: {exc}"}
    return {"path": str(path), "step": int(state["progress"]["step"]), "model": bool(state.get("model"))}


def serve() -> None:
    """The zygote's side: import once, then answer one JSON request per stdin line (start, poll, checkpoint)."""
    import importlib

    replies = os.fdopen(os.dup(1), "w")  # what libraries print goes to the log, not into the replies
    os.dup2(2, 1)

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # peft (the lora extra: `train --lora-rank`) imports transformers, which imports torchvision: through
    # stratbench's guard (PyPI's CUDA torchvision on a CPU torch), once here rather than ~4 s in every LoRA rank
    from stratbench.core.torchvision_compat import guard_torchvision_import

    guard_torchvision_import()
    try:
        importlib.import_module("peft")
    except ImportError:
        pass
    from stratbench import cli
    from stratbench.core.dist import free_port
    from stratbench.strategies.base import discover

    discover()
    cli.build_parser()
    exits: dict[int, int] = {}
    groups: set[int] = set()

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    def child(log: str, env: dict[str, str], run, cwd: str | None = None) -> None:
        """In a forked child: output to ``log``, die with the zygote, in ``cwd`` (where given) run ``run()``, exit
        with its code."""
        code = 1
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
            replies.close()
            os.environ.update(env)
            if cwd:
                os.chdir(cwd)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            code = run()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported in the rank's log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)

    def start(req: dict) -> list[int]:
        nproc, port, leader, pids = req["nproc"], free_port(), 0, []
        for rank in range(nproc):
            env = dict(req["env"], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            if nproc > 1:  # what torchrun sets for its workers
                env.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="zygote", STRATBENCH_DIE_WITH_PARENT="1",
                )  # fmt: skip
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, leader)
                child(f"{req['log']}.rank{rank}.log", env, lambda: cli.main(req["argv"]), req.get("cwd"))
            leader = leader or pid
            try:
                os.setpgid(pid, leader)  # also here: the child may not have run yet
            except OSError:  # it has (and may have exited already)
                pass
            pids.append(pid)
        groups.add(leader)
        return pids

    def poll(pid: int) -> int | None:
        if pid not in exits:
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                return None
            exits[pid] = os.waitstatus_to_exitcode(status)
        return exits[pid]

    def checkpoint(req: dict) -> dict:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)

            def run() -> int:
                os.write(write, json.dumps(check_checkpoint(Path(req["out"]))).encode())
                return 0

            child(os.devnull, {}, run)
        os.close(write)
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
        os.close(read)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return json.loads(data) if data else {"error": f"the check exited {code} without a result"}

    reply({"ready": True, "threads": len(os.listdir("/proc/self/task"))})
    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "start":
                reply({"pids": start(req)})
            elif req["op"] == "poll":
                reply({"codes": [poll(p) for p in req["pids"]]})
            elif req["op"] == "checkpoint":
                reply(checkpoint(req))
    finally:
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    serve()


def run_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (a run's output folder)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found
