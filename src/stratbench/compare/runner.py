"""Run the cells of a sweep: one fresh process tree per cell, a time limit, a record per cell, resume, Ctrl-C.

Each cell runs ``python -m stratbench train --config CELL/config.yaml [--nproc N]`` through an executor
(``launching.executor``: this machine, in a session of its own, so that a timeout or Ctrl-C kills its whole
tree, torchrun's workers included; or a Ray cluster, one launcher per node) with its output and log in its own
folder. Its outcome is appended to ``results.jsonl`` as soon as it ends, in whatever order cells end, so a sweep
that is stopped keeps what is done and the same command resumes it, skipping the cells already recorded (but
not a cell whose node was lost, which runs again). On a cluster (SLURM, Ray) each submission is written down
before and as it is made (``launching.submissions``), and a resumed sweep first takes over (or cancels) the jobs
a killed one left running, so that no cell runs twice and no folder is cleaned under a live job.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.compare.matrix import Cell, Matrix, Plan, pretrained_checkpoint
from stratbench.core.errors import ConfigError
from stratbench.core.files import append_json_line
from stratbench.core.lock import output_lock, wait_released
from stratbench.launching.executor import Executor, Handle, Job, Outcome, Shape
from stratbench.launching.local_executor import LocalExecutor
from stratbench.launching.submissions import Submissions, job_key
from stratbench.measuring.environment import environment
from stratbench.measuring.records import SCHEMA, RunRecord

RESULTS = "results.jsonl"
SWEEP = "sweep.json"
CELLS_DIR = "cells"
FINISHED = ("ok", "failed", "oom", "timeout", "nan")
"""Statuses a rerun keeps (``--retry`` reruns all but ok). Skipped cells are re-checked on every run."""
STOP_WAIT_S = 60.0
"""How long a resumed sweep waits for a cancelled earlier job's processes to leave its cell's folder."""


class Interrupted(Exception):
    """The user pressed Ctrl-C: the running cell was stopped and not recorded."""


# ------------------------------------------------------------------------------------------------
# records


def load_records(out: Path, name: str = RESULTS) -> dict[str, dict[str, Any]]:
    """Latest record per cell id from ``out/results.jsonl`` (or ``out/NAME``: the calibration runs'
    ``calibration.jsonl``), as written: what a resumed sweep checks and rewrites; a torn last line from a killed
    sweep is ignored. ``load_run_records`` parses them for the readers."""
    path = Path(out) / name
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "id" in rec:
            records.pop(rec["id"], None)  # re-insert so that dict order follows the latest write
            records[rec["id"]] = rec
    return records


def load_run_records(out: Path) -> dict[str, RunRecord]:
    """The latest record per cell id of ``out/results.jsonl``, parsed (old files too: a field a record lacks or
    holds in another type reads as not recorded)."""
    return {cell: RunRecord.from_dict(rec) for cell, rec in load_records(out).items()}


def append_record(out: Path, record: dict[str, Any], name: str = RESULTS) -> None:
    """Append one line to ``out/results.jsonl`` (or ``out/NAME``) and flush it to disk, so a crash of the sweep
    itself loses nothing finished (a last line cut short by a crash is dropped or ended first)."""
    append_json_line(Path(out) / name, record)


def machine_of(environment: dict[str, Any] | None) -> dict[str, str]:
    """Hostname and a one-line device description (GPU names, or the CPU and its cores)."""
    env = environment or {}
    host = env.get("hostname") or platform.node()
    gpus = env.get("gpus") or []
    if env.get("device_type") == "cuda" and gpus:
        names = sorted(set(gpus))
        device = ", ".join(f"{gpus.count(n)}x {n}" for n in names)
    else:
        device = f"CPU: {env.get('cpu', 'unknown')} ({env.get('cpu_count', '?')} cores)"
    return {"hostname": str(host), "device": device}


def local_environment(world_size: int) -> dict[str, Any]:
    """The environment block of this machine, for cells that produced no result.json."""
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return environment(world_size, device)


def make_record(
    cell: Cell,
    status: str,
    reason: str = "",
    result: dict[str, Any] | None = None,
    *,
    elapsed_s: float | None = None,
    returncode: int | None = None,
    cell_dir: Path | None = None,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One line of results.jsonl: the cell, its outcome, and (when it ran) its result.json content."""
    result = result or {}
    env = result.get("environment") or environment or local_environment(cell.world_size)
    return {
        "schema": SCHEMA,
        "id": cell.id,
        "method": cell.method,
        "label": cell.name,
        "precision": cell.precision,
        "world_size": cell.world_size,
        "nodes": cell.nodes,
        "batch_size": cell.batch_size,
        "strategy_options": cell.options,
        "cell_config": cell.config,
        "status": status,
        "reason": reason,
        "machine": machine_of(env),
        "environment": env,
        "config": result.get("config") or cell.train_config(cell_dir or ""),
        "data_parallel_size": result.get("data_parallel_size"),
        "per_device_batch_size": result.get("per_device_batch_size"),
        "global_batch_size": result.get("global_batch_size", cell.batch_size),
        "model": result.get("model", cell.config.get("model")),
        "data": result.get("data", cell.config.get("data")),
        "metrics": result.get("metrics") or {},
        "sharding": result.get("sharding") or {},
        "mesh": result.get("mesh") or {},
        "transforms": result.get("transforms") or [],
        "parameters": parameters_of(result.get("model_meta")),
        **({"moe": result["moe"]} if isinstance(result.get("moe"), dict) else {}),  # an MoE's parameters, routing
        "elapsed_s": elapsed_s,
        "returncode": returncode,
        "cell_dir": str(cell_dir) if cell_dir else None,
        "log": str(cell_dir / "train.log") if cell_dir else None,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def parameters_of(model_meta: Any) -> dict[str, int]:
    """The model's parameter count and, of it, the trainable one (result.json's ``model_meta``: LoRA trains the
    adapters only); empty where the run recorded none."""
    meta = model_meta if isinstance(model_meta, dict) else {}
    keys = (("total", "num_parameters"), ("trainable", "trainable_parameters"))
    return {name: meta[key] for name, key in keys if isinstance(meta.get(key), int)}


# ------------------------------------------------------------------------------------------------
# outcome of one cell

_NOISE = ("ChildFailedError", "torch.distributed.elastic", "Traceback (most recent call last)", "warnings.warn",
          "To see the stack trace", "error_file:", "traceback :", "Root Cause", "Failures:", "<NO_OTHER_FAILURES>")  # fmt: skip
_ERROR_LINE = re.compile(r"(error|exception|killed|failed|abort|signal)", re.IGNORECASE)


def log_lines(path: Path, tail_bytes: int = 64_000) -> list[str]:
    """Last lines of a log, with tqdm's carriage-return redraws split into lines."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]


def last_error_line(path: Path) -> str:
    """The most telling error line of a cell's log: stratbench's own one-line error, else the last exception."""
    lines = log_lines(path)
    for ln in reversed(lines):
        if ln.startswith("stratbench train: error:"):
            return ln[len("stratbench train: error:") :].strip()
    for ln in reversed(lines):
        if _ERROR_LINE.search(ln) and not any(n in ln for n in _NOISE):
            return ln[:400]
    return lines[-1][:400] if lines else ""


def _nonfinite(metrics: dict[str, Any]) -> bool:
    final = metrics.get("final_loss")
    if final is not None and not math.isfinite(float(final)):
        return True
    return any(v is None or not math.isfinite(float(v)) for v in metrics.get("loss_curve") or [])


def classify(returncode: int, result: dict[str, Any] | None, log: Path) -> tuple[str, str]:
    """Status and reason of a cell that exited, from its result.json (written by the loop) or else its log."""
    if result and result.get("status") == "ok":
        if _nonfinite(result.get("metrics") or {}):
            return "nan", "the training loss became NaN/inf"
        note = f"(exited with code {returncode} after writing its result)" if returncode else ""
        return "ok", note
    reason = (result or {}).get("reason") or ""
    status = (result or {}).get("status") or ""
    text = " ".join(log_lines(log)[-40:])
    if "FloatingPointError" in reason or "loss became" in reason or (not reason and "loss became" in text):
        return "nan", reason or last_error_line(log)
    if status == "oom" or "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "oom", reason or last_error_line(log)
    if not reason:
        reason = last_error_line(log) or f"exited with code {returncode} without writing result.json"
    if returncode == 3 and not result:  # UnsupportedError found by the cell's own preflight
        return "skipped", reason
    if returncode == 0 and not result:
        return "failed", f"exited with code 0 without writing result.json ({reason})"
    return "failed", reason


# ------------------------------------------------------------------------------------------------
# processes


def cell_command(cell: Cell, config_path: Path) -> list[str]:
    """The cell's command on one node (the executor adds the node flags of a cell of several nodes)."""
    cmd = [sys.executable, "-m", "stratbench", "train", "--config", str(config_path)]
    if cell.world_size > 1:
        cmd += ["--nproc", str(cell.procs_per_node)]
    return cmd


# ------------------------------------------------------------------------------------------------
# the sweep


class Display:
    """Progress over the cells (rich, on a terminal) with the running cell's last log line under it; on a
    non-terminal (CI, a test) one plain line per cell."""

    def __init__(self, total: int, console) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.durations: list[float] = []
        self.t0 = time.monotonic()
        self.live = console.is_terminal
        self.progress = None
        if self.live:
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
                transient=False,
            )
            self.overall = self.progress.add_task("cells", total=total, info="", count=f"0/{total}")
            self.current = self.progress.add_task("", total=None, info="", count="")
            self.progress.start()

    def eta(self, running_for: float = 0.0) -> str:
        if not self.durations:
            return "ETA: after the first cell"
        left = max(0.0, (self.total - self.done) * (sum(self.durations) / len(self.durations)) - running_for)
        return f"ETA ~{_fmt_duration(left)}"

    def start(self, n: int, cell: Cell) -> None:
        self.cell = cell
        self.begin(n, f"{cell.name} {cell.precision} {cell.shape}", f"{cell.id}/train.log")

    def begin(self, n: int, what: str, log: str) -> None:
        """Run ``n`` of the total starts: ``what`` names it, ``log`` is where its output goes."""
        self.cell_t0 = time.monotonic()
        text = f"[{n}/{self.total}] {what}"
        if self.progress is not None:
            self.progress.reset(
                self.current, description=text, info="starting", count=""
            )  # elapsed restarts per cell
            self.progress.update(self.overall, info=self.eta())
        else:
            left = f"; {self.done} done, {self.eta()}" if self.done else ""
            self.console.print(f"{text} ... (log: {log}{left})", highlight=False, soft_wrap=True)

    def tick(self, last_line: str) -> None:
        if self.progress is None:
            return
        running = time.monotonic() - self.cell_t0
        self.progress.update(self.current, info=last_line[-90:])
        self.progress.update(self.overall, info=self.eta(running))

    def finish(self, cell: Cell, status: str, reason: str, elapsed: float | None, ran: bool) -> None:
        self.end(f"{cell.name} {cell.precision} {cell.shape}", status, reason, elapsed, ran)

    def end(self, what: str, status: str, reason: str, elapsed: float | None, ran: bool) -> None:
        self.done += 1
        if ran and elapsed is not None:
            self.durations.append(elapsed)
        colour = {"ok": "green", "skipped": "yellow"}.get(status, "red")
        when = f" in {_fmt_duration(elapsed)}" if ran and elapsed is not None else ""
        from rich.markup import escape

        # escaped: reasons quote library output such as gloo's "[/path/pair.cc:553]", which rich reads as a tag
        why = f": {escape(reason)}" if reason and status != "ok" else ""
        line = f"  [{colour}]{status}[/{colour}] {escape(what)}{when}{why}"
        self.console.print(line, highlight=False, soft_wrap=True)
        if self.progress is not None:
            self.progress.update(self.overall, advance=1, info=self.eta(), count=f"{self.done}/{self.total}")

    def skip_only(self) -> None:
        """A cell that was already recorded counts as done without a duration."""
        self.done += 1
        if self.progress is not None:
            self.progress.update(self.overall, advance=1, count=f"{self.done}/{self.total}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.update(
                self.current, description="done", info=f"total {_fmt_duration(time.monotonic() - self.t0)}"
            )
            self.progress.stop()


