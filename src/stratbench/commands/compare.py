"""stratbench compare: run a matrix of methods x precisions x world sizes on one model and data set, one report."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from stratbench.api import plan_sweep, run_sweep
from stratbench.compare.calibration import CALIBRATION
from stratbench.compare.matrix import PRETRAIN
from stratbench.compare.presets import PRESET_HELP
from stratbench.compare.pretrain import pretrain_status
from stratbench.compare.report import print_table
from stratbench.compare.runner import load_records
from stratbench.core.config import TrainConfig, base_type, coerce, field_docs
from stratbench.core.errors import ConfigError
from stratbench.core.tables import table_console
from stratbench.launching.executors import add_executor_arguments, executor_options, make_executor

NAME = "compare"
HELP = (
    "train every method side by side (a preset or a YAML matrix) and write one report (md, csv, html, charts)"
)
ORDER = 5
_PASS = "cell__"
# TrainConfig options a sweep sets per cell itself; every other option can be passed to all cells.
_NOT_PASSED = ("output", "strategy", "precision", "nproc", "nnodes", "node_rank", "master_addr", "master_port",
               "rdzv_endpoint", "max_restarts", "resume", "resume_from", "progress", "strategy_options")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, metavar="NAME",
                     help="built-in matrix: " + "; ".join(f"{name} ({what})" for name, what in PRESET_HELP.items()))
    src.add_argument("--matrix", metavar="FILE.yaml", help="a matrix file (format: docs/usage.md, \"Your own matrix\")")
    src.add_argument("--methods", metavar="A,B,C",
                     help="no preset: each of these methods (e.g. single,ddp,fsdp,deepspeed) on the --model and "
                          "--data given (default the quick preset's tinynet on digits), at --precisions; `stratbench "
                          "list` names them")  # fmt: skip
    parser.add_argument("--precisions", metavar="A,B",
                        help="with --methods: the precisions of each method (default fp32)")
    parser.add_argument("--method-option", action="append", metavar="METHOD.KEY=VALUE", dest="method_option",
                        help="a method's option for each of its cells, e.g. fsdp.wrap=size or deepspeed.zero_stage=3 "
                             "(repeatable; `stratbench train --help-method METHOD` lists its options)")  # fmt: skip
    parser.add_argument("--output", help="sweep folder (default: runs/compare-PRESET); rerunning resumes in it")
    parser.add_argument("--only", action="append", metavar="NAMES",
                        help="keep cells matching one of these comma-separated names (method, label, precision, "
                             "cell id, wN; wildcards ok); repeat the flag to require several")  # fmt: skip
    parser.add_argument("--skip", action="append", metavar="NAMES", help="drop cells matching any of these names")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and which are skipped here and why; run nothing")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="time limit per cell (default: the preset's)")
    parser.add_argument("--retry", action="store_true", help="also rerun cells recorded as failed/oom/timeout/nan")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="run each cell N times; the table shows the median and the spread (min-max) of "
                             "times, throughput, memory, accuracy and loss (default 1)")  # fmt: skip
    parser.add_argument("--allow-slow", action="store_true",
                        help="run cells that would be skipped as impractically slow here (fp16 on CPU, GPU presets on CPU)")  # fmt: skip
    parser.add_argument("--hardware", metavar="SYSTEM|FILE",
                        help="profile for the report's predicted-step column (a built-in system or a `stratbench "
                             "probe` file; default: the built-in one of the device the cells ran on)")  # fmt: skip
    parser.add_argument("--calibrate", action="store_true",
                        help="before the cells, calibrate the report's predicted step on this machine: `stratbench "
                             "probe --nproc N`, `single` at the per-process and global batch with a cell process's "
                             "threads, and each multi-process method once on one process (records in "
                             "OUTPUT/calibration.jsonl; resumable). Without it a CPU report leaves that column n/a. "
                             "The quick preset: ~20 short runs more (docs/projection.md)")  # fmt: skip
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="processes of the multi-process methods (default: the preset's; seed: the GPUs present)")  # fmt: skip
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="spread each multi-process cell over N nodes (world size / N processes on each; "
                             "--executor ray/slurm places them on N distinct machines, local runs N launchers here)")  # fmt: skip
    parser.add_argument("--gpus-per-node", "--procs-per-node", dest="procs_per_node", type=int, metavar="P",
                        help="processes on each node (one per GPU on GPUs): each multi-process cell gets "
                             "nodes x P processes, nodes from --nodes (default 1); instead of --world-size")  # fmt: skip
    parser.add_argument("--max-concurrent-cells", type=int, default=0, metavar="N",
                        help="cells under way at once (default: local 1, so that timings are not shared; ray, slurm: "
                             "every cell submitted, each waiting for its own reserved CPUs/GPUs)")  # fmt: skip
    parser.add_argument("--precision", metavar="NAME",
                        help="every cell at this precision instead of the matrix's (e.g. fp64: losses equal to "
                             "~1e-12 across methods and executors, the check of a cluster against this machine); "
                             "cells that then coincide run once")  # fmt: skip
    parser.add_argument("--pretrain-steps", type=int, metavar="N",
                        help="steps of the matrix's pretraining run (ft-quick: the model trained on text before "
                             "the cells fine-tune it; default: the matrix's)")  # fmt: skip
    add_executor_arguments(parser)
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="memory of one device, e.g. 2GiB: a cell whose memory estimate exceeds it is recorded as "
                        "'does not fit (estimate X of Y)' instead of being run (default: the preset's, or no limit)")  # fmt: skip
    group = parser.add_argument_group("training options passed to every cell (override the matrix's base)")
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in _NOT_PASSED:
            continue
        flag = "--" + f.name.replace("_", "-")
        kw = dict(dest=_PASS + f.name, default=None, help=docs.get(f.name, "").replace("%", "%%"))
        if base_type(f.type) is bool:
            group.add_argument(flag, nargs="?", const="true", metavar="BOOL", **kw)
        else:
            group.add_argument(flag, metavar=f.name.upper(), **kw)


def overrides_from(args: argparse.Namespace) -> dict:
    """The training options given on the command line, typed as TrainConfig declares them."""

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out = {}
    for k, v in vars(args).items():
        if k.startswith(_PASS) and v is not None:
            name = k[len(_PASS) :]
            out[name] = coerce(name, v, fields[name].type)
    return out


def world_of(world_size: int | None, nodes: int | None, procs_per_node: int | None) -> int | None:
    """The processes of a multi-process cell: ``--world-size``, or ``--nodes`` x ``--gpus-per-node``."""
    if procs_per_node is None:
        return world_size
    if procs_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {procs_per_node}")
    world = (nodes or 1) * procs_per_node
    if world_size is not None and world_size != world:
        raise ConfigError(f"--world-size {world_size} disagrees with --nodes {nodes or 1} x --gpus-per-node "
                          f"{procs_per_node} = {world}: give one of them")  # fmt: skip
    return world


def run(args: argparse.Namespace) -> int:

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    world_size = world_of(args.world_size, args.nodes, args.procs_per_node)
    console = table_console()
    executor = make_executor(args.executor, args.max_concurrent_cells, **executor_options(args))
    try:
        sweep = plan_sweep(args.preset, matrix=args.matrix, output=args.output, only=args.only, skip=args.skip,
                           timeout=args.timeout, allow_slow=args.allow_slow, calibrate=args.calibrate,
                           hardware=args.hardware, world_size=world_size, device_memory=args.device_memory,
                           nodes=args.nodes, precision=args.precision, executor=executor,
                           pretrain_steps=args.pretrain_steps, methods=args.methods,
                           precisions=args.precisions, method_options=args.method_option,
                           **overrides_from(args))  # fmt: skip
    except BaseException:
        executor.close()
        raise
    if args.dry_run:
        executor.close()
        _print_plan(sweep, console)
        return 0
    console.print(f"[bold]stratbench compare[/bold] {sweep.matrix.heading}: {len(sweep.plans)} cells -> {sweep.output}"
                  f" ({executor.where()})", highlight=False, soft_wrap=True)  # fmt: skip
    done = run_sweep(sweep, repeats=args.repeats, retry=args.retry, hardware=args.hardware, console=console,
                     command=["stratbench", *[shlex.quote(a) for a in sys.argv[1:]]])  # fmt: skip
    print_table(done.records, console)
    paths = done.report
    console.print(f"report: {paths['md']}, {paths['html']}, {paths['csv']}", highlight=False, soft_wrap=True)
    if done.interrupted:
        console.print(
            f"[yellow]interrupted[/yellow] ({done.interrupted}); finished cells are kept - rerun the same command to resume"
        )
        return 130
    return 1 if done.failed else 0


def _print_plan(sweep, console) -> None:
    """--dry-run: each cell, whether it runs here (or why not), and what a rerun keeps."""

    done = load_records(sweep.output)
    console.print(f"[bold]{sweep.matrix.heading}[/bold]: {sweep.matrix.description}", highlight=False, soft_wrap=True)
    console.print(f"{len(sweep.plans)} cells; output {sweep.output}; time limit per cell {sweep.timeout_s:.0f} s",
                  highlight=False, soft_wrap=True)  # fmt: skip
    if sweep.matrix.pretrain is not None:
        opts = ", ".join(f"{k} {v}" for k, v in sweep.matrix.pretrain.items())
        console.print(f"  0. pretrain: single x1 into {sweep.output / PRETRAIN} ({opts}); every cell starts from its "
                      f"last checkpoint  -> {pretrain_status(sweep.matrix, sweep.output)}", highlight=False, soft_wrap=True)  # fmt: skip
    said: dict[str, int] = {}  # a reason several cells share is written out once, then referred to
    for n, p in enumerate(sweep.plans, 1):
        c = p.cell
        prev = done.get(c.id, {}).get("status")
        what = (
            ("run" if prev is None or prev == "skipped" else f"done ({prev}), kept")
            if p.status is None
            else f"{p.status}: {p.reason}"
        )
        if p.status is not None and what in said:
            what = f"{p.status}: as cell {said[what]}"
        elif p.status is not None:
            said[what] = n
        console.print(f"{n:3d}. {c.name:<22} {c.precision:<11} {c.shape}  batch {c.batch_size:<5} {c.id}  -> {what}",
                      highlight=False, soft_wrap=True)  # fmt: skip
    runnable = sum(p.status is None for p in sweep.plans)
    console.print(f"{runnable} to run, {len(sweep.plans) - runnable} skipped or invalid here", highlight=False)
    if sweep.calibration is not None:
        _print_calibration(sweep.calibration, sweep.output, console)


def _print_calibration(calibration, out: Path, console) -> None:
    """--dry-run --calibrate: the calibration runs, before the cells, and what is left out."""

    done = load_records(out, CALIBRATION)
    console.print(f"calibration ({len(calibration.runs)} runs before the cells, records in {out / CALIBRATION}):",
                  highlight=False, soft_wrap=True)  # fmt: skip
    for n, run in enumerate(calibration.runs, 1):
        prev = done.get(run.id, {}).get("status")
        what = (("run" if prev is None else f"done ({prev}), kept") if run.status is None
                else f"{run.status}: {run.reason}")  # fmt: skip
        console.print(f"{n:3d}. {run.what}  {run.id}  -> {what} (for {len(run.for_cells)} cells)",
                      highlight=False, soft_wrap=True)  # fmt: skip
    for note in calibration.notes:
        console.print(f"  - {note}", highlight=False, soft_wrap=True)
