"""stratbench estimate: predicted memory per device for a model, batch, precision and method, before training."""

from __future__ import annotations

import argparse
import json

NAME = "estimate"
HELP = (
    "predict memory per device (parameters, gradients, optimizer, activations) for a method, before training"
)
ORDER = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="GLOBAL batch per optimizer step (per device = batch / world size)",
    )
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument(
        "--precision", default="fp32", help="fp32, fp64, fp16-true, bf16-true, fp16-mixed, bf16-mixed (or Lightning's names)"
    )
    parser.add_argument(
        "--strategy",
        default="single",
        help="a method (see `stratbench list`) or 'all' for one row per method",
    )
    parser.add_argument("--world-size", type=int, default=1, help="number of devices (processes)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: plain SGD, no state)")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each residual block"
    )
    parser.add_argument(
        "--device-type", default="cuda", choices=("cuda", "cpu"), help="device whose overhead/rounding to use"
    )
    parser.add_argument(
        "--nnodes", type=int, default=1, help="nodes the world size spans (fsdp1 HYBRID_SHARD)"
    )
    parser.add_argument(
        "--max-batch",
        action="store_true",
        help="solve for the largest global batch that fits --device-memory",
    )
    parser.add_argument("--device-memory", help="memory of one device, e.g. 80GiB (default: detected GPU)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_time_arguments(parser)
    from stratbench.commands.train import add_strategy_option_arguments

    add_strategy_option_arguments(parser)  # the same method flags as `train`, from each strategy's Options


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="resnet50", help="tinynet, resnet18/34/50, or a builder 'pkg.module:build'"
    )
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument(
        "--cifar-stem", action="store_true", help="ResNet: 3x3 stride-1 stem for 32x32 inputs"
    )
    parser.add_argument("--width", type=int, default=16, help="tinynet width")


