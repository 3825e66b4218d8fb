"""Kill saving runs at random moments; after each kill a loadable checkpoint must exist and resume must go on.

For each method, one output folder: start `stratbench train --save-every-steps 1 --keep-last 2 --resume`, wait
until it has finished two steps, sleep a random 0-2 s (each step saves, so the kill lands in or between saves),
SIGKILL every process of the run at once, then check:

- ``checkpoint.resolve_resume`` finds a checkpoint and ``load_any`` loads it weights-only (model and progress);
- its step is past the step the killed run resumed from (the killed run saved after resuming);
- the killed run continued from there: the first metrics.csv row it wrote is step ``resumed + 1``, the rows it
  wrote are consecutive (a fresh start would log step 1 again).

The next kill's run resumes from that checkpoint (so every kill after the first also hits a resumed run); after
the last kill a final run resumes to ``step + 2`` and must end with status "ok" and ``resumed_from`` = that step,
leaving nothing of the killed saves in OUTPUT/checkpoints but step entries and ``last``.

``--swap-kills K`` makes K of each method's kills (not the first) land inside a checkpoint swap, between its two
renames, which random kills almost never hit: that run resumes from the older of the two kept entries, so its
first save re-writes the newer one, and ``checkpoint.FAULT_SWAP_ENV`` makes the swap SIGKILL the run after the
previous entry was renamed to ``.step-N.old`` and before the new one is in place. Resume must then read
``.step-N.old``.

Runs start as real processes (``stratbench train``: the launcher, torchrun and its workers; ~17-20 s of imports
per run on 2 shared cores), or with ``--zygote`` as forks of one helper process that imported torch, stratbench
and DeepSpeed once (tests/zygote.py): each rank runs the code a torchrun worker runs, ~1-5 s per run.

    PYTHONPATH=src .venv/bin/python benchmarks/fault_injection.py --kills 5 --seed 0 \\
        --report benchmarks/fault_injection_cpu_2026-11-22.md       # 4 x 5 = 20 kills, real processes: 413 s
    PYTHONPATH=src .venv/bin/python benchmarks/fault_injection.py --zygote --kills 5 --swap-kills 1 \\
        --max-delay-s 1 --seed 0 --report benchmarks/fault_injection_zygote_cpu_2026-11-23.md   # 85 s

(2 shared cores, load 5-8 from other jobs for the second; the first predates --keep-last 2 and swap kills.)
tests/checkpoints/test_safety.py runs the zygote chain: 20 kills, 4 of them inside a swap.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from zygote import Zygote, ZygoteRun, check_checkpoint, run_processes  # noqa: E402  (tests/zygote.py: the rank forker)

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
SWAP_ENV = "STRATBENCH_TEST_KILL_IN_SWAP"  # checkpoint.FAULT_SWAP_ENV (not imported: keeps this file torch-free)


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


def leftovers(out: Path) -> list[str]:
    """Entries of OUTPUT/checkpoints other than ``last`` and step entries: what killed saves left behind."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != "last" and not p.name.startswith("step-"))


def swap_pair(out: Path) -> tuple[Path, Path] | str:
    """The entries a swap kill uses: ``newer``, the one ``last`` points at, and ``older``, the step before it.
    Not simply the two newest entries: a kill after a save's rename and before ``last`` moved leaves a complete
    newer entry that ``last`` does not name; a swap of that one leaves ``last`` whole, and resume rightly takes
    it, not the ``.old`` copy."""
    last = out / "checkpoints" / "last"
    names = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    if not last.exists():
        return f"no `last` to take the swap pair from: {names}"
    newer = last.resolve()
    older = newer.with_name(f"step-{int(newer.name[5:]) - 1:08d}")
    if not older.exists():
        return f"no step entry before {newer.name} to resume from: {names}"
    return older, newer


