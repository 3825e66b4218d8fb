"""Where a run's measurements go. The loop feeds one ``RunMetrics`` object; it fans rows out to these sinks,
which only the main rank has. Each sink is a few lines; the loop names none of them.

- ``CsvSink`` (always): ``OUTPUT/metrics.csv``, one row per optimizer step (appended on resume).
- ``TensorBoardSink`` (``--tensorboard``): scalars under ``OUTPUT/tensorboard``.
- ``MLflowSink`` (``--mlflow``, the ``mlflow`` extra): params, per-step metrics and the result file, in a local
  SQLite store ``OUTPUT/mlflow.db`` (artifacts in ``OUTPUT/mlflow-artifacts``) unless ``--mlflow-tracking-uri``
  names another.
- ``ResultSink`` (always): ``OUTPUT/result.json``, written atomically when the run ends, whatever its status.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Protocol

from stratbench.config import TrainConfig

STEP_FIELDS = ("step", "epoch", "loss", "lr", "step_time_s", "samples_per_s", "memory_bytes", "gpu_util_pct")
"""Columns of metrics.csv (loss: this rank's micro-batches on the main rank; memory: allocated on CUDA, RSS on CPU)."""


class Sink(Protocol):
    def log_step(self, row: dict[str, Any]) -> None: ...
    def log_eval(self, step: int, evaluation: dict[str, float]) -> None: ...
    def close(self, result: dict[str, Any]) -> None: ...


class CsvSink:
    def __init__(self, path: Path, append: bool) -> None:
        new = not (append and path.exists() and path.stat().st_size > 0)
        self._fh = path.open("w" if new else "a", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=STEP_FIELDS)
        if new:
            self._writer.writeheader()

    def log_step(self, row: dict[str, Any]) -> None:
        self._writer.writerow({k: row.get(k) for k in STEP_FIELDS})
        self._fh.flush()  # a killed run keeps every step it finished

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        pass

    def close(self, result: dict[str, Any]) -> None:
        self._fh.close()


class TensorBoardSink:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(folder)

    def log_step(self, row: dict[str, Any]) -> None:
        for key in STEP_FIELDS[2:]:
            if row.get(key) is not None:
                self._writer.add_scalar(f"train/{key}", row[key], row["step"])

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        self._writer.add_scalar("val/accuracy", evaluation["val_accuracy"], step)
        self._writer.add_scalar("val/loss", evaluation["val_loss"], step)

    def close(self, result: dict[str, Any]) -> None:
        self._writer.close()


class MLflowSink:
    def __init__(self, cfg: TrainConfig, out: Path) -> None:
        try:
            import mlflow
        except ImportError:  # checked in preflight; kept for direct use of the sink
            raise ImportError("--mlflow needs the mlflow extra: pip install 'stratbench[mlflow]'") from None
        uri = cfg.mlflow_tracking_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; the user asked for one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._mlflow = mlflow
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(cfg.mlflow_experiment)
        if experiment is None:
            # Artifacts (the result file) next to the run's other outputs; MLflow's default is ./mlruns in
            # whatever the working directory is. An existing experiment keeps the location it was made with.
            artifacts = (out / "mlflow-artifacts").resolve().as_uri()
            experiment_id = self._client.create_experiment(cfg.mlflow_experiment, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        name = f"{cfg.strategy}/{cfg.precision}"
        self._run_id = self._client.create_run(
            experiment_id, run_name=name, tags={"output": str(out)}
        ).info.run_id
        params = {k: v for k, v in cfg.to_dict().items() if k != "strategy_options"}
        params.update({f"strategy.{k}": v for k, v in cfg.strategy_options.items()})
        self._client.log_batch(
            self._run_id, params=[mlflow.entities.Param(k, str(v)[:500]) for k, v in params.items()]
        )

    def log_step(self, row: dict[str, Any]) -> None:
        metrics = [
            self._mlflow.entities.Metric(k, float(row[k]), 0, row["step"])
            for k in STEP_FIELDS[2:]
            if row.get(k) is not None
        ]
        self._client.log_batch(self._run_id, metrics=metrics)

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        for key in ("val_loss", "val_accuracy"):
            self._client.log_metric(self._run_id, key, evaluation[key], step=step)

    def close(self, result: dict[str, Any]) -> None:
        summary = {
            k: v
            for k, v in result.get("metrics", {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for key, value in summary.items():
            self._client.log_metric(self._run_id, f"final/{key}", float(value))
        self._client.log_dict(self._run_id, result, "result.json")
        status = "FINISHED" if result.get("status") == "ok" else "FAILED"
        self._client.set_terminated(self._run_id, status=status)


class ResultSink:
    def __init__(self, path: Path) -> None:
        self.path = path

    def log_step(self, row: dict[str, Any]) -> None:
        pass

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        pass

    def close(self, result: dict[str, Any]) -> None:
        from stratbench.checkpoint import atomic_write

        atomic_write(self.path, json.dumps(result, indent=2, default=str))


def build_sinks(cfg: TrainConfig, out: Path, resuming: bool) -> list[Sink]:
    """The main rank's sinks for this run (others get none)."""
    sinks: list[Sink] = [CsvSink(out / "metrics.csv", append=resuming)]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if cfg.mlflow:
        sinks.append(MLflowSink(cfg, out))
    sinks.append(ResultSink(out / "result.json"))  # last: the other sinks may add to the result when closing
    return sinks