def _fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class SweepRunner:
    """Runs the planned cells of one sweep into ``out``; see the module docstring."""

    def __init__(self, matrix: Matrix, out: Path, *, timeout_s: float, retry: bool = False, console=None,
                 command: list[str] | None = None, repeats: int = 1, executor: Executor | None = None) -> None:  # fmt: skip
        """``executor``: where each cell's processes run (default: this machine, one cell at a time)."""
        from rich.console import Console

        self.matrix = matrix
        self.out = Path(out).resolve()
        self.timeout_s = timeout_s
        self.retry = retry
        self.console = console or Console()
        self.command = command or sys.argv
        self.repeats = max(1, int(repeats))
        self.executor = executor or LocalExecutor()
        self.submissions = Submissions(self.out, self.executor, say=self._say)

    def _say(self, line: str) -> None:
        from rich.markup import escape

        self.console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)

    def write_sweep_meta(self, plans: list[Plan]) -> None:
        """sweep.json: the cells of this sweep in order (the report lists cells not run yet as such)."""
        cells = [
            {
                "id": p.cell.id,
                "method": p.cell.method,
                "label": p.cell.name,
                "precision": p.cell.precision,
                "world_size": p.cell.world_size,
                "batch_size": p.cell.batch_size,
            }  # fmt: skip
            for p in plans
        ]
        # A filtered rerun (--only ddp) into the same folder keeps the earlier cells' place in the report.
        previous = read_result(self.out / SWEEP) or {}
        ids = {c["id"] for c in cells}
        merged = [c for c in previous.get("cells", []) if c.get("id") not in ids]
        order = {c["id"]: i for i, c in enumerate(previous.get("cells", []))}
        merged = sorted([*merged, *cells], key=lambda c: order.get(c["id"], len(order)))
        meta = {
            "name": self.matrix.heading,
            "description": self.matrix.description,
            "base": self.matrix.base,
            "command": self.command,
            "timeout_s": self.timeout_s,
            "cells": merged,
            "latest": [c["id"] for c in cells],
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        atomic_write(self.out / SWEEP, json.dumps(meta, indent=2, default=str))

    def run(
        self, plans: list[Plan], before: Callable[[SweepRunner], Any] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Call ``before(self)`` (the calibration runs: ``compare.calibration.run_calibration``), when given, and
        then run every planned cell not already finished; raises ``Interrupted`` on Ctrl-C (after recording). Holds the output
        folder's lock throughout: a second sweep on the same folder is refused (it would train the same cells
        at once and record them twice)."""
        import threading

        # SIGTERM (a job scheduler, `kill`) stops the sweep like Ctrl-C: the running cell's tree is killed
        # rather than orphaned (cells run in their own sessions, so they would not get the signal).
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            with output_lock(self.out):
                self.write_sweep_meta(plans)
                if before is not None:
                    before(self)
                return self._run(plans)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _run(self, plans: list[Plan]) -> dict[str, dict[str, Any]]:
        """Submit each cell to run to the executor (``executor.slots`` at a time), record each as it ends, in
        whatever order; Ctrl-C cancels every cell under way (not recorded) and raises ``Interrupted``. The jobs
        an earlier, killed run of this folder left on the cluster are settled first (``_reconcile``)."""
        records = load_records(self.out)
        env = local_environment(1)
        adopted = self._reconcile([p for p in plans if self._needs_run(p, records)])
        display = Display(len(plans), self.console)
        active: list[_CellRun] = []
        try:
            for n, p in enumerate(plans, 1):
                if self._settled(p, records, display, env):
                    continue
                while len(active) >= self.executor.slots:
                    self._wait_any(active, records, display)
                handle = adopted.pop(job_key(self.out, p.cell.id), None)
                if handle is not None:
                    display.start(n, p.cell)
                    active.append(_CellRun(p.cell, handle, handle.job.log.parent))
                else:
                    active.append(self._submit(n, p.cell, display))
            while active:
                self._wait_any(active, records, display)
        except KeyboardInterrupt:
            self.executor.cancel_all([run.handle for run in active])
            for run in active:
                self.submissions.ended(run.handle.job, "cancelled")
            running = ", ".join(run.cell.id for run in active)
            raise Interrupted(f"stopped while running {running}" if running else "stopped between cells") from None
        finally:
            display.close()
        return records

    def _needs_run(self, p: Plan, records: dict[str, dict[str, Any]]) -> bool:
        """The cell is to be run now: planned to run and not finished before (what ``_settled`` lets through)."""
        old = records.get(p.cell.id)
        keep = ("ok",) if self.retry else FINISHED
        if p.status is not None or not old:
            return p.status is None
        return old.get("status") not in keep or bool(old.get("lost")) or _repeats_of(old) < self.repeats

    def _reconcile(self, plans: list[Plan]) -> dict[str, Handle]:
        """Before any cell is submitted: the jobs of earlier runs of this folder still on the cluster are adopted
        or cancelled (``Submissions.reconcile``); then every cell to run anew must have a folder no process
        writes into any more (a cancelled job winding down), before ``prepare`` cleans it."""
        jobs = [self.job_for(p.cell, self.out / CELLS_DIR / p.cell.id) for p in plans]
        adopted = self.submissions.reconcile({job.key: job for job in jobs}, adopt=self.repeats == 1)
        for p in plans:
            if job_key(self.out, p.cell.id) not in adopted:
                self._wait_idle(self.out / CELLS_DIR / p.cell.id)
        return adopted

    def _wait_idle(self, cell_dir: Path, timeout_s: float = STOP_WAIT_S) -> None:
        """Wait until no run holds the lock of ``cell_dir`` (or of one of its repeats); one line if one still
        does after ``timeout_s``: its folder is not cleaned under it."""
        for folder in [cell_dir, *sorted(cell_dir.glob("repeat-*"))]:
            holder = wait_released(folder, timeout_s)
            if holder is not None:
                raise ConfigError(f"{folder} is still being written by a run (pid {holder}) that is not this "
                                  "sweep's: a job of an earlier run the cluster no longer lists? Stop it (or wait "
                                  "for it to end), then rerun")  # fmt: skip

    def _settled(self, p: Plan, records: dict[str, dict[str, Any]], display: Display, env: dict[str, Any]) -> bool:
        """True when the cell needs no run: finished before (kept), or planned as skipped/failed (recorded)."""
        old = records.get(p.cell.id)
        if p.status is None and not self._needs_run(p, records):
            display.skip_only()
            self.console.print(f"  [dim]done before[/dim] {p.cell.name} {p.cell.precision} "
                               f"{p.cell.shape}: {old['status']}", highlight=False, soft_wrap=True)  # fmt: skip
            return True
        if p.status is None:
            return False
        if not (old and old.get("status") == p.status and old.get("reason") == p.reason):
            rec = make_record(p.cell, p.status, p.reason, environment=env)
            append_record(self.out, rec)
            records[p.cell.id] = rec
        display.finish(p.cell, p.status, p.reason, None, ran=False)
        return True

    def _submit(self, n: int, cell: Cell, display: Display) -> _CellRun:
        display.start(n, cell)
        run_dir = self.out / CELLS_DIR / cell.id
        if self.repeats > 1:
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir = self._repeat_dir(cell, 1)
        return _CellRun(cell, self.submissions.submit(self.prepare(cell, run_dir)), run_dir)

    def _repeat_dir(self, cell: Cell, k: int) -> Path:
        log = Path(cell.id) / f"repeat-{k}" / "train.log"
        self.console.print(f"    repeat {k}/{self.repeats} (log: {log})", highlight=False, soft_wrap=True)
        return self.out / CELLS_DIR / cell.id / f"repeat-{k}"

    def _wait_any(self, active: list[_CellRun], records: dict[str, dict[str, Any]], display: Display) -> None:
        """Poll the cells under way until at least one ends; record those that ended."""
        while True:
            time.sleep(POLL_S)
            ended = [(run, rec) for run in list(active) if (rec := self._poll(run)) is not None]
            for run, rec in ended:
                active.remove(run)
                append_record(self.out, rec)
                records[run.cell.id] = rec
                self.submissions.ended(run.handle.job, rec["status"])
                display.finish(run.cell, rec["status"], rec["reason"], rec["elapsed_s"], ran=True)
            if ended:
                return
            latest = active[-1]
            lines = log_lines(latest.handle.job.log, 4000)
            display.tick(lines[-1] if lines else "")

    def _poll(self, run: _CellRun) -> dict[str, Any] | None:
        """The cell's record once its last run ended (a repeated cell: the next repeat is submitted)."""
        outcome = self._outcome(run.handle)
        if outcome is None:
            return None
        rec = self.record(run.cell, run.run_dir, outcome)
        # how long the cell waited for its resources (a placement group) before it started (an adopted job may
        # have started before this run saw it)
        rec["queued_s"] = max(0.0, (run.handle.started_at or time.monotonic()) - run.handle.submitted_at)
        if self.repeats == 1:
            return rec
        run.runs.append(rec)
        k = len(run.runs)
        if rec["status"] != "ok":  # the first run that does not end ok ends the cell
            rec["reason"] = f"repeat {k} of {self.repeats}: {rec['reason']}"
            rec["repeats"] = {"n": k, "requested": self.repeats}
            return rec
        if k == self.repeats:
            return aggregate_repeats(run.runs)
        run.run_dir = self._repeat_dir(run.cell, k + 1)
        self.submissions.ended(run.handle.job, rec["status"])
        run.handle = self.submissions.submit(self.prepare(run.cell, run.run_dir))
        return None

    def _outcome(self, handle: Handle) -> Outcome | None:
        """The job's outcome; one over the sweep's time limit (counted from its start, not its wait for
        resources) is cancelled and ends as timed out."""
        outcome = self.executor.poll(handle)
        if outcome is not None or handle.started_at is None:
            return outcome
        elapsed = time.monotonic() - handle.started_at
        if elapsed <= self.timeout_s:
            return None
        self.executor.cancel(handle)
        return Outcome(None, elapsed, timed_out=True)

    def prepare(self, cell: Cell, cell_dir: Path, env: dict[str, str] | None = None) -> Job:
        """A clean folder for the cell's run with its config.yaml, and the job that runs it."""
        if cell_dir.exists():  # a previous attempt (failed, or interrupted; its jobs settled): start clean
            shutil.rmtree(cell_dir)
        cell_dir.mkdir(parents=True)
        config = cell.train_config(cell_dir)
        if self.matrix.pretrain is not None:  # every cell starts from the sweep's pretraining run (compare.pretrain)
            config.setdefault("init_from", str(pretrained_checkpoint(self.out)))
        atomic_write(cell_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        return self.job_for(cell, cell_dir, env)

    def job_for(self, cell: Cell, cell_dir: Path, env: dict[str, str] | None = None) -> Job:
        """The job that runs ``cell`` in ``cell_dir`` (nothing written), keyed to this folder and the cell."""
        gpus = cell.procs_per_node if self.matrix.uses_gpus(cell) else 0
        return Job(cell.id, tuple(cell_command(cell, cell_dir / "config.yaml")), cell_dir / "train.log",
                   Shape(cell.nodes, cell.procs_per_node, gpus), env or {}, key=job_key(self.out, cell.id))  # fmt: skip

    def wait(self, job: Job, display: Display, what: str) -> Outcome:
        """Run one job to its end (the calibration runs, one at a time); Ctrl-C cancels it and raises
        ``Interrupted`` naming ``what``."""
        handle = self.submissions.submit(job)
        try:
            while True:
                time.sleep(POLL_S)
                outcome = self._outcome(handle)
                if outcome is not None:
                    return outcome
                lines = log_lines(job.log, 4000)
                display.tick(lines[-1] if lines else "")
        except KeyboardInterrupt:
            self.executor.cancel(handle)
            raise Interrupted(what) from None

    def run_process(self, cmd: list[str], log_path: Path, display: Display, what: str,
                    env: dict[str, str] | None = None) -> tuple[int | None, float, bool, list[float]]:  # fmt: skip
        """Run ``cmd`` with its output in ``log_path``, under the sweep's time limit: (exit code, seconds, timed
        out, load averages seen). Ctrl-C kills its whole tree and raises ``Interrupted`` naming ``what``;
        ``env`` is added to this process's environment."""
        outcome = self.wait(Job(log_path.parent.name, tuple(cmd), log_path, env=env or {}), display, what)
        return outcome.returncode, outcome.elapsed_s, outcome.timed_out, outcome.loads

    def run_cell(self, cell: Cell, display: Display, run_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """Run one cell to its end and return its record; Ctrl-C stops it and raises ``Interrupted``.
        ``env``: variables added to its environment (a calibration run's OMP_NUM_THREADS)."""
        cell_dir = run_dir or self.out / CELLS_DIR / cell.id
        outcome = self.wait(self.prepare(cell, cell_dir, env), display, f"stopped while running {cell.id}")
        return self.record(cell, cell_dir, outcome)

    def record(self, cell: Cell, cell_dir: Path, outcome: Outcome) -> dict[str, Any]:
        """The cell's record from how its job ended and what it wrote (result.json, its log)."""
        result = read_result(cell_dir / "result.json")
        log_path = cell_dir / "train.log"
        if outcome.timed_out:  # the sweep's --timeout, or the executor's own limit (SLURM's) with its reason
            status = "timeout"
            reason = outcome.reason or (
                f"did not finish within the {self.timeout_s:.0f} s limit per cell; its processes were killed"
            )
        elif outcome.reason:  # the executor ended it: its node died, its folder is not shared
            status, reason = "failed", outcome.reason
        else:
            status, reason = classify(outcome.returncode, result, log_path)
        rec = make_record(cell, status, reason, result, elapsed_s=outcome.elapsed_s,
                          returncode=outcome.returncode, cell_dir=cell_dir)  # fmt: skip
        # Timings only mean something on an otherwise idle machine: keep the load seen, the report flags it.
        loads = outcome.loads
        rec["host_load_mean"] = sum(loads) / len(loads) if loads else None
        rec["host_cpu_count"] = outcome.cpu_count
        if outcome.lost:
            rec["lost"] = True  # no fault of the cell: a rerun of the sweep runs it again
        return rec


POLL_S = 0.5
"""How often the sweep looks at the cells under way."""


@dataclass
class _CellRun:
    """A cell under way: the job running now and, for a repeated cell, the records of its runs so far."""

    cell: Cell
    handle: Handle
    run_dir: Path
    runs: list[dict[str, Any]] = field(default_factory=list)


# Measures a repeated cell reports as median and spread: (key in metrics, how to read it from a record).
REPEATED = {
    "train_time_s": lambda m: m.get("train_time_s"),
    "throughput_samples_per_s": lambda m: m.get("throughput_samples_per_s"),
    "step_time_mean_s": lambda m: m.get("step_time_mean_s"),
    "peak_memory_bytes": lambda m: max(
        (p for p in m.get("peak_memory_bytes") or [] if p is not None), default=None
    ),
    "val_accuracy": lambda m: m.get("val_accuracy"),
    "final_loss": lambda m: m.get("final_loss"),
}


def _repeats_of(rec: dict[str, Any]) -> int:
    return int((rec.get("repeats") or {}).get("n") or 1)


def aggregate_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from N ok runs of a cell: the run with the median throughput supplies everything else;
    each measure of ``REPEATED`` becomes the median over the runs, with min, max and every value kept."""
    import statistics

    def tp(r: dict[str, Any]) -> float:
        return float((r.get("metrics") or {}).get("throughput_samples_per_s") or 0.0)

    order = sorted(range(len(runs)), key=lambda i: tp(runs[i]))
    chosen = runs[order[(len(runs) - 1) // 2]]
    rec = json.loads(json.dumps(chosen, default=str))  # a copy
    spread: dict[str, Any] = {}
    for key, read in REPEATED.items():
        values = [read(r.get("metrics") or {}) for r in runs]
        if any(v is None for v in values):
            continue
        med = statistics.median(values)
        spread[key] = {"median": med, "min": min(values), "max": max(values), "values": values}
        if key != "peak_memory_bytes":  # the per-rank list stays the chosen run's; its max is in `repeats`
            rec["metrics"][key] = med
    rec["repeats"] = {"n": len(runs), "requested": len(runs), "median_run": order[(len(runs) - 1) // 2] + 1,
                      "metrics": spread, "elapsed_s": [r.get("elapsed_s") for r in runs],
                      "host_load_mean": [r.get("host_load_mean") for r in runs]}  # fmt: skip
    rec["elapsed_s"] = sum(r.get("elapsed_s") or 0.0 for r in runs)
    loads = [r.get("host_load_mean") for r in runs if r.get("host_load_mean") is not None]
    rec["host_load_mean"] = max(loads) if loads else None  # the busiest run decides whether times are trusted
    others = [m.get("host_others_share") for r in runs if (m := r.get("metrics") or {}).get("host_others_share") is not None]
    rec["metrics"]["host_others_share"] = max(others) if others else None
    return rec


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def read_result(path: Path) -> dict[str, Any] | None:
    """A JSON file's object (result.json, sweep.json), or None where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_records(path: Path, problem) -> None:
    if not path.exists():
        return
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.splitlines()
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            why = problem(record) if isinstance(record, dict) else "not a JSON object"
            if why:
                raise ValueError(why)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if n == len(lines) and not data.endswith(b"\n"):
                print(
                    f"note: {path} line {n} is cut short (a sweep stopped while writing it); skipped",
                    file=sys.stderr,
                )
                continue
            first = str(exc).splitlines()[0][:120]
            raise ConfigError(
                f"{path} line {n} is not a record stratbench can read ({first}); fix or delete that line"
            ) from None
