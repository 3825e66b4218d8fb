"""The SLURM executor: each job is one SLURM batch job, submitted through submitit (``sbatch``), whose ``srun``
starts one task per node; each task runs ``launching.slurm_node``, which runs that node's launcher command
(``--nnodes N --node-rank $SLURM_NODEID --master-addr <the allocation's first node>``). SLURM reserves, queues
and places; stratbench's launcher (torchrun) trains, exactly as a local cell does.

What is submitted is a plain command (submitit's ``CommandFunction``): the pickle submitit writes beside the job
(``CELL/slurm/ID_submitted.pkl``, read by submitit on the node) holds only that command, written by this user;
nothing the nodes write is unpickled here (they report through JSON, ``slurm_node.outcome_path``). Job states
come from ``squeue --states=all`` (submitit's own watcher needs ``sacct``, which a cluster without accounting
lacks). The output folder must be on a filesystem every node shares (docs/cluster.md). submitit is imported only
when a job is submitted.
"""

from __future__ import annotations

import datetime
import getpass
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError, UnsupportedError
from stratbench.launching.executor import Executor, Found, Handle, Job, Outcome, Shape
from stratbench.launching.slurm_node import outcome_path

COMMANDS = ("sinfo", "sbatch", "squeue", "scancel", "srun")
REFRESH_S = 1.0
"""How often the states of the jobs under way are asked of SLURM (one ``squeue`` for all of them)."""
STOP_TIMEOUT_S = 60.0
"""How long a cancel waits for SLURM to end the jobs (their processes get KillWait seconds after SIGTERM)."""
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED",
          "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING", "SPECIAL_EXIT"}  # fmt: skip
RUNNING = {"RUNNING", "COMPLETING"}
LOST = {"CANCELLED": "cancelled", "PREEMPTED": "pre-empted", "NODE_FAIL": "its node failed",
        "BOOT_FAIL": "its node failed to boot", "REVOKED": "revoked"}  # fmt: skip
"""Job ends that are no fault of the run: recorded as failed and ``lost`` (a rerun of the sweep submits it again)."""
SET_HERE = {"nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "partition", "account", "time",
            "job-name", "comment", "output", "error", "open-mode", "signal", "array", "wrap"}  # fmt: skip
"""sbatch options stratbench sets itself: not accepted as --slurm-option (``comment`` carries the job's key)."""
COMMENT = "stratbench:"
"""A job's ``--comment`` is COMMENT + its key (``Job.key``): what a rerun of its folder finds it by (``squeue``)."""
TIME = re.compile(
    r"\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|UNLIMITED|INFINITE", re.IGNORECASE
)


@dataclass
class _Node:
    """A node of a partition, as sinfo shows it."""

    name: str
    partition: str
    cpus: int
    gpus: int
    state: str

    def __str__(self) -> str:
        gpus = f", {self.gpus} GPU" if self.gpus else ""
        return f"{self.name} ({self.cpus} CPU{gpus}, {self.state})"


