"""What a training method would cost on hardware you do not have: step time, throughput, scaling efficiency and
memory per device, from quantities that transfer between machines.

Per optimizer step and device (docs/projection.md has every formula and why):

* **compute** = FLOPs per sample (counted by ``torch.utils.flop_counter``) x samples per device / (dense peak of
  the precision x achieved efficiency x the device's share of its node), + a fixed per-step overhead where a
  calibration measured one. Forward is 1/3 of it, backward 2/3; activation checkpointing adds one forward. With
  ``--float8`` the converted Linears' products run at the GPU's fp8 peak x the fp8 efficiency and the rest
  (attention, norms, the output head) at the precision's (``float8_rate``).
* **communication** from the method's own ``comm_model`` rows (kind, payload, calls, phase, group): an
  alpha-beta ring cost, ``calls x call latency + steps x alpha + wire factor x payload / bandwidth``, and
  hierarchical when the group spans nodes (intra-node reduce-scatter, inter-node all-reduce of 1/g of the
  payload over the node's NICs, intra-node all-gather). Forward- and backward-phase traffic (DDP's buckets,
  FSDP's prefetched gathers) hides under that phase's compute up to ``overlap`` (a stated fraction of the
  system, measured by ``stratbench probe``; never 100%) x the strategy's own ``comm_overlap``; optimizer-phase
  traffic is exposed.
* **optimizer step** = bytes the step reads and writes (the rank's share of parameters and gradients, its
  optimizer states and master copies) / memory bandwidth; on the host's memory bandwidth when the optimizer is
  offloaded.
* **CPU offload** = bytes crossing the host link per step (gradients down and parameters up for an offloaded
  optimizer, parameters twice for offloaded parameters) / host-link bandwidth, not overlapped.

A strategy without ``comm_model`` (or a model whose FLOPs cannot be counted) is reported as "no model",
never as 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import ConfigError
from stratbench.data.text import is_text_data
from stratbench.measuring.comm import Collective, ddp_buckets, mesh_span, wire_factor
from stratbench.measuring.hardware import Gpu, HardwareError, InputPipeline, Link, System, builtin, resolve
from stratbench.measuring.model_trace import ModelSpec, model_info, trace_ops
from stratbench.measuring.records import RunRecord, number, record_problem
from stratbench.models.family import family_of
from stratbench.models.flops import flops_by_op, linear_flops
from stratbench.models.transforms import FORWARD_SHARE, flops_factor
from stratbench.models.transforms.float8 import convertible
from stratbench.predicting.estimate import estimate
from stratbench.predicting.roofline import basis_of, step_seconds
from stratbench.strategies.base import all_strategies, baseline_name, get_strategy
from stratbench.strategies.costs import MemoryContext, NoMemoryModel, loop_collectives


def precision_key(precision: str, tf32: bool = False) -> str:
    """The peak-table key of a precision's compute dtype (as ``environment.peak_flops``)."""
    if precision == "fp64":
        return "fp64"
    if "bf16" in precision:
        return "bf16"
    if "fp16" in precision:
        return "fp16"
    return "tf32" if tf32 else "fp32"


@functools.cache
def _counted(spec: ModelSpec) -> tuple[float | None, str | None]:
    """(forward+backward FLOPs per sample, family) of a model: one count on the meta device gives both."""
    counted = flops_by_op(spec.build, spec.sample_shape, spec.num_classes, spec.is_text)
    return (None if counted is None else sum(counted[0].values())), family_of(counted)


def model_flops(cfg: TrainConfig) -> float | None:
    """Forward+backward FLOPs of one sample of the config's model (counted on the meta device, cached)."""
    return _counted(ModelSpec.from_config(cfg))[0]


def model_family(cfg: TrainConfig) -> str | None:
    """convnet, transformer or None for the config's model (``stratbench.models.family``'s rule, cached)."""
    return _counted(ModelSpec.from_config(cfg))[1]


@functools.cache
def _float8_counted(spec: ModelSpec) -> float | None:
    return linear_flops(spec.build, spec.sample_shape, convertible, spec.is_text)


def float8_flops(cfg: TrainConfig) -> float | None:
    """Forward+backward FLOPs of one sample in the Linears ``--float8`` converts (``transforms.float8.convertible``:
    all but the output head, dimensions multiples of 16), counted on the meta device, cached."""
    return _float8_counted(ModelSpec.from_config(cfg))


def float8_refusal(recipe: str, gpu: Gpu) -> str | None:
    """Why a ``--float8 recipe`` run cannot be projected on ``gpu``, in one line (a GPU without float8 units: no
    fp8 peak in its profile, as train refuses such a device); None where it can or ``recipe`` is "none"."""
    if recipe == "none" or gpu.peak("fp8") is not None:
        return None
    return (
        f"--float8 {recipe} needs a GPU with float8 units (compute capability 8.9 or later: Ada, Hopper, "
        f"Blackwell); {gpu.name} ({gpu.key}) has none: no fp8 peak in its hardware profile"
    )


def float8_rate(
    out: MethodProjection, cfg: TrainConfig, gpu: Gpu, flops: float, achieved: float,
    calibration: Calibrations | None,
) -> float:  # fmt: skip
    """The FLOP/s a step of ``cfg`` achieves: ``achieved`` (the precision's peak x efficiency) without
    ``--float8``; with it, the converted Linears' share of the ``flops`` (``float8_flops``) runs at the fp8 peak x
    the fp8 efficiency (a calibration's ``fp8`` entry, the user's hardware file, else the evidence-based default)
    and the rest at ``achieved``: seconds add, so the rate is their FLOP-weighted harmonic mean. What was used goes
    on ``out.float8``. The caller has checked the GPU's fp8 peak (``float8_refusal``)."""
    if cfg.float8 == "none":
        return achieved
    share = min(1.0, (float8_flops(cfg) or 0.0) / flops)
    peak = gpu.peak("fp8") or 0.0
    cal = (calibration or {}).get("fp8")
    if cal is not None:
        eff, source = cal.efficiency, f"calibration, {cal.source}"
    elif gpu.efficiency_source.get("fp8"):
        eff, source = gpu.efficiency["fp8"], f"{gpu.efficiency_source['fp8']} (gpus.{gpu.key}.efficiency.fp8)"
    else:
        d = gpu.default_efficiency("fp8", out.model_family)
        eff, source = d.value, f"default: {d.source}" + (f" [{d.note}]" if d.note else "")
    out.float8 = dict(recipe=cfg.float8, flops_share=share, fp8_peak=peak, efficiency=eff, source=source)
    return 1.0 / (share / (peak * eff) + (1.0 - share) / achieved)


# ------------------------------------------------------------------------------------------------
# Communication: the alpha-beta ring model, hierarchical across nodes.


def ring_steps(kind: str, n: int) -> int:
    """Latency steps of a ring algorithm over ``n`` ranks (NCCL's nsteps in src/graph/tuning.cc)."""
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send_recv":
        return 1
    return n - 1