def add_time_arguments(parser: argparse.ArgumentParser) -> None:
    """The step-time projection's flags (stratbench.projection), shared with `advise`."""
    parser.add_argument(
        "--time",
        action="store_true",
        help="also project step time, throughput and scaling efficiency on --hardware (world size = nodes x GPUs per node)",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="a system from the hardware profiles (h100-sxm, a100-sxm, h100-pcie, l40s-pcie, p40-pcie3), "
        "a YAML profile file (e.g. one written by `stratbench probe`), or FILE:SYSTEM",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes for --time")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="devices per node for --time (default: the system's)")
    parser.add_argument(
        "--calibrate",
        action="append",
        default=[],
        metavar="RESULT_JSON",
        help="a measured single-device run (result.json) whose achieved efficiency replaces the default; "
        "repeat it with runs at other batch sizes to also fit a fixed per-step overhead, and with one-device "
        "runs of other methods (--nproc 1) to add each method's own overhead per step",
    )


def time_setup(args: argparse.Namespace):
    """(system, calibration) for --time, validated before any work; (None, None) without --time."""
    from stratbench.errors import ConfigError
    from stratbench.hardware import resolve
    from stratbench.projection import load_calibration

    if not getattr(args, "time", False):
        return None, None
    system = resolve(args.hardware or "h100-sxm")
    if not 1 <= args.nodes <= MAX_WORLD:
        raise ConfigError(f"--nodes must be between 1 and {MAX_WORLD}, got {args.nodes}")
    gpn = args.gpus_per_node or system.gpus_per_node
    if not 1 <= gpn <= 1024:
        raise ConfigError(f"--gpus-per-node must be between 1 and 1024, got {gpn}")
    if args.nodes > 1 and system.inter_node is None:
        raise ConfigError(f"--nodes {args.nodes}: system {system.key!r} has no inter_node link")
    if args.world_size not in (1, args.nodes * gpn):
        raise ConfigError(
            f"--world-size {args.world_size} disagrees with --nodes {args.nodes} x --gpus-per-node {gpn}; with --time leave it out"
        )
    args.world_size, args.nnodes, args.gpus_per_node = args.nodes * gpn, args.nodes, gpn
    if args.device_memory is None:
        args.device_memory = f"{system.gpu.memory_bytes:.0f}B"
    calibration = load_calibration(args.calibrate, system) if args.calibrate else None
    return system, calibration


MAX_WORLD = 4096  # estimate.rank_states is O(world x parameters): 4096 answers in ~15 s here
MAX_BATCH = 100_000_000


def check_common(args: argparse.Namespace) -> None:
    """The values every row shares (precision, world size, batch): one line before any row is computed."""
    from stratbench.config import canonical_precision
    from stratbench.errors import ConfigError
    from stratbench.models import check_model
    from stratbench.precision import SPECS

    args.precision = canonical_precision(args.precision)  # Lightning's names too (16-mixed, bf16-true, ...)
    if args.precision not in SPECS:
        raise ConfigError(f"unknown precision {args.precision!r}; choose one of: {', '.join(SPECS)}")
    if not 1 <= args.world_size <= MAX_WORLD:
        raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD}, got {args.world_size}")
    if not 1 <= args.batch_size <= MAX_BATCH:
        raise ConfigError(f"--batch-size must be between 1 and {MAX_BATCH}, got {args.batch_size}")
    if args.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    check_model(args.model)


def config_for(args: argparse.Namespace, strategy: str):
    """The TrainConfig of one row (``check_common`` has run)."""
    from stratbench.commands.train import strategy_options_from_args
    from stratbench.config import TrainConfig, validate
    from stratbench.errors import ConfigError
    from stratbench.strategies.base import get_strategy

    world = 1 if strategy == "single" else args.world_size
    if not args.max_batch and args.batch_size % (world * args.grad_accum):
        raise ConfigError(
            f"--batch-size {args.batch_size} is not divisible by world size x grad accum ({world} x {args.grad_accum}); "
            "train refuses it too"
        )
    cfg = TrainConfig(
        model=args.model, image_size=args.image_size, num_classes=args.num_classes, data="synthetic",
        cifar_stem=args.cifar_stem, width=args.width, batch_size=args.batch_size, grad_accum=args.grad_accum,
        precision=args.precision, strategy=strategy, nnodes=args.nnodes,
        strategy_options=strategy_options_from_args(args, strategy, strict=args.strategy != "all"),
        optimizer=args.optimizer, momentum=args.momentum, activation_checkpointing=args.activation_checkpointing,
    )  # fmt: skip
    validate(cfg)
    get_strategy(strategy).parse_options(cfg.strategy_options)  # bad option values: one line, before any work
    return cfg


def detected_device_memory() -> int | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from stratbench import estimate as est
    from stratbench.errors import ConfigError
    from stratbench.report_table import fmt_bytes, table_console

    console = table_console()  # piped: wide enough for whole method names
    from stratbench.strategies.base import all_strategies, get_strategy

    names = sorted(all_strategies()) if args.strategy == "all" else [get_strategy(args.strategy).name]
    if args.strategy == "single" and args.world_size > 1:
        raise ConfigError(
            f"single runs on one device; --world-size {args.world_size} needs ddp, fsdp, ... (or --strategy all)"
        )
    device_memory = est.parse_bytes(args.device_memory) if args.device_memory else detected_device_memory()
    if args.max_batch and device_memory is None:
        raise ConfigError(
            "--max-batch needs --device-memory (e.g. 80GiB): no GPU was detected to read it from"
        )

    check_common(args)
    system, calibration = time_setup(args)
    if system is not None and not args.device_memory:
        device_memory = None
    if system is not None:
        device_memory = est.parse_bytes(args.device_memory)
    results = [_row(args, name, system, calibration, device_memory) for name in names]
    if system is not None:
        single = next((r["projection"] for r in results if r["strategy"] == "single"), None)
        if single and single.get("throughput"):
            for r in results:  # strong scaling: the same global batch on one device
                if r.get("projection"):
                    t = r["projection"].get("throughput")
                    r["projection"]["speedup_vs_single"] = t / single["throughput"] if t else None
    if args.json:
        out: dict = {"device_memory": device_memory, "results": results}
        if system is not None:
            out["hardware"] = hardware_summary(system, args, calibration)
        print(json.dumps(out, indent=2))
        return 0
    title = (
        f"{args.model} {args.image_size}px, global batch {args.batch_size}, {args.precision}, {args.optimizer}, "
        f"world size {args.world_size}, {args.device_type}"
    )
    if system is not None:
        print_time_table(console, results, system, args, calibration, device_memory, title)
        return 0
    if len(results) == 1 and not args.max_batch:
        e = results[0]["estimate"]
        table = Table(title=f"memory per device: {e['strategy']} ({title}, micro-batch {e['micro_batch']})")
        for col in ("component", "on device", "on host", "note"):
            table.add_column(col, justify="right" if col.startswith("on") else "left")
        for row in e["rows"]:
            table.add_row(
                row["component"],
                fmt_bytes(row["device_bytes"]),
                fmt_bytes(row["host_bytes"]) if row["host_bytes"] else "-",
                row["note"],
            )
        table.add_section()
        table.add_row(
            "peak, forward/backward",
            fmt_bytes(e["peak_fwd_bwd"]),
            "",
            "resident states + gathered + traced working peak",
        )
        table.add_row(
            "peak, optimizer step",
            fmt_bytes(e["peak_step"]),
            "",
            "resident states + gradients + step scratch",
        )
        table.add_row(
            "predicted peak allocated",
            fmt_bytes(e["peak_bytes"]),
            "",
            "compare with torch.cuda.max_memory_allocated",
        )
        table.add_row(
            "per-process overhead",
            fmt_bytes(e["overhead_bytes"]),
            "",
            f"{args.device_type} context + allocator slack",
        )
        table.add_row(
            "[bold]total per device",
            f"[bold]{fmt_bytes(e['total_bytes'])}",
            fmt_bytes(e["host_bytes"]) if e["host_bytes"] else "-",
            "what must fit",
        )
        console.print(table)
        if device_memory:
            fits = "fits" if e["total_bytes"] <= device_memory else "does NOT fit"
            console.print(f"{fits} in {fmt_bytes(device_memory)} per device")
        return 0
    table = Table(
        title=(
            "largest global batch that fits " + fmt_bytes(device_memory) + ": "
            if args.max_batch
            else "memory per device: "
        )
        + title
    )
    cols = [
        "method",
        "params",
        "grads",
        "optimizer",
        "master",
        "buckets",
        "gathered",
        "fwd/bwd working",
        "peak allocated",
        "total per device",
    ]
    if args.max_batch:
        cols.insert(1, "max global batch")
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for res in results:
        e = res["estimate"]
        if e is None:
            why = (
                f"n/a: {res['na']}" if res.get("na")
                else "no memory model" if res.get("no_model") else "0 (even one sample per device does not fit)"
            )
            table.add_row(res["strategy"], why, *[""] * (len(cols) - 2))
            continue
        byname = {r["component"]: r["device_bytes"] for r in e["rows"]}
        cells = [
            fmt_bytes(byname["parameters"]), fmt_bytes(byname["gradients"]), fmt_bytes(byname["optimizer states"]),
            fmt_bytes(byname["fp32 master weights"]), fmt_bytes(byname["gradient buckets"]), fmt_bytes(byname["gathered parameters"]),
            fmt_bytes(byname["forward/backward working peak"]), fmt_bytes(e["peak_bytes"]), fmt_bytes(e["total_bytes"]),
        ]  # fmt: skip
        label = f"{res['strategy']} (x{e['world_size']})"
        table.add_row(label, *([str(res["max_global_batch"])] if args.max_batch else []), *cells)
    console.print(table)
    return 0


def _row(args: argparse.Namespace, name: str, system, calibration, device_memory) -> dict:
    """One method's row: its memory estimate (or largest batch) and, with --time, its projection. With
    ``--strategy all`` a method that cannot be built for this model and world is an n/a row with the reason,
    and the others still print; its options are completed for the world (``Strategy.options_for_world``)."""
    from stratbench import estimate as est
    from stratbench.errors import ConfigError
    from stratbench.strategies.base import get_strategy

    world = 1 if name == "single" else args.world_size
    try:
        cfg = config_for(args, name)
        if args.strategy == "all":
            cfg = cfg.replace(strategy_options=get_strategy(name).options_for_world(cfg, world))
            get_strategy(name).parse_options(cfg.strategy_options)
        if args.max_batch:
            batch, e = est.max_batch(cfg, world, device_memory, args.device_type)
            row = {"strategy": name, "max_global_batch": batch, "estimate": e.to_dict() if e else None}
        else:
            row = {"strategy": name, "estimate": est.estimate(cfg, world, args.device_type).to_dict()}
        if cfg.strategy_options:
            row["options"] = cfg.strategy_options
    except est.NoMemoryModel as exc:
        if args.strategy != "all":
            raise
        row = {"strategy": name, "estimate": None, "no_model": str(exc)}
    except ConfigError as exc:
        if args.strategy != "all":
            raise
        return {"strategy": name, "estimate": None, "na": str(exc), "projection": None}
    if system is not None:
        from stratbench.projection import project

        row["projection"] = project(cfg, system, args.nodes, args.gpus_per_node, calibration, memory=False).to_dict()
    return row


def hardware_summary(system, args: argparse.Namespace, calibration) -> dict:
    return {
        "system": system.key,
        "source": system.source,
        "gpu": system.gpu.name,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "intra_node": system.intra_node.key,
        "inter_node": system.inter_node.key if system.inter_node else None,
        "overlap": system.overlap,
        "overlap_source": system.overlap_source,
        "calibration": None if calibration is None else {
            k: {"efficiency": c.efficiency, "overhead_s": c.overhead_s, "source": c.source, "points": c.points}
            for k, c in calibration.items()
        },
    }  # fmt: skip


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def print_time_table(console, results, system, args, calibration, device_memory, title) -> None:
    """One row per method: projected step time and its parts, throughput, scaling, memory and whether it fits."""
    from rich.table import Table

    from stratbench.report_table import fmt_bytes

    gpu = system.gpu
    table = Table(
        title=f"projected on {args.nodes} x {args.gpus_per_node} {gpu.name} ({system.key}; "
        f"intra {system.intra_node.key}, inter {system.inter_node.key if system.inter_node else '-'}): {title}"
    )
    cols = ["method", "step", "samples/s", "speed-up", "scaling eff.", "compute", "comm (exposed)", "optimizer",
            "offload", "dominant", "memory/device", "fits"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("method", "dominant") else "right", no_wrap=col == "method")
    for res in results:
        if res.get("na"):
            table.add_row(res["strategy"], "n/a", res["na"], *[""] * (len(cols) - 3))
            continue
        p, e = res["projection"], res.get("estimate")
        mem = e["total_bytes"] if e else None
        fits = "-" if mem is None or not device_memory else ("yes" if mem <= device_memory else "NO")
        label = f"{res['strategy']} (x{p['world']})"
        if p["status"] != "ok":
            table.add_row(label, p["status"], p["reason"], *[""] * 8, fits)
            continue
        table.add_row(
            label, fmt_seconds(p["step_s"]), f"{p['throughput']:,.0f}",
            f"{p['speedup_vs_single']:.2f}x" if p.get("speedup_vs_single") else "-",
            f"{p['scaling_efficiency']:.0%}" if p["scaling_efficiency"] is not None else "-",
            fmt_seconds(p["compute_s"]), f"{fmt_seconds(p['comm_s'])} ({fmt_seconds(p['comm_exposed_s'])})",
            fmt_seconds(p["optimizer_s"]), fmt_seconds(p["offload_s"]) if p["offload_s"] else "-", p["dominant"],
            fmt_bytes(mem) if mem is not None else "no memory model", fits,
        )  # fmt: skip
    console.print(table)
    effs = sorted({(p["projection"]["efficiency"], p["projection"]["efficiency_source"]) for p in results if (p.get("projection") or {}).get("efficiency")})
    for eff, src in effs:
        console.print(f"compute efficiency {eff:.1%} of {gpu.name}'s dense peak: {src}")
    console.print(
        f"overlap of forward/backward communication with compute: {system.overlap:.0%} ({system.overlap_source}); "
        "scaling eff. = throughput / (devices x one device at the same per-device batch); "
        "speed-up = vs single at the same global batch"
    )