def _run(cmd: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def _sinfo(fmt: str, timeout_s: float = 30.0) -> str:
    """sinfo's lines per node in ``fmt``; SLURM unreachable is one line. A client without its configuration file
    retries for a minute: that is seen in its first error line and reported at once."""
    proc = subprocess.Popen(["sinfo", "--noheader", "--Node", "--format", fmt], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            break
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            if "retrying" in err or time.monotonic() > deadline:
                proc.kill()
                proc.communicate()
                raise _unreachable(err or f"sinfo did not answer within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise _unreachable(err or f"sinfo exited with code {proc.returncode}")
    return out


def _unreachable(err: str) -> UnsupportedError:
    why = re.sub(r"^sinfo: (error|fatal): |, retrying in .*$", "", _first_line(err))
    return UnsupportedError(f"--executor slurm: cannot reach SLURM ({why}); run it where sinfo works (a login "
                            "node, or here after scripts/local_slurm.sh up and its SLURM_CONF)")  # fmt: skip


def parse_options(items: Iterable[str]) -> dict[str, Any]:
    """``--slurm-option KEY=VALUE`` (or ``KEY`` alone, a flag) as sbatch long options; one line for a bad one."""
    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if not re.fullmatch(r"[a-z][a-z0-9-]+", key):
            raise ConfigError(f"--slurm-option {item!r} is not KEY=VALUE with KEY an sbatch long option "
                              "(e.g. qos=high, constraint=a100, mem=64G, exclusive)")  # fmt: skip
        if key in SET_HERE:
            raise ConfigError(f"--slurm-option {item!r}: stratbench sets --{key} itself (from --nodes, the cell's "
                              "processes, --slurm-partition/--slurm-account/--slurm-time); not one of: "
                              f"{', '.join(sorted(SET_HERE))}")  # fmt: skip
        options[key] = value if eq else True
    return options


def _gpus(gres: str) -> int:
    """GPUs in sinfo's GRES column (``gpu:4``, ``gpu:a100:4(S:0-1)``, ``(null)``)."""
    return sum(int(n) for n in re.findall(r"gpu(?::[^:,()]+)?:(\d+)", gres))


def _seconds(stamp: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


class SlurmExecutor(Executor):
    """Jobs as SLURM batch jobs in ``slurm_partition`` (default: the cluster's default partition), charged to
    ``slurm_account``, with time limit ``slurm_time`` (default: the partition's) and extra sbatch options."""

    name = "slurm"
    options = ("slurm_partition", "slurm_account", "slurm_time", "slurm_option", "cancel_stale")
    durable = True

    def __init__(self, max_concurrent: int = 0, slurm_partition: str | None = None,
                 slurm_account: str | None = None, slurm_time: str | None = None,
                 slurm_option: list[str] | None = None, cancel_stale: bool | None = None) -> None:  # fmt: skip
        super().__init__(max_concurrent, cancel_stale)
        if slurm_time is not None and not TIME.fullmatch(slurm_time.strip()):
            raise ConfigError(f"--slurm-time {slurm_time!r} is not a SLURM time limit: MINUTES, MINUTES:SECONDS, "
                              "HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS")  # fmt: skip
        self.partition = slurm_partition
        self.account = slurm_account
        self.time = slurm_time.strip() if slurm_time else None
        self.extra = parse_options(slurm_option or [])
        # what the jobs get: --slurm-time, else the partition's own (known after check)
        self.time_limit = self.time or ""
        self._states: dict[str, tuple[str, str, str, str]] = {}
        self._asked_at = 0.0

    def default_slots(self) -> int:
        return 1_000_000  # every cell submitted: SLURM queues them until their resources are free

    def where(self) -> str:
        return f"SLURM partition {self.partition}" if self.partition else "SLURM"

    # --------------------------------------------------------------------------------------------
    # before any job

    def check(self, shapes: Iterable[Shape]) -> None:
        """One line, before any job, when SLURM cannot be reached, the partition does not exist, or a shape
        needs more than the partition's nodes have (then ``sbatch --test-only`` of each shape, for the rest)."""
        nodes = self._resolve()
        for shape in sorted(set(shapes), key=lambda s: (s.nodes, s.procs_per_node, s.gpus_per_node)):
            fit = [n for n in nodes if n.cpus >= shape.procs_per_node and n.gpus >= shape.gpus_per_node]
            if len(fit) < shape.nodes:
                have = ", ".join(str(n) for n in nodes)
                raise ConfigError(f"a cell needs {shape}; SLURM partition {self.partition} has {len(nodes)} "
                                  f"node(s): {have} (lower --nodes or --world-size, or pick another "
                                  "--slurm-partition)")  # fmt: skip
            self._test_only(shape)

    def _resolve(self) -> list[_Node]:
        """The partition's nodes (and its name and time limit when not given); SLURM's commands missing or its
        controller unreachable, or an unknown partition, is one line."""
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise UnsupportedError(f"--executor slurm needs SLURM's commands ({', '.join(missing)} not found on "
                                   "PATH): run it on a SLURM login node (scripts/local_slurm.sh up starts one "
                                   "here)")  # fmt: skip
        rows = [ln.split("|") for ln in _sinfo("%N|%P|%c|%G|%t|%L|%l").splitlines() if ln.count("|") == 6]
        default = next((r[1].rstrip("*") for r in rows if r[1].endswith("*")), None)
        names = sorted({r[1].rstrip("*") for r in rows})
        if self.partition is None:
            if default is None:
                raise ConfigError(f"SLURM has no default partition: give --slurm-partition, one of: "
                                  f"{', '.join(names) or 'none'}")  # fmt: skip
            self.partition = default
        mine = [r for r in rows if r[1].rstrip("*") == self.partition]
        if not mine:
            listed = ", ".join(n + (" (default)" if n == default else "") for n in names) or "none"
            raise ConfigError(
                f"--slurm-partition {self.partition!r} does not exist; SLURM's partitions: {listed}"
            )
        limit = mine[0][5] if mine[0][5] not in ("n/a", "") else mine[0][6]
        self.time_limit = self.time or ("UNLIMITED" if limit in ("infinite", "n/a", "") else limit)
        return [_Node(r[0], self.partition, int(r[2].rstrip("+") or 0), _gpus(r[3]), r[4]) for r in mine]

    def sbatch_options(self, shape: Shape) -> dict[str, Any]:
        """What a job of ``shape`` asks sbatch for (long option -> value; True: a flag)."""
        opts: dict[str, Any] = {"partition": self.partition, "time": self.time_limit, "nodes": shape.nodes,
                                "ntasks-per-node": 1, "cpus-per-task": shape.procs_per_node}  # fmt: skip
        if self.account:
            opts["account"] = self.account
        if shape.gpus_per_node:
            opts["gpus-per-node"] = shape.gpus_per_node
        return {**opts, **self.extra}

    def _test_only(self, shape: Shape) -> None:
        """``sbatch --test-only`` with a job's exact options: SLURM's own verdict (an account, a time over the
        partition's limit, an option it does not know), without submitting anything."""
        flags = [f"--{k}" if v is True else f"--{k}={v}" for k, v in self.sbatch_options(shape).items()]
        out = _run(["sbatch", "--test-only", *flags, "--wrap", "true"])
        if out.returncode != 0:
            why = _first_line(out.stderr.replace("sbatch: error: ", "")) or f"exit code {out.returncode}"
            raise ConfigError(f"SLURM refuses a job of {shape} ({' '.join(flags)}): {why}")

    # --------------------------------------------------------------------------------------------
    # jobs

    def submit(self, job: Job) -> Handle:
        if not self.time_limit or not self.partition:
            self._resolve()
        try:
            import submitit
        except ImportError:
            raise UnsupportedError(
                '--executor slurm needs submitit: pip install "stratbench[cluster]" (or "submitit>=1.5")'
            ) from None
        folder = job.log.parent / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        shape = job.shape
        ex = submitit.SlurmExecutor(folder=folder, python=shlex.quote(sys.executable))
        extra = {k: v for k, v in self.sbatch_options(shape).items() if k not in ("partition", "account", "nodes",
                 "ntasks-per-node", "cpus-per-task", "gpus-per-node")}  # fmt: skip
        # submitit asks for SIGUSR2 90 s before the time limit, to requeue a checkpointable callable; a cell is a
        # command, and USR2 would kill its workers: SIGCONT instead, which submitit ignores and which does nothing
        # to a running process, so the job runs to its limit and ends TIMEOUT.
        extra["signal"] = "CONT@1"
        if job.key:
            extra["comment"] = COMMENT + job.key
        ex.update_parameters(job_name=job.name, partition=self.partition, account=self.account, nodes=shape.nodes,
                             ntasks_per_node=1, cpus_per_task=shape.procs_per_node,
                             gpus_per_node=shape.gpus_per_node or None, additional_parameters=extra)  # fmt: skip
        command = [sys.executable, "-m", "stratbench.launching.slurm_node", "--log", str(job.log),
                   "--nodes", str(shape.nodes), "--procs", str(shape.procs_per_node),
                   *[f"--env={k}={v}" for k, v in job.env.items()], "--", *job.command]  # fmt: skip
        try:
            submitted = ex.submit(submitit.helpers.CommandFunction(command, verbose=False))
        except (
            Exception
        ) as exc:  # sbatch refused it (submitit raises its own types): this job fails, not the sweep
            why = f"sbatch refused the job: {_first_line(str(exc))}"
            return Handle(job, state={"id": None, "folder": folder, "refused": why})
        self._asked_at = 0.0  # ask SLURM at the next poll
        return Handle(job, state={"id": str(submitted.job_id), "folder": folder})

    def poll(self, handle: Handle) -> Outcome | None:
        job_id = handle.state["id"]
        if job_id is None:
            return Outcome(None, 0.0, reason=handle.state["refused"])
        state, reason, start, end = self._state(job_id)
        if state in QUEUED:
            return None
        if state in RUNNING:
            if handle.started_at is None:  # SLURM's start time: an adopted job started before this run saw it
                began = _seconds(start)
                ago = max(0.0, time.time() - began) if began else 0.0
                handle.started_at = time.monotonic() - ago
            return None
        now = time.monotonic()
        if handle.started_at is None:  # it ran between two looks: SLURM's own start and end
            began, ended = _seconds(start), _seconds(end)
            handle.started_at = now - (ended - began) if began and ended and ended >= began else now
        return self._ended(handle, state, reason, now - handle.started_at)

    def _state(self, job_id: str) -> tuple[str, str, str, str]:
        """(state, reason, start, end) of a job, from one ``squeue`` for every job under way, at most every
        REFRESH_S; a job SLURM no longer lists is 'GONE'."""
        if time.monotonic() - self._asked_at >= REFRESH_S or job_id not in self._states:
            ids = {job_id, *(i for i, s in self._states.items() if s[0] in QUEUED | RUNNING)}
            out = _run(["squeue", "--noheader", "--states=all", "--jobs", ",".join(sorted(ids)),
                        "--format", "%i|%T|%r|%S|%e"])  # fmt: skip
            if out.returncode != 0 and "Invalid job id" not in out.stderr:
                return self._states.get(job_id, ("PENDING", "", "", ""))  # the controller is busy: ask again
            seen = {r[0]: (r[1], r[2], r[3], r[4]) for r in
                    (ln.split("|") for ln in out.stdout.splitlines()) if len(r) == 5}  # fmt: skip
            for i in ids:
                self._states[i] = seen.get(i, ("GONE", "", "", ""))
            self._asked_at = time.monotonic()
        return self._states[job_id]

    def _ended(self, handle: Handle, state: str, reason: str, elapsed: float) -> Outcome:
        """The outcome of a job SLURM has ended, with node 0's own report (exit code, loads) when it wrote one."""
        job, job_id = handle.job, handle.state["id"]
        self._states.pop(job_id, None)
        node0 = _read_json(outcome_path(job.log, 0))
        if node0.get("job_id") not in (None, job_id):  # another job's report: not this one's outcome
            node0 = {}
        code = node0.get("returncode")
        if handle.state.get("adopted") and node0.get("elapsed_s") is not None:
            elapsed = node0["elapsed_s"]  # it ran (partly) while no run watched it: the node's own count
        done = {"elapsed_s": elapsed, "loads": node0.get("loads") or [], "cpu_count": node0.get("cpu_count")}
        # GONE with a report: a job that ended before an adopting run asked, and that SLURM has since forgotten
        if state == "COMPLETED" or (state in ("FAILED", "GONE") and node0):
            return Outcome(code if code is not None else 0, **done)
        what = f"SLURM job {job_id}"
        if state == "TIMEOUT":
            limit = (
                f"--slurm-time {self.time}" if self.time else f"the partition's time limit {self.time_limit}"
            )
            return Outcome(None, reason=f"timed out ({limit}; {what})", timed_out=True, **done)
        if state in LOST:
            return Outcome(None, reason=f"{LOST[state]} ({what} ended {state}); rerun the same command to run "
                           "it again", lost=True, **done)  # fmt: skip
        if state == "GONE":
            return Outcome(None, reason=f"{what} is no longer known to SLURM (its controller restarted?); rerun "
                           "the same command to run it again", lost=True, **done)  # fmt: skip
        why = "out of memory (SLURM's memory limit)" if state == "OUT_OF_MEMORY" else f"{what} ended {state}"
        err = _last_line(handle.state["folder"].glob(f"{job_id}_0_log.err"))
        return Outcome(None, reason=f"{why} before stratbench reported on node 0" + (f": {err}" if err else "")
                       + (f" ({reason})" if reason and reason != "None" else ""), **done)  # fmt: skip

    def cancel(self, handle: Handle) -> None:
        self.cancel_all([handle])

    def cancel_all(self, handles: list[Handle]) -> None:
        """``scancel`` every job at once, then wait until SLURM has ended them (their processes are gone)."""
        self._scancel([h.state["id"] for h in handles if h.state["id"] is not None])

    def _scancel(self, ids: list[str]) -> None:
        if not ids:
            return
        _run(["scancel", *ids])
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            out = _run(["squeue", "--noheader", "--jobs", ",".join(ids), "--format", "%i|%T"])
            alive = [ln for ln in out.stdout.splitlines() if ln.split("|")[-1] in QUEUED | RUNNING]
            if out.returncode == 0 and not alive or "Invalid job id" in out.stderr:
                break
            time.sleep(0.2)
        for job_id in ids:
            self._states.pop(job_id, None)

    # --------------------------------------------------------------------------------------------
    # an earlier run's jobs (launching.submissions)

    def ref(self, handle: Handle) -> dict[str, Any]:
        return {"id": handle.state["id"]} if handle.state.get("id") else {}

    def find(self, prefix: str, open_entries: Mapping[str, Mapping[str, Any]]) -> list[Found]:
        """This user's jobs whose comment carries a key starting with ``prefix`` (``squeue --states=all``: live,
        or ended within SLURM's MinJobAge), and the journal's open submissions SLURM no longer lists; an ended
        one only when its node 0 reported (``slurm/node0.json`` with its id): its result can be read."""
        out = _run(["squeue", f"--user={getpass.getuser()}", "--noheader", "--states=all", "--format", "%i|%T|%k"])
        if out.returncode != 0:
            raise UnsupportedError(f"--executor slurm: cannot list this folder's earlier jobs (squeue: "
                                   f"{_first_line(out.stderr) or f'exit code {out.returncode}'})")  # fmt: skip
        found: list[Found] = []
        rows = [ln.split("|", 2) for ln in out.stdout.splitlines() if ln.count("|") >= 2]
        for job_id, state, comment in rows:
            key = comment.strip().removeprefix(COMMENT)
            if not (comment.startswith(COMMENT) and key.startswith(prefix)):
                continue
            if state in QUEUED | RUNNING:
                live = "running" if state in RUNNING else "queued"
                found.append(Found(key, {"id": job_id}, live, f"SLURM job {job_id} ({state})"))
            elif _reported(open_entries.get(key), job_id):
                found.append(Found(key, {"id": job_id}, "ended", f"SLURM job {job_id} (ended {state})"))
        seen = {f.key for f in found}
        for key, entry in open_entries.items():
            if key.startswith(prefix) and key not in seen:
                job_id = (entry.get("ref") or {}).get("id") or _node0(entry).get("job_id")
                if job_id and _reported(entry, str(job_id)):
                    found.append(Found(key, {"id": str(job_id)}, "ended", f"SLURM job {job_id} (ended)"))
        return sorted(found, key=lambda f: int(re.sub(r"\D", "", f.ref["id"]) or 0), reverse=True)

    def adopt(self, job: Job, found: Found) -> Handle:
        self._asked_at = 0.0
        return Handle(job, state={"id": found.ref["id"], "folder": job.log.parent / "slurm", "adopted": True})

    def remove(self, found: list[Found]) -> None:
        self._scancel([f.ref["id"] for f in found if f.live])


def _node0(entry: Mapping[str, Any] | None) -> dict[str, Any]:
    """Node 0's report in the folder of a journal entry (``slurm/node0.json``), {} when there is none."""
    folder = (entry or {}).get("dir")
    return _read_json(outcome_path(Path(folder) / "train.log", 0)) if folder else {}


def _reported(entry: Mapping[str, Any] | None, job_id: str) -> bool:
    """Node 0 of SLURM job ``job_id`` wrote how it ended into the entry's folder."""
    return str(_node0(entry).get("job_id")) == job_id


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _last_line(paths: Iterable[Path]) -> str:
    for path in paths:
        try:
            lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            continue
        if lines:
            return lines[-1][:300]
    return ""
