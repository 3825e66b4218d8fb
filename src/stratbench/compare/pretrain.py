"""A sweep's pretraining run: the matrix's ``pretrain`` options trained once, with ``single`` on one process, into
``OUTPUT/pretrain`` before any cell, so that every cell fine-tunes the same trained model (``init_from`` its last
checkpoint, which the runner adds to each cell's config). A rerun of the sweep keeps a pretraining run that
finished (its result.json ok and its checkpoint there) and runs it again otherwise. Its outcome goes into
sweep.json (``pretrain``), which the report's Setup section names; a failed one stops the sweep with one line,
before any cell runs (every cell would fail to load its start)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.compare.matrix import PRETRAIN, Matrix, pretrain_config, pretrained_checkpoint
from stratbench.compare.runner import SWEEP, Display, SweepRunner, classify, read_result
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import ConfigError, StratbenchError
from stratbench.training import engine

RESULT = "result.json"


def check_pretrain(matrix: Matrix, out: Path) -> None:
    """Every check of the pretraining run that needs no work (its options, its method here): one line naming what
    is wrong, before anything is written."""
    cfg = from_dict(TrainConfig, pretrain_config(matrix, out), where="matrix pretrain")
    try:
        engine.preflight(cfg, world_size=1)
    except StratbenchError as exc:
        raise ConfigError(f"the sweep's pretraining run cannot run: {exc}") from None


def pretrain_done(matrix: Matrix, out: Path) -> dict[str, Any] | None:
    """The pretraining run's result.json where it finished ok with the matrix's options and its checkpoint is
    there; None otherwise (it is to be run)."""
    result = read_result(Path(out) / PRETRAIN / RESULT)
    if result is None or result.get("status") != "ok" or not pretrained_checkpoint(out).exists():
        return None
    saved = result.get("config") if isinstance(result.get("config"), dict) else {}
    if any(saved.get(key) != value for key, value in (matrix.pretrain or {}).items()):
        return None  # trained with other options (--pretrain-steps): the cells start from another model
    return result


def pretrain_status(matrix: Matrix, out: Path) -> str:
    """What a run of the sweep would do with the pretraining run (``compare --dry-run``)."""
    return "done (ok), kept" if pretrain_done(matrix, out) is not None else "run"


def run_pretrain(runner: SweepRunner) -> dict[str, Any]:
    """Run the pretraining run unless it finished before, then record it in sweep.json; raises ConfigError (one
    line, naming its log) when it does not end ok."""
    out = runner.out
    what = _what(runner.matrix)
    result = pretrain_done(runner.matrix, out)
    display = Display(1, runner.console)
    if result is not None:
        display.skip_only()
        runner.console.print(f"  [dim]done before[/dim] {what}: ok", highlight=False, soft_wrap=True)
        display.close()
        return _record(out, result, None)
    folder = out / PRETRAIN
    if folder.exists():  # an earlier, unfinished attempt: start it again from scratch
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config_path = folder / "config.yaml"
    atomic_write(config_path, yaml.safe_dump(pretrain_config(runner.matrix, out), sort_keys=False))
    log = folder / "train.log"
    display.begin(1, what, f"{PRETRAIN}/train.log")
    command = [sys.executable, "-m", "stratbench", "train", "--config", str(config_path)]
    code, elapsed, timed_out, _ = runner.run_process(command, log, display, f"stopped while running {what}")
    result = read_result(folder / RESULT)
    status, reason = ("timeout", f"over the {runner.timeout_s:.0f} s limit") if timed_out else classify(
        code if code is not None else -1, result, log)  # fmt: skip
    display.end(what, status, reason, elapsed, ran=True)
    display.close()
    if status != "ok" or not pretrained_checkpoint(out).exists():
        raise ConfigError(f"the sweep's pretraining run ended {status}: {reason or 'no checkpoint written'} "
                          f"(log: {log}); no cell was run")  # fmt: skip
    return _record(out, result or {}, elapsed)


def _what(matrix: Matrix) -> str:
    """How the display names the pretraining run."""
    opts = matrix.pretrain or {}
    steps = f", {opts['max_steps']} steps" if opts.get("max_steps") else ""
    return f"pretrain: {opts.get('model', TrainConfig.model)} on {opts.get('data', TrainConfig.data)}{steps}"


def _record(out: Path, result: dict[str, Any], elapsed: float | None) -> dict[str, Any]:
    """The pretraining run in sweep.json's ``pretrain``: its options, what it reached, where its checkpoint is."""
    metrics = result.get("metrics") or {}
    entry = {
        "config": (result.get("config") or {}),
        "status": result.get("status"),
        "steps": metrics.get("steps"),
        "final_loss": metrics.get("final_loss"),
        "val_loss": metrics.get("val_loss"),
        "train_time_s": metrics.get("train_time_s"),
        "elapsed_s": elapsed,
        "kept": elapsed is None,
        "checkpoint": str(pretrained_checkpoint(Path(PRETRAIN).parent)),
    }
    meta = read_result(out / SWEEP) or {}
    meta["pretrain"] = entry
    atomic_write(out / SWEEP, json.dumps(meta, indent=2, default=str))
    return entry


def describe_pretrain(entry: Any) -> str:
    """One line of the report naming the model every cell started from (sweep.json's ``pretrain``); '' if none."""
    if not isinstance(entry, dict):
        return ""
    cfg = entry.get("config") if isinstance(entry.get("config"), dict) else {}
    bits = [f"model {cfg.get('model')} trained on data {cfg.get('data')}"]
    if cfg.get("seq_len"):
        bits.append(f"sequence {cfg['seq_len']}")
    if entry.get("steps") is not None:
        bits.append(f"{entry['steps']} steps of {cfg.get('optimizer')} lr {cfg.get('lr')}, batch {cfg.get('batch_size')}")
    if isinstance(entry.get("final_loss"), int | float):
        bits.append(f"final loss {entry['final_loss']:.4f}")
    if isinstance(entry.get("val_loss"), int | float):
        bits.append(f"val loss {entry['val_loss']:.4f}")
    if isinstance(entry.get("train_time_s"), int | float):
        bits.append(f"{entry['train_time_s']:.0f} s")
    return ", ".join(bits) + f" (the sweep's pretrain run, once; every cell starts from {entry.get('checkpoint')})"
