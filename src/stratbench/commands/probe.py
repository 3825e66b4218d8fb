"""stratbench probe: measure this machine's collectives (all_reduce, all_gather, reduce_scatter, broadcast)
between N local processes over a range of sizes, fit latency + bytes / bandwidth per kind, measure the
processes' compute (matmul) and memory bandwidth and how much communication hides under compute, and write it
all as a hardware profile that `estimate --time --hardware FILE` and the projection read.

The processes are started the way `train` starts them (stratbench.launching.launch: torchrun, gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

NAME = "probe"
HELP = "measure collective bandwidth/latency, compute and overlap between N local processes; write a hardware profile"
ORDER = 42

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DEFAULT_SIZES = "4KiB,64KiB,512KiB,2MiB,8MiB,32MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices) to measure between")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="gloo on cpu, nccl on cuda"
    )
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="payload sizes, comma-separated (e.g. 4KiB,1MiB,32MiB)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per size (the median is kept)")
    parser.add_argument("--output", default="probe.yaml", help="hardware profile to write (YAML)")
    parser.add_argument(
        "--name", default=None, help="system name in the profile (default: local-<device>-<nproc>)"
    )
    parser.add_argument("--json", action="store_true", help="print the measurements and fits as JSON")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the launcher's resolved config (workers)
    parser.add_argument("--raw", help=argparse.SUPPRESS)  # where rank 0 writes the measurements (workers)


def parse_sizes(text: str) -> list[int]:
    from stratbench.core.errors import ConfigError
    from stratbench.predicting.estimate import parse_bytes

    try:
        sizes = sorted({parse_bytes(s) for s in text.split(",") if s.strip()})
    except ConfigError as exc:
        raise ConfigError(f"--sizes {text!r}: {exc}") from exc
    if len(sizes) < 2:
        raise ConfigError(f"--sizes {text!r}: give at least two sizes to fit latency and bandwidth")
    if sizes[-1] > 2**31:
        raise ConfigError(f"--sizes {text!r}: sizes above 2 GiB are not probed")
    return sizes


def run(args: argparse.Namespace) -> int:
    if args.raw:
        return worker(args)
    from stratbench.core.config import TrainConfig
    from stratbench.core.errors import ConfigError, StratbenchError
    from stratbench.launching.launch import launch

    if not 2 <= args.nproc <= 64:
        raise ConfigError(f"--nproc must be between 2 and 64, got {args.nproc}")
    if args.repeats < 3:
        raise ConfigError(f"--repeats must be at least 3, got {args.repeats}")
    sizes = parse_sizes(args.sizes)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.output)
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--output {args.output}: write the profile as .yaml")
    with tempfile.TemporaryDirectory(prefix="stratbench-probe-") as tmp:
        raw = Path(tmp) / "probe.json"
        cfg = TrainConfig(nproc=args.nproc, device=device, output=tmp, progress=False)
        command = ("probe", "--raw", str(raw), "--sizes", ",".join(map(str, sizes)), "--repeats", str(args.repeats),
                   "--device", device)  # fmt: skip
        code = launch(cfg, command)
        if code != 0 or not raw.exists():
            raise StratbenchError(f"the probe's {args.nproc} processes failed (torchrun exit code {code})")
        data = json.loads(raw.read_text())
    profile, fits = build_profile(data, args.name or f"local-{device}-{args.nproc}")
    out.parent.mkdir(parents=True, exist_ok=True)
    from stratbench.measuring.hardware import dump

    header = (
        f"# written by `stratbench probe --nproc {args.nproc} --device {device}` on {data['host']} at {data['when']}\n"
        f"# ({data['backend']}, torch {data['torch']}, {data['cpu']} with {data['cpu_count']} cores). Measured, not\n"
        "# spec-sheet numbers: collectives fitted as latency + wire bytes / bandwidth per kind; peak_flops = a\n"
        "# 1024x1024 matmul in one process; compute_share = the per-process matmul rate with every process running\n"
        "# over the one-process rate; overlap = measured share of an all_reduce hidden under matmuls;\n"
        "# loaded_latency = a small call's cost right after a ~2 ms compute burst on every process (training's).\n"
    )
    from stratbench.checkpoints.checkpoint import atomic_output
    from stratbench.measuring.hardware import load

    # A temporary file, read back (what is written must load), then renamed: a failed probe keeps an earlier one.
    with atomic_output(out, ".yaml") as tmp:
        tmp.write_text(header + dump(profile))
        load(tmp)
    if args.json:
        print(json.dumps({"measurements": data, "fits": fits, "profile": str(out)}, indent=2))
        return 0
    print_report(data, fits, out)
    return 0


# ------------------------------------------------------------------------------------------------
# the workers


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from stratbench.core.dist import destroy_process_group, die_with_parent, init_process_group, read_env

    if os.environ.get("STRATBENCH_DIE_WITH_PARENT"):
        die_with_parent()
    import warnings

    # all_gather_into_tensor / reduce_scatter_tensor are what FSDP and DeepSpeed call; torch 2.13 flags them
    # as deprecated in favour of *_single, which older torch lacks.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    env = read_env(args.device)
    init_process_group(env, timeout_s=300)
    n, rank, device = env.world_size, env.rank, env.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"collectives": {}, "ranks": n}
    for kind in KINDS:
        rows = []
        for size in sizes:
            call, payload = _collective(kind, size, n, device)
            for _ in range(2):
                call()
            times = []
            for _ in range(args.repeats):
                dist.barrier()
                times.append(slowest(_timed(call, sync)))
            rows.append({"payload_bytes": payload, "seconds": statistics.median(times), "all": times})
        out["collectives"][kind] = rows

    # Compute: a 1024x1024 matmul, first in rank 0 alone with every core, then in every process at once.
    size = 1024
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)

    def mm_rate(dtype: torch.dtype, seconds: float = 0.6) -> float:
        # A dtype without fast kernels here (bf16 on a CPU without native bf16: 2.3 s per 1024x1024 matmul on an
        # AVX2 EPYC, ~100x fp32) is timed on 256x256 matrices: its reference kernel's rate per FLOP, without
        # spending half a minute of the probe on it.
        m = SLOW_MM_SIZE
        small = a[:m, :m].to(dtype)
        torch.mm(small, small)
        m = m if _timed(lambda: torch.mm(small, small), sync) > SLOW_MM_S else size
        x, y = a[:m, :m].to(dtype), b[:m, :m].to(dtype)
        torch.mm(x, y)
        t = _timed(lambda: torch.mm(x, y), sync)
        reps = max(1, int(seconds / max(t, 1e-6)))
        return 2 * m**3 * reps / _timed(lambda: [torch.mm(x, y) for _ in range(reps)], sync)

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    threads = torch.get_num_threads()
    dist.barrier()
    alone = {}
    if rank == 0:
        if device.type == "cpu":
            torch.set_num_threads(os.cpu_count() or threads)
        alone = {k: mm_rate(d) for k, d in dtypes.items()}
        torch.set_num_threads(threads)
        # the same process alone with the threads each process has: what a 1-thread calibration run gets
        out["matmul_alone_per_process"] = {k: mm_rate(d) for k, d in dtypes.items()}
    dist.barrier()
    together = {k: mm_rate(d) for k, d in dtypes.items()}
    rates = [None] * n
    dist.all_gather_object(rates, together)
    out["matmul_alone"] = alone
    out["matmul_together"] = {k: min(r[k] for r in rates) for k in dtypes}

    # Memory bandwidth: copying 64 MiB (read + write), every process at once.
    src = torch.ones(16 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = min(_timed(lambda: dst.copy_(src), sync) for _ in range(5))
    out["memory_bandwidth"] = slowest(t) and 2 * src.numel() * 4 / slowest(t)

    # Overlap: an all_reduce started asynchronously while matmuls run, against each alone.
    comm = torch.ones(8 * 2**20 // 4, dtype=torch.float32, device=device)
    x = a
    t_mm = _timed(lambda: torch.mm(x, b), sync)
    t_comm = slowest(_timed(lambda: dist.all_reduce(comm), sync))
    k = max(1, int(t_comm / max(t_mm, 1e-6)))

    def compute() -> None:
        for _ in range(k):
            torch.mm(x, b)

    shares = []
    for _ in range(5):
        dist.barrier()
        tc = slowest(_timed(compute, sync))
        dist.barrier()
        tm = slowest(_timed(lambda: dist.all_reduce(comm), sync))
        dist.barrier()

        def both() -> None:
            work = dist.all_reduce(comm, async_op=True)
            compute()
            work.wait()

        tb = slowest(_timed(both, sync))
        shares.append(max(0.0, min(1.0, (tc + tm - tb) / min(tc, tm))))
    out["overlap"] = statistics.median(shares)
    out["overlap_all"] = shares
    out["loaded"] = _loaded_latencies(sizes[0], n, device, sync, args.repeats)
    if rank == 0:
        import platform

        import torch as _t

        from stratbench.measuring.environment import cpu_name

        out |= {
            "backend": dist.get_backend(), "device": device.type, "torch": _t.__version__, "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "threads_per_process": threads, "host": socket.gethostname(),
            "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "platform": platform.platform(),
            "gpus": [_t.cuda.get_device_name(i) for i in range(_t.cuda.device_count())] if device.type == "cuda" else [],
        }  # fmt: skip
        from stratbench.checkpoints.checkpoint import atomic_write

        atomic_write(Path(args.raw), json.dumps(out))
    destroy_process_group()
    return 0


def _collective(kind: str, size: int, n: int, device) -> tuple[Any, int]:
    """One call of ``kind`` on about ``size`` bytes of fp32 over ``n`` ranks, with the tensor-in/tensor-out forms
    FSDP and DeepSpeed call; returns (the call, its payload bytes: a multiple of n elements)."""
    import torch
    import torch.distributed as dist

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


LOADED_BURST_S = 2e-3
SLOW_MM_SIZE = 256
SLOW_MM_S = 5e-3
"""A 256x256 matmul slower than this (below ~6.7 GFLOP/s) marks a dtype without fast kernels on this device."""
"""Compute before each call of the loaded measurement: about one layer's forward or backward of a small model."""


