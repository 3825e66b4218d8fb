"""The one training loop. It talks only to a Strategy (and, through it, a Precision); no method-specific code.

Order of set-up, the same for every method: seed -> data -> model (same init on every rank) -> weights ->
activation checkpointing -> strategy.setup (convert precision, move, wrap, build optimizer on the wrapped
parameters) -> compile -> resume. Timing: each optimizer step is timed from a synchronised clock, data loading
included, evaluation and checkpointing excluded; the first ``timing_warmup_steps`` steps are left out of the
step statistics. Memory peaks are reset at the start of each phase.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench import checkpoint as ckpt
from stratbench.config import TrainConfig, dump_yaml, validate
from stratbench.data import (
    build_data,
    check_data,
    split_batch,
    steps_per_epoch,
    train_loader,
)
from stratbench.dist import (
    DistEnv,
    destroy_process_group,
    init_process_group,
    read_env,
    rng_state,
    seed_everything,
    set_rng_state,
)
from stratbench.errors import CheckpointError, ConfigError, StratbenchError, UnsupportedError
from stratbench.metrics import (
    MemoryPhase,
    StepTimer,
    UtilisationSampler,
    environment,
    flops_per_sample,
    peak_flops,
)
from stratbench.models import (
    apply_activation_checkpointing,
    build_model,
    check_model,
    count_parameters,
    load_weights,
)
from stratbench.precision import SPECS, Precision, configure_tf32
from stratbench.strategies.base import Strategy, get_strategy


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer class and keyword arguments; callable on parameters. Strategies that build the optimizer
    themselves (ZeroRedundancyOptimizer, DeepSpeed) read ``cls`` and ``kwargs``."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    if cfg.optimizer == "sgd":
        return OptimizerSpec(torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay})
    return OptimizerSpec(torch.optim.AdamW, {"lr": cfg.lr, "weight_decay": cfg.weight_decay})


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warm = cfg.lr_warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def world_size_of(cfg: TrainConfig) -> int:
    """Processes the run will have: nproc x nnodes when stratbench starts them, else the launcher's
    WORLD_SIZE (torchrun, deepspeed) or SLURM_NTASKS (srun, one task per device)."""
    import os

    from stratbench.launch import needs_launch

    if needs_launch(cfg):
        return cfg.nproc * cfg.nnodes
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if name in os.environ:
            return int(os.environ[name])
    return cfg.nproc * cfg.nnodes


def preflight(cfg: TrainConfig, world_size: int | None = None) -> type[Strategy]:
    """Every check that needs no data or model: bad input fails here, before any work starts."""
    validate(cfg)
    check_model(cfg.model)
    check_data(cfg)
    if cfg.precision not in SPECS:
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose one of: {', '.join(SPECS)}")
    strategy_cls = get_strategy(cfg.strategy)
    strategy_cls.parse_options(cfg.strategy_options)
    world = world_size if world_size is not None else world_size_of(cfg)
    from stratbench.dist import resolve_device

    device = resolve_device(cfg.device)
    from stratbench.precision import supported_on

    reason = supported_on(SPECS[cfg.precision], device) or strategy_cls.check_supported(cfg, device, world)
    if reason:
        raise UnsupportedError(f"{cfg.strategy}/{cfg.precision} cannot run here: {reason}")
    split_batch(cfg.batch_size, strategy_cls.data_parallel_size(cfg, world), cfg.grad_accum)
    if cfg.weights and not Path(cfg.weights).is_file():
        raise CheckpointError(f"weights file not found: {cfg.weights}")
    for path in (cfg.init_from, cfg.resume_from if cfg.resume or cfg.resume_from else None):
        if path:
            ckpt.read_meta(Path(path))
    if cfg.resume and not cfg.resume_from:
        last = ckpt.last_checkpoint(Path(cfg.output))
        if last.exists():
            ckpt.read_meta(last)
    return strategy_cls


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train in this process (one rank of a launched group, or the only process) and return the result."""
    strategy_cls = preflight(cfg)
    env = read_env(cfg.device)
    if strategy_cls.needs_process_group:
        init_process_group(env, cfg.dist_timeout_s)
    elif env.world_size > 1:
        raise ConfigError(f"strategy {cfg.strategy!r} runs in one process; it was launched as {env.world_size}")
    try:
        return Trainer(cfg, env, strategy_cls).fit()
    finally:
        if strategy_cls.needs_process_group:
            destroy_process_group()


