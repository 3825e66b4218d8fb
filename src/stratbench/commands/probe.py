"""stratbench probe: measure this machine's collectives (all_reduce, all_gather, reduce_scatter, broadcast)
between N local processes over a range of sizes, fit latency + bytes / bandwidth per kind, measure the
processes' compute (matmul) and memory bandwidth and how much communication hides under compute, and write it
all as a hardware profile that `estimate --time --hardware FILE` and the projection read.

The processes are started the way `train` starts them (stratbench.launching.launch: torchrun, gloo on CPU, NCCL on
GPUs); what each measures and the fit: stratbench.measuring.probe.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from stratbench.checkpoints.checkpoint import atomic_output, atomic_write
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError, StratbenchError
from stratbench.core.tables import fmt_bytes, table_console
from stratbench.launching.launch import launch
from stratbench.measuring.comm import wire_factor
from stratbench.measuring.hardware import dump, load
from stratbench.measuring.probe import build_profile, measure_processes
from stratbench.predicting.estimate import parse_bytes

NAME = "probe"
HELP = "measure collective bandwidth/latency, compute and overlap between N local processes; write a hardware profile"
ORDER = 42

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
    if args.raw:  # one of the processes `probe` started
        data = measure_processes(args.device, [int(s) for s in args.sizes.split(",")], args.repeats)
        if data is not None:
            atomic_write(Path(args.raw), json.dumps(data))
        return 0
    sizes, device, out = check_args(args)
    data = measure(args.nproc, device, sizes, args.repeats)
    profile, fits = build_profile(data, args.name or f"local-{device}-{args.nproc}")
    write_profile(out, profile_header(data, args.nproc, device), profile)
    if args.json:
        print(json.dumps({"measurements": data, "fits": fits, "profile": str(out)}, indent=2))
        return 0
    print_report(data, fits, out)
    return 0


def check_args(args: argparse.Namespace) -> tuple[list[int], str, Path]:
    """(sizes in bytes, device, profile file), every value checked before any process starts."""
    if not 2 <= args.nproc <= 64:
        raise ConfigError(f"--nproc must be between 2 and 64, got {args.nproc}")
    if args.repeats < 3:
        raise ConfigError(f"--repeats must be at least 3, got {args.repeats}")
    sizes = parse_sizes(args.sizes)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.output)
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--output {args.output}: write the profile as .yaml")
    return sizes, device, out


def measure(nproc: int, device: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """The measurements of ``nproc`` processes started the way `train` starts them (rank 0 writes them)."""
    with tempfile.TemporaryDirectory(prefix="stratbench-probe-") as tmp:
        raw = Path(tmp) / "probe.json"
        cfg = TrainConfig(nproc=nproc, device=device, output=tmp, progress=False)
        command = ("probe", "--raw", str(raw), "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats),
                   "--device", device)  # fmt: skip
        code = launch(cfg, Path(tmp), command)
        if code != 0 or not raw.exists():
            raise StratbenchError(f"the probe's {nproc} processes failed (torchrun exit code {code})")
        return json.loads(raw.read_text())


def profile_header(data: dict[str, Any], nproc: int, device: str) -> str:
    """The comment the profile file starts with: how it was measured, and what each number means."""
    return (
        f"# written by `stratbench probe --nproc {nproc} --device {device}` on {data['host']} at {data['when']}\n"
        f"# ({data['backend']}, torch {data['torch']}, {data['cpu']} with {data['cpu_count']} cores). Measured, not\n"
        "# spec-sheet numbers: collectives fitted as latency + wire bytes / bandwidth per kind; peak_flops = a\n"
        "# 1024x1024 matmul in one process; compute_share = the per-process matmul rate with every process running\n"
        "# over the one-process rate; overlap = measured share of an all_reduce hidden under matmuls;\n"
        "# loaded_latency = a small call's cost right after a ~2 ms compute burst on every process (training's).\n"
    )


def write_profile(out: Path, header: str, profile: dict[str, Any]) -> None:
    """A temporary file, read back (what is written must load), then renamed: a failed probe keeps an earlier one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, ".yaml") as tmp:
        tmp.write_text(header + dump(profile))
        load(tmp)


def print_report(data: dict[str, Any], fits: dict[str, Any], out: Path) -> None:
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
        loaded = (
            f" ({f['loaded_latency_s'] * 1e6:.1f} us per call in training)" if "loaded_latency_s" in f else ""
        )
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
