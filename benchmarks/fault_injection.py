"""Kill saving runs at random moments; after each kill a loadable checkpoint must exist and resume must go on.

For each method, one output folder: start `stratbench train --save-every-steps 1 --resume`, wait until it has
finished two steps, sleep a random 0-2 s (each step saves, so the kill lands in or between saves), SIGKILL every
process of the run at once (launcher, torchrun, workers), then check:

- ``checkpoint.resolve_resume`` finds a checkpoint and ``load_any`` loads it weights-only (model and progress);
- its step is past the step the killed run resumed from (the killed run saved after resuming);
- the killed run continued from there: the first metrics.csv row it wrote is step ``resumed + 1``, the rows it
  wrote are consecutive (a fresh start would log step 1 again).

The next kill's run resumes from that checkpoint (so every kill after the first also hits a resumed run); after
the last kill a final run resumes to ``step + 2`` and must end with status "ok" and ``resumed_from`` = that step.

    PYTHONPATH=src .venv/bin/python benchmarks/fault_injection.py --kills 5 --seed 0 \\
        --report benchmarks/fault_injection_cpu_2026-11-22.md       # 4 methods x 5 = 20 kills, ~10 min on 2 cores

tests/test_safety.py runs the same chain with fewer kills.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# The tiny problem of the tests (tests/conftest.py TINY), trained until killed.
RUN = [
    "--model", "tinynet", "--width", "8", "--norm", "none", "--data", "digits", "--batch-size", "32",
    "--lr", "0.02", "--progress", "false", "--measure-flops", "false", "--timing-warmup-steps", "1",
    "--epochs", "1000",
]  # fmt: skip
METHODS = {
    "single": (["--strategy", "single"], 1),
    "ddp": (["--strategy", "ddp"], 2),
    "fsdp": (["--strategy", "fsdp"], 2),
    "deepspeed-z2": (["--strategy", "deepspeed", "--zero-stage", "2"], 2),
}


def run_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (the run's output folder)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def kill_run(out: Path) -> None:
    """SIGKILL every process of the run at once (launcher, torchrun, workers): the harshest stop."""
    for pid in run_processes(str(out)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    while run_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if run_processes(str(out)):
        raise AssertionError(f"processes of {out} still alive 15 s after SIGKILL")


def logged_steps(out: Path) -> list[int]:
    """The step column of OUTPUT/metrics.csv (a row cut by the kill is skipped)."""
    path = out / "metrics.csv"
    if not path.exists():
        return []
    steps = []
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                steps.append(int(row["step"]))
            except (TypeError, ValueError):
                pass
    return steps


@dataclass
class Kill:
    method: str
    n: int
    delay_s: float
    resumed_from: int  # the step the killed run started from (0: a fresh start)
    first_logged: int | None = None
    checkpoint: str = ""
    step: int | None = None
    problems: list[str] = field(default_factory=list)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratbench", *args]


def kill_chain(method: str, out: Path, kills: int, rng: random.Random, timeout_s: float = 240) -> list[Kill]:
    """``kills`` SIGKILLs of saving runs in one folder, each run resuming from the previous kill's checkpoint,
    then a final resume to completion. Returns one record per kill; problems are listed, not raised."""
    from stratbench import checkpoint as ckpt

    flags, nproc = METHODS[method]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    records: list[Kill] = []
    step = 0
    for n in range(kills):
        before = len(logged_steps(out))
        cmd = _cli("train", "--output", str(out), *flags, "--nproc", str(nproc), *RUN,
                   "--save-every-steps", "1", "--resume")  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rec = Kill(method, n, round(rng.uniform(0.0, 2.0), 2), step)
        records.append(rec)
        deadline = time.monotonic() + timeout_s
        while len(logged_steps(out)) < before + 2:  # two steps done: one checkpoint written after resuming
            if proc.poll() is not None:
                rec.problems.append(
                    f"the run exited {proc.returncode} before its second step: {proc.stderr.read()[-500:]}"
                )
                return records
            if time.monotonic() > deadline:
                kill_run(out)
                rec.problems.append(f"no second step within {timeout_s} s")
                return records
            time.sleep(0.1)
        time.sleep(rec.delay_s)
        kill_run(out)
        proc.wait()
        proc.stderr.close()
        new = logged_steps(out)[before:]
        rec.first_logged = new[0] if new else None
        if new != list(range(step + 1, step + 1 + len(new))):
            rec.problems.append(f"after resuming from step {step} the run logged steps {new[:5]}...")
        path = ckpt.resolve_resume(str(out), None)
        if path is None:
            rec.problems.append("no checkpoint to resume from")
            return records
        rec.checkpoint = path.name
        try:
            state = ckpt.load_any(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            rec.problems.append(f"{path.name} does not load: {type(exc).__name__}: {exc}")
            return records
        rec.step = int(state["progress"]["step"])
        if not state.get("model"):
            rec.problems.append(f"{path.name} holds no model weights")
        if rec.step <= step:
            rec.problems.append(f"checkpoint step {rec.step} is not past the resumed step {step}")
        if rec.problems:
            return records
        step = rec.step
    cmd = _cli("train", "--output", str(out), *flags, "--nproc", str(nproc), *RUN, "--max-steps", str(step + 2),
               "--resume")  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    if (
        done.returncode != 0
        or result.get("status") != "ok"
        or (result.get("resumed_from") or {}).get("step") != step
    ):
        records[-1].problems.append(
            f"the final resume from step {step} exited {done.returncode} with {result.get('status')!r}, "
            f"resumed_from={result.get('resumed_from')}: {done.stderr[-500:]}"
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="kills per method")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--report", default=None, help="write the results as a Markdown table to this file")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(args.output or tempfile.mkdtemp(prefix="fault-injection-"))
    started = time.time()
    records: list[Kill] = []
    for method in args.methods:
        t0 = time.monotonic()
        chain = kill_chain(method, root / method, args.kills, rng)
        records += chain
        bad = [r for r in chain if r.problems]
        print(
            f"{method}: {len(chain)} kills, {len(bad)} with problems, {time.monotonic() - t0:.0f} s",
            flush=True,
        )
    failed = [r for r in records if r.problems]
    lines = [
        "| method | kill | delay after 2nd step (s) | resumed from | first step logged | checkpoint found | its step | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        outcome = "; ".join(r.problems) if r.problems else "ok"
        lines.append(
            f"| {r.method} | {r.n + 1} | {r.delay_s} | {r.resumed_from} | {r.first_logged} | `{r.checkpoint}` | {r.step} | {outcome} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.report:
        import torch

        cmd = "PYTHONPATH=src python benchmarks/fault_injection.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        Path(args.report).write_text(
            f"# Fault injection: SIGKILL of saving runs, {len(records)} kills\n\n"
            f"Command: `{cmd}`  \n"
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared with other "
            f"jobs), torch {torch.__version__}, Python {platform.python_version()}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s in all.\n\n"
            "Each row: one run saving every step (`--save-every-steps 1 --resume`), killed with SIGKILL (all of its "
            "processes at once) the given delay after it finished its second step. *resumed from*: the step the "
            "killed run resumed from (0: fresh start); *first step logged*: its first metrics.csv row (must be "
            "resumed + 1); *checkpoint found*: what `--resume` picks after the kill, loaded weights-only; *its "
            "step* must be past *resumed from*. After each method's last kill a final run resumes to step + 2 and "
            "must end with status ok and `resumed_from` = that step.\n\n"
            f"{table}\n\n"
            f"Result: {len(records) - len(failed)} of {len(records)} kills left a loadable checkpoint that resume "
            "continued from.\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
