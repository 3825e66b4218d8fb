"""The one training loop. It talks only to a Strategy (and, through it, a Precision), a TrainState and a
RunMetrics object; no method-specific code and no logger.

Order of set-up, the same for every method: seed -> data -> model (same init on every rank) -> weights ->
strategy.setup (the model transforms before the wrap: activation checkpointing, the precision's cast; move,
wrap, build the optimizer on the wrapped parameters; the transforms after the wrap: compile) -> resume ->
(every rank set up) the main rank's files. Nothing is written into the output folder before that, so input
refused during set-up leaves an earlier run's folder as it was. Timing: each
optimizer step is timed from a synchronised clock, data loading included, evaluation and checkpointing excluded;
the first ``timing_warmup_steps`` steps are left out of the step statistics. Memory peaks are reset at the start
of each phase.
"""

from __future__ import annotations

import importlib.util
import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import checkpoint as ckpt
from stratbench.core.config import TrainConfig, dump_yaml, validate
from stratbench.core.dist import (
    DistEnv,
    destroy_process_group,
    init_process_group,
    needs_launch,
    read_env,
    resolve_device,
    seed_everything,
)
from stratbench.core.errors import (
    CheckpointError,
    ConfigError,
    DivergedError,
    StratbenchError,
    UnsupportedError,
    is_out_of_memory,
)
from stratbench.core.inputs import Inputs, map_inputs
from stratbench.core.library_warnings import filed_library_warnings
from stratbench.core.optim import lr_lambda, optimizer_spec
from stratbench.core.precision import SPECS, Precision, configure_tf32, spec_of, supported_on
from stratbench.core.progress import progress_bar
from stratbench.data.datasets import (
    DataBundle,
    build_data,
    check_data,
    is_user_data,
    make_train_batches,
    make_val_batches,
    pipeline_of,
    split_batch,
    steps_per_epoch,
    user_data_shape,
)
from stratbench.data.instruct import IGNORE
from stratbench.data.text import is_text_data
from stratbench.measuring.commvol import enable_group_record
from stratbench.measuring.environment import environment
from stratbench.measuring.metrics import RunMetrics
from stratbench.measuring.model_trace import text_vocab
from stratbench.models.flops import flops_per_sample
from stratbench.models.hf import check_vocab, is_hf_name
from stratbench.models.moe import Routing
from stratbench.models.transforms.lora import lora_meta, parameter_counts
from stratbench.models.zoo import (
    build_model,
    check_model,
    has_lazy_parameters,
    load_weights,
    model_routing,
)
from stratbench.strategies.base import Strategy, get_strategy
from stratbench.training.losses import (
    MaskedTokenCrossEntropy,
    build_loss,
    check_loss,
    describe_loss,
    per_sample_eval,
    perplexity,
    step_denominator,
    with_router_loss,
)
from stratbench.training.sinks import Sink, build_sinks
from stratbench.training.state import TrainState


def world_size_of(cfg: TrainConfig) -> int:
    """Processes the run will have: nproc x nnodes when stratbench starts them, else the launcher's
    WORLD_SIZE (torchrun, deepspeed) or SLURM_NTASKS (srun, one task per device)."""
    import os

    if needs_launch(cfg):
        return cfg.nproc * cfg.nnodes
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if name in os.environ:
            return int(os.environ[name])
    return cfg.nproc * cfg.nnodes


def check_config(cfg: TrainConfig, world: int) -> type[Strategy]:
    """The checks of a run's options that do not depend on this machine (values, combinations, the strategy's
    options, the batch split over ``world`` processes): what any command stratbench recommends must pass."""
    validate(cfg)
    text = is_text_data(cfg.data)
    check_model(cfg.model, text, cfg.seq_len if text else None)
    check_data(cfg)
    if text and cfg.tokenizer and cfg.vocab_size is None and is_hf_name(cfg.model):
        check_vocab(cfg.model, text_vocab(cfg))  # a tokenizer's vocabulary the model's head must cover
    check_loss(cfg)
    spec_of(cfg.precision)
    strategy_cls = get_strategy(cfg.strategy)
    strategy_cls.parse_options(cfg.strategy_options)
    split_batch(cfg.batch_size, strategy_cls.data_parallel_size(cfg, world), cfg.grad_accum)
    return strategy_cls


