"""Where a run's measurements go. The loop feeds one ``RunMetrics`` object; it fans rows out to these sinks,
which only the main rank has. Each sink is a few lines; the loop names none of them.

- ``CsvSink`` (always): ``OUTPUT/metrics.csv``, one row per optimizer step (appended on resume).
- ``TensorBoardSink`` (``--tensorboard``): scalars under ``OUTPUT/tensorboard``.
- ``MLflowSink`` (``--mlflow``, the ``mlflow`` extra): params, per-step metrics and the result file, in a local
  SQLite store ``OUTPUT/mlflow.db`` (artifacts in ``OUTPUT/mlflow-artifacts``) unless ``--mlflow-tracking-uri``
  names another.
- ``WandbSink`` (``--wandb``, the ``wandb`` extra): config and environment, per-step and validation metrics and
  the result summary in a W&B run whose files are under ``OUTPUT/wandb``; offline unless a login is found.
- ``ResultSink`` (always): ``OUTPUT/result.json``, written atomically when the run ends, whatever its status.
"""

from __future__ import annotations

import csv
import json
import netrc
import os
import shlex
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError

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


WANDB_PEAKS = ("peak_memory_bytes", "peak_reserved_bytes", "eval_peak_memory_bytes", "nvml_used_peak_bytes")
"""Per-rank peaks of result.json that the W&B summary holds as one number: the largest over the ranks."""


def wandb_logged_in() -> bool:
    """Whether W&B credentials are present, read the way ``wandb`` reads them (the API key or identity-token
    variable, else the netrc entry ``wandb login`` writes for the host) without asking the network."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for name in candidates:
        path = Path(name).expanduser()
        try:
            creds = netrc.netrc(path).authenticators(host) if path.is_file() else None
        except (netrc.NetrcParseError, OSError):
            creds = None
        if creds and creds[2]:
            return True
    return False


def resolve_wandb_mode(requested: str) -> str:
    """The W&B mode a run uses: an explicit --wandb-mode; for ``auto``, wandb's own WANDB_MODE switch if set, else
    online with a login and offline without one, so that a run never stops at a login prompt."""
    if requested != "auto":
        return requested
    env_mode = os.environ.get("WANDB_MODE", "")
    env_mode = {"dryrun": "offline", "run": "online"}.get(env_mode, env_mode)  # wandb's older spellings
    if env_mode in ("online", "offline", "disabled"):
        return env_mode
    return "online" if wandb_logged_in() else "offline"


def wandb_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The run's final numbers for ``run.summary``: status (and reason), every scalar metric of result.json, and
    the per-rank memory peaks as their largest value (lists such as the loss curve are in the history)."""
    summary: dict[str, Any] = {"status": result.get("status")}
    if result.get("reason"):
        summary["reason"] = result["reason"]
    for key, value in result.get("metrics", {}).items():
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            summary[key] = value
        elif key in WANDB_PEAKS and isinstance(value, list):
            peaks = [v for v in value if isinstance(v, int | float)]
            if peaks:
                summary[key] = max(peaks)
    return summary


class WandbSink:
    """One W&B run per ``stratbench train`` invocation (a resumed run is a new W&B run that starts at the step
    it resumes from). The service process wandb starts is shut down in ``close``, whatever the run's status."""

    def __init__(self, cfg: TrainConfig, out: Path, header: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:  # checked in preflight; kept for direct use of the sink
            raise ImportError("--wandb needs the wandb package: pip install 'stratbench[wandb]'") from None
        self._wandb = wandb
        self.mode = resolve_wandb_mode(cfg.wandb_mode)
        # wandb's service process reads the environment too: offline must mean no network at all. Put back in
        # close, for a caller that goes on in this process.
        self._mode_before = os.environ.get("WANDB_MODE")
        os.environ["WANDB_MODE"] = self.mode
        run_info = {k: v for k, v in header.items() if k not in ("config", "metrics", "status")}
        config = {**cfg.to_dict(), "run": run_info}  # run: environment, world size, batch split, loss
        try:
            self.run = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_entity,
                name=f"{cfg.strategy}/{cfg.precision}",
                dir=str(out.resolve()),  # wandb adds its own "wandb" folder: OUTPUT/wandb
                mode=self.mode,
                config=config,
                tags=[cfg.strategy, cfg.precision, cfg.model],
                notes=f"output: {out}",
                # silent: no banner lines between the training log's; no git probe of the output folder.
                settings=wandb.Settings(silent=True, disable_git=True),
            )
        except Exception as exc:  # a bad login, an unreachable server: one line, before any training
            self._restore()
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"--wandb: wandb.init failed ({self.mode} mode): {reason}") from None

    def log_step(self, row: dict[str, Any]) -> None:
        values = {f"train/{k}": row[k] for k in STEP_FIELDS[1:] if row.get(k) is not None}
        self.run.log(values, step=row["step"])

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        values = {"val/accuracy": evaluation["val_accuracy"], "val/loss": evaluation["val_loss"]}
        self.run.log(values, step=step)

    def close(self, result: dict[str, Any]) -> None:
        """Summary, then finish (exit code 1 marks a run that did not end "ok") and stop wandb's service."""
        try:
            self.run.summary.update(wandb_summary(result))
            self.run.finish(exit_code=0 if result.get("status") == "ok" else 1)
        finally:
            self._restore()
        if self.mode == "offline":
            folder = Path(self.run.dir).parent
            sync = f"wandb sync {shlex.quote(str(folder))}"
            print(f"wandb: offline run in {folder}; upload it with: {sync}", flush=True)

    def _restore(self) -> None:
        """Stop wandb's service process (wandb.finish leaves it running until exit) and put WANDB_MODE back."""
        self._wandb.teardown()
        if self._mode_before is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = self._mode_before


class ResultSink:
    def __init__(self, path: Path) -> None:
        self.path = path

    def log_step(self, row: dict[str, Any]) -> None:
        pass

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        pass

    def close(self, result: dict[str, Any]) -> None:

        atomic_write(self.path, json.dumps(result, indent=2, default=str))


def build_sinks(
    cfg: TrainConfig, out: Path, resuming: bool, header: dict[str, Any] | None = None
) -> list[Sink]:
    """The main rank's sinks for this run (others get none); ``header``: the result's first fields (environment,
    batch split), which W&B logs beside the config."""
    sinks: list[Sink] = []
    if cfg.wandb:  # first: a login or server it cannot reach is refused before any file is opened
        sinks.append(WandbSink(cfg, out, header or {}))
    if cfg.mlflow:
        sinks.append(MLflowSink(cfg, out))
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    # After the trackers, which add files of their own: metrics.csv is the one an earlier run's is replaced by.
    sinks.append(CsvSink(out / "metrics.csv", append=resuming))
    sinks.append(ResultSink(out / "result.json"))  # last: the other sinks may add to the result when closing
    return sinks
