"""The loop's pieces as a user meets them: the per-step CSV log, the MLflow sink, the train-state object that
resumes a run, a strategy plug-in that reaches every command without touching the package, and one registry
that every command reads."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import EQUIV, REPO, RTOL, TINY, assert_curves_match, cli, run_stratbench, train

QUICK = [*TINY, "--max-steps", "6"]


def test_metrics_csv_has_one_row_per_step_and_resume_appends(tmp_path):
    pandas = pytest.importorskip("pandas")
    out = tmp_path / "run"
    train(out, "--strategy", "single", *QUICK, "--max-steps", "4")
    first = pandas.read_csv(out / "metrics.csv")
    assert list(first.columns) == ["step", "epoch", "loss", "lr", "step_time_s", "samples_per_s", "memory_bytes", "gpu_util_pct"]
    assert first["step"].tolist() == [1, 2, 3, 4]
    assert (first["step_time_s"] > 0).all() and (first["samples_per_s"] > 0).all() and (first["memory_bytes"] > 0).all()
    assert first["gpu_util_pct"].isna().all()  # no GPU: empty, never 0
    res = train(out, "--strategy", "single", *QUICK, "--max-steps", "7", "--resume")
    both = pandas.read_csv(out / "metrics.csv")
    assert both["step"].tolist() == list(range(1, 8)), "a resumed run appends its steps"
    # One process: the CSV's per-step loss is the loss curve of result.json.
    assert both["loss"].tolist()[4:] == pytest.approx(res["metrics"]["loss_curve"], rel=1e-12)
    assert both["lr"].iloc[0] == pytest.approx(0.02)


def test_mlflow_sink_logs_a_run_found_by_search_runs(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    out = tmp_path / "run"
    res = train(out, "--strategy", "single", *QUICK, "--mlflow", "--mlflow-experiment", "loop-test", timeout=300)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("loop-test").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "single/fp32"
    assert run.data.params["strategy"] == "single" and run.data.params["batch_size"] == "32"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 7))
    assert [m.value for m in history] == pytest.approx(res["metrics"]["loss_curve"], rel=1e-12)
    assert run.data.metrics["val_accuracy"] == pytest.approx(res["metrics"]["val_accuracy"])
    # The result file is an artifact inside the run's folder, not in the working directory's ./mlruns.
    saved = json.loads((out / "mlflow-artifacts" / run.info.run_id / "artifacts" / "result.json").read_text())
    assert saved["status"] == "ok" and saved["metrics"]["steps"] == 6
    assert not (REPO / "mlruns").exists()


def test_train_state_round_trips():
    """state_dict / load_state_dict are symmetric: progress, scheduler, scaler state and the RNG come back."""
    from stratbench.core.config import TrainConfig
    from stratbench.core.dist import DistEnv
    from stratbench.core.precision import Precision
    from stratbench.strategies.single import SingleDevice
    from stratbench.training.state import Progress, TrainState

    def make() -> TrainState:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        strategy = SingleDevice(TrainConfig(), DistEnv(), Precision("fp32", torch.device("cpu")), None)
        return TrainState(sched, strategy)

    a = make()
    for _ in range(3):
        a.scheduler.optimizer.step()
        a.scheduler.step()
    a.progress = Progress(step=3, epoch=1, batch_in_epoch=2)
    a.strategy.precision.skipped_steps = 5
    torch.manual_seed(123)
    saved = a.state_dict()
    expected = torch.rand(4)
    b = make()
    torch.manual_seed(0)
    b.load_state_dict(saved)
    assert b.progress == Progress(step=3, epoch=1, batch_in_epoch=2)
    assert b.scheduler.state_dict() == a.scheduler.state_dict() and b.scheduler.get_last_lr() == [0.25]
    assert b.strategy.precision.skipped_steps == 5
    assert torch.equal(torch.rand(4), expected), "the RNG continues where the saved run was"
    assert b.state_dict().keys() == saved.keys()


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_through_the_train_state_continues_the_run(tmp_path, reference_run, strategy):
    """10 steps, then `--resume` in the same folder to step 20: steps 11-20 are the uninterrupted run's."""
    out = tmp_path / strategy
    first = train(out, "--strategy", strategy, *EQUIV, "--max-steps", "10", nproc=2)
    second = train(out, "--strategy", strategy, *EQUIV, "--resume", nproc=2)
    assert second["resumed_from"]["step"] == 10 and second["metrics"]["steps"] == 10
    ref = reference_run["metrics"]["loss_curve"]
    assert_curves_match(first["metrics"]["loss_curve"], ref[:10], RTOL)
    assert_curves_match(second["metrics"]["loss_curve"], ref[10:], RTOL)


# ---- one registry: every strategy reaches every command ----------------------------------------------------