def _loaded_latencies(size: int, n: int, device, sync, repeats: int) -> dict[str, Any]:
    """The cost of a collective inside training: every process computes a burst of matmuls (the same count on
    each, ~LOADED_BURST_S), then calls the collective at once, as training does between layers; the call's cost
    is the iteration's time minus the burst's (both the median over calls of the mean over ranks). It holds what
    a probe between idle processes does not see: the wait for the peer's slower burst (cores, caches and OS
    jitter shared) and the transport threads' wait for a core that computes."""
    import torch
    import torch.distributed as dist

    x = torch.randn(256, 256, device=device)
    y = torch.randn(256, 256, device=device)
    torch.mm(x, y)
    sync()
    t = _timed(lambda: [torch.mm(x, y) for _ in range(10)], sync) / 10
    count = torch.tensor([max(1, round(LOADED_BURST_S / max(t, 1e-7)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # the same burst on every rank
    k = int(count.item())

    def burst() -> None:
        for _ in range(k):
            torch.mm(x, y)

    mine: dict[str, list[tuple[float, float]]] = {}
    for kind in KINDS:
        call, payload = _collective(kind, size, n, device)
        call()
        rows = []
        for _ in range(max(15, 3 * repeats)):
            dist.barrier()
            start = time.perf_counter()
            burst()
            sync()
            mid = time.perf_counter()
            call()
            sync()
            rows.append((mid - start, time.perf_counter() - start))
        mine[kind] = rows
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    out: dict[str, Any] = {"payload_bytes": payload, "burst_s": statistics.median(r[0] for r in mine["all_reduce"])}
    for kind in KINDS:
        reps = len(mine[kind])
        bursts = [statistics.fmean(e[kind][i][0] for e in everyone) for i in range(reps)]
        iters = [statistics.fmean(e[kind][i][1] for e in everyone) for i in range(reps)]
        out[kind] = max(0.0, statistics.median(iters) - statistics.median(bursts))
    return out


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
    from stratbench.measuring.comm import wire_factor
    from stratbench.measuring.hardware import builtin, fmt_rate

    n = int(data["ranks"])
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
    ar = fits["all_reduce"]
    link_key = f"{name}-link"
    links = {
        link_key: {
            "bandwidth": fmt_rate(ar["link_bandwidth"], "B/s"),
            "latency": f"{ar['latency_s'] / max(1, 2 * (n - 1)) * 1e6:.4g} us",
            "efficiency": 1.0,
            "collectives": {
                k: {
                    "latency": f"{f['latency_s'] * 1e6:.4g} us",
                    "bandwidth": fmt_rate(f["link_bandwidth"], "B/s"),
                    "ranks": n,
                }
                | ({"loaded_latency": f"{f['loaded_latency_s'] * 1e6:.4g} us"} if "loaded_latency_s" in f else {})
                for k, f in fits.items()
            },
        }
    }
    profile: dict[str, Any] = {"version": 1, "default_system": name}
    single = data.get("matmul_alone") or {}
    together = data["matmul_together"]
    share = min(1.0, together["fp32"] / single["fp32"]) if single.get("fp32") else 1.0
    if data["device"] == "cuda":
        gpu = builtin().gpu_for_device((data.get("gpus") or [""])[0])
        if gpu is None:
            from stratbench.core.errors import ConfigError

            raise ConfigError(
                f"GPU {data['gpus'][0]!r} is not in the hardware profiles: add it to the written file"
            )
        gpu_key = gpu.key
        share = 1.0
    else:
        import psutil

        gpu_key = f"{name}-cpu"
        profile["gpus"] = {
            gpu_key: {
                "name": f"{data['cpu']} ({data['cpu_count']} cores)",
                "kind": "cpu",
                "match": "(?!)",  # never a CUDA device name
                "peak_flops": {k: fmt_rate(v, "FLOP/s") for k, v in single.items()},
                "memory": f"{psutil.virtual_memory().total} B",
                "memory_bandwidth": fmt_rate(data["memory_bandwidth"], "B/s"),
            }
        }
    profile["links"] = links
    profile["systems"] = {
        name: {
            "gpu": gpu_key,
            "gpus_per_node": n,
            "intra_node": link_key,
            "host": link_key,
            "host_memory_bandwidth": fmt_rate(data["memory_bandwidth"] * n, "B/s"),
            "call_latency": "0 us",  # inside each fit's latency
            "overlap": round(float(data["overlap"]), 3),
            "compute_share": round(share, 3),
        }
    }
    per_process = data.get("matmul_alone_per_process") or {}
    if data["device"] != "cuda" and per_process.get("fp32") and single.get("fp32"):
        # A calibration run with this many threads is counted against this share of the all-core peak, so
        # that predicted / calibrated = thread_share / compute_share: how much slower a process runs when
        # every process runs at once (shared cores, caches, memory bandwidth) than alone.
        profile["systems"][name]["thread_share"] = round(min(1.0, per_process["fp32"] / single["fp32"]), 3)
        profile["systems"][name]["threads_per_process"] = int(data["threads_per_process"])
    return profile, fits


def print_report(data: dict[str, Any], fits: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    from stratbench.core.tables import fmt_bytes, table_console
    from stratbench.measuring.comm import wire_factor

    n = data["ranks"]
    console = table_console()
    table = Table(
        title=f"{data['backend']} collectives between {n} processes on {data['host']} (median of the slowest rank)"
    )
    table.add_column("payload", justify="right")
    for kind in data["collectives"]:
        table.add_column(f"{kind} time", justify="right")
        table.add_column("bus GB/s", justify="right")
    sizes = [r["payload_bytes"] for r in next(iter(data["collectives"].values()))]
    for i, size in enumerate(sizes):
        cells = [fmt_bytes(size)]
        for kind, rows in data["collectives"].items():
            t = rows[i]["seconds"]
            cells += [f"{t * 1e3:.3f} ms", f"{wire_factor(kind, n) * size / t / 1e9:.3f}"]
        table.add_row(*cells)
    console.print(table)
    for kind, f in fits.items():
        loaded = f" ({f['loaded_latency_s'] * 1e6:.1f} us per call in training)" if "loaded_latency_s" in f else ""
        console.print(
            f"{kind:>14}: t = {f['latency_s'] * 1e6:.1f} us + wire bytes / {f['link_bandwidth'] / 1e9:.3f} GB/s{loaded}"
        )
    alone, together = data.get("matmul_alone") or {}, data["matmul_together"]
    for k in together:
        console.print(
            f"matmul {k}: {alone.get(k, 0) / 1e9:.1f} GFLOP/s in one process, {together[k] / 1e9:.1f} GFLOP/s per process "
            f"with {n} running"
        )
    console.print(
        f"memory bandwidth (copy, per process, all running): {data['memory_bandwidth'] / 1e9:.2f} GB/s"
    )
    console.print(
        f"overlap of an all_reduce with matmuls: {data['overlap']:.0%} (median of {data['overlap_all']})"
    )
    console.print(f"profile written: {out}  (use: stratbench estimate --time --hardware {out})")