def preflight(cfg: TrainConfig, world_size: int | None = None) -> type[Strategy]:
    """Every check that needs no data or model: bad input fails here, before any work starts."""
    world = world_size if world_size is not None else world_size_of(cfg)
    strategy_cls = check_config(cfg, world)

    device = resolve_device(cfg.device)
    if strategy_cls.splits_model and is_user_data(cfg.data) and user_data_shape(cfg).multi_input:
        raise ConfigError(f"data {cfg.data!r}: {strategy_cls.several_inputs_refusal()}")
    reason = supported_on(SPECS[cfg.precision], device) or strategy_cls.refusal(cfg, device, world)
    if reason:
        raise UnsupportedError(f"{cfg.strategy}/{cfg.precision} cannot run here: {reason}")
    if cfg.mlflow and importlib.util.find_spec("mlflow") is None:
        raise ConfigError("--mlflow needs the mlflow extra: pip install 'stratbench[mlflow]'")
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb needs the wandb package: pip install 'stratbench[wandb]'")
    if cfg.weights and not Path(cfg.weights).is_file():
        raise CheckpointError(f"weights file not found: {cfg.weights}")
    if cfg.weights and not cfg.trust_checkpoint:
        ckpt.check_file(Path(cfg.weights))  # loadable weights-only, or one line before anything is written
    for path in (cfg.init_from, cfg.resume_from if cfg.resume or cfg.resume_from else None):
        if path:
            ckpt.read_meta(Path(path))
    if cfg.resume and not cfg.resume_from:
        found = ckpt.resolve_resume(cfg.output, None)
        if found is not None:
            ckpt.read_meta(found)
    return strategy_cls


SetupError = Callable[[Exception], None]
"""Told of an exception raised before the run wrote anything into its output folder (a refusal of the input, or a
failure while building the data, model or method): a launched worker reports it to its launcher."""


@contextmanager
def _setting_up(on_setup_error: SetupError | None) -> Iterator[None]:
    """Tell ``on_setup_error`` of an exception raised in the block (then raise it on)."""
    try:
        yield
    except Exception as exc:
        if on_setup_error is not None:
            on_setup_error(exc)
        raise


def run(cfg: TrainConfig, on_setup_error: SetupError | None = None) -> dict[str, Any]:
    """Train in this process (one rank of a launched group, or the only process) and return the result; the
    warnings libraries raise meanwhile are filed in the run's folder (``core.library_warnings``)."""
    with filed_library_warnings(cfg.output):
        return _run(cfg, on_setup_error)


def _run(cfg: TrainConfig, on_setup_error: SetupError | None) -> dict[str, Any]:
    with _setting_up(on_setup_error):
        strategy_cls = preflight(cfg)
        env = read_env(cfg.device)
        if env.nodes > 1 and cfg.comm_volume:
            enable_group_record()  # which process group each collective ran on: intra- or inter-node bytes
        if strategy_cls.needs_process_group:
            init_process_group(env, cfg.dist_timeout_s)
        elif env.world_size > 1:
            raise ConfigError(
                f"strategy {cfg.strategy!r} runs in one process; it was launched as {env.world_size}"
            )
    try:
        with _setting_up(on_setup_error):
            trainer = Trainer(cfg, env, strategy_cls)
        return trainer.fit(on_setup_error)
    finally:
        if strategy_cls.needs_process_group:
            destroy_process_group()


@dataclass
class Run:
    """What set-up produced: the data, the wrapped model and optimizer, the train state and the step budget."""

    bundle: DataBundle
    loader: Any
    sampler: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    meta: dict[str, Any]
    micro_batch: int
    steps_per_epoch: int
    run_steps: int
    flops: float | None
    routing: Routing | None
    """A mixture of experts' routing (its counts and loss, result.json's ``moe``); None for a dense model."""