class Trainer:
    def __init__(self, cfg: TrainConfig, env: DistEnv, strategy_cls: type[Strategy]) -> None:
        self.cfg = cfg
        self.env = env
        self.out = Path(cfg.output)
        configure_tf32(cfg.tf32, env.device)
        precision = Precision(cfg.precision, env.device)
        self.strategy = strategy_cls(cfg, env, precision, strategy_cls.parse_options(cfg.strategy_options))
        self.result: dict[str, Any] = {}
        self.writer = None

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        t_start = time.perf_counter()
        self.result = self._result_header()
        if env.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.out / "config.yaml")
        try:
            self._fit()
            self.result["status"] = "ok"
        except torch.OutOfMemoryError as exc:
            self._fail("oom", f"out of memory: {str(exc).splitlines()[0]}")
            raise
        except StratbenchError as exc:
            self._fail("failed", str(exc))
            raise
        except Exception as exc:
            self._fail("failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        finally:
            self.result["metrics"]["wall_time_s"] = time.perf_counter() - t_start
            if env.is_main:
                _write_json(self.out / "result.json", self.result)
            if self.writer:
                self.writer.close()
        return self.result

    def _fail(self, status: str, reason: str) -> None:
        self.result["status"] = status
        self.result["reason"] = reason
        self.result["traceback"] = traceback.format_exc(limit=8)

    def _result_header(self) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        dp = type(self.strategy).data_parallel_size(cfg, env.world_size)
        return {
            "status": "running",
            "strategy": cfg.strategy,
            "precision": cfg.precision,
            "model": cfg.model,
            "data": cfg.data,
            "world_size": env.world_size,
            "data_parallel_size": dp,
            "global_batch_size": cfg.batch_size,
            "per_device_batch_size": cfg.batch_size // (dp * cfg.grad_accum) * cfg.grad_accum,
            "micro_batch_size": cfg.batch_size // (dp * cfg.grad_accum),
            "grad_accum": cfg.grad_accum,
            "batch_semantics": "batch_size is the global batch per optimizer step, over all devices and micro-steps",
            "config": cfg.to_dict(),
            "environment": environment(env.world_size, env.device),
            "metrics": {},
        }

    # ------------------------------------------------------------------------------------------
    def _fit(self) -> None:
        cfg, env, strategy = self.cfg, self.env, self.strategy
        seed_everything(cfg.seed)
        bundle = build_data(cfg)
        micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
        pin = env.device.type == "cuda"
        loader, sampler = train_loader(bundle.train, micro, env.rank, env.world_size, cfg.seed, cfg.num_workers, pin)
        spe = steps_per_epoch(len(bundle.train), env.world_size, micro, cfg.grad_accum)
        if spe == 0:
            raise ConfigError(
                f"the training set ({len(bundle.train)} samples) is smaller than one global batch ({cfg.batch_size})"
            )
        total_steps = spe * cfg.epochs
        run_steps = min(total_steps, cfg.max_steps or total_steps)

        def build() -> nn.Module:
            return build_model(cfg.model, bundle.num_classes, cifar_stem=cfg.cifar_stem, norm=cfg.norm, width=cfg.width)

        seed_everything(cfg.seed)  # the same initial weights on every rank and for every method
        model = build()
        meta = {
            "model": cfg.model,
            "num_classes": bundle.num_classes,
            "class_names": bundle.class_names,
            "image_size": bundle.image_size,
            "mean": list(bundle.mean),
            "std": list(bundle.std),
            "cifar_stem": cfg.cifar_stem,
            "norm": cfg.norm,
            "width": cfg.width,
            "data": cfg.data,
            "num_parameters": count_parameters(model),
        }
        self.result["model_meta"] = meta
        if cfg.weights:
            skipped = load_weights(model, cfg.weights)
            self.result["weights_skipped"] = skipped
        if cfg.init_from:
            state = ckpt.load_any(Path(cfg.init_from))
            model.load_state_dict(state["model"])
        flops = flops_per_sample(build, (3, bundle.image_size, bundle.image_size), bundle.num_classes) if cfg.measure_flops else None
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)

        spec = optimizer_spec(cfg)
        model, optimizer = strategy.setup(model, spec)
        if cfg.compile:
            model = torch.compile(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))

        step, epoch, batch_in_epoch = 0, 0, 0
        resume_path = ckpt.resolve_resume(cfg.output, cfg.resume_from) if (cfg.resume or cfg.resume_from) else None
        if resume_path is not None:
            state = strategy.load_checkpoint(resume_path, model, optimizer)
            progress = state["progress"]
            step, epoch, batch_in_epoch = progress["step"], progress["epoch"], progress["batch_in_epoch"]
            scheduler.load_state_dict(state["scheduler"])
            strategy.precision.load_state_dict(state.get("precision", {}))
            if state.get("rng") and state.get("world_size") == env.world_size:
                set_rng_state(state["rng"][env.rank] if isinstance(state["rng"], list) else state["rng"])
            self.result["resumed_from"] = {"path": str(resume_path), "step": step}
        if cfg.tensorboard and env.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.out / "tensorboard")

        timer = StepTimer(strategy.synchronize, cfg.timing_warmup_steps)
        util = UtilisationSampler(strategy.memory_devices())
        loss_fn = nn.CrossEntropyLoss()
        step_losses: list[float] = []
        epoch_times: list[float] = []
        train_peaks: list[list[int]] = []
        reserved_peaks: list[list[int]] = []
        evals: list[dict[str, float]] = []
        state_bytes: dict[str, int] | None = None
        bar = _progress(cfg, env, run_steps, step)
        self._save_args = (model, optimizer, scheduler, meta)
        samples_per_step = cfg.batch_size

        while epoch < cfg.epochs and step < run_steps:
            sampler.set_epoch(epoch, skip=batch_in_epoch * micro * cfg.grad_accum)
            it = iter(loader)
            phase = MemoryPhase(strategy.memory_devices())
            phase.start()
            util.start()
            model.train()
            epoch_time = 0.0
            while batch_in_epoch < spe and step < run_steps:
                timer.start()
                loss_sum = torch.zeros((), device=env.device)
                for k in range(cfg.grad_accum):
                    x, y = next(it)
                    x = x.to(env.device, non_blocking=True)
                    y = y.to(env.device, non_blocking=True)
                    if cfg.channels_last:
                        x = x.contiguous(memory_format=torch.channels_last)
                    with strategy.accumulate(is_last_micro_step=k == cfg.grad_accum - 1):
                        loss, _ = strategy.forward_loss(model, x, y, loss_fn)
                        strategy.backward(loss / cfg.grad_accum)
                    loss_sum += loss.detach()
                if state_bytes is None and (step >= 1 or run_steps == 1):
                    state_bytes = strategy.state_bytes(model, optimizer)
                strategy.optimizer_step(optimizer, cfg.clip_grad_norm)
                scheduler.step()
                dt = timer.stop()
                epoch_time += dt
                loss_value = loss_sum.item() / cfg.grad_accum
                if not math.isfinite(loss_value) and not strategy.precision.scaler.is_enabled():
                    raise FloatingPointError(f"loss became {loss_value} at step {step}")
                step_losses.append(loss_value)
                step += 1
                batch_in_epoch += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{loss_value:.4f}", samples_s=f"{samples_per_step / dt:.0f}")
                if self.writer:
                    self.writer.add_scalar("train/loss", loss_value, step)
                    self.writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                    self.writer.add_scalar("train/samples_per_s", samples_per_step / dt, step)
                if cfg.save_every_steps and step % cfg.save_every_steps == 0 and step < run_steps:
                    self._save(step, epoch, batch_in_epoch)
            util.stop()
            phase.stop()
            epoch_times.append(epoch_time)
            train_peaks.append(phase.peak_bytes())
            reserved_peaks.append(phase.peak_reserved)
            epoch_done = batch_in_epoch >= spe
            if epoch_done:
                epoch, batch_in_epoch = epoch + 1, 0
            last = step >= run_steps or epoch >= cfg.epochs
            if (cfg.eval_every_epoch and epoch_done) or last:
                ev = self.evaluate(model, bundle)
                ev["epoch"] = epoch if epoch_done else epoch + batch_in_epoch / spe
                evals.append(ev)
                if self.writer:
                    self.writer.add_scalar("val/accuracy", ev["val_accuracy"], step)
                    self.writer.add_scalar("val/loss", ev["val_loss"], step)
                if env.is_main:
                    line = f"epoch {ev['epoch']:.2f}: val_loss {ev['val_loss']:.4f}  val_accuracy {ev['val_accuracy']:.4f}"
                    bar.write(line) if bar is not None else print(line, flush=True)
            if (cfg.save_every_epoch and epoch_done) or last:
                self._save(step, epoch, batch_in_epoch)
        if bar is not None:
            bar.close()
        if state_bytes is None:
            state_bytes = strategy.state_bytes(model, optimizer)
        self._finish_metrics(timer, util, step_losses, epoch_times, train_peaks, reserved_peaks, evals, state_bytes, flops)

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, bundle) -> dict[str, float]:
        """Validation loss/accuracy; each sample counted once over all ranks, every rank runs the same number
        of batches (padding has weight 0), so sharded methods' collectives stay in step."""
        from stratbench.data import val_loader

        cfg, env, strategy = self.cfg, self.env, self.strategy
        micro = max(1, cfg.batch_size // (env.world_size * cfg.grad_accum))
        loader = val_loader(bundle.val, micro, env.rank, env.world_size, cfg.num_workers, env.device.type == "cuda")
        model.eval()
        phase = MemoryPhase(strategy.memory_devices())
        phase.start()
        totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
        for x, y, valid in loader:
            x, y, valid = x.to(env.device), y.to(env.device), valid.to(env.device)
            if cfg.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            x = strategy.precision.convert_input(x)
            with strategy.precision.autocast():
                logits = model(x)
            losses = nn.functional.cross_entropy(logits.float(), y, reduction="none")
            totals[0] += (losses * valid).sum().double()
            totals[1] += ((logits.argmax(1) == y) * valid).sum().double()
            totals[2] += valid.sum().double()
        phase.stop()
        strategy.all_reduce(totals, "sum")
        model.train()
        self._eval_peak = phase.peak_bytes()
        return {"val_loss": (totals[0] / totals[2]).item(), "val_accuracy": (totals[1] / totals[2]).item(), "val_samples": int(totals[2].item())}

    def _save(self, step: int, epoch: int, batch_in_epoch: int) -> None:
        model, optimizer, scheduler, meta = self._save_args
        t0 = time.perf_counter()
        rngs = self.strategy.all_gather_object(rng_state())
        extra = {
            "progress": {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch},
            "scheduler": scheduler.state_dict(),
            "precision": self.strategy.precision.state_dict(),
            "rng": rngs,
            "world_size": self.env.world_size,
            "strategy": self.cfg.strategy,
            "precision_name": self.cfg.precision,
            "config": self.cfg.to_dict(),
            "meta": meta,
        }
        self.strategy.save_checkpoint(ckpt.last_checkpoint(self.out), model, optimizer, extra)
        self.result.setdefault("metrics", {}).setdefault("checkpoint_time_s", 0.0)
        self.result["metrics"]["checkpoint_time_s"] += time.perf_counter() - t0

    def _finish_metrics(self, timer, util, step_losses, epoch_times, train_peaks, reserved_peaks, evals, state_bytes, flops):
        cfg, env, strategy = self.cfg, self.env, self.strategy
        # Per-step loss averaged over ranks (each rank's micro-batches are the same size): one collective.
        losses = torch.tensor(step_losses, dtype=torch.float64, device=env.device)
        strategy.all_reduce(losses, "sum")
        losses /= env.world_size
        peaks_local = [max(col) for col in zip(*train_peaks, strict=False)] if train_peaks else []
        reserved_local = [max(col) for col in zip(*reserved_peaks, strict=False)] if reserved_peaks and reserved_peaks[0] else []
        local = {
            "timer": timer.summary(),
            "peak": peaks_local,
            "reserved": reserved_local,
            "eval_peak": getattr(self, "_eval_peak", []),
            "util": util.summary(),
            "state_bytes": state_bytes,
            "epoch_times": epoch_times,
        }
        ranks = strategy.all_gather_object(local)
        mean_steps = [r["timer"]["step_time_mean_s"] for r in ranks if r["timer"]["step_time_mean_s"] is not None]
        measured = local["timer"]["measured_steps"]
        train_time = sum(epoch_times)
        # Ranks step in lock-step; the slowest rank's step time is the method's step time.
        step_time = max(mean_steps) if mean_steps else None
        throughput = cfg.batch_size / step_time if step_time else None
        device_kind = "cuda" if env.device.type == "cuda" else "cpu"
        per_rank_peaks = [p for r in ranks for p in r["peak"]]
        metrics: dict[str, Any] = self.result["metrics"]
        metrics.update(
            {
                "train_time_s": train_time,
                "epoch_time_s": epoch_times,
                "steps": len(step_losses),
                "measured_steps": measured,
                "step_time_mean_s": step_time,
                "step_time_mean_per_rank_s": [r["timer"]["step_time_mean_s"] for r in ranks],
                "step_time_median_s": local["timer"]["step_time_median_s"],
                "step_time_p90_s": local["timer"]["step_time_p90_s"],
                "step_time_rank_mean_s": (sum(mean_steps) / len(mean_steps)) if mean_steps else None,
                "throughput_samples_per_s": throughput,
                "peak_memory_bytes": per_rank_peaks,
                "peak_memory_kind": "cuda_max_allocated" if device_kind == "cuda" else "cpu_peak_rss",
                "peak_reserved_bytes": [p for r in ranks for p in r["reserved"]],
                "eval_peak_memory_bytes": [p for r in ranks for p in r["eval_peak"]],
                "nvml_used_peak_bytes": [p for r in ranks for p in r["util"]["nvml_used_peak_bytes"]],
                "gpu_util_mean_pct": [p for r in ranks for p in r["util"]["gpu_util_mean_pct"]],
                "gpu_util_peak_pct": [p for r in ranks for p in r["util"]["gpu_util_peak_pct"]],
                "loss_curve": losses.tolist(),
                "final_loss": losses[-1].item() if len(losses) else None,
                "val_loss": evals[-1]["val_loss"] if evals else None,
                "val_accuracy": evals[-1]["val_accuracy"] if evals else None,
                "evaluations": evals,
                "skipped_steps": strategy.precision.skipped_steps,
                "flops_per_sample": flops,
            }
        )
        if flops and throughput:
            achieved = flops * throughput / max(1, strategy.data_parallel_size(cfg, env.world_size))
            metrics["achieved_flops_per_device"] = achieved
            peak = peak_flops(env.device, cfg.precision, cfg.tf32)
            metrics["mfu"] = achieved / peak if peak else None
        else:
            metrics["mfu"] = None
        self.result["sharding"] = {k: [r["state_bytes"][k] for r in ranks] for k in state_bytes}


def _progress(cfg: TrainConfig, env: DistEnv, total: int, initial: int):
    if not (cfg.progress and env.is_main):
        return None
    import sys

    from tqdm.auto import tqdm

    # On a terminal: live updates. In a log file (CI, compare's per-cell logs): a line every 10 s at most.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(
        total=total,
        initial=initial,
        desc=f"{cfg.strategy}/{cfg.precision}",
        unit="step",
        dynamic_ncols=True,
        mininterval=interval,
        maxinterval=max(10.0, interval),
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)
