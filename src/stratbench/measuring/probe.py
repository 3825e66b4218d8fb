"""What `stratbench probe` measures in each of its processes, and the hardware profile it fits from that.

Each process (started by torchrun, gloo on CPU, NCCL on GPUs) times the collectives (all_reduce, all_gather,
reduce_scatter, broadcast) over a range of sizes, a matmul alone and with every process running, a memory copy,
how much of an all_reduce hides under matmuls, and a small call right after a compute burst. ``build_profile``
fits latency + bytes / bandwidth per kind and writes it all as the mapping of a hardware profile that
`estimate --time --hardware FILE` and the projection read.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import psutil
import torch
import torch.distributed as dist

from stratbench.core.dist import DistEnv, destroy_process_group, die_with_parent, init_process_group, read_env
from stratbench.core.errors import ConfigError
from stratbench.measuring.comm import wire_factor
from stratbench.measuring.environment import cpu_name
from stratbench.measuring.hardware import builtin, fmt_rate

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
MM_SIZE = 1024
"""The matmul whose rate is the compute peak: MM_SIZE x MM_SIZE fp32 (and bf16)."""
LOADED_BURST_S = 2e-3
"""Compute before each call of the loaded measurement: about one layer's forward or backward of a small model."""
SLOW_MM_SIZE = 256
SLOW_MM_S = 5e-3
"""A 256x256 matmul slower than this (below ~6.7 GFLOP/s) marks a dtype without fast kernels on this device."""


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds of one call of ``fn``, between two synchronisations of the device."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


class Ranks:
    """This process's view of the probe's processes: how many, which one, the device and its synchronisation."""

    def __init__(self, env: DistEnv) -> None:
        self.n, self.rank, self.device = env.world_size, env.rank, env.device
        device = env.device
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def slowest(self, seconds: float) -> float:
        """The largest of every process's ``seconds`` (a collective: every process must call it)."""
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def measure_processes(device: str, sizes: list[int], repeats: int) -> dict[str, Any] | None:
    """Run in every process of the probe: join the process group, measure, leave it. The measurements on rank 0
    (the slowest process's time of each collective, the rates, the host), None on the others."""
    if os.environ.get("STRATBENCH_DIE_WITH_PARENT"):
        die_with_parent()
    # all_gather_into_tensor / reduce_scatter_tensor are what FSDP and DeepSpeed call; torch 2.13 flags them
    # as deprecated in favour of *_single, which older torch lacks.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    env = read_env(device)
    init_process_group(env, timeout_s=300)
    ranks = Ranks(env)
    out: dict[str, Any] = {"collectives": collective_times(ranks, sizes, repeats), "ranks": ranks.n}
    a = torch.randn(MM_SIZE, MM_SIZE, device=ranks.device)
    b = torch.randn(MM_SIZE, MM_SIZE, device=ranks.device)
    out |= matmul_rates(ranks, a, b)
    out["memory_bandwidth"] = memory_bandwidth(ranks)
    shares = overlap_shares(ranks, a, b)
    out["overlap"], out["overlap_all"] = statistics.median(shares), shares
    out["loaded"] = loaded_latencies(ranks, sizes[0], repeats)
    if ranks.rank == 0:
        out |= host_info(ranks)
    destroy_process_group()
    return out if ranks.rank == 0 else None