class Trainer:
    def __init__(self, cfg: TrainConfig, env: DistEnv, strategy_cls: type[Strategy]) -> None:
        self.cfg = cfg
        self.env = env
        self.out = Path(cfg.output)
        configure_tf32(cfg.tf32, env.device)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        precision = Precision(cfg.precision, env.device)
        self.strategy = strategy_cls(cfg, env, precision, strategy_cls.parse_options(cfg.strategy_options))
        self.loss_fn = build_loss(cfg)
        self.train_loss = self.loss_fn
        """What the steps backpropagate: ``loss_fn``, plus an MoE model's load-balancing loss (set up with the model)."""
        self.result: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------
    def fit(self, on_setup_error: SetupError | None = None) -> dict[str, Any]:
        """Set up everything (data, model, weights, method, resume), then open the main rank's writers and train,
        writing the result whatever happens from there. Nothing is written before set-up has succeeded on every
        rank: bad input leaves an existing output folder as it was (``on_setup_error`` hears why)."""
        t_start = time.perf_counter()
        with _setting_up(on_setup_error):
            self.result = self._result_header()
            metrics = RunMetrics(self.strategy, self.cfg, [])
            run = self._setup(metrics)
            self.strategy.barrier()  # every rank is set up before rank 0 replaces an earlier run's files
            sinks = self._open_writers()  # a W&B login it cannot use is refused here, with nothing replaced
        metrics.sinks = sinks
        try:
            self._write_run_files()
            self._fit(run, metrics)
            self.result["status"] = "ok"
        except torch.OutOfMemoryError as exc:
            self._fail("oom", f"out of memory: {str(exc).splitlines()[0]}")
            raise
        except DivergedError as exc:
            self._fail("diverged", str(exc))
            raise
        except StratbenchError as exc:
            self._fail("failed", str(exc))
            raise
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._fail("oom" if is_out_of_memory(exc) else "failed", text)
            raise
        finally:
            self.result["metrics"]["wall_time_s"] = time.perf_counter() - t_start
            for sink in sinks:
                sink.close(self.result)
        return self.result

    def _open_writers(self) -> list[Sink]:
        """The main rank's sinks (the trackers asked for, metrics.csv, result.json when the run ends), opened once
        set-up has succeeded on every rank."""
        if not self.env.is_main:
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        resuming = bool(self.cfg.resume or self.cfg.resume_from)
        return build_sinks(self.cfg, self.out, resuming, header=self.result)

    def _write_run_files(self) -> None:
        """The main rank's config.yaml and the method's own files (its DeepSpeed or accelerate config)."""
        if not self.env.is_main:
            return
        dump_yaml(self.cfg, self.out / "config.yaml")
        for name, text in self.strategy.run_files().items():
            ckpt.atomic_write(self.out / name, text)

    def _fit(self, run: Run, metrics: RunMetrics) -> None:
        cfg = self.cfg
        metrics.tokens_per_sample = run.bundle.tokens_per_sample  # unpadded
        progress = run.state.progress
        bar = _progress(cfg, self.env, run.run_steps, progress.step)
        while progress.epoch < cfg.epochs and progress.step < run.run_steps:
            batches = self._epoch_batches(run)
            with metrics.train_phase():
                while progress.batch_in_epoch < run.steps_per_epoch and progress.step < run.run_steps:
                    dt = self._step(run, batches, metrics)
                    bar.set_postfix(  # before update: a plain progress line shows this step's loss
                        {"epoch": progress.epoch, "loss": f"{metrics.losses[-1]:.4f}",
                         "samples/s": f"{cfg.batch_size / dt:.0f}"},
                        refresh=False,
                    )  # fmt: skip
                    bar.update(1)
                    if (
                        cfg.save_every_steps
                        and progress.step % cfg.save_every_steps == 0
                        and progress.step < run.run_steps
                    ):
                        self._save(run)
            epoch_done = progress.batch_in_epoch >= run.steps_per_epoch
            if epoch_done:
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            last = progress.step >= run.run_steps or progress.epoch >= cfg.epochs
            if (cfg.eval_every_epoch and epoch_done) or last:
                self._evaluate_and_log(run, metrics, epoch_done, bar)
            if (cfg.save_every_epoch and epoch_done) or last:
                self._save(run)
        bar.close()
        metrics.record_state_bytes(run.model, run.optimizer)
        summary, sharding = metrics.summary(run.flops)
        self.result["metrics"].update(summary)
        self.result["sharding"] = sharding
        self.result.update(self.strategy.report())
        if run.routing is not None:
            self.result["moe"] = self._moe_report(run)

    def _moe_report(self, run: Run) -> dict[str, Any]:
        """result.json's ``moe``: active and total parameters, then the routing summed over the ranks."""
        device = self.env.device
        active, total = run.meta["active_parameters"], run.meta["num_parameters"]
        routing = run.routing.report(lambda t: self.strategy.all_reduce(t.to(device), "sum").cpu())
        return {"active_parameters": active, "total_parameters": total, "steps": run.state.progress.step, **routing}

    def _step(self, run: Run, batches: Iterator, metrics: RunMetrics) -> float:
        """One optimizer step, timed: load the micro-batches, forward/backward (the strategy's schedule), step."""
        cfg, strategy, progress = self.cfg, self.strategy, run.state.progress
        metrics.step_start()
        with metrics.phase("data"):
            micro = [self._to_device(next(batches)) for _ in range(cfg.grad_accum)]
        if isinstance(self.loss_fn, MaskedTokenCrossEntropy):
            with metrics.phase("other"):
                self.loss_fn.denominator = self._token_denominator(micro)
        loss = strategy.run_step(run.model, micro, self.train_loss)
        if progress.step >= 1 or run.run_steps == 1:  # the optimizer state exists from the first step on
            with metrics.phase("other"):
                metrics.record_state_bytes(run.model, run.optimizer)
        with metrics.phase("optimizer"):
            strategy.optimizer_step(run.optimizer, cfg.clip_grad_norm)
        with metrics.phase("other"):
            lr = run.state.scheduler.get_last_lr()[0]
            run.state.scheduler.step()
        dt = metrics.step_end(progress.step + 1, progress.epoch, loss, lr)
        value = metrics.losses[-1]
        if not math.isfinite(value) and not strategy.precision.scaler.is_enabled():
            raise DivergedError(
                f"the loss became {value} at step {progress.step + 1} (lr {lr:g}); lower --lr or use --clip-grad-norm"
            )
        progress.step += 1
        progress.batch_in_epoch += 1
        return dt

    def _token_denominator(self, micro: list) -> float:
        """The masked loss's divisor for this step (``losses.step_denominator``): the response tokens of every
        micro-batch on every rank, one all-reduce of a scalar per step (fine-tuning data only)."""
        strategy = self.strategy
        local = torch.zeros(1, dtype=torch.float64, device=self.env.device)
        for _, y in micro:
            local += (y != IGNORE).sum()
        tokens = strategy.all_reduce(local, "sum").item()
        _, shards = strategy.data_shard()
        # a sample split over C processes (context parallelism) is averaged over them too: a C times smaller divisor
        return step_denominator(tokens, self.env.world_size, shards, strategy.step_chunks()) / strategy.sequence_shards()

    # ---- set-up --------------------------------------------------------------------------------
    def _setup(self, metrics: RunMetrics | None = None) -> Run:
        cfg, env, strategy = self.cfg, self.env, self.strategy
        seed_everything(cfg.seed)
        bundle = build_data(cfg)
        shard, shards = strategy.data_shard()
        micro = split_batch(cfg.batch_size, shards, cfg.grad_accum)
        # The host DataLoader, or the device-side pipeline (--data-pipeline; the default on CUDA for in-memory data).
        loader, sampler = make_train_batches(
            cfg, bundle, env.device, shard, shards, micro, strategy.step_chunks()
        )
        self.result["data_pipeline"] = pipeline_of(loader)
        spe = steps_per_epoch(len(bundle.train), shards, micro, cfg.grad_accum)
        if spe == 0:
            raise ConfigError(
                f"the training set ({len(bundle.train)} samples) is smaller than one global batch ({cfg.batch_size})"
            )
        total_steps = spe * cfg.epochs

        def build() -> nn.Module:
            return build_model(
                cfg.model,
                bundle.num_classes,
                cifar_stem=cfg.cifar_stem,
                norm=cfg.norm,
                width=cfg.width,
                sample_shape=None if bundle.multi_input else bundle.sample_shape,
                seq_len=bundle.seq_len,
                moe_top_k=cfg.moe_top_k,
                capacity_factor=cfg.capacity_factor,
            )

        seed_everything(cfg.seed)  # the same initial weights on every rank and for every method
        if metrics is not None:
            metrics.before_model(build)
        model = build()
        routing = model_routing(model)
        meta = self._model_meta(bundle, model, routing)
        if cfg.weights:
            self.result["weights_skipped"] = load_weights(model, cfg.weights)
        if cfg.init_from:
            model.load_state_dict(ckpt.load_any(Path(cfg.init_from))["model"])
        if bundle.multi_input and has_lazy_parameters(model):
            raise ConfigError(f"model {cfg.model!r} has lazy modules and data {cfg.data!r} several input tensors: "
                              "give the lazy layers their sizes (they are shaped from one tensor's sample)")  # fmt: skip
        counted = cfg.measure_flops and not bundle.multi_input  # the meta-device count feeds one tensor
        flops = flops_per_sample(build, bundle.sample_shape, bundle.num_classes, bundle.is_text) if counted else None
        strategy.total_steps = total_steps
        # the model transforms (activation checkpointing, the precision's cast, compile) run inside the set-up
        built = model  # the set-up may wrap it (DDP, FSDP, DeepSpeed's engine); the routing is found in it
        model, optimizer = strategy.setup(model, optimizer_spec(cfg))
        # the routing of the set-up model: a strategy may swap the MoE layers in place (deepspeed: DeepSpeed-MoE's)
        routing = model_routing(built)
        self.train_loss = with_router_loss(self.loss_fn, routing)
        self.result["transforms"] = list(strategy.transforms.applied)
        scheduler = strategy.lr_scheduler(optimizer, lr_lambda(cfg, total_steps))
        self.result.update(strategy.optimizer_report(optimizer))
        state = TrainState(scheduler, strategy)
        resume_path = (
            ckpt.resolve_resume(cfg.output, cfg.resume_from) if (cfg.resume or cfg.resume_from) else None
        )
        if resume_path is not None:
            state.load_state_dict(strategy.checkpoint_io.load_checkpoint(resume_path, model, optimizer))
            self.result["resumed_from"] = {"path": str(resume_path), "step": state.progress.step}
            if self.env.is_main:
                print(f"resumed from {resume_path} at step {state.progress.step} of {total_steps} (epoch "
                      f"{state.progress.epoch})", flush=True)  # fmt: skip
        run_steps = min(total_steps, cfg.max_steps or total_steps)
        return Run(bundle, loader, sampler, model, optimizer, state, meta, micro, spe, run_steps, flops, routing)

    def _model_meta(self, bundle: DataBundle, model: nn.Module, routing: Routing | None) -> dict[str, Any]:
        """What inference needs to rebuild and feed the model; saved in every checkpoint."""
        cfg = self.cfg
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
        }
        # total (LoRA's adapters included) and trained (with LoRA the adapters only); the LoRA settings let
        # inference rebuild the adapted model a checkpoint's keys name
        meta["trainable_parameters"], meta["num_parameters"] = parameter_counts(model, cfg)
        if routing is not None:  # the parameters a token passes through (FLOPs and MFU count these); the routing
            active, total = routing.parameter_split(model)  # inference rebuilds with the run's routing flags
            meta["active_parameters"] = meta["num_parameters"] - (total - active)
            meta |= {"moe_top_k": cfg.moe_top_k, "capacity_factor": cfg.capacity_factor}
        if cfg.lora_rank > 0:
            meta["lora"] = lora_meta(cfg)
        if bundle.is_text:  # what generation needs: the window, the vocabulary and how text became ids
            meta |= {
                "seq_len": bundle.seq_len, "vocab_size": bundle.num_classes,
                "tokenizer": cfg.tokenizer or bundle.tokenizer_file,
                "codec": bundle.codec.name if bundle.codec is not None else None,
            }  # fmt: skip
        if bundle.real_tokens_per_sample is not None:  # fine-tuning examples: how they were read, cut and batched
            self.result["data_meta"] = bundle.meta
        self.result["model_meta"] = meta
        return meta

    def _epoch_batches(self, run: Run) -> Iterator:
        """The data of the current epoch, from where its progress says (a resumed run skips what it saw)."""
        p = run.state.progress
        run.sampler.set_epoch(p.epoch, skip=p.batch_in_epoch * run.micro_batch * self.cfg.grad_accum)
        return iter(run.loader)

    def _to_device(self, batch: tuple[Inputs, torch.Tensor]) -> tuple[Inputs, torch.Tensor]:
        x, y = batch
        x = map_inputs(lambda t: t.to(self.env.device, non_blocking=True), x)
        if self.cfg.channels_last and torch.is_tensor(x):
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.env.device, non_blocking=True)

    # ---- evaluation and checkpoints -------------------------------------------------------------
    def _evaluate_and_log(self, run: Run, metrics: RunMetrics, epoch_done: bool, bar) -> None:
        progress = run.state.progress
        with metrics.eval_phase():
            ev = self.evaluate(run.model, run.bundle)
        ev["epoch"] = (
            progress.epoch if epoch_done else progress.epoch + progress.batch_in_epoch / run.steps_per_epoch
        )
        metrics.log_eval(progress.step, ev)
        if self.env.is_main:
            line = f"epoch {ev['epoch']:.2f}: val_loss {ev['val_loss']:.4f}  val_accuracy {ev['val_accuracy']:.4f}"
            if "val_perplexity" in ev:
                line += f"  val_perplexity {ev['val_perplexity']:.2f}"
            bar.write(line)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, bundle: DataBundle) -> dict[str, float]:
        """Validation loss/accuracy; each sample counted once over all ranks, every rank runs the same number
        of batches (padding has weight 0), so sharded methods' collectives stay in step."""
        cfg, env, strategy = self.cfg, self.env, self.strategy
        shard, shards = strategy.data_shard()
        micro = split_batch(cfg.batch_size, shards, cfg.grad_accum)
        loader = make_val_batches(cfg, bundle, env.device, shard, shards, micro)
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=env.device)  # loss sum, correct, count, tokens
        for x, y, valid in loader:
            x, y = self._to_device((x, y))
            valid = valid.to(env.device)
            losses, correct = strategy.eval_per_sample(model, x, y, per_sample_eval)
            totals[0] += (losses * valid).sum().double()
            totals[1] += (correct * valid).sum().double()
            totals[2] += valid.sum().double()
            if bundle.is_text:  # the tokens scored: not prompt or padding
                totals[3] += ((y != IGNORE).sum(-1) * valid).sum().double()
        strategy.all_reduce(totals, "sum")
        totals /= env.world_size // shards  # processes sharing a shard (a pipeline's stages) counted it alike
        model.train()
        out = {
            "val_loss": (totals[0] / totals[2]).item(),
            "val_accuracy": (totals[1] / totals[2]).item(),
            "val_samples": int(totals[2].item()),
        }
        if bundle.is_text:  # accuracy is next-token accuracy; perplexity is what language models report
            out["val_perplexity"] = perplexity(out["val_loss"])
            out["val_tokens"] = int(totals[3].item())
        return out

    def _save(self, run: Run) -> None:
        t0 = time.perf_counter()
        extra = run.state.state_dict() | {
            "strategy": self.cfg.strategy,
            "precision_name": self.cfg.precision,
            "config": self.cfg.to_dict(),
            "meta": run.meta,
        }
        # A step-numbered entry, then `last` points at it once every rank has written its part; entries beyond
        # the newest --keep-last are pruned only after that, so a complete checkpoint always exists.
        path = ckpt.save_path_for(self.out, run.state.progress.step)
        self.strategy.checkpoint_io.save_checkpoint(path, run.model, run.optimizer, extra)
        if self.env.is_main:
            ckpt.publish(self.out, path, self.cfg.keep_last)
        self.strategy.barrier()
        metrics = self.result["metrics"]
        metrics["checkpoint_time_s"] = metrics.get("checkpoint_time_s", 0.0) + time.perf_counter() - t0

    # ---- the result --------------------------------------------------------------------------
    def _fail(self, status: str, reason: str) -> None:
        self.result["status"] = status
        self.result["reason"] = reason
        self.result["traceback"] = traceback.format_exc(limit=8)

    def _result_header(self) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        dp = type(self.strategy).data_parallel_size(cfg, env.world_size)
        micro = split_batch(cfg.batch_size, dp, cfg.grad_accum)
        return {
            "status": "running",
            "strategy": cfg.strategy,
            "precision": cfg.precision,
            "model": cfg.model,
            "data": cfg.data,
            "world_size": env.world_size,
            "data_parallel_size": dp,
            "global_batch_size": cfg.batch_size,
            "per_device_batch_size": micro * cfg.grad_accum,
            "micro_batch_size": micro,
            "grad_accum": cfg.grad_accum,
            "loss": describe_loss(cfg),
            "batch_semantics": "batch_size is the global batch per optimizer step, over all devices and micro-steps",
            "config": cfg.to_dict(),
            "environment": environment(env.world_size, env.device),
            "metrics": {},
        }


def _progress(cfg: TrainConfig, env: DistEnv, total: int, initial: int):
    """Rank 0's progress display (stratbench.core.progress): tqdm on a terminal, a plain line every 10 s or 10% of
    the steps on a file or a pipe (a CI log, compare's per-cell logs), nothing elsewhere or with --progress false."""
    return progress_bar(cfg.progress and env.is_main, total, initial, f"{cfg.strategy}/{cfg.precision}")