# ---- two ways to start a run -----------------------------------------------------------------------------
class ProcessRun:
    """``stratbench train`` as the user runs it (launcher, torchrun, workers)."""

    def __init__(self, out: Path, args: list[str], env: dict[str, str], log: Path) -> None:
        self.out, self.log = out, log
        full = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **env)
        cmd = [sys.executable, "-m", "stratbench", "train", *args]
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, env=full, stdout=subprocess.DEVNULL, stderr=fh)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        kill_run(self.out)
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the run did not end within {timeout} s") from None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-800:]


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.runs = 0

    def start(self, out: Path, args: list[str], nproc: int, env: dict[str, str]) -> ProcessRun:
        self.runs += 1
        return ProcessRun(out, args, env, self.logs / f"{Path(out).name}-{self.runs}.log")

    def check(self, out: Path) -> dict:
        return check_checkpoint(out)

    def close(self) -> None:
        pass


class ZygoteRuns:
    """Runs forked from one pre-imported process (tests/zygote.py): each rank runs the code a torchrun worker
    runs, without the launcher's and torchrun's imports."""

    def __init__(self, logs: Path) -> None:
        self.zygote = Zygote(logs)

    def start(self, out: Path, args: list[str], nproc: int, env: dict[str, str]) -> ZygoteRun:
        return self.zygote.start(["train", *args], nproc, env, name=Path(out).name)

    def check(self, out: Path) -> dict:
        return self.zygote.checkpoint(out)

    def close(self) -> None:
        self.zygote.close()


# ---- the chain ----------------------------------------------------------------------------------------------
@dataclass
class Kill:
    method: str
    n: int
    kind: str  # "random": SIGKILL delay_s after the run's second step; "swap": inside a checkpoint swap
    delay_s: float
    resumed_from: int  # the step the killed run started from (0: a fresh start)
    first_logged: int | None = None
    checkpoint: str = ""
    step: int | None = None
    problems: list[str] = field(default_factory=list)


