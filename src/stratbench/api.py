"""stratbench from Python (a notebook, a script): what ``stratbench train``, ``compare`` and ``estimate`` do,
returning results instead of printing tables.

    from stratbench.api import TrainConfig, compare, estimate, train

    result = train(strategy="ddp", nproc=2, precision="bf16-mixed", output="runs/ddp")  # result.json's content
    result = train(TrainConfig(model="resnet18", data="synthetic"), epochs=1)          # a config, changed
    sweep = compare("quick", output="runs/quick", only=["single,ddp"])                 # a Sweep: records + report
    mem = estimate(model="resnet50", strategy="fsdp", world_size=4, batch_size=128)   # an Estimate

Bad input raises ``stratbench.core.errors.StratbenchError`` (a ConfigError, UnsupportedError, ...) with the same
one-line message the command prints, before any work.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path
from typing import Any

from stratbench.checkpoints import checkpoint as ckpt
from stratbench.compare.calibration import check_results_file, plan_calibration, run_calibration
from stratbench.compare.matrix import (
    bytes_of,
    check_method_option,
    check_runnable,
    load_matrix,
    parse_method_options,
    plan,
    select,
)
from stratbench.compare.pretrain import check_pretrain, run_pretrain
from stratbench.compare.report import render_sweeps
from stratbench.compare.runner import Interrupted, SweepRunner
from stratbench.core.config import TrainConfig, coerce, from_dict
from stratbench.core.dist import launched_by_launcher
from stratbench.core.errors import ConfigError
from stratbench.launching.executor import Executor, Shape
from stratbench.launching.executors import EXECUTORS, make_executor
from stratbench.launching.job import run_job
from stratbench.launching.local_executor import LocalExecutor
from stratbench.measuring.hardware import resolve
from stratbench.predicting import estimate as est
from stratbench.training.engine import check_config

__all__ = ["Sweep", "TrainConfig", "compare", "estimate", "plan_sweep", "run_sweep", "train", "train_config"]


def train_config(config: TrainConfig | None = None, /, **options: Any) -> TrainConfig:
    """``config`` (default: TrainConfig()) with ``options`` changed, checked and typed as the CLI would
    (unknown names and bad values: one ConfigError naming them; a recipe is expanded)."""
    if config is not None and not isinstance(config, TrainConfig):
        raise ConfigError(f"train(): config must be a TrainConfig, not {type(config).__name__}")
    base = config.to_dict() if config is not None else {}
    return from_dict(TrainConfig, {**base, **options}, where="train()")


def train(config: TrainConfig | None = None, /, **options: Any) -> dict[str, Any]:
    """Train one model with one method, as ``stratbench train`` does (``nproc`` > 1 starts stratbench's launcher
    and its worker processes); returns the run's result (what ``OUTPUT/result.json`` holds)."""

    cfg = train_config(config, **options)
    if launched_by_launcher():
        raise ConfigError("stratbench.train() starts a whole run; it cannot run inside a launched worker")
    with ckpt.trusted(cfg.trust_checkpoint):
        result = run_job(cfg)
    return result if result is not None else {}


@dataclasses.dataclass
class Sweep:
    """A finished (or interrupted) comparison: every record of its folder and the report's files."""

    output: Path
    records: list[dict[str, Any]]
    report: dict[str, Path]
    """Paths of the report's files by kind: md, html, csv (and the charts)."""
    interrupted: str | None = None

    @property
    def failed(self) -> list[dict[str, Any]]:
        """Cells that ran and did not finish ok (failed, oom, timeout, nan)."""
        return [r for r in self.records if r.get("status") not in ("ok", "skipped")]


@dataclasses.dataclass
class SweepPlan:
    """What a comparison will run: the matrix, each cell's plan, the folder, the time limit, the calibration."""

    matrix: Any
    plans: list[Any]
    output: Path
    timeout_s: float
    calibration: Any = None
    executor: Executor | None = None
    """Where the cells run (None: this machine, one at a time)."""