def ring_time(kind: str, payload: float, n: int, bandwidth: float, step_latency: float) -> float:
    """One call of a ring collective of ``payload`` bytes over ``n`` ranks on links of ``bandwidth`` bytes/s:
    ``steps x alpha + wire_factor x payload / bandwidth`` (all_reduce: 2(n-1) alpha + 2(n-1)/n B / bw)."""
    if n <= 1:
        return 0.0
    return ring_steps(kind, n) * step_latency + wire_factor(kind, n) * payload / bandwidth


def _on_link(kind: str, payload: float, n: int, link: Link, bandwidth: float | None = None) -> float:
    """A ring over ``n`` ranks on ``link``: a measured per-kind fit (probe) where the link has one, otherwise
    the link's latency and effective bandwidth (``bandwidth`` overrides it, e.g. a NIC shared per device)."""
    if n <= 1:
        return 0.0
    fit = link.collectives.get(kind)
    if fit is not None and bandwidth is None:
        # The fit's latency is a whole call at fit.ranks (in training where the probe measured that); scale it
        # by the ring's step count.
        latency = fit.call_latency * ring_steps(kind, n) / max(1, ring_steps(kind, fit.ranks))
        return latency + wire_factor(kind, n) * payload / fit.bandwidth
    return ring_time(kind, payload, n, bandwidth or link.effective_bandwidth, link.latency)


def collective_time(
    kind: str, payload: float, calls: int, group: int, system: System, per_node: int | None = None
) -> float:
    """Seconds for ``calls`` calls moving ``payload`` bytes in all over ``group`` ranks of ``system``, ``per_node``
    of them on each node (None: packed onto as few nodes as possible; ``ranks_per_node`` places a mesh
    dimension's group)."""
    if group <= 1 or calls <= 0:
        return 0.0
    g = min(group, per_node or system.gpus_per_node)
    m = math.ceil(group / g)
    fixed = calls * system.call_latency
    per_call = payload / calls
    intra = system.intra_node
    if m == 1:
        # The per-kind fit's latency is per call: price each call, not the sum as one.
        return fixed + calls * _on_link(kind, per_call, g, intra)
    inter = system.inter_node
    if inter is None:
        raise HardwareError(f"system {system.key!r} has no inter_node link: {group} ranks need {m} nodes")
    nic = system.inter_bandwidth_per_device()
    if kind == "all_reduce":
        # Reduce-scatter within the node, all-reduce of each device's 1/g across nodes, all-gather within.
        t = (
            _on_link("reduce_scatter", per_call, g, intra)
            + _on_link("all_reduce", per_call / g, m, inter, nic)
            + _on_link("all_gather", per_call, g, intra)
        )
    elif kind in ("all_gather", "reduce_scatter", "broadcast"):
        t = _on_link(kind, per_call, g, intra) + _on_link(kind, per_call / g, m, inter, nic)
    elif kind == "send_recv":
        t = inter.latency + per_call / nic
    else:  # all_to_all: the share for peers on the node over the intra link, the rest over the NICs
        t = (g - 1) / group * per_call / intra.effective_bandwidth + (group - g) / group * per_call / nic
        t += (g - 1) * intra.latency + (m - 1) * inter.latency
    return fixed + calls * t


