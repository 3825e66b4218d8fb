"""Shared test helpers: run `stratbench train` (1 or N ranks forked from the session zygote, or the real launcher) and read its result."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratbench.cli import main
from stratbench.core.dist import free_port
from zygote import Zygote

REPO = Path(__file__).resolve().parents[1]

# One intra-op thread in each test process and in everything it starts: `make test` runs two test processes on 2
# cores, each often beside ranks of its own, and torch's default (one thread per core) then has OpenMP threads
# spin-waiting for a core another process holds: 10 steps of gpt-tiny took 17 s instead of 0.6 s, and a short
# in-process train ~10x longer. Subprocesses inherit it (run_stratbench and the zygote also set it themselves);
# the launcher reads OMP_NUM_THREADS as a user's setting (threads_per_process).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
sys.path.insert(0, str(REPO / "scripts"))  # scripts/async_io_build.py: DeepSpeed's async_io op for the nvme tests

import async_io_build  # noqa: E402

# The tiny problem the fast tests train: tinynet on real digits, 20 steps, no normalisation layer (GroupNorm at
# width 8 divides float rounding noise by sqrt(eps) on the digits' flat background: any change of summation order
# then grows past 1e-2 within 20 steps).
TINY = [
    "--model", "tinynet", "--width", "8", "--norm", "none", "--data", "digits", "--batch-size", "32",
    "--epochs", "1", "--max-steps", "20", "--lr", "0.02", "--progress", "false", "--measure-flops", "false",
    "--timing-warmup-steps", "1",
]  # fmt: skip

# The problem every cross-method equivalence test trains: TINY in fp64, so that the check holds by construction on
# any CPU. In fp32 the CPU kernels (oneDNN/MKL) pick different algorithms, with different rounding, for different
# batch shapes and instruction sets, and 20 SGD steps amplify a 1e-7 difference ~2e4 times: on one AMD EPYC
# (AVX2), `single` fp32 itself moved by 1.8e-3 when oneDNN/MKL were capped at AVX or SSE4.1, and DDP fp32 vs
# `single` fp32 was 2.2e-3 apart (an Intel AVX-512 machine: 9e-4). In fp64 rounding is ~1e-16: measured on the same
# machine under all three ISA caps, `single` fp64 was bit-identical across caps and ddp, ddp-zero, fsdp, fsdp1 and
# accelerate-ddp matched it to 6.0e-16 (benchmarks/equivalence_isa_cpu_2026-11-22.md).
EQUIV = [*TINY, "--precision", "fp64"]
RTOL = 1e-9
"""fp64 tolerance: the worst fp32 amplification seen (2e4 over 20 steps) on fp64 rounding (1.1e-16) gives ~2e-12;
1e-9 leaves a 500x margin, while any real method difference (a wrong average, a missed all-reduce, a skipped
LR step) is >= 1e-3."""
RTOL_FP32_SAME_MICRO_BATCHES = 1e-12
"""fp32, a 2-rank run against `single --grad-accum 2`: the data order gives one process's 2 micro-batches exactly the
samples the 2 ranks take (data.virtual_rank_order), so every kernel call has the same inputs, and the gradients
differ only by the order of one two-operand sum and by power-of-two scaling, which are exact: bit-identical by
construction on any CPU (measured 0.0 for ddp and DeepSpeed ZeRO-2/3 on an AMD EPYC with AVX-512). 1e-12 leaves
room for nothing but the fp64 loss report. (Before that order, the micro-batches held other samples than the
ranks' and the two curves were 2.8e-7 apart on an AVX2 EPYC but 1.9e-3 on an AVX-512 one.) DeepSpeed has no
fp64 mode: its master weights and optimizer state are fp32, so this is its equivalence check."""
RTOL_FP32_FOUR_RANKS = 1e-5
"""fp32, a 4-rank run against `single --grad-accum 4`: the micro-batches hold the same samples, but gloo's ring
reduce-scatter sums the 4 ranks' gradients in another order than the accumulation does, and a 4-operand fp32 sum
is not associative. Measured for DeepSpeed ZeRO-3 with hpZ over 4 steps on an AMD EPYC: 0.0 with its own kernels,
5.2e-8 with oneDNN/MKL capped at SSE4.1 (CI's second pass). 1e-5 leaves a 200x margin; a wrong average, a missed
reduction or a wrong partition moves the curve by >= 1e-3."""


def stratbench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratbench", *args]


def run_nodes(output: Path, command: str, *args: str, nnodes: int = 2, nproc: int = 1, timeout: float = 300) -> list[str]:
    """``stratbench COMMAND --output OUTPUT ARGS`` as ``nnodes`` machines would run it, on loopback: one command per
    node (``--nnodes --nproc --node-rank --master-addr --master-port``), each starting its own torchrun; returns
    each node's stdout, and fails the test with a node's output where one exits non-zero."""
    port = str(free_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            stratbench_cmd(command, "--output", str(output), *args, "--nnodes", str(nnodes), "--nproc", str(nproc),
                           "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port),  # fmt: skip
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )
        for rank in range(nnodes)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {rank} exited {p.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    return [out for out, _ in outputs]


def run_stratbench(
    *args: str, timeout: float = 300, env: dict | None = None, check: bool = True, prefix: list[str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    """Run the CLI in a fresh interpreter (after ``prefix``, e.g. a setpriv command), in ``cwd`` (default: the
    repository); on failure show its output in the assertion."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    proc = subprocess.run(
        [*(prefix or []), *stratbench_cmd(*args)], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"stratbench {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def cli(*args: str) -> str:
    """Run a command in this process through ``stratbench.cli.main`` (a fresh interpreter's work minus its
    start-up, for tests about what a command does rather than about starting it) and return what it printed; a
    non-zero exit fails the test with what it wrote to stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    if code != 0:
        raise AssertionError(f"stratbench {' '.join(map(str, args))} exited {code}\n{err.getvalue()[-4000:]}")
    return out.getvalue()


_ZYGOTE: Zygote | None = None


def zygote() -> Zygote:
    """The session's rank forker (tests/zygote.py), started on first use and closed when the session ends."""
    global _ZYGOTE
    if _ZYGOTE is None:
        import tempfile

        _ZYGOTE = Zygote(Path(tempfile.mkdtemp(prefix="stratbench-zygote-")))
    return _ZYGOTE


def pytest_collection_finish(session):
    """An nvme test selected: DeepSpeed's async_io op starts building in the background (scripts/async_io_build.py)."""
    if not session.config.option.collectonly and any("nvme_offload_swaps" in i.nodeid for i in session.items):
        async_io_build.start()


def pytest_sessionfinish(session, exitstatus):
    if _ZYGOTE is not None:
        _ZYGOTE.close()
    async_io_build.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)


def train(
    output: Path, *args: str, nproc: int = 1, timeout: float = 300, launcher: bool = False, cwd: Path | None = None,
    **kw,
) -> dict:  # fmt: skip
    """Train with the given flags and return result.json. Each rank runs `stratbench train` as a torchrun worker
    does, forked from the session's zygote (no launcher, torchrun or fresh interpreter: ~7 s less per 2-process
    run), in ``cwd`` where given (a user's folder: their modules are found there); ``launcher=True``, an ``env``,
    or STRATBENCH_TESTS_LAUNCHER=1 in the environment (every test, as before the zygote: ~8 min more) runs the
    whole command as a user does (launcher, torchrun, workers)."""
    kw = {k: v for k, v in kw.items() if v is not None}
    if launcher or kw or os.environ.get("STRATBENCH_TESTS_LAUNCHER") == "1":
        run_stratbench("train", "--output", str(output), "--nproc", str(nproc), *args, timeout=timeout, cwd=cwd, **kw)
    else:
        argv = ["train", "--output", str(output), "--nproc", str(nproc), *args]
        run = zygote().start(argv, nproc, name=Path(output).name, cwd=cwd)
        code = run.wait(timeout)
        if code != 0:
            raise AssertionError(f"stratbench train {' '.join(args)} (nproc {nproc}) exited {code}\n{run.log_tail(6000)}")
    return json.loads((Path(output) / "result.json").read_text())


def tiny_lm_fp64(seq: int = 32, batch: int = 8, eval_samples: int = 16) -> list[str]:
    """gpt-tiny on text in fp64 (AdamW, gradient clipping on, one warm-up step): the flags the tensor-parallel
    layouts' equivalence runs share (tp, fsdp --tp, pipeline --tp)."""
    return [
        "--model", "gpt-tiny", "--data", "text", "--seq-len", str(seq), "--batch-size", str(batch), "--epochs", "1",
        "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", str(eval_samples), "--progress", "false",
        "--timing-warmup-steps", "1", "--precision", "fp64", "--measure-flops", "false", "--clip-grad-norm", "0.5",
    ]  # fmt: skip


def uneven_ft_flags(folder: Path, seq_len: int = 48, val_fraction: str = "0.1") -> list[str]:
    """gpt-tiny fine-tuning flags (fp64, 3 steps of 8) on a JSONL the helper writes into ``folder``: 16
    examples whose responses run from 1 to 40 tokens, so that micro-batches and ranks hold very different numbers
    of scored tokens (the masked loss's token mean is what they test)."""
    lengths = [1, 30, 2, 3, 25, 1, 2, 40, 3, 1, 28, 2, 4, 33, 1, 2]
    rows = [{"prompt": f"q{i}", "response": "ab" * (n // 2) + "c" * (n % 2)} for i, n in enumerate(lengths)]
    (folder / "ft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "--model", "gpt-tiny", "--data", f"jsonl:{folder / 'ft.jsonl'}", "--seq-len", str(seq_len), "--batch-size",
        "8", "--max-steps", "3", "--optimizer", "adamw", "--lr", "0.003", "--precision", "fp64", "--val-fraction",
        val_fraction, "--timing-warmup-steps", "0", "--progress", "false", "--measure-flops", "false",
    ]  # fmt: skip


COMM = ["--comm-volume", "true", "--breakdown", "true", "--measure-alloc", "true"]
"""Record the collectives of step 3 (stratbench.measuring.commvol), time each step's phases, and read the allocator through
step 2 (--measure-alloc) in an equivalence run: none changes a number the run computes."""


def assert_breakdown_adds_up(res: dict, schedule_as_backward: bool = False) -> dict:
    """metrics.breakdown: on every rank the five phases, each timed on its own spans, add up to the step time
    the step timer measured independently (within 2% on the median step: a part of the step no span covers, or a span timed twice,
    breaks it), and each phase the method runs was timed. ``schedule_as_backward``: a pipeline times its whole
    schedule (forwards and backwards interleaved) as backward, so its forward is 0."""
    b = res["metrics"]["breakdown"]
    assert b["phases"] == ["data", "forward", "backward", "optimizer", "other"], b["phases"]
    for r in b["per_rank_s"]:
        total = sum(r[p] for p in b["phases"])
        # On the median step: a step the other test worker's processes preempted between two spans (a few ms,
        # on 2 cores) is not a span missing, which shows on every step.
        assert abs(r["unattributed_median"]) <= 0.02 * r["step_median"], (
            f"phases add up to {(r['step_median'] - r['unattributed_median']) * 1e3:.3f} ms on the median step, "
            f"which took {r['step_median'] * 1e3:.3f} ms ({-r['unattributed_median'] / r['step_median']:+.1%}): {r}"
        )
        assert abs(r["unattributed"] - (r["step"] - total)) <= 1e-9, r
        timed = ("backward", "optimizer", "other") if schedule_as_backward else ("forward", "backward", "optimizer", "other")
        assert all(r[p] > 0 for p in timed), r
        if schedule_as_backward:
            assert r["forward"] == 0, f"the pipeline's schedule is timed as backward, forward was {r['forward']}"
    return b


def assert_estimate_within(res: dict, tol: float = 0.10) -> float:
    """The memory estimate of the run's config (its busiest rank) is within ``tol`` of the allocator peak the
    run measured on itself (--measure-alloc, the largest over the ranks); returns the relative error."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.predicting.estimate import estimate

    measured = [a for a in res["metrics"]["cpu_alloc_peak_bytes"] if a]
    assert len(measured) == res["world_size"], res["metrics"]["cpu_alloc_peak_bytes"]
    e = estimate(from_dict(TrainConfig, dict(res["config"])), res["world_size"], "cpu")
    err = (e.peak_bytes - max(measured)) / max(measured)
    rows = ", ".join(f"{r.component} {r.device_bytes / 2**20:.3f}" for r in e.rows if r.device_bytes)
    assert abs(err) <= tol, (
        f"{res['config']['strategy']} {res['precision']}: estimated {e.peak_bytes / 2**20:.3f} MiB, measured "
        f"{[round(a / 2**20, 3) for a in measured]} MiB ({err:+.1%}); imports left out "
        f"{res['metrics'].get('cpu_alloc_import_bytes')}; estimate rows (MiB): {rows}"
    )
    return err


def assert_comm_matches_formula(res: dict, tol: float = 0.05) -> dict:
    """Per collective kind, the busiest rank's measured payload per step is within ``tol`` of the method's
    ``comm_model`` formula, and a kind the formula does not predict was not sent (returns metrics.comm)."""
    comm = res["metrics"]["comm"]
    assert comm.get("predicted") is not None, comm.get("predicted_note") or comm.get("note")
    assert comm["check"], comm
    for kind, c in comm["check"].items():
        want, got = c["predicted_payload_bytes"], c["measured_payload_bytes"]
        assert abs(got - want) <= tol * want, f"{kind}: measured {got:.0f} B/step vs formula {want} B/step ({comm})"
    assert sum(r["unknown_dtype_calls"] for r in comm["measured_per_rank"]) == 0, comm
    return comm


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two loss curves (asserting equal length)."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b, strict=True))


DEEPSPEED = ["--strategy", "deepspeed"]
DEEPSPEED_TIMEOUT = 240
"""A 2-rank DeepSpeed run's limit in tests/strategies/test_deepspeed*.py (its engine and ops start slowly)."""


def ok_curve(res: dict) -> list[float]:
    """A finished run's loss curve (the run's reason where it did not finish)."""
    assert res["status"] == "ok", res.get("reason")
    return res["metrics"]["loss_curve"]


def assert_curves_match(curve: list[float], ref: list[float], rtol: float) -> None:
    """Every step's loss within ``rtol`` (relative) of the reference's; the message shows the worst step."""
    diff = max_rel_diff(curve, ref)
    worst = max(range(len(ref)), key=lambda i: abs(curve[i] - ref[i]) / max(abs(ref[i]), 1e-300))
    assert diff < rtol, f"max relative difference {diff:.3e} >= {rtol:g} at step {worst}: {curve[worst]!r} vs {ref[worst]!r}"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> dict:
    """The `single` fp64 run of EQUIV that every method's loss curve is compared with."""
    return train(tmp_path_factory.mktemp("reference") / "single", "--strategy", "single", *EQUIV)


@pytest.fixture(scope="session")
def reference_fp32_same_micro_batches(tmp_path_factory) -> dict:
    """`single` fp32 on TINY with --grad-accum 2: the 2 micro-batches of 16 that 2 ranks compute on."""
    return train(tmp_path_factory.mktemp("reference") / "single-fp32-accum2", "--strategy", "single", *TINY, "--grad-accum", "2")


LONG_FIRST = (
    "readme/test_readme_tour.py", "checkpoints/test_safety.py", "strategies/test_deepspeed.py", "launching/test_launch.py",
    "compare/test_compare.py", "strategies/test_pipeline.py", "commands/test_user_work.py", "training/test_training.py",
    "strategies/test_fsdp.py", "data/test_table.py", "data/test_multi_input.py", "compare/test_ray.py",
    "compare/test_slurm.py",
)  # fmt: skip
"""Test files that take minutes, longest first, handed out in this order under ``make test``'s 2 workers
(``--dist loadfile --no-loadscope-reorder``: a file at a time per worker), so that the longest is not the last
file left. Per-file wall seconds under `make test` (2026-11-28): the README tour with the manual's lines ~225,
safety ~160, the others 40-100. The Ray and SLURM files (370 and 150 s alone) run under `make test-clusters`, one
after the other: side by side (a run that handed them out first and second) Ray took 543 s, SLURM 507 s and the
whole suite 4.6 min longer, their daemons, schedulers and cells contending for the 2 cores; and a third xdist
worker, tried to fill the CPU that 2 leave idle, saved 45 s of 21 min and failed a Ray test on a cell that could
not start within 240 s. The README tour was 549 of the suite's ~2,100 CPU-seconds when it ran every command of
the old README (38 lines)."""


LAST = ("strategies/test_deepspeed_nvme.py",)
"""Collected last: the nvme runs wait for DeepSpeed's async_io op, whose build conftest starts in the background at
collection (pytest_sessionstart below): by then it has had the whole suite's idle CPU."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    rank.update({name: len(LONG_FIRST) + 1 + i for i, name in enumerate(LAST)})

    def order(item) -> int:
        return rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(LONG_FIRST))

    items.sort(key=order)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _log_handlers_on_a_live_stream():
    """A library that sets up its logging during a test that captures with ``capsys`` (transformers, on its first
    warning: a StreamHandler on the sys.stderr of that moment) keeps writing to that test's capture after it is
    closed: every later warning of that library became a "--- Logging error ---" traceback on stderr, and a later
    test's one-line check failed on it. Such a handler is pointed at fd 2's stderr before each test."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler and getattr(handler.stream, "closed", False):
                handler.stream = sys.__stderr__  # fd 2 (never closed); setStream would flush the closed one
    yield


def fails(capsys, *argv: str) -> str:
    """Run the CLI in process with ``argv``: it must exit non-zero with exactly one line on stderr (returned)."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    assert len(err.splitlines()) == 1, err
    return err


BIG_LOSS = """import torch.nn.functional as F


def loss(logits, targets):
    return 2.0**10 * F.cross_entropy(logits, targets)
"""
"""A user's loss module (``--loss bigloss:loss``): cross-entropy times 2**10, so fp16-mixed overflows and skips steps."""


def md_section(md: str, heading: str) -> list[str]:
    """The lines of report.md's ``## heading...`` section, up to the next ``## `` heading (a compare report has
    several tables; a test reads the one it checks)."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"## {heading}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def sweep_processes(out: Path) -> list:
    """Live processes whose command line names a sweep's folder (its cells' launchers, torchrun, workers): what a
    cancelled or finished sweep on any executor must not leave behind."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(out) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def projection_published():
    """benchmarks/projection_published.py as a module (and benchmarks/ on sys.path for its model builders)."""
    import importlib

    folder = str(REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("projection_published")
    finally:
        sys.path.remove(folder)


QUICK_FP64 = ["--preset", "quick", "--precision", "fp64", "--max-steps", "3", "--timing-warmup-steps", "1",
              "--only", "single,ddp,fsdp,pipeline-1f1b,deepspeed-z1,dp"]  # fmt: skip
"""The quick preset in fp64, 3 steps each, one cell of each way a cell is launched and recorded: one process
(single), two processes (ddp), a sharded method that checkpoints per rank (fsdp), a pipeline, and two rows refused
here with their reasons (deepspeed has no fp64 mode, dp needs GPUs). The table every executor must reproduce (the
same cells, statuses, reasons and losses as the local executor's). An executor starts `stratbench train` the same
way whatever the method (each method's equivalence to single is tested locally): the preset's other 8 cells ran the
same launch again, ~2 min of the suite's time in each of the sweeps that used it (local, SLURM, and Ray's then)."""


def quick_base() -> dict:
    """The matrix base of QUICK_FP64's cells (for a matrix of the same problem: its curves are the local sweep's)."""
    from stratbench.compare.presets import preset_quick

    return {**preset_quick()["base"], "max_steps": 3, "timing_warmup_steps": 1}


@pytest.fixture(scope="session")
def quick_fp64_local(tmp_path_factory, worker_id) -> Path:
    """`stratbench compare` + QUICK_FP64 on the local executor, run as a user runs it (a fresh interpreter, in an
    empty folder): once per `make test`, the xdist workers sharing it through a lock (the Ray and the SLURM tests
    each check their executor's sweep against it)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # gw0, gw1: each has its own basetemp under the run's folder
        shared = shared.parent
    out = shared / "quick-fp64-local"
    with FileLock(str(shared / "quick-fp64-local.lock")):
        if not (out / "report.md").is_file():
            (shared / "quick-user").mkdir(exist_ok=True)
            run_stratbench("compare", *QUICK_FP64, "--output", str(out), cwd=shared / "quick-user", timeout=900)
    return out


def _glance(report: Path) -> list[list[str]]:
    """The report's "Completed cells at a glance" rows without the columns that time or measure memory."""
    lines = report.read_text().split("## Completed cells at a glance", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| ")]
    header, rows = rows[0], rows[1:]
    keep = [i for i, name in enumerate(header) if name in ("method", "precision", "devices", "val accuracy")]
    return [[row[i] for i in keep] for row in rows]


def assert_same_table(out: Path, local: Path) -> None:
    """A sweep (another executor's) gave the local sweep's table: the same cells with the same statuses and
    reasons, every completed cell's fp64 loss curve within RTOL of the local one, the same report rows."""
    from stratbench.compare.runner import load_records

    got, ref = load_records(out), load_records(local)
    assert sorted(got) == sorted(ref)
    for cid, rec in ref.items():
        assert (got[cid]["status"], got[cid]["reason"]) == (rec["status"], rec["reason"]), cid
        if rec["status"] == "ok":
            assert_curves_match(got[cid]["metrics"]["loss_curve"], rec["metrics"]["loss_curve"], RTOL)
    assert _glance(out / "report.md") == _glance(local / "report.md")