def plan_sweep(
    preset: str | None = None,
    *,
    matrix: str | None = None,
    output: str | Path | None = None,
    only: list[str] | None = None,
    skip: list[str] | None = None,
    timeout: float | None = None,
    allow_slow: bool = False,
    calibrate: bool = False,
    hardware: str | None = None,
    world_size: int | None = None,
    device_memory: str | int | None = None,
    nodes: int | None = None,
    precision: str | None = None,
    executor: Executor | None = None,
    pretrain_steps: int | None = None,
    methods: list[str] | str | None = None,
    precisions: list[str] | str | None = None,
    method_options: dict[str, dict[str, Any]] | list[str] | None = None,
    **options: Any,
) -> SweepPlan:
    """Every check of a comparison before any cell runs: the matrix, the cells kept, their plans here, the
    results file already in ``output``, the calibration runs, and whether ``executor`` (default: this machine)
    can hold every cell. ``options`` are training options for every cell; ``device_memory`` (bytes or a size
    such as ``2GiB``) replaces the matrix's budget per device: a cell whose estimate exceeds it is recorded as
    'does not fit (estimate X of Y)' instead of being run; ``nodes``: the nodes of every multi-process cell;
    ``precision``: every cell's precision instead of the matrix's (``fp64``: losses that agree to ~1e-12 across
    methods, executors and machines; cells that then coincide run once); ``pretrain_steps``: the steps of the
    matrix's pretraining run instead of its own (``compare.pretrain``); ``methods`` (instead of a preset or a
    matrix): each of these methods at each of ``precisions`` (default fp32) on the model and data of
    ``options``; ``method_options``: strategy options for every cell of a method, ``{"fsdp": {"wrap": "size"}}``
    or ``["fsdp.wrap=size"]`` as the CLI's ``--method-option``."""

    timeout = _number("timeout", timeout, float, low=0, open_low=True)
    world_size = _number("world_size", world_size, int, low=1)
    nodes = _number("nodes", nodes, int, low=1)
    pretrain_steps = _number("pretrain_steps", pretrain_steps, int, low=1)
    only, skip = _names("only", only), _names("skip", skip)
    executor = _executor(executor)
    if calibrate and not executor.runs_here:
        raise ConfigError(f"--calibrate measures this machine, but --executor {executor.name} runs the cells "
                          "elsewhere: calibrate with a local compare on a node like the cluster's")  # fmt: skip
    if hardware is not None and not isinstance(hardware, str):
        raise ConfigError(f"hardware must be a system name or a profile file, not {type(hardware).__name__}")
    if hardware:
        resolve(hardware)  # a bad profile is refused now, not after the sweep
    given = [k for k, v in (("preset", preset), ("matrix", matrix), ("methods", methods)) if v]
    if len(given) > 1:
        raise ConfigError(f"give one of preset, matrix and methods, not {' and '.join(given)}")
    m = load_matrix(preset, matrix, _typed(options), world_size, nodes, precision, pretrain_steps,
                    _comma("methods", methods), _comma("precisions", precisions), _method_options(method_options))
    if device_memory is not None:
        m.device_memory = bytes_of(device_memory)
    plans = plan(m, select(m.cells, only, skip), allow_slow=allow_slow)
    out = Path(output or f"runs/compare-{m.name}")
    check_results_file(out)  # a corrupt line is refused before any cell runs; a torn last one is noted
    if m.pretrain is not None:
        check_pretrain(m, out)
    calibration = None
    if calibrate:
        calibration = plan_calibration(m, plans, allow_slow=allow_slow)
    executor.check(Shape(p.cell.nodes, p.cell.procs_per_node, p.cell.procs_per_node if m.uses_gpus(p.cell) else 0)
                   for p in plans if p.status is None)  # fmt: skip
    return SweepPlan(m, plans, out, timeout or m.timeout_s, calibration, executor)


def _number(
    name: str, value: Any, typ: type, low: float, high: float | None = None, open_low: bool = False
) -> Any:
    """``value`` read as the CLI reads ``typ`` (None stays None), within [low, high] (``open_low``: above low);
    one line naming it otherwise (a bool is not a number here)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    number = coerce(name, value, typ)
    if number < low or (open_low and number == low) or (high is not None and number > high):
        bound = f"above {low}" if open_low else f"at least {low}"
        raise ConfigError(f"{name} must be {bound}{f' and at most {high}' if high else ''}, got {value!r}")
    return number


def _names(name: str, value: Any) -> list[str] | None:
    """``only``/``skip``: a comma-separated string or a list of them (as --only/--skip, repeatable)."""
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{name} must be a string of comma-separated names or a list of them, not {value!r}")


def _comma(name: str, value: Any) -> list[str] | None:
    """``methods``/``precisions``: comma-separated names (a string or a list of them), flattened."""
    given = _names(name, value)
    return None if given is None else [t.strip() for g in given for t in g.split(",") if t.strip()]


def _method_options(value: Any) -> dict[str, dict[str, Any]] | None:
    """``method_options`` as ``--method-option`` gives them (["fsdp.wrap=size"]) or as a mapping, checked alike."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return parse_method_options(_names("method_options", value))
    if not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(f"method_options must map a method to its options, e.g. {{'fsdp': {{'wrap': 'size'}}}}; got {value!r}")
    out: dict[str, dict[str, Any]] = {}
    for method, opts in value.items():
        for key, v in opts.items():
            name = str(key).replace("-", "_")
            check_method_option(str(method), name, v, f"method_options {method}.{key}")
            out.setdefault(str(method), {})[name] = v
    return out