def test_every_registered_strategy_has_a_list_row_and_an_estimate_row():
    from stratbench.strategies.base import all_strategies

    names = sorted(all_strategies())
    listed = cli("list")
    for name in names:
        assert name in listed, f"{name} missing from `stratbench list`"
    est = json.loads(cli("estimate", "--strategy", "all", "--world-size", "2", "--model", "tinynet",
                         "--image-size", "32", "--num-classes", "10", "--batch-size", "32", "--json"))  # fmt: skip
    rows = {r["strategy"]: r for r in est["results"]}
    assert sorted(rows) == names
    for name, row in rows.items():  # a method that cannot split tinynet says why (one row never sinks the table)
        if row["estimate"] is None:
            assert "has no tensor-parallel plan" in (row.get("na") or ""), (name, row.get("na"))
        else:
            assert row["estimate"]["peak_bytes"] > 0, name
    assert rows["ddp"]["estimate"] is not None and rows["pipeline"]["estimate"] is not None


PLUGIN = '''
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register


class ThrowawayCost(CostModel):
    @classmethod
    def memory_model(cls, ctx, rank):
        return ctx.replicated(buckets=False)

    @classmethod
    def comm_model(cls, ctx):
        return []  # one process: no collectives


class ThrowawayCheckpointIO(CheckpointIO):
    def save_checkpoint(self, path, model, optimizer, extra):
        return super().save_checkpoint(path, model, optimizer, extra | {"saved_by": "throwaway"})


@register
class Throwaway(Strategy):
    name = "throwaway"
    description = "a test plug-in: one process, like single"
    cost = ThrowawayCost
    checkpoint_io_class = ThrowawayCheckpointIO


@register
class NoModel(Strategy):
    name = "throwaway-nomodel"
    description = "a test plug-in without a memory model"
'''


@pytest.fixture
def plugin_env(tmp_path) -> dict[str, str]:
    """A strategy module outside the package, registered through the stratbench.strategies entry point of a
    distribution found on the import path (as `pip install` of a user's package would leave it)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "throwaway_strategy.py").write_text(textwrap.dedent(PLUGIN))
    dist = site / "throwaway_strategy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-strategy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[stratbench.strategies]\nthrowaway = throwaway_strategy\n")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}


PLUGIN_COMMANDS = """
import contextlib, io, json, sys
from stratbench.cli import main
from stratbench.compare.matrix import build_matrix, plan

out = {}
for key, argv in json.loads(sys.argv[1]).items():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    out[key] = [code, printed.getvalue()]
m = build_matrix({"cells": [{"method": "throwaway", "precision": "fp32"}]})
out["plan"] = [[p.cell.method, p.cell.world_size, p.status] for p in plan(m)]
print(json.dumps(out))
"""
"""The plug-in's commands, one after another in one fresh interpreter of the plug-in's environment (its entry
point found as an installed distribution's), each through ``stratbench.cli.main``: one start-up instead of four."""


def test_a_plugin_strategy_reaches_list_train_estimate_and_compare(tmp_path, plugin_env):
    """One file outside the package (its runtime, cost model and checkpoint I/O) reaches every command: a train
    run that saves through its checkpoint I/O, an estimate row, a projection row and a compare cell."""
    import subprocess

    from stratbench.checkpoints import checkpoint

    res = train(tmp_path / "run", "--strategy", "throwaway", *QUICK, "--max-steps", "3", env=plugin_env)
    assert res["status"] == "ok" and res["strategy"] == "throwaway" and res["metrics"]["steps"] == 3
    assert checkpoint.read_meta(tmp_path / "run" / "checkpoints" / "last")["saved_by"] == "throwaway"
    estimate = ["estimate", "--strategy", "all", "--model", "tinynet", "--image-size", "32", "--num-classes", "10",
                "--batch-size", "32", "--json"]  # fmt: skip
    commands = {"list": ["list"], "estimate": estimate,
                "timed": [*estimate, "--time", "--hardware", "h100-sxm", "--gpus-per-node", "1"]}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", PLUGIN_COMMANDS, json.dumps(commands)], capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, **plugin_env), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert all(out[k][0] == 0 for k in commands), {k: out[k] for k in commands}
    assert "throwaway" in out["list"][1]
    rows = {r["strategy"]: r for r in json.loads(out["estimate"][1])["results"]}
    assert rows["throwaway"]["estimate"]["peak_bytes"] == rows["single"]["estimate"]["peak_bytes"]
    assert rows["throwaway-nomodel"]["estimate"] is None and "no memory model" in rows["throwaway-nomodel"]["no_model"]
    projected = {r["strategy"]: r["projection"] for r in json.loads(out["timed"][1])["results"]}
    mine, single = projected["throwaway"], projected["single"]
    assert mine["status"] == "ok" and mine["comm_s"] == 0 and mine["step_s"] == pytest.approx(single["step_s"])
    assert projected["throwaway-nomodel"]["status"] == "no model"
    assert out["plan"] == [["throwaway", 1, None]]


def test_a_broken_plugin_is_one_clear_line(tmp_path, plugin_env):
    site = Path(plugin_env["PYTHONPATH"].split(os.pathsep)[0])
    (site / "throwaway_strategy.py").write_text("raise RuntimeError('boom')\n")
    proc = run_stratbench("list", env=plugin_env, timeout=120, check=False)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "throwaway" in lines[0] and "boom" in lines[0], proc.stderr
