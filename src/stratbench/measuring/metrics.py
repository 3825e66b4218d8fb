"""Honest measurement: synchronised step timers, per-phase memory peaks (CUDA allocator, NVML, CPU RSS),
an NVML utilisation sampler, FLOPs per sample and MFU, and the environment written into every result."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from stratbench.measuring.clock import PhaseClock, StepTimer, breakdown_report
from stratbench.measuring.commvol import comm_report
from stratbench.measuring.environment import peak_flops
from stratbench.measuring.load import LoadSampler, busy_text, cpu_count, is_busy, others_share
from stratbench.measuring.memory import MemoryPhase, current_memory_bytes
from stratbench.measuring.nvml import UtilisationSampler
from stratbench.measuring.windows import AllocWindow, CommWindow, TraceWindow, column_max

# Dense peak FLOP/s per device (no sparsity) come from the hardware profiles (src/stratbench/measuring/hardware.yaml: one
# source of truth with the projection, every figure cited there). Each GPU entry's regular expression is searched
# in torch.cuda.get_device_name(), so that "NVIDIA L40" does not take the L4's figures, "RTX A1000" not the
# A100's, nor an NVL part the SXM's. MFU is reported only for the GPUs listed there, or against the peak a user
# states (--peak-tflops, which also lets a CPU run report one).


def mfu_metrics(
    flops_per_sample: float, samples_per_s: float, devices: int, peak_flops_per_device: float | None
) -> dict[str, Any]:
    """Achieved FLOP/s per device and MFU: the whole model's FLOPs per sample times the global samples per second
    is the work all devices did together, so it is shared by every device the run occupies (processes x devices
    each drives), not by the data-parallel replicas: a tensor-, pipeline- or 3D-parallel run splits one replica's
    work over several devices, and dividing by the replicas would read MFU T, P or P x T times too high."""
    achieved = flops_per_sample * samples_per_s / max(1, devices)
    peak = peak_flops_per_device
    return {
        "achieved_flops_per_device": achieved,
        "mfu_devices": devices,
        "peak_flops_per_device": peak,
        "mfu": achieved / peak if peak else None,
    }


class RunMetrics:
    """The loop's one measurement object. The loop feeds it once per step (``step_start``/``step_end``) and per
    phase (``train_phase``, ``eval_phase``); it keeps the per-rank numbers, streams per-step rows to the sinks,
    and ``summary`` aggregates over ranks at the end (the only collectives it makes)."""

    def __init__(self, strategy: Any, cfg: Any, sinks: list[Any]) -> None:
        self.strategy = strategy
        self.cfg = cfg
        self.sinks = sinks
        self.tokens_per_sample: int | None = None
        """Text data: real (unpadded) tokens per sample, the mean over the training items of fine-tuning data (the
        engine sets it once the data is known): tokens/s in the summary counts these, never padding."""
        self.devices = strategy.memory_devices()
        self.load = LoadSampler()
        """The machine's load average while it trains: a busy machine inflates every time this run records."""
        self.timer = StepTimer(strategy.synchronize, cfg.timing_warmup_steps)
        self.util = UtilisationSampler(self.devices)
        self.losses: list[float] = []
        self.epoch_times: list[float] = []
        self.train_peaks: list[list[int]] = []
        self.reserved_peaks: list[list[int]] = []
        self.eval_peaks: list[list[int]] = []
        self.evaluations: list[dict[str, float]] = []
        self.state_bytes: dict[str, int] | None = None
        self._epoch_time = 0.0
        self.comm = CommWindow(strategy.env.world_size) if getattr(cfg, "comm_volume", False) else None
        self.trace = TraceWindow(cfg, strategy.env) if getattr(cfg, "profile", 0) else None
        self.alloc = AllocWindow() if getattr(cfg, "measure_alloc", False) else None
        self.phases: PhaseClock | None = None
        if getattr(cfg, "breakdown", False) or self.trace is not None:
            self.phases = PhaseClock(strategy.synchronize)
            strategy.phase = self.phase

    # ---- phases --------------------------------------------------------------------------------
    @contextmanager
    def train_phase(self) -> Iterator[None]:
        """One stretch of training steps (an epoch, or its remainder): memory peak reset, utilisation sampled."""
        phase = MemoryPhase(self.devices)
        phase.start()
        self.util.start()
        self.load.sample(force=True)
        self._epoch_time = 0.0
        try:
            yield
        finally:
            self.load.sample(force=True)
            self.util.stop()
            phase.stop()
            self.epoch_times.append(self._epoch_time)
            self.train_peaks.append(phase.peak_bytes())
            self.reserved_peaks.append(phase.peak_reserved)

    @contextmanager
    def eval_phase(self) -> Iterator[None]:
        phase = MemoryPhase(self.devices)
        phase.start()
        try:
            yield
        finally:
            phase.stop()
            self.eval_peaks.append(phase.peak_bytes())

    # ---- steps ---------------------------------------------------------------------------------
    def before_model(self, build: Callable[[], nn.Module]) -> None:
        """The engine calls this just before it builds the model: the baseline of --measure-alloc, read after a
        throw-away build on the meta device, so that the modules the builder imports lazily (torchvision,
        a user's package: ~10 MiB of Python objects) are not counted as the model's memory."""
        if self.alloc is not None and self.strategy.env.device.type == "cpu":
            with torch.device("meta"):
                build()
            self.alloc.start_baseline()

    def phase(self, name: str):
        """``with metrics.phase("forward"):`` -- one part of the step (a no-op without --breakdown/--profile)."""
        return self.phases.phase(name) if self.phases is not None else nullcontext()

    def step_start(self) -> None:
        if self.timer.seen == self.timer.warmup > 0:
            self.util.restart_window()  # GPU utilisation over the timed steps only
        if self.comm is not None:
            self.comm.before_step(self.timer.seen)
        if self.trace is not None:
            self.trace.before_step(self.timer.seen)
        if self.alloc is not None:
            self.alloc.before_step(self.timer.seen)
        self.timer.start()

    def step_end(self, step: int, epoch: int, loss: torch.Tensor, lr: float) -> float:
        """Stop the step clock (synchronised), record the loss and send one row to the sinks; returns the
        step's time in seconds. The loss is read after the clock stops, so that reading it adds no wait."""
        dt = self.timer.stop()
        self.load.sample()
        if self.alloc is not None:
            self.alloc.after_step()
        traced = self.trace is not None and self.trace.recorder is not None
        if traced and self.timer.seen > self.timer.warmup:
            self.timer.times.pop()  # a traced step is slower: kept out of the step-time statistics
        if self.phases is not None:
            self.phases.end_step(dt, measured=self.timer.seen > self.timer.warmup and not traced)
        if self.comm is not None:
            self.comm.after_step(self.timer.seen, self.cfg.timing_warmup_steps)
        if self.trace is not None:
            self.trace.after_step(self.timer.seen)
        self._epoch_time += dt
        loss = float(loss)
        self.losses.append(loss)
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "step_time_s": dt,
            "samples_per_s": self.cfg.batch_size / dt if dt > 0 else None,
            "memory_bytes": current_memory_bytes(self.devices[0]),
            "gpu_util_pct": self.util.latest(),
        }
        for sink in self.sinks:
            sink.log_step(row)
        return dt

    def log_eval(self, step: int, evaluation: dict[str, float]) -> None:
        self.evaluations.append(evaluation)
        for sink in self.sinks:
            sink.log_eval(step, evaluation)

    def record_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Bytes of model states this rank holds, taken once (after the first step has created them)."""
        if self.state_bytes is None:
            self.state_bytes = self.strategy.state_bytes(model, optimizer)

    # ---- the end -------------------------------------------------------------------------------
    def summary(self, flops: float | None) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """Aggregate over ranks (collectives): the ``metrics`` block of result.json and the ``sharding`` block."""
        losses = self._mean_losses()
        local = self._local_summary()
        if self.trace is not None:
            self.trace.finish()
        ranks = self.strategy.all_gather_object(local)
        metrics = self._step_metrics(ranks, local, losses, flops)
        metrics["node_of_rank"] = [r["node"] for r in ranks]  # the launcher's node of each global rank
        self._add_optional(metrics, ranks, flops)
        self._add_tokens(metrics)
        self._add_load(metrics, ranks)
        sharding = {k: [r["state_bytes"].get(k) for r in ranks] for k in local["state_bytes"]}
        return metrics, sharding

    def _mean_losses(self) -> torch.Tensor:
        """Per-step loss averaged over ranks (equal-size micro-batches, or the masked loss's step token count:
        the global mean either way): one collective."""
        env = self.strategy.env
        losses = torch.tensor(self.losses, dtype=torch.float64, device=env.device)
        self.strategy.all_reduce(losses, "sum")
        return losses / env.world_size

    def _local_summary(self) -> dict[str, Any]:
        return {
            "timer": self.timer.summary(),
            "peak": column_max(self.train_peaks),
            "reserved": column_max(self.reserved_peaks),
            "eval_peak": self.eval_peaks[-1] if self.eval_peaks else [],
            "util": self.util.summary(),
            "state_bytes": self.state_bytes or {},
            "comm": self.comm.finish() if self.comm is not None else None,
            "phases": self.phases.summary() if self.phases is not None else None,
            "alloc": self.alloc.summary() if self.alloc is not None else None,
            "devices": len(set(self.devices)),
            "load": self.load.mean(),
            "cpu": self.load.cpu.summary(),
            "host": socket.gethostname(),  # the machine: a loopback run's nodes share one (``node`` differs)
            "cores": cpu_count(),
            "node": self.strategy.env.node,
        }

    def _step_metrics(
        self, ranks: list[dict], local: dict, losses: torch.Tensor, flops: float | None
    ) -> dict:
        cfg, strategy, env = self.cfg, self.strategy, self.strategy.env
        mean_steps = [
            r["timer"]["step_time_mean_s"] for r in ranks if r["timer"]["step_time_mean_s"] is not None
        ]
        # Ranks step in lock-step; the slowest rank's step time is the method's step time.
        step_time = max(mean_steps) if mean_steps else None

        def per_rank(key: str, sub: str | None = None) -> list[Any]:
            return [v for r in ranks for v in (r[key][sub] if sub else r[key])]

        evals = self.evaluations
        return {
            "train_time_s": sum(self.epoch_times),
            "epoch_time_s": self.epoch_times,
            "steps": len(self.losses),
            "measured_steps": local["timer"]["measured_steps"],
            "step_time_mean_s": step_time,
            "step_time_mean_per_rank_s": [r["timer"]["step_time_mean_s"] for r in ranks],
            "step_time_median_s": local["timer"]["step_time_median_s"],
            "step_time_p90_s": local["timer"]["step_time_p90_s"],
            "step_time_rank_mean_s": (sum(mean_steps) / len(mean_steps)) if mean_steps else None,
            "throughput_samples_per_s": cfg.batch_size / step_time if step_time else None,
            "peak_memory_bytes": per_rank("peak"),
            "peak_memory_kind": "cuda_max_allocated" if env.device.type == "cuda" else "cpu_peak_rss",
            "peak_reserved_bytes": per_rank("reserved"),
            "eval_peak_memory_bytes": per_rank("eval_peak"),
            "nvml_used_peak_bytes": per_rank("util", "nvml_used_peak_bytes"),
            "gpu_util_mean_pct": per_rank("util", "gpu_util_mean_pct"),
            "gpu_util_peak_pct": per_rank("util", "gpu_util_peak_pct"),
            "loss_curve": losses.tolist(),
            "final_loss": losses[-1].item() if len(losses) else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_accuracy": evals[-1]["val_accuracy"] if evals else None,
            "evaluations": evals,
            "skipped_steps": strategy.precision.skipped_steps,
            "flops_per_sample": flops,
            "mfu": None,
        }

    def _add_tokens(self, metrics: dict[str, Any]) -> None:
        """Text data: what language-model runs are compared by, tokens/s and the validation perplexity. A window of
        a token stream is ``seq_len`` tokens; fine-tuning examples count their real tokens, padding excluded (the
        training set's mean per item: samples/s x that mean is the unpadded tokens/s over whole epochs)."""
        seq = self.tokens_per_sample
        if seq is None:
            return
        samples = metrics["throughput_samples_per_s"]
        metrics["tokens_per_sample"] = seq
        metrics["throughput_tokens_per_s"] = samples * seq if samples else None
        metrics["flops_per_token"] = metrics["flops_per_sample"] / seq if metrics["flops_per_sample"] else None
        evals = self.evaluations
        metrics["val_perplexity"] = evals[-1].get("val_perplexity") if evals else None

    def _add_load(self, metrics: dict[str, Any], ranks: list[dict]) -> None:
        """The machine's load while the run trained (the busiest node's), and one warning line where it was busy:
        the same measure and rule as compare's busy mark (``measuring.load``)."""
        loaded = [r for r in ranks if r["load"] is not None]
        top = max(loaded, key=lambda r: r["load"] / r["cores"]) if loaded else None
        metrics["host_load_mean"] = top["load"] if top else None
        metrics["host_cpu_count"] = cores = top["cores"] if top else cpu_count()
        hosts: dict[Any, list[dict]] = {}  # each machine's ranks' CPU readings (a loopback run's nodes share one)
        for r in ranks:
            if r.get("cpu"):
                hosts.setdefault(r.get("host"), []).append(r["cpu"])
        shares = [x for x in (others_share(v, cores) for v in hosts.values()) if x is not None]
        metrics["host_others_share"] = others = max(shares) if shares else None
        load = top["load"] if top else None
        metrics["host_busy"] = is_busy(load, cores, others)
        if metrics["host_busy"] and self.strategy.env.is_main:
            print(f"warning: the machine was busy while this run trained ({busy_text(load, cores, others)}): "
                  "its times are inflated, not the method's own; rerun on an idle machine to measure it",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _add_optional(self, metrics: dict[str, Any], ranks: list[dict], flops: float | None) -> None:
        """MFU, the CPU allocator's peaks, the phase breakdown and the communication volume, where measured."""
        cfg, strategy, env = self.cfg, self.strategy, self.strategy.env
        throughput = metrics["throughput_samples_per_s"]
        if flops and throughput:
            # The devices the run occupies: every process's own (a DataParallel or model-parallel process drives
            # several), whatever share of them holds a replica.
            devices = sum(r["devices"] for r in ranks)
            given = getattr(cfg, "peak_tflops", None)
            peak = given * 1e12 if given else peak_flops(env.device, cfg.precision, cfg.tf32)
            metrics.update(mfu_metrics(flops, throughput, devices, peak))
            metrics["peak_flops_source"] = "--peak-tflops" if given else "hardware.yaml" if peak else None
        if self.alloc is not None:
            metrics["cpu_alloc_peak_bytes"] = [r["alloc"]["peak"] for r in ranks]
            metrics["cpu_alloc_resident_bytes"] = [r["alloc"]["resident"] for r in ranks]
            metrics["cpu_alloc_import_bytes"] = [r["alloc"]["imports"] for r in ranks]
        if getattr(cfg, "breakdown", False):
            metrics["breakdown"] = breakdown_report([r["phases"] for r in ranks])
        if self.comm is not None:
            predicted = strategy.cost.predicted_comm(cfg, env.world_size, strategy.options)
            node_of = metrics["node_of_rank"]
            mesh = strategy.cost.predicted_mesh(cfg, env.world_size, strategy.options) if len(set(node_of)) > 1 else {}
            metrics["comm"] = comm_report([r["comm"] for r in ranks], predicted, node_of, mesh)