def ranks_per_node(row: Collective, mesh: dict[str, int], gpus_per_node: int) -> int:
    """How many ranks of one call's group share a node, on a device mesh laid out row-major over nodes of
    ``gpus_per_node`` (``CostModel.mesh_dims``: the last dimension's ranks are neighbours). A group over dimension
    ``row.dim`` has ranks ``stride`` apart, the product of the dimensions after it: ``gpus_per_node // stride``
    of them per node (1 where the stride is a node or more: fsdp --tp 8's dp groups have one rank per node and
    cross the NICs only). A pair of a larger dimension (a pipeline's stage-to-stage send) is priced on the
    slowest boundary: across nodes where the dimension spans nodes. No dimension: neighbouring ranks."""
    size, stride = mesh_span(mesh, row.dim) or (row.group_size, 1)
    per_node = max(1, min(size, gpus_per_node // stride))
    if row.group_size < size:
        return row.group_size if per_node >= size else 1
    return per_node


def placement_note(mesh: dict[str, int], system: System) -> str:
    """One line where tensor parallelism spans nodes: its all-reduces sit on the critical path of every block and
    are then priced over the inter-node link ("" where the tp group fits one node)."""
    t, g = mesh.get("tp", 1), system.gpus_per_node
    if t <= g:
        return ""
    inter = system.inter_node.key if system.inter_node else "no inter-node link"
    return (
        f"tensor parallelism over {t} ranks spans {math.ceil(t / g)} nodes of {g}: its per-block all-reduces are "
        f"priced over {inter}; keep tp <= {g} (one node's {system.intra_node.key})"
    )


# ------------------------------------------------------------------------------------------------
# Calibration: achieved efficiency from a measured single-device run.


@dataclass
class Calibration:
    """Achieved fraction of the device's dense peak (and a fixed per-step overhead) measured on real runs."""

    efficiency: float
    key: str
    """Precision key it was measured in (fp32, tf32, bf16, ...)."""
    overhead_s: float = 0.0
    device: str = ""
    source: str = ""
    points: list[dict[str, float]] = field(default_factory=list)
    thread_share: float = 1.0
    """Share of the profile's peak the calibration runs had (CPU runs with fewer threads than cores)."""
    method_overhead_s: dict[str, float] = field(default_factory=dict)
    """Per method (``method_key``): seconds per micro-step its one-device run took beyond what this calibration
    predicts for `single` at that batch: the method's own host work (hooks, flat-parameter copies, gathers
    through a 1-rank group, wrappers) that no FLOP or collective term counts."""
    method_sources: dict[str, str] = field(default_factory=dict)
    tokens_per_expert: list[list[int]] | None = None
    """An MoE calibration run's routed assignments per layer and expert (its result's ``moe``): the projection
    prices expert parallelism's exchanges at the busiest rank they imply (``parallel.ep_costs``)."""


def method_key(cfg: TrainConfig) -> str:
    """The method a run measured, as a calibration names it: the strategy and its options (ZeRO stage, FSDP
    sharding, schedule, ...) except file paths, e.g. ``deepspeed[zero_stage=3]``."""
    opts = {k: v for k, v in sorted((cfg.strategy_options or {}).items()) if not str(k).endswith("path")}
    if not opts:
        return cfg.strategy
    return cfg.strategy + "[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]"


def _check_status(status: Any, where: str) -> None:
    if status not in (None, "ok"):
        raise ConfigError(f"{where}: the run's status is {status!r}; calibrate on a run that finished")


def _not_a_result(where: str) -> ConfigError:
    return ConfigError(f"{where}: not a stratbench result.json (no 'config'/'metrics')")


def _result_config(rec: RunRecord, where: str) -> TrainConfig:
    """The config a calibration run trained (a ConfigError where it did not finish or recorded none)."""
    _check_status(rec.status, where)
    if not rec.config:
        raise _not_a_result(where)
    cfg = from_dict(TrainConfig, dict(rec.config))
    if cfg.float8 != "none":
        raise ConfigError(
            f"{where}: a --float8 run cannot calibrate (its Linears ran at the fp8 peak, the rest at "
            f"{cfg.precision}'s); calibrate on the same run without --float8"
        )
    return cfg


def _run_world(rec: RunRecord, cfg: TrainConfig) -> int:
    """The processes a calibration run had: its record's world size, else its config's."""
    return int(rec.world_size) if rec.world_size is not None else cfg.nproc


def optimizer_bytes(
    cfg: TrainConfig, world: int, rank: int = 0, device_type: str = "cuda"
) -> tuple[float, float]:
    """(bytes the optimizer step moves through device memory, through host memory) on ``rank``."""
    cls = get_strategy(cfg.strategy)
    info = model_info(ModelSpec.from_config(cfg))
    ctx = MemoryContext(cfg, world, info, cls.parse_options(cfg.strategy_options), device_type)
    rm = cls.cost.memory_model(ctx, rank)
    if rm is None:
        return 0.0, 0.0
    full = info.total * ctx.param_bytes
    slots = ctx.opt_slots
    optim = rm.optim + rm.host_optim
    if slots and optim:
        state_elem = 4 if (rm.master or rm.host_master) else ctx.param_bytes
        share = min(1.0, optim / (slots * info.total * state_elem))
    else:
        share = min(1.0, (rm.grads + rm.host_grads) / full) if full else 0.0
    moved = 3 * share * full + 2 * optim + 2 * (rm.master + rm.host_master)  # params r+w, grads r, states r+w
    if rm.host_optim or rm.host_master:
        return 0.0, moved
    return moved, 0.0


def offload_bytes(cfg: TrainConfig, world: int, rank: int = 0, device_type: str = "cuda") -> float:
    """Bytes crossing the host link per step: the rank's gradients down and parameters up for an offloaded
    optimizer, the offloaded parameters twice (forward and backward) for parameter offload."""
    cls = get_strategy(cfg.strategy)
    info = model_info(ModelSpec.from_config(cfg))
    ctx = MemoryContext(cfg, world, info, cls.parse_options(cfg.strategy_options), device_type)
    rm = cls.cost.memory_model(ctx, rank)
    if rm is None:
        return 0.0
    moved = 0.0
    if rm.host_optim or rm.host_master:
        slots = ctx.opt_slots
        state_elem = 4 if (rm.master or rm.host_master) else ctx.param_bytes
        elems = (rm.optim + rm.host_optim) / (slots * state_elem) if slots else info.total / world
        moved += elems * (4 + ctx.param_bytes)  # fp32 gradients down, updated parameters up
    if rm.host_params:
        moved += 2 * rm.host_params
    return moved


Calibrations = dict[str, Calibration]
"""One calibration per precision key (fp32, bf16, ...): a projection in a precision nothing calibrated uses the
documented default, shown as such."""


def calibrate(results: list[RunRecord], system: System, names: list[str] | None = None) -> Calibrations:
    """Calibrations per precision key from measured one-device runs: those of `single` give the efficiency and
    fixed overhead (``calibrate_one``); those of another method on one device (e.g. `--strategy fsdp --nproc 1`)
    give that method's extra host time per step (``Calibration.method_overhead_s``), which a projection of the
    method then adds on any number of devices."""
    names = names or [f"result {i}" for i in range(len(results))]
    groups: dict[str, tuple[list, list]] = {}
    methods: list[tuple[RunRecord, str, TrainConfig]] = []
    for result, name in zip(results, names, strict=True):
        cfg = _result_config(result, name)
        if cfg.strategy != baseline_name():
            methods.append((result, name, cfg))
            continue
        rs, ns = groups.setdefault(precision_key(cfg.precision, cfg.tf32), ([], []))
        rs.append(result)
        ns.append(name)
    cals = {k: calibrate_one(rs, system, ns) for k, (rs, ns) in groups.items()}
    extras: dict[tuple[str, str], list[float]] = {}
    for result, name, cfg in methods:
        key, mkey = precision_key(cfg.precision, cfg.tf32), method_key(cfg)
        world = _run_world(result, cfg)
        if world != 1:
            raise ConfigError(
                f"{name}: a calibration run uses one device; this {cfg.strategy} run had world size {world}"
                " (run it with --nproc 1 to measure the method's own overhead)"
            )
        refused = method_run_refused(cfg.strategy)
        if refused:
            raise ConfigError(f"{name}: {refused}: calibrate with `single` runs only")
        cal = cals.get(key)
        if cal is None:
            raise ConfigError(
                f"{name}: a {mkey} run calibrates that method's overhead on top of a `single` calibration run"
                f" in {key}; give one (allowed precisions so far: {', '.join(sorted(cals)) or 'none'})"
            )
        step = _step_time(result, name)
        extras.setdefault((key, mkey), []).append(
            (step - _single_step(cfg, cal, system, result)) / cfg.grad_accum
        )
    for (key, mkey), xs in extras.items():
        cal = cals[key]
        # a method cannot take less than the FLOPs: a negative extra only removes fixed overhead
        cal.method_overhead_s[mkey] = max(-cal.overhead_s, statistics.fmean(xs))
        cal.method_sources[mkey] = (
            f"{mkey}: {cal.method_overhead_s[mkey] * 1e3:+.1f} ms per step beyond `single`, measured on one device"
            f" ({len(xs)} run{'s' if len(xs) > 1 else ''})"
        )
    return cals


def method_run_refused(strategy: str) -> str | None:
    """Why a one-device run of ``strategy`` cannot calibrate that method's own overhead (None: it can, or the
    method is not installed here: ``Strategy.calibration_refused``)."""
    cls = all_strategies().get(strategy)
    return (cls.calibration_refused or None) if cls is not None else None


def _step_time(result: RunRecord, where: str) -> float:
    step = result.metrics.step_time_median_s or result.metrics.step_time_mean_s
    if not step:
        raise ConfigError(f"{where}: no measured step time (metrics.step_time_median_s)")
    return float(step)


def _thread_share(result: RunRecord, system: System) -> float:
    """The share of a CPU profile's all-core peak a run's process had (1.0 on a GPU)."""
    if result.on_gpu or system.gpu.kind != "cpu":
        return 1.0
    # A CPU profile's peak is a matmul on every core; a run with fewer threads had that share of it.
    # The probe measured that share for its processes' thread count; other counts get threads / cores.
    env = result.environment
    threads, cores = number(env.get("torch_threads")), number(env.get("cpu_count"))
    if threads and threads == system.threads_per_process and system.thread_share:
        return system.thread_share
    if threads and cores and threads < cores:
        return threads / cores
    return 1.0


def _single_step(cfg: TrainConfig, cal: Calibration, system: System, result: RunRecord) -> float:
    """What ``cal`` predicts for `single` at ``cfg``'s batch, precision and threads: one device, no method."""
    flops = model_flops(cfg)
    if not flops:
        raise ConfigError(f"the FLOPs of model {cfg.model!r} cannot be counted")
    gpu = system.gpu
    work, t_opt = _single_work(cfg, gpu, flops)
    # work is the whole step's batch (its grad_accum micro-batches together); the fixed overhead is per micro-step
    compute = work / (gpu.peak(cal.key) * cal.efficiency * _thread_share(result, system))
    return cal.overhead_s * cfg.grad_accum + compute + t_opt


def _single_work(cfg: TrainConfig, gpu: Gpu, flops: float) -> tuple[float, float]:
    """`single` on ``gpu`` at ``cfg``'s batch: one micro-batch's FLOPs (recomputation included) and the seconds of
    its optimizer step (the optimizer state's bytes over the memory bandwidth)."""
    single = cfg.replace(strategy=baseline_name(), strategy_options={})
    dev_bytes, _ = optimizer_bytes(single, 1, 0, "cpu" if gpu.kind == "cpu" else "cuda")
    work = flops * cfg.batch_size * flops_factor(cfg)  # recomputation's share (models.transforms)
    return work, dev_bytes / gpu.memory_bandwidth


def calibrate_one(results: list[RunRecord], system: System, names: list[str] | None = None) -> Calibration:
    """Achieved efficiency from measured single-device runs of one model and precision. One run: efficiency =
    FLOPs x batch / ((step time - modelled optimizer step) x peak). Runs at two or more batch sizes: a
    least-squares line step = overhead + batch x FLOPs / (peak x efficiency), which also gives the fixed
    per-step overhead (Python, kernel launches) that dominates small models."""
    if not results:
        raise ConfigError("--calibrate needs at least one result.json")
    names = names or [f"result {i}" for i in range(len(results))]
    points = []
    key = None
    device_gpu: Gpu | None = None
    model = None
    shares: set[float] = set()
    for result, where in zip(results, names, strict=True):
        cfg = _result_config(result, where)
        world = _run_world(result, cfg)
        if world != 1:
            raise ConfigError(
                f"{where}: a calibration run must use one device (world size {world}); run --strategy single"
            )
        step = _step_time(result, where)
        k = precision_key(cfg.precision, cfg.tf32)
        gpu = _run_device(result, where, system)
        thread_share = _thread_share(result, system)
        if key not in (None, k) or model not in (None, (cfg.model, cfg.image_size, cfg.width)):
            raise ConfigError(f"{where}: calibration runs must share one model and precision")
        if device_gpu is not None and gpu.key != device_gpu.key:
            raise ConfigError(f"{where}: calibration runs must come from one device type")
        key, model, device_gpu = k, (cfg.model, cfg.image_size, cfg.width), gpu
        flops = model_flops(cfg)
        if not flops:
            raise ConfigError(f"{where}: the FLOPs of model {cfg.model!r} cannot be counted")
        if gpu.peak(k) is None:
            raise ConfigError(f"{where}: no {k} peak for {gpu.name} in the hardware profiles")
        work, t_opt = _single_work(cfg, gpu, flops)
        shares.add(thread_share)
        # in units of the profile's peak: FLOPs run on a share of the cores count as more of its time
        points.append({"batch": cfg.batch_size, "step_s": float(step), "optimizer_s": t_opt,
                       "flop": work / thread_share, "thread_share": thread_share})  # fmt: skip
    assert key is not None and device_gpu is not None
    overhead, efficiency, how = _fit_points(points, device_gpu.peak(key))
    if shares != {1.0}:
        peaks = "/".join(f"{x:.2f}" for x in sorted(shares))
        how += f"; peak x {peaks} (the run's threads' share of all cores)"
    return Calibration(
        efficiency=efficiency,
        key=key,
        overhead_s=overhead,
        device=device_gpu.key,
        source=f"calibrated on {device_gpu.name} ({', '.join(names)}; {how})",
        points=points,
        thread_share=statistics.fmean(shares),
        tokens_per_expert=(results[-1].fields.get("moe") or {}).get("tokens_per_expert"),
    )


def _run_device(result: RunRecord, where: str, system: System) -> Gpu:
    """The profile of the device a calibration run ran on: its GPU (``system``'s own where the names match), or
    ``system``'s CPU for a CPU run (a CPU run calibrates only a CPU profile)."""
    if not result.on_gpu:
        if system.gpu.kind != "cpu":
            raise ConfigError(
                f"{where}: a CPU run calibrates a CPU profile (made by `stratbench probe`), not {system.key!r}"
            )
        return system.gpu
    dev_name = result.gpu_name
    gpu = builtin().gpu_for_device(dev_name)
    if system.gpu.kind == "cuda" and system.gpu.matches(dev_name):
        gpu = system.gpu
    if gpu is None:
        raise ConfigError(
            f"{where}: device {dev_name!r} is not in the hardware profiles; add it with --hardware FILE"
        )
    return gpu


def _fit_points(points: list[dict[str, float]], peak: float) -> tuple[float, float, str]:
    """(fixed seconds per step, efficiency, how they were found) from calibration points: a least-squares line
    over two or more batch sizes, else the mean efficiency of one batch's runs with no fixed overhead. Where the
    line does not rise (a busy machine slowed the smaller batch's few timed steps) the largest batch's runs alone
    give the efficiency, and ``how`` says so: one noisy point must not leave a whole column without prediction."""
    batches = {p["batch"] for p in points}
    if len(batches) < 2:
        return _one_batch(points, peak)
    xs = [p["flop"] for p in points]
    ys = [p["step_s"] - p["optimizer_s"] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        steps = ", ".join(f"batch {p['batch']}: {p['step_s'] * 1e3:.1f} ms" for p in points)
        _, efficiency, how = _one_batch([p for p in points if p["batch"] == max(batches)], peak)
        return 0.0, efficiency, (
            f"{how}; the step time did not grow with the batch ({steps}: a busy machine?), so no fixed overhead "
            "was fitted; measure more steps or larger batches"
        )
    overhead = max(0.0, my - slope * mx)
    how = f"fit over batches {sorted(batches)}: {overhead * 1e3:.1f} ms fixed per step"
    return overhead, 1.0 / (slope * peak), how


def _one_batch(points: list[dict[str, float]], peak: float) -> tuple[float, float, str]:
    """The mean efficiency of one batch size's calibration runs, with no fixed overhead."""
    efficiency = statistics.fmean(p["flop"] / ((p["step_s"] - p["optimizer_s"]) * peak) for p in points)
    step_ms = statistics.fmean(p["step_s"] for p in points) * 1e3
    return 0.0, efficiency, f"batch {points[0]['batch']}, step {step_ms:.1f} ms"


def load_calibration(paths: list[str], system: System) -> Calibrations:
    """``--calibrate FILE...``: the calibrations from the result.json files at ``paths``, each parsed once."""
    raw = []
    for p in paths:
        try:
            raw.append(json.loads(Path(p).read_text()))
        except OSError as exc:
            raise ConfigError(f"--calibrate {p}: cannot read it ({exc.strerror})") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--calibrate {p}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    results = [_result_record(r, str(p)) for r, p in zip(raw, paths, strict=True)]
    return calibrate(results, system, list(paths))


def _result_record(raw: Any, where: str) -> RunRecord:
    """A result.json's JSON as a record, checked first for what only the JSON shows: a result.json has its
    ``config`` and ``metrics`` (a record reads either absent as empty)."""
    if isinstance(raw, dict):
        _check_status(raw.get("status"), where)
    if not isinstance(raw, dict) or "config" not in raw or "metrics" not in raw:
        raise _not_a_result(where)
    why = record_problem(raw)  # a field of the wrong type: named, with the file
    if why:
        raise ConfigError(f"{where}: {why}")
    return RunRecord.from_dict(raw)


# ------------------------------------------------------------------------------------------------
# The projection of one method.


@dataclass
class MethodProjection:
    method: str
    world: int
    nodes: int
    status: str = "ok"
    """ok, or "no model" (no comm_model / uncountable FLOPs), or "error" with the reason."""
    reason: str = ""
    step_s: float | None = None
    throughput: float | None = None
    """Samples (a language model's: windows of seq_len tokens) per second."""
    tokens_per_s: float | None = None
    """A language model's throughput in tokens per second (None for an image model)."""
    scaling_efficiency: float | None = None
    compute_s: float = 0.0
    overhead_s: float = 0.0
    comm_s: float = 0.0
    comm_exposed_s: float = 0.0
    optimizer_s: float = 0.0
    offload_s: float = 0.0
    straggler_s: float = 0.0
    """Seconds per step lost waiting for the slowest process at each synchronisation (``straggler_seconds``)."""
    input_s: float = 0.0
    """Seconds per step the node's host input pipeline adds beyond the rest (``input_ceiling``); 0 without one."""
    input_note: str = ""
    dominant: str = ""
    memory_bytes: int | None = None
    fits: bool | None = None
    efficiency: float | None = None
    efficiency_source: str = ""
    efficiency_from: str = ""
    """Where the efficiency comes from: "default", "hardware file" (the user's --hardware file set it) or
    "calibration" (--calibrate runs); ``efficiency_source`` says which file or runs."""
    uncalibrated: bool = False
    """True where the efficiency is a built-in default (``efficiency_from`` "default"): evidence from other
    models' published runs, not a measurement of this one; ``efficiency_source`` names that evidence."""
    model_family: str | None = None
    """convnet, transformer or None (``stratbench.models.family``): which default applies."""
    efficiency_note: str = ""
    """For a default without evidence of its own (GPU, precision, family): the fallback rule that gave it."""
    overlap: float | None = None
    mesh: dict[str, int] = field(default_factory=dict)
    """The method's device mesh (``CostModel.mesh_dims``: named dimensions, outermost first); empty: one dimension."""
    placement_note: str = ""
    """Said where tensor parallelism spans nodes (``placement_note``): priced so, but slow."""
    comm_rows: list[dict[str, Any]] = field(default_factory=list)
    basis: str = ""
    """What the compute time rests on (``BASES``' words): "calibrated run", "hardware file", "family fallback"
    (the evidence-based efficiency per GPU, precision and family), "roofline with measured fractions" (the profile's
    ``measured_roofline``, `stratbench calibrate-hw`) or "roofline with published fractions"."""
    roofline: dict[str, Any] = field(default_factory=dict)
    """The roofline basis' breakdown of one micro-batch (``roofline.RooflineTime``); empty on other bases."""
    error_band: dict[str, Any] = field(default_factory=dict)
    """The held-out error of ``basis`` on published figures (``error_band``): median and 80th-percentile absolute
    error, rows, what they are and the results file; empty where no published check covers the basis."""
    float8: dict[str, Any] = field(default_factory=dict)
    """A ``--float8`` run's pricing (``float8_rate``): recipe, the converted Linears' share of the FLOPs, the fp8
    peak (FLOP/s), its efficiency and that efficiency's source; empty without ``--float8``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def project(
    cfg: TrainConfig,
    system: System,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    calibration: Calibrations | None = None,
    memory: bool = True,
    label: str | None = None,
    input_pipeline: InputPipeline | None = None,
    basis: str = "efficiency",
) -> MethodProjection:
    """Step time and its parts for ``cfg.strategy`` on ``nodes`` x ``gpus_per_node`` devices of ``system``;
    ``input_pipeline``: the data loader's host CPU cost where it is CPU-bound (None: data on the device, or a
    loader that keeps up); ``basis`` (``BASES``): "efficiency" prices the compute at one efficiency (calibrated,
    the hardware file's or the family default), "roofline" per traced op (``predicting.roofline``)."""
    if basis not in BASES:
        raise ConfigError(f"basis {basis!r}; allowed: {', '.join(BASES)}")
    gpn = gpus_per_node or system.gpus_per_node
    if gpn != system.gpus_per_node:
        system = dataclasses.replace(system, gpus_per_node=gpn)
    cls = get_strategy(cfg.strategy)
    world = cls.devices_for_world(nodes * gpn)
    out = MethodProjection(label or cfg.strategy, world, nodes if world > 1 else 1)
    device_type = "cpu" if system.gpu.kind == "cpu" else "cuda"
    info = model_info(ModelSpec.from_config(cfg))
    routed = next((c for c in (calibration or {}).values() if c.tokens_per_expert), None)
    ctx = MemoryContext(cfg, world, info, cls.parse_options(cfg.strategy_options), device_type, busiest_rank=True,
                        routed_counts=routed and routed.tokens_per_expert, routed_source=routed and routed.source or "")  # fmt: skip
    out.mesh = cls.cost.mesh_dims(ctx)
    out.placement_note = placement_note(out.mesh, system)
    rows = cls.cost.comm_model(ctx)
    if rows is None:
        out.status, out.reason = "no model", f"{cfg.strategy} has no communication model (CostModel.comm_model)"
        return out
    rows = rows + loop_collectives(cfg, world)
    flops = model_flops(cfg)
    if not flops:
        out.status, out.reason = "no model", f"the FLOPs of model {cfg.model!r} cannot be counted"
        return out
    key = precision_key(cfg.precision, cfg.tf32)
    peak = system.gpu.peak(key)
    if peak is None or float8_refusal(cfg.float8, system.gpu):
        no_peak = f"{system.gpu.name} has no {key} peak in the hardware profiles"
        out.status, out.reason = "error", float8_refusal(cfg.float8, system.gpu) or no_peak
        return out
    out.model_family = model_family(cfg)
    samples = cfg.batch_size / cls.data_parallel_size(cfg, world)
    basis, eff, overhead, cal = _compute_basis(out, cfg, system.gpu, key, flops, samples, calibration, basis)
    achieved = float8_rate(out, cfg, system.gpu, flops, peak * eff, calibration)
    # a pipeline's busiest stage and its bubble (CostModel.compute_scale); 1 for whole-model methods
    flops_on_path = flops * samples * flops_factor(cfg)  # the model transforms' (activation checkpointing)
    forward, backward = _compute(out, cfg, system, world, flops_on_path * cls.cost.compute_scale(ctx), achieved,
                                 overhead, cal)  # fmt: skip
    _communication(out, rows, system, float(cls.cost.comm_overlap(ctx)), forward, backward)
    if not _optimizer_and_offload(out, cfg, world, system, device_type):
        return out
    out.straggler_s = straggler_seconds(out.compute_s, world, cfg.grad_accum, system.step_time_cv)
    out.step_s = out.compute_s + out.comm_exposed_s + out.optimizer_s + out.offload_s + out.straggler_s
    _input_pipeline(out, cfg, system, world, input_pipeline)
    out.throughput = cfg.batch_size / out.step_s
    out.tokens_per_s = out.throughput * cfg.seq_len if is_text_data(cfg.data) else None
    terms = {"compute": out.compute_s, "communication": out.comm_exposed_s, "optimizer": out.optimizer_s,
             "offload": out.offload_s, "stragglers": out.straggler_s, "input pipeline": out.input_s}  # fmt: skip
    out.dominant = max(terms, key=terms.get)
    out.scaling_efficiency = _scaling_efficiency(
        cfg, system, world, samples, calibration, out.throughput, basis
    )
    # every band is of GPU figures (published ones, the project's H200 runs): a CPU's projection quotes none
    out.error_band = {} if device_type == "cpu" else error_band(out.basis, out.model_family)
    if memory:
        out.memory_bytes, out.fits = _memory(cfg, world, device_type, system.gpu)
    return out


@functools.cache
def _error_bands() -> dict[str, Any]:
    """measuring/error_bands.json, written by benchmarks/projection_heldout.py from its committed results (no
    bands while that benchmark has not written it: its own first run projects before it writes)."""
    from importlib import resources

    path = resources.files("stratbench.measuring").joinpath("error_bands.json")
    return json.loads(path.read_text()) if path.is_file() else {"bands": {}, "source": ""}


def error_band(basis: str, family: str | None = None) -> dict[str, Any]:
    """The held-out error band of ``basis`` (a ``MethodProjection.basis``): its median and 80th-percentile
    absolute error over the published figures it was checked on, those of model ``family`` (convnet,
    transformer) where the check has enough of them, with the results file; {} where none was."""
    data = _error_bands()
    band = data["bands"].get(basis)
    if band is None:
        return {}
    band = (band.get("families") or {}).get(family) or {k: v for k, v in band.items() if k != "families"}
    return {"basis": basis, **band, "source": data["source"]}


def _memory(cfg: TrainConfig, world: int, device_type: str, gpu: Gpu) -> tuple[int | None, bool | None]:
    """(estimated bytes per device, whether they fit ``gpu``); (None, None) for a method without a memory model."""
    try:
        e = estimate(cfg, world, device_type)
    except NoMemoryModel:
        return None, None
    return e.total_bytes, e.total_bytes <= gpu.memory_bytes


def _efficiency(
    out: MethodProjection, gpu: Gpu, key: str, calibration: Calibrations | None, mkey: str
) -> tuple[float, float, Calibration | None]:
    """(achieved share of the peak, fixed seconds per micro-step, the calibration of ``key`` or None): calibrated
    where ``calibration`` has ``key`` (plus the method's own overhead where it measured one), else the profile's
    default; the source goes on ``out``."""
    cal = (calibration or {}).get(key)
    if cal is not None:
        eff, out.efficiency_source, overhead = cal.efficiency, cal.source, cal.overhead_s
        out.efficiency_from, out.basis = "calibration", "calibrated run"
        if cal.device != gpu.key:
            out.efficiency_source += f"; applied to {gpu.name}"
    elif gpu.efficiency_source.get(key):
        eff, overhead = gpu.efficiency[key], 0.0
        out.efficiency_from = out.basis = "hardware file"
        out.efficiency_source = f"{gpu.efficiency_source[key]} (gpus.{gpu.key}.efficiency.{key})"
    else:
        d = gpu.default_efficiency(key, out.model_family)
        eff, overhead = d.value, 0.0
        out.efficiency_from, out.uncalibrated, out.efficiency_note = "default", True, d.note
        out.basis = "family fallback"
        what = f"{out.model_family} {key}" if out.model_family else f"{key} (model family unknown)"
        out.efficiency_source = f"default for {what} on {gpu.name}: {d.source}" + (
            f" [{d.note}]" if d.note else ""
        )
    if cal is None and calibration:
        out.efficiency_source += f" (calibrated: {', '.join(calibration)} only)"
    out.efficiency = eff
    if cal is not None and mkey in cal.method_overhead_s:
        overhead += cal.method_overhead_s[mkey]
        out.efficiency_source += "; " + cal.method_sources[mkey]
    return eff, overhead, cal


BASES = ("auto", "efficiency", "roofline")
"""``project``'s bases of the compute time (``estimate --time --basis``): one efficiency (calibrated run, hardware
file or family fallback), or the per-op roofline, with the fractions `calibrate-hw` measured where the profile has
them, else the published ones (``predicting.roofline``); "auto" (``auto_basis``) picks between them."""


def auto_basis(gpu: Gpu, key: str, calibration: Calibrations | None) -> tuple[str, str]:
    """``--basis auto``: (basis, why the roofline is not used). A calibration of ``key`` or the hardware file's
    efficiency for it: that efficiency (a measurement of this setup, or the user's word); else the roofline where
    ``gpu`` has fractions (its held-out error is below the family fallback's: benchmarks/projection_heldout_cpu_
    2026-11-28.md); the family fallback only where it has none."""
    if (calibration or {}).get(key) is not None or gpu.efficiency_source.get(key):
        return "efficiency", ""
    if gpu.roofline is None:
        return "efficiency", f"{gpu.name} has no roofline fractions"
    return "roofline", ""


def _compute_basis(
    out: MethodProjection, cfg: TrainConfig, gpu: Gpu, key: str, flops: float, samples: float,
    calibration: Calibrations | None, basis: str,
) -> tuple[str, float, float, Calibration | None]:  # fmt: skip
    """(the basis used, achieved share of the peak, fixed seconds per micro-step, the calibration used) of
    ``basis``; under "auto" a model the roofline cannot trace op by op falls back to the efficiency, said in
    ``out.efficiency_note``."""
    chosen, why = auto_basis(gpu, key, calibration) if basis == "auto" else (basis, "")
    if chosen == "roofline":
        try:
            return chosen, _roofline(out, cfg, gpu, key, flops, samples), 0.0, None
        except ConfigError as exc:
            if basis != "auto":
                raise
            chosen, why = "efficiency", str(exc).removeprefix("--basis roofline: ")
    eff, overhead, cal = _efficiency(out, gpu, key, calibration, method_key(cfg))
    if why:  # the family fallback under auto: said where the efficiency's source is printed
        out.efficiency_note = "; ".join(x for x in (out.efficiency_note, f"not the roofline basis: {why}") if x)
        out.efficiency_source += f" [not the roofline basis: {why}]"
    return chosen, eff, overhead, cal


def _roofline(
    out: MethodProjection, cfg: TrainConfig, gpu: Gpu, key: str, flops: float, samples: float
) -> float:
    """The share of ``gpu``'s ``key`` peak at which the roofline basis runs ``cfg``'s step: one micro-batch's
    traced ops (``trace_ops``) priced op by op (``roofline.step_seconds``), as the efficiency that gives the same
    seconds for the counted FLOPs; what was used goes on ``out`` (basis, source, the per-class breakdown)."""
    if gpu.roofline is None:
        raise ConfigError(f"--basis roofline: {gpu.name} ({gpu.key}) has no roofline fractions (hardware.yaml "
                          "roofline and the gpu's generation; `stratbench calibrate-hw` measures them); use the "
                          "efficiency basis")  # fmt: skip
    micro = max(1, round(samples / cfg.grad_accum))
    try:
        ops = trace_ops(ModelSpec.from_config(cfg), micro, cfg.precision)
    except ConfigError:
        raise
    except Exception as exc:  # a user model the fake tensors cannot run op by op: said, as flops_by_op's None
        raise ConfigError(f"--basis roofline: model {cfg.model!r} cannot be traced op by op ({exc})") from exc
    timed = step_seconds(ops, gpu, key, fused=bool(cfg.compile))
    eff = flops * micro / (timed.seconds * gpu.peak(key))
    out.efficiency, out.efficiency_from, out.basis = eff, "roofline", basis_of(gpu)
    out.efficiency_source = f"{timed.source}; micro-batch {micro}: {timed.seconds * 1e3:.3f} ms"
    out.roofline = timed.to_dict() | {"micro_batch": micro}
    return eff


def _compute(
    out: MethodProjection, cfg: TrainConfig, system: System, world: int, flops: float, achieved: float,
    overhead: float, cal: Calibration | None,
) -> tuple[float, float]:  # fmt: skip
    """``out``'s compute seconds per step: ``flops`` on the critical path over the ``achieved`` FLOP/s (shared
    between the devices of a node), plus the fixed overhead per micro-step; returns the forward and backward
    seconds that communication can hide under."""
    share = system.compute_share if min(world, system.gpus_per_node) > 1 else 1.0
    flop_time = flops / (achieved * share)
    # the forward's share of the step's FLOPs, less where the transforms add work in backward (recomputation)
    forward = flop_time * FORWARD_SHARE / flops_factor(cfg)
    if cal is not None and system.gpu.kind == "cpu" and share < 1.0:
        # On a CPU the fixed per-step work (Python, dispatch) runs on the same shared cores as the FLOPs: it
        # slows down by as much when every process runs (calibrated share / the share each process gets).
        overhead *= cal.thread_share / share
    out.overhead_s = overhead * cfg.grad_accum
    out.compute_s = flop_time + out.overhead_s
    return forward, flop_time - forward


def _communication(
    out: MethodProjection, rows: list[Collective], system: System, method_overlap: float, forward: float,
    backward: float,
) -> None:  # fmt: skip
    """``out``'s communication per step, and what of it stays exposed. Each phase's calls run one after another
    on their own stream, each as soon as the phase's compute has produced its data (``chunks``): what ends
    after the phase's compute is exposed (``exposed_after``: the last bucket of DDP at least; all of it where a
    method reduces in one bucket after backward, and all optimizer-phase traffic); of the rest, the system's
    measured overlap x the method's own (``comm_overlap``) is hidden. Calls marked ``critical`` (2D's Megatron
    all-reduces) are exposed whole. Each call is priced where its group's ranks sit (``ranks_per_node``)."""
    f = system.overlap * method_overlap
    out.overlap = f
    windows = {"forward": forward, "backward": backward}
    by_phase: dict[str, list[tuple[float, float]]] = {}
    critical = 0.0  # seconds of calls that nothing runs under (``Collective.critical``): all exposed
    for r in rows:
        g = ranks_per_node(r, out.mesh, system.gpus_per_node)
        timed = [(ready, collective_time(r.kind, size, 1, r.group_size, system, g)) for ready, size in chunks(r)]  # fmt: skip
        if r.critical:
            critical += sum(t for _, t in timed)
        else:
            by_phase.setdefault(r.phase, []).extend(timed)
        nodes = math.ceil(r.group_size / min(g, r.group_size)) if r.group_size > 1 else 1
        out.comm_rows.append(r.to_dict() | {"seconds": sum(t for _, t in timed), "ranks_per_node": g,
                                            "nodes": nodes})  # fmt: skip
    out.comm_s = exposed = 0.0
    for phase, timed in by_phase.items():
        window = windows.get(phase, 0.0)
        total = sum(t for _, t in timed)
        late = exposed_after([(share * window, t) for share, t in timed], window)
        out.comm_s += total
        exposed += total - f * (total - late)
    out.comm_s += critical
    out.comm_exposed_s = exposed + critical


def chunks(row: Collective) -> list[tuple[float, float]]:
    """(share of its phase's compute done when it can start, bytes) of each call of ``row``: DDP's buckets
    (``ddp_buckets``) in reduction order, else ``calls`` equal calls; a call can start when the compute has
    produced its share of the payload (gradients come out of backward at an even rate per byte; a prefetched
    forward gather mirrors it: the first call precedes all compute, the last the last unit's)."""
    if row.calls <= 0 or row.payload_bytes <= 0:
        return []
    sizes = (ddp_buckets(row.payload_bytes, row.bucket_bytes) if row.bucket_bytes
             else [row.payload_bytes / row.calls] * row.calls)  # fmt: skip
    out, done = [], 0.0
    for size in sizes:
        done += size
        out.append((done / row.payload_bytes, size))
    return out


def exposed_after(calls: list[tuple[float, float]], window: float) -> float:
    """Seconds by which ``calls`` ((ready time, seconds) each, on one stream in the order they become ready, each
    starting when it is ready and the one before has ended) end after ``window`` (the phase's compute)."""
    end = 0.0
    for ready, t in sorted(calls):
        end = max(end, ready) + t
    return max(0.0, end - window)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables], Blom's approximation Phi^-1((n - 0.375)/(n + 0.25))
    (0 for one; 0.59, 1.43, 2.34, 2.82 for 2, 8, 64, 256, where the exact values are 0.56, 1.42, 2.42, 2.86)."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_seconds(compute_s: float, world: int, micro_steps: int, cv: float) -> float:
    """What waiting for the slowest of ``world`` processes adds to a step whose compute takes ``compute_s``:
    each micro-step's time varies by ``cv`` (coefficient of variation) independently, so the step's compute
    varies by cv / sqrt(micro-steps) of it, and the step ends with the slowest process:
    ``E[max of world normals] x cv x compute / sqrt(micro_steps)``."""
    if world <= 1 or cv <= 0:
        return 0.0
    return expected_max_normal(world) * cv * compute_s / math.sqrt(max(1, micro_steps))


def input_ceiling(pipeline: InputPipeline, host_cores: int, processes: int) -> float:
    """Samples per second one node's host can feed: its cores less one per process (the training loop's own
    thread; at least one core is left to the loader) over the loader's CPU seconds per sample."""
    return max(1, host_cores - processes) / pipeline.cpu_per_sample


def _input_pipeline(
    out: MethodProjection, cfg: TrainConfig, system: System, world: int, pipeline: InputPipeline | None
) -> None:
    """Stretch ``out``'s step to the node's input ceiling where the host cannot feed its devices faster."""
    if pipeline is None:
        return
    if not system.host_cores:
        out.input_note = f"{pipeline.key}: system {system.key!r} gives no host_cores, so no input ceiling"
        return
    procs = min(world, system.gpus_per_node)
    ceiling = input_ceiling(pipeline, system.host_cores, procs)
    need = cfg.batch_size * procs / max(1, world) / ceiling
    out.input_note = (f"{pipeline.key}: {ceiling:,.0f} samples/s per node (({system.host_cores} cores - {procs} "
                      f"training processes) / {pipeline.cpu_per_sample * 1e3:.2f} ms per sample)")  # fmt: skip
    if need > out.step_s:
        out.input_s = need - out.step_s
        out.step_s = need


def _optimizer_and_offload(
    out: MethodProjection, cfg: TrainConfig, world: int, system: System, device_type: str
) -> bool:
    """``out``'s optimizer step (bytes over device or host memory bandwidth) and host-link transfers; False (with
    ``out``'s status "error") where the system lacks the host bandwidth a CPU optimizer step needs."""
    dev_bytes, host_bytes = optimizer_bytes(cfg, world, 0, device_type)
    host_bw = system.host_memory_bandwidth / system.gpus_per_node if system.host_memory_bandwidth else 0.0
    out.optimizer_s = dev_bytes / system.gpu.memory_bandwidth
    if host_bytes:
        if not host_bw:
            out.status, out.reason = (
                "error",
                f"system {system.key!r} has no host_memory_bandwidth (CPU optimizer step)",
            )
            return False
        out.optimizer_s += host_bytes / host_bw
    link = offload_bytes(cfg, world, 0, device_type)
    out.offload_s = link / system.host.effective_bandwidth if link else 0.0
    return True


def _scaling_efficiency(
    cfg: TrainConfig, system: System, world: int, samples: float, calibration: Calibrations | None,
    throughput: float, basis: str = "efficiency",
) -> float | None:  # fmt: skip
    """Throughput over ``world`` devices each running the baseline on a replica's share of the batch alone (a
    pipeline's stages are devices too); None where the baseline has no projection."""
    if world <= 1:
        return 1.0
    one = project(
        cfg.replace(strategy=baseline_name(), strategy_options={}, batch_size=max(1, round(samples))),
        system, 1, system.gpus_per_node, calibration, memory=False, basis=basis,
    )  # fmt: skip
    return throughput / (world * one.throughput) if one.throughput else None


def project_all(
    cfg: TrainConfig,
    system: System,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    calibration: Calibrations | None = None,
    strategies: list[str] | None = None,
    memory: bool = True,
) -> list[MethodProjection]:
    """One projection per registered strategy (or the named ones); errors become rows, not exceptions."""
    out = []
    for name in strategies or sorted(all_strategies()):
        try:
            out.append(
                project(
                    cfg.replace(strategy=name, strategy_options={}),
                    system,
                    nodes,
                    gpus_per_node,
                    calibration,
                    memory,
                )
            )
        except ConfigError as exc:
            out.append(MethodProjection(name, 0, nodes, status="error", reason=str(exc)))
    return out


# ------------------------------------------------------------------------------------------------
# Predicted beside measured: a compare record's step time, projected on the machine it ran on.

CPU_SYSTEM = "cpu-gloo"
"""The built-in profile of processes sharing a CPU over gloo (hardware.yaml): what a compare sweep on a CPU
predicts its own rows with when no probe profile is given."""


def system_for_record(rec: RunRecord, hardware: str | None = None) -> System:
    """The profile of the machine a compare record ran on: ``hardware`` (a system name or a probe file) when
    given; otherwise the built-in system of the record's GPU, or ``cpu-gloo`` on a CPU."""
    if hardware:
        return resolve(hardware)
    if not rec.on_gpu:
        return builtin().system(CPU_SYSTEM)
    name = rec.gpu_name
    gpu = builtin().gpu_for_device(name)
    if gpu is None:
        raise ConfigError(f"GPU {name!r} is not in the hardware profiles (add it with --hardware FILE)")
    for system in builtin().systems.values():
        if system.gpu.key == gpu.key:
            return system
    raise ConfigError(f"no built-in system has the {gpu.name} (give one with --hardware FILE)")


@dataclass
class RecordPrediction:
    """What the projection says of one finished compare record: ``step_s`` None with ``reason`` where it has
    nothing to say."""

    step_s: float | None = None
    reason: str = ""
    system: str = ""
    calibrated: bool = False
    dominant: str = ""
    basis: str = ""
    """What the prediction rests on: the efficiency's source (calibration runs, method overhead) or "default"."""


def predict_record(
    rec: RunRecord, calibration_rec: RunRecord | None, hardware: str | None = None
) -> RecordPrediction:
    """The projected seconds per optimizer step of a finished compare record, on the machine it ran on.

    On a GPU: the record's device profile, calibrated on ``calibration_rec`` (the same sweep's ``single`` run of
    that precision) when there is one, else the documented default efficiency. On a CPU there is no peak to
    default to, so a calibration run is required (links, overlap and compute share: ``cpu-gloo``, measured by
    `stratbench probe` on a 2-core machine, or the probe file given as ``hardware``)."""

    def basis() -> tuple[System, dict[str, Calibration] | None]:
        system = system_for_record(rec, hardware)
        if system.gpu.kind == "cpu" and calibration_rec is None:
            raise ConfigError("no single run of this precision in the sweep to calibrate the CPU on")
        return system, calibrate([calibration_rec], system, [baseline_name()]) if calibration_rec else None

    return _predict(rec, basis)


def predict_calibrated(
    rec: RunRecord, runs: list[RunRecord], profile: str, hardware: str | None = None,
    names: list[str] | None = None,
) -> RecordPrediction:  # fmt: skip
    """The projected seconds per optimizer step of a finished compare record from calibration runs made for it
    (`compare --calibrate`: `single` at two batch sizes and the record's method on one process, as result.json
    records) on the probe ``profile`` of the machine (or ``hardware`` where given): no measurement of the record
    itself enters it."""

    def basis() -> tuple[System, dict[str, Calibration] | None]:
        system = resolve(hardware or profile)
        return system, calibrate(runs, system, names)

    return _predict(rec, basis)


def _predict(
    rec: RunRecord, basis: Callable[[], tuple[System, dict[str, Calibration] | None]]
) -> RecordPrediction:
    """Project ``rec``'s config on the system and calibration ``basis`` gives; a ConfigError on the way (a
    config, profile or calibration that does not load) becomes the prediction's reason."""
    try:
        cfg = from_dict(TrainConfig, dict(rec.config))
        system, calibration = basis()
        p = project(cfg, system, 1, max(1, rec.world), calibration, memory=False)
    except ConfigError as exc:
        return RecordPrediction(reason=str(exc))
    if p.status != "ok" or not p.step_s:
        return RecordPrediction(reason=p.reason or p.status, system=system.key)
    return RecordPrediction(p.step_s, "", system.key, calibration is not None, p.dominant, _basis(p))


def _basis(p: MethodProjection) -> str:
    """What a prediction rests on, in words: the efficiency's source, and a --float8 run's fp8 pricing."""
    if not p.float8:
        return p.efficiency_source
    f8 = p.float8
    return (f"{p.efficiency_source}; float8 Linears ({f8['flops_share']:.0%} of the FLOPs) at the fp8 peak x "
            f"{f8['efficiency']:.1%} ({f8['source']})")  # fmt: skip