def collective_times(ranks: Ranks, sizes: list[int], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """kind -> one row per size: its payload bytes and the median over ``repeats`` calls of the slowest rank's
    time (after two untimed calls)."""
    out = {}
    for kind in KINDS:
        rows = []
        for size in sizes:
            call, payload = collective(kind, size, ranks.n, ranks.device)
            for _ in range(2):
                call()
            times = []
            for _ in range(repeats):
                dist.barrier()
                times.append(ranks.slowest(timed(call, ranks.sync)))
            rows.append({"payload_bytes": payload, "seconds": statistics.median(times), "all": times})
        out[kind] = rows
    return out


def collective(kind: str, size: int, n: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """One call of ``kind`` on about ``size`` bytes of fp32 over ``n`` ranks, with the tensor-in/tensor-out forms
    FSDP and DeepSpeed call; returns (the call, its payload bytes: a multiple of n elements)."""
    numel = max(n, size // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
    }
    return calls[kind], numel * 4


def mm_rate(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, sync: Callable[[], None], seconds: float = 0.6
) -> float:
    """FLOP/s of ``a @ b`` in ``dtype``, repeated for about ``seconds``. A dtype without fast kernels here (bf16
    on a CPU without native bf16: 2.3 s per 1024x1024 matmul on an AVX2 EPYC, ~100x fp32) is timed on 256x256
    matrices: its reference kernel's rate per FLOP, without spending half a minute of the probe on it."""
    m = SLOW_MM_SIZE
    small = a[:m, :m].to(dtype)
    torch.mm(small, small)
    m = m if timed(lambda: torch.mm(small, small), sync) > SLOW_MM_S else a.shape[0]
    x, y = a[:m, :m].to(dtype), b[:m, :m].to(dtype)
    torch.mm(x, y)
    t = timed(lambda: torch.mm(x, y), sync)
    reps = max(1, int(seconds / max(t, 1e-6)))
    return 2 * m**3 * reps / timed(lambda: [torch.mm(x, y) for _ in range(reps)], sync)


def matmul_rates(ranks: Ranks, a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """The matmul's rate per dtype in rank 0 alone with every core ("matmul_alone") and with its own threads
    ("matmul_alone_per_process": what a 1-thread calibration run gets), then in every process at once (the
    slowest's: "matmul_together")."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    threads = torch.get_num_threads()
    out: dict[str, Any] = {}
    dist.barrier()
    alone = {}
    if ranks.rank == 0:
        if ranks.device.type == "cpu":
            torch.set_num_threads(os.cpu_count() or threads)
        alone = {k: mm_rate(a, b, d, ranks.sync) for k, d in dtypes.items()}
        torch.set_num_threads(threads)
        out["matmul_alone_per_process"] = {k: mm_rate(a, b, d, ranks.sync) for k, d in dtypes.items()}
    dist.barrier()
    together = {k: mm_rate(a, b, d, ranks.sync) for k, d in dtypes.items()}
    rates: list[Any] = [None] * ranks.n
    dist.all_gather_object(rates, together)
    out["matmul_alone"] = alone
    out["matmul_together"] = {k: min(r[k] for r in rates) for k in dtypes}
    return out


def memory_bandwidth(ranks: Ranks) -> float:
    """Bytes/s of copying 64 MiB (read + write) with every process copying at once (the slowest's)."""
    src = torch.ones(16 * 2**20, dtype=torch.float32, device=ranks.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = min(timed(lambda: dst.copy_(src), ranks.sync) for _ in range(5))
    return ranks.slowest(t) and 2 * src.numel() * 4 / ranks.slowest(t)


def overlap_shares(ranks: Ranks, a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Five measurements of the share of an 8 MiB all_reduce hidden under matmuls: the all_reduce started
    asynchronously while the matmuls run, against each alone (the slowest rank's times)."""
    comm = torch.ones(8 * 2**20 // 4, dtype=torch.float32, device=ranks.device)
    sync = ranks.sync
    t_mm = timed(lambda: torch.mm(a, b), sync)
    t_comm = ranks.slowest(timed(lambda: dist.all_reduce(comm), sync))
    k = max(1, int(t_comm / max(t_mm, 1e-6)))

    def compute() -> None:
        for _ in range(k):
            torch.mm(a, b)

    def both() -> None:
        work = dist.all_reduce(comm, async_op=True)
        compute()
        work.wait()

    shares = []
    for _ in range(5):
        dist.barrier()
        tc = ranks.slowest(timed(compute, sync))
        dist.barrier()
        tm = ranks.slowest(timed(lambda: dist.all_reduce(comm), sync))
        dist.barrier()
        tb = ranks.slowest(timed(both, sync))
        shares.append(max(0.0, min(1.0, (tc + tm - tb) / min(tc, tm))))
    return shares


def loaded_latencies(ranks: Ranks, size: int, repeats: int) -> dict[str, Any]:
    """The cost of a collective inside training: every process computes a burst of matmuls (the same count on
    each, ~LOADED_BURST_S), then calls the collective at once, as training does between layers; the call's cost
    is the iteration's time minus the burst's (both the median over calls of the mean over ranks). It holds what
    a probe between idle processes does not see: the wait for the peer's slower burst (cores, caches and OS
    jitter shared) and the transport threads' wait for a core that computes."""
    n, device, sync = ranks.n, ranks.device, ranks.sync
    x = torch.randn(256, 256, device=device)
    y = torch.randn(256, 256, device=device)
    torch.mm(x, y)
    sync()
    t = timed(lambda: [torch.mm(x, y) for _ in range(10)], sync) / 10
    count = torch.tensor([max(1, round(LOADED_BURST_S / max(t, 1e-7)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # the same burst on every rank
    k = int(count.item())

    def burst() -> None:
        for _ in range(k):
            torch.mm(x, y)

    mine: dict[str, list[tuple[float, float]]] = {}
    for kind in KINDS:
        call, payload = collective(kind, size, n, device)
        call()
        mine[kind] = [_burst_then_call(burst, call, sync) for _ in range(max(15, 3 * repeats))]
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    out: dict[str, Any] = {
        "payload_bytes": payload,
        "burst_s": statistics.median(r[0] for r in mine["all_reduce"]),
    }
    for kind in KINDS:
        reps = len(mine[kind])
        bursts = [statistics.fmean(e[kind][i][0] for e in everyone) for i in range(reps)]
        iters = [statistics.fmean(e[kind][i][1] for e in everyone) for i in range(reps)]
        out[kind] = max(0.0, statistics.median(iters) - statistics.median(bursts))
    return out


def _burst_then_call(
    burst: Callable[[], None], call: Callable[[], Any], sync: Callable[[], None]
) -> tuple[float, float]:
    """(seconds of the burst, seconds of the burst and the call), every rank starting together."""
    dist.barrier()
    start = time.perf_counter()
    burst()
    sync()
    mid = time.perf_counter()
    call()
    sync()
    return mid - start, time.perf_counter() - start


def host_info(ranks: Ranks) -> dict[str, Any]:
    """Where the probe ran: backend, device, torch, CPU, cores, threads per process, host, time, GPUs."""
    device = ranks.device
    return {
        "backend": dist.get_backend(), "device": device.type, "torch": torch.__version__, "cpu": cpu_name(),
        "cpu_count": os.cpu_count(), "threads_per_process": torch.get_num_threads(), "host": socket.gethostname(),
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "platform": platform.platform(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device.type == "cuda" else [],
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# fit and profile


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, seconds per byte) of ``t = latency + bytes x beta``, least squares weighted by 1/t so that
    small and large sizes count alike (relative error). Latency is clamped at >= 0."""
    w = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * (x - mx) * (t - my) for wi, (x, t) in zip(w, points, strict=True))
    beta = sxy / sxx if sxx else 0.0
    if beta <= 0:  # flat: all latency
        return my, 1e-15
    alpha = my - beta * mx
    if alpha < 0:  # refit through the origin
        alpha = 0.0
        beta = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True)) / sum(
            wi * x * x for wi, (x, _) in zip(w, points, strict=True)
        )
    return alpha, beta


def build_profile(data: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The YAML mapping of a profile from the workers' measurements, and the fits per kind."""
    n = int(data["ranks"])
    fits = collective_fits(data, n)
    link_key = f"{name}-link"
    profile: dict[str, Any] = {"version": 1, "default_system": name}
    single = data.get("matmul_alone") or {}
    together = data["matmul_together"]
    share = min(1.0, together["fp32"] / single["fp32"]) if single.get("fp32") else 1.0
    if data["device"] == "cuda":
        gpu_key, share = _known_gpu(data), 1.0
    else:
        gpu_key = f"{name}-cpu"
        profile["gpus"] = {gpu_key: _cpu_as_gpu(data, single)}
    profile["links"] = {link_key: _link(fits, n)}
    system = {
        "gpu": gpu_key,
        "gpus_per_node": n,
        "intra_node": link_key,
        "host": link_key,
        "host_memory_bandwidth": fmt_rate(data["memory_bandwidth"] * n, "B/s"),
        "call_latency": "0 us",  # inside each fit's latency
        "overlap": round(float(data["overlap"]), 3),
        "compute_share": round(share, 3),
    }
    per_process = data.get("matmul_alone_per_process") or {}
    if data["device"] != "cuda" and per_process.get("fp32") and single.get("fp32"):
        # A calibration run with this many threads is counted against this share of the all-core peak, so
        # that predicted / calibrated = thread_share / compute_share: how much slower a process runs when
        # every process runs at once (shared cores, caches, memory bandwidth) than alone.
        system["thread_share"] = round(min(1.0, per_process["fp32"] / single["fp32"]), 3)
        system["threads_per_process"] = int(data["threads_per_process"])
    profile["systems"] = {name: system}
    return profile, fits


def collective_fits(data: dict[str, Any], n: int) -> dict[str, Any]:
    """kind -> its fit: latency, seconds per byte, the link bandwidth it implies, and (from the loaded
    measurement) the latency of a call in training."""
    fits: dict[str, Any] = {}
    loaded = data.get("loaded") or {}
    for kind, rows in data["collectives"].items():
        alpha, beta = fit_alpha_beta([(r["payload_bytes"], r["seconds"]) for r in rows])
        link_bw = wire_factor(kind, n) / beta
        fits[kind] = {"latency_s": alpha, "seconds_per_byte": beta, "link_bandwidth": link_bw, "ranks": n}
        if kind in loaded:
            # a small call's cost after a compute burst, less its bytes' share: the latency of a call in training
            wire = wire_factor(kind, n) * loaded["payload_bytes"] * beta
            fits[kind]["loaded_latency_s"] = max(alpha, loaded[kind] - wire)
    return fits


def _link(fits: dict[str, Any], n: int) -> dict[str, Any]:
    """The profile's link between the processes: all_reduce's bandwidth and per-hop latency, and every fit."""
    ar = fits["all_reduce"]
    collectives = {}
    for k, f in fits.items():
        fit = {
            "latency": f"{f['latency_s'] * 1e6:.4g} us",
            "bandwidth": fmt_rate(f["link_bandwidth"], "B/s"),
            "ranks": n,
        }
        if "loaded_latency_s" in f:
            fit["loaded_latency"] = f"{f['loaded_latency_s'] * 1e6:.4g} us"
        collectives[k] = fit
    return {
        "bandwidth": fmt_rate(ar["link_bandwidth"], "B/s"),
        "latency": f"{ar['latency_s'] / max(1, 2 * (n - 1)) * 1e6:.4g} us",
        "efficiency": 1.0,
        "collectives": collectives,
    }


def _known_gpu(data: dict[str, Any]) -> str:
    """The key of the probed GPU in the built-in profiles (one line where it is not there)."""
    gpu = builtin().gpu_for_device((data.get("gpus") or [""])[0])
    if gpu is None:
        raise ConfigError(
            f"GPU {data['gpus'][0]!r} is not in the hardware profiles: add it to the written file"
        )
    return gpu.key


def _cpu_as_gpu(data: dict[str, Any], single: dict[str, float]) -> dict[str, Any]:
    """The profile's device entry for a CPU probe: its one-process matmul peaks, memory and bandwidth."""
    return {
        "name": f"{data['cpu']} ({data['cpu_count']} cores)",
        "kind": "cpu",
        "match": "(?!)",  # never a CUDA device name
        "peak_flops": {k: fmt_rate(v, "FLOP/s") for k, v in single.items()},
        "memory": f"{psutil.virtual_memory().total} B",
        "memory_bandwidth": fmt_rate(data["memory_bandwidth"], "B/s"),
    }