def _executor(value: Any) -> Executor:
    """Where the cells run: an Executor, a name (local, ray, slurm, with their defaults) or None (this machine)."""
    if value is None:
        return LocalExecutor()
    if isinstance(value, str):
        return make_executor(value)
    if not isinstance(value, Executor):
        raise ConfigError(
            f"executor must be an Executor or one of: {', '.join(EXECUTORS)}; got {type(value).__name__}"
        )
    return value


def _typed(options: dict[str, Any]) -> dict[str, Any]:
    """Training options for every cell, typed as TrainConfig declares them (unknown names: one line)."""

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(f"compare(): unknown training option(s) {', '.join(map(repr, unknown))}")
    return {k: coerce(k, v, fields[k].type) for k, v in options.items()}


def run_sweep(
    sweep: SweepPlan,
    *,
    repeats: int = 1,
    retry: bool = False,
    hardware: str | None = None,
    console: Any = None,
    command: list[str] | None = None,
) -> Sweep:
    """Run the planned cells (resuming: recorded cells are kept), then write the report; Ctrl-C stops the
    sweep, keeps the finished cells and still writes the report (``Sweep.interrupted`` says why)."""

    if not isinstance(sweep, SweepPlan):
        raise ConfigError(f"run_sweep() takes the SweepPlan plan_sweep() returns, not {type(sweep).__name__}")
    repeats = _number("repeats", repeats, int, low=1)
    check_runnable(sweep.plans)
    runner = SweepRunner(sweep.matrix, sweep.output, timeout_s=sweep.timeout_s, retry=retry, console=console,
                         repeats=repeats, command=command or ["python", *sys.argv], executor=sweep.executor)  # fmt: skip
    pretrain = sweep.matrix.pretrain is not None and any(p.status is None for p in sweep.plans)
    before: list[Any] = [run_pretrain] if pretrain else []
    if sweep.calibration:
        before.append(partial(run_calibration, runs=sweep.calibration.runs))
    interrupted = None
    try:
        runner.run(sweep.plans, partial(_in_turn, before) if before else None)
    except Interrupted as exc:
        interrupted = str(exc)
    finally:
        runner.executor.close()
    paths, records = render_sweeps([runner.out], runner.out, hardware=hardware)
    return Sweep(runner.out, records, paths, interrupted)


def _in_turn(steps: list[Any], runner: SweepRunner) -> None:
    """The runs a sweep makes before its cells, in order: the pretraining run, then the calibration runs."""
    for step in steps:
        step(runner)


def compare(
    preset: str | None = None,
    *,
    repeats: int = 1,
    retry: bool = False,
    console: Any = None,
    **plan_options: Any,
) -> Sweep:
    """Train every cell of a preset (``quick``, ``seed``, ...) or a ``matrix=`` YAML file side by side into
    ``output`` and write one report, as ``stratbench compare`` does. ``only``/``skip`` select cells by name,
    other keywords are ``plan_sweep``'s (timeout, calibrate, hardware, world_size) or training options for
    every cell (``epochs=1``)."""
    repeats = _number("repeats", repeats, int, low=1)
    sweep = plan_sweep(preset, **plan_options)
    return run_sweep(
        sweep, repeats=repeats, retry=retry, hardware=plan_options.get("hardware"), console=console
    )


def estimate(
    model: str = "resnet50",
    *,
    strategy: str = "single",
    world_size: int = 1,
    device_type: str = "cuda",
    **options: Any,
):
    """Memory per device of ``model`` trained with ``strategy`` on ``world_size`` devices, before training
    (``stratbench.predicting.estimate.Estimate``: ``total_bytes``, ``peak_bytes``, ``rows``, ``to_dict()``). ``options``
    are TrainConfig fields: batch_size (the global batch), precision, optimizer, image_size, strategy_options..."""

    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    world_size = _number("world_size", world_size, int, low=1, high=est.MAX_WORLD)
    cfg = train_config(None, model=model, strategy=strategy, data=options.pop("data", "synthetic"), **options)
    check_config(cfg, world_size)
    return est.estimate(cfg, world_size, device_type)