def kill_chain(
    method: str,
    out: Path,
    kills: int,
    rng: random.Random,
    runs: Processes | ZygoteRuns,
    swap_kills: int = 0,
    max_delay_s: float = 2.0,
    timeout_s: float = 240,
) -> list[Kill]:
    """``kills`` SIGKILLs of saving runs in one folder, each run resuming from the previous kill's checkpoint,
    ``swap_kills`` of them inside a checkpoint swap, then a final resume to completion. Returns one record per
    kill; problems are listed, not raised."""
    flags, nproc = METHODS[method]
    swaps = set(rng.sample(range(1, kills), min(swap_kills, kills - 1)))
    records: list[Kill] = []
    step = 0
    base = ["--output", str(out), *flags, "--nproc", str(nproc), *RUN, "--save-every-steps", "1", "--keep-last", "2"]
    for n in range(kills):
        before = len(logged_steps(out))
        rec = Kill(method, n, "swap" if n in swaps else "random", round(rng.uniform(0.0, max_delay_s), 2), step)
        records.append(rec)
        args, env = [*base, "--resume"], {}
        if rec.kind == "swap":
            pair = swap_pair(out)
            if isinstance(pair, str):
                rec.problems.append(pair)
                return records
            older, newer = pair
            # Resume from the older entry: the first save re-writes the newer one, a swap with a previous entry.
            rec.resumed_from, rec.delay_s = int(older.name[5:]), 0.0
            args, env = [*base, "--resume-from", str(older)], {SWAP_ENV: newer.name}
        run = runs.start(out, args, nproc, env)
        if rec.kind == "swap":
            try:
                code = run.wait(timeout_s)
            except TimeoutError:
                rec.problems.append(f"the run did not kill itself in its swap within {timeout_s} s")
                return records
            if code != -signal.SIGKILL:
                rec.problems.append(f"the run exited {code}, not by SIGKILL in its swap: {run.log_tail()}")
                return records
        else:
            deadline = time.monotonic() + timeout_s
            while len(logged_steps(out)) < before + 2:  # two steps done: one checkpoint written after resuming
                if (code := run.poll()) is not None:
                    rec.problems.append(f"the run exited {code} before its second step: {run.log_tail()}")
                    return records
                if time.monotonic() > deadline:
                    run.kill()
                    rec.problems.append(f"no second step within {timeout_s} s")
                    return records
                time.sleep(0.05)
            time.sleep(rec.delay_s)
            run.kill()
        new = logged_steps(out)[before:]
        rec.first_logged = new[0] if new else None
        if not new or new != list(range(rec.resumed_from + 1, rec.resumed_from + 1 + len(new))):
            rec.problems.append(f"after resuming from step {rec.resumed_from} the run logged steps {new[:5]}...")
        found = runs.check(out)
        rec.checkpoint = Path(found.get("path", "")).name
        if "error" in found:
            rec.problems.append(found["error"])
            return records
        rec.step = found["step"]
        if not found["model"]:
            rec.problems.append(f"{rec.checkpoint} holds no model weights")
        if rec.step <= rec.resumed_from:
            rec.problems.append(f"checkpoint step {rec.step} is not past the resumed step {rec.resumed_from}")
        if rec.kind == "swap" and rec.checkpoint != f".{env[SWAP_ENV]}.old":
            rec.problems.append(f"killed inside the swap of {env[SWAP_ENV]}, resume picks {rec.checkpoint}")
        if rec.problems:
            return records
        step = rec.step
    args = [*base, "--max-steps", str(step + 2), "--resume"]
    run = runs.start(out, args, nproc, {})
    code = run.wait(timeout_s)
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    left = leftovers(out)
    if code != 0 or result.get("status") != "ok" or (result.get("resumed_from") or {}).get("step") != step or left:
        records[-1].problems.append(
            f"the final resume from step {step} exited {code} with {result.get('status')!r}, "
            f"resumed_from={result.get('resumed_from')}, left in checkpoints/: {left}: {run.log_tail()}"
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="kills per method")
    parser.add_argument("--swap-kills", type=int, default=0, help="of which inside a checkpoint swap (not the first)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay-s", type=float, default=2.0, help="random kill moment after the second step")
    parser.add_argument("--zygote", action="store_true", help="fork each run from one pre-imported process")
    parser.add_argument("--output", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--report", default=None, help="write the results as a Markdown table to this file")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(args.output or tempfile.mkdtemp(prefix="fault-injection-"))
    started = time.time()
    records: list[Kill] = []
    runs = ZygoteRuns(root / "logs") if args.zygote else Processes(root / "logs")
    try:
        for method in args.methods:
            t0 = time.monotonic()
            chain = kill_chain(method, root / method, args.kills, rng, runs, args.swap_kills, args.max_delay_s)
            records += chain
            bad = [r for r in chain if r.problems]
            print(
                f"{method}: {len(chain)} kills, {len(bad)} with problems, {time.monotonic() - t0:.0f} s",
                flush=True,
            )
    finally:
        runs.close()
    failed = [r for r in records if r.problems]
    lines = [
        "| method | kill | kind | delay after 2nd step (s) | resumed from | first step logged | checkpoint found | its step | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        outcome = "; ".join(r.problems) if r.problems else "ok"
        lines.append(
            f"| {r.method} | {r.n + 1} | {r.kind} | {r.delay_s} | {r.resumed_from} | {r.first_logged} | `{r.checkpoint}` | {r.step} | {outcome} |"
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
            "Each row: one run saving every step (`--save-every-steps 1 --keep-last 2 --resume`), killed with "
            "SIGKILL (all of its processes at once) the given delay after it finished its second step, or (kind "
            "*swap*) by itself inside a checkpoint swap, between its two renames. *resumed from*: the step the "
            "killed run resumed from (0: fresh start); *first step logged*: its first metrics.csv row (must be "
            "resumed + 1); *checkpoint found*: what `--resume` picks after the kill, loaded weights-only; *its "
            "step* must be past *resumed from*. After each method's last kill a final run resumes to step + 2 and "
            "must end with status ok, `resumed_from` = that step, and no leftovers in checkpoints/.\n\n"
            f"{table}\n\n"
            f"Result: {len(records) - len(failed)} of {len(records)} kills left a loadable checkpoint that resume "
            "continued from.\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
