"""stratbench estimate: predicted memory per device for a model, batch, precision and method, before training."""

from __future__ import annotations

import argparse
import json

import torch
from rich.table import Table

from stratbench.commands.train import (
    add_help_arguments,
    add_strategy_option_arguments,
    strategy_options_from_args,
)
from stratbench.core.config import CHOICES, RANGES, TrainConfig, canonical_precision, coerce, validate
from stratbench.core.errors import ConfigError, did_you_mean
from stratbench.core.precision import SPECS, TF32_GPUS, spec_of
from stratbench.core.tables import (
    NaNotes,
    fit_table,
    fmt_bytes,
    name_cell,
    name_column,
    note_width,
    table_console,
    text_column,
)
from stratbench.data.datasets import check_data
from stratbench.data.instruct import FT_SOURCES
from stratbench.data.text import TEXT_SOURCES, is_text_data
from stratbench.measuring.hardware import resolve
from stratbench.models.hf import default_seq_len, is_hf_name
from stratbench.models.zoo import check_model
from stratbench.predicting import estimate as est
from stratbench.predicting.projection import BASES, float8_refusal, load_calibration
from stratbench.predicting.rows import RowSettings, hardware_summary, method_rows, none_answered
from stratbench.strategies.base import all_strategies, get_strategy

NAME = "estimate"
HELP = (
    "predict memory per device (parameters, gradients, optimizer, activations) for a method, before training"
)
ORDER = 40
ESTIMATE_TEXT = f"{', '.join(TEXT_SOURCES)}, or fine-tuning examples {', '.join(FT_SOURCES)}"
"""The text data the estimate takes (train's text and fine-tuning forms; its images are synthetic only)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_help_arguments(parser)  # --help-all and --help-method, as train's: the method options, by method
    add_model_arguments(parser)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="GLOBAL batch per optimizer step (per device = batch / world size)",
    )
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument(
        "--precision",
        default="fp32",
        help=f"{', '.join(SPECS)} (or Lightning's names)",
    )
    parser.add_argument(
        "--strategy",
        default="single",
        help=f"a method: {', '.join(sorted(all_strategies()))} (`stratbench list` says what each is), or 'all' "
        "for one row per method",
    )
    parser.add_argument("--world-size", type=int, default=1, help="number of devices (processes)")
    parser.add_argument("--optimizer", default="sgd", choices=CHOICES["optimizer"])
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: plain SGD, no state)")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each residual block"
    )
    parser.add_argument(
        "--ac-mode", default="full",
        help="with --activation-checkpointing: full, selective, every:N or budget:F (with --compile; train's)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="the run compiles (train's --compile): what budget:F needs; the estimate models no other effect of it",
    )  # fmt: skip
    parser.add_argument(
        "--float8", default="none", choices=CHOICES["float8"],
        help="float8 Linears through torchao (train's): the trace sees what they save for backward",
    )  # fmt: skip
    # LoRA (as train's flags): adapters' parameters added, gradients and optimizer state for them only
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank, the base frozen (0: off)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default 2 x rank)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout on the adapters' input")
    parser.add_argument(
        "--lora-targets", default="all-linear", help="LoRA: comma-separated Linear names, or all-linear"
    )
    parser.add_argument(
        "--quantize-base", default="none", help="QLoRA: none, nf4 or int8 (the adapted Linears' frozen weights in 4 or 8 bits)"
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
    parser.add_argument(
        "--wide", action="store_true", help="every column (each memory component), wider than the terminal"
    )
    add_time_arguments(parser)
    add_strategy_option_arguments(parser)  # the same method flags as `train`, from each strategy's Options


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="resnet50",
        help="tinynet, resnet18/34/50, a transformer (gpt-tiny, gpt-tiny-long, gpt2-small, llama-1b, llama-8b, llama-8b-long; "
        "the mixtures of experts gpt-moe-tiny, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-style: give it text --data), or a "
        "builder 'pkg.module:build'",
    )  # fmt: skip
    parser.add_argument(
        "--data", default="synthetic",
        help=f"synthetic (images of --image-size, --num-classes), or text for a language model: {ESTIMATE_TEXT} "
        "(--seq-len tokens per sample)",
    )  # fmt: skip
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument(
        "--seq-len", type=int, default=None,
        help=f"text data: tokens per sample (default {TrainConfig.seq_len}, or a Hugging Face model's positions "
        "where it has fewer: as train decides it)",
    )  # fmt: skip
    parser.add_argument(
        "--vocab-size", type=int, default=None,
        help="text data: the model's vocabulary (default: as train decides it, from the data: 256 for bytes "
        "and synthetic tokens, of token files their largest id + 1)",
    )  # fmt: skip
    parser.add_argument(
        "--cifar-stem", action="store_true", help="ResNet: 3x3 stride-1 stem for 32x32 inputs"
    )
    parser.add_argument("--width", type=int, default=16, help="tinynet width")
    parser.add_argument("--moe-top-k", type=int, default=None, help="a mixture of experts: experts per token (as train)")
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="a mixture of experts: expert capacity (as train; default dropless)"
    )


def check_model_arguments(args: argparse.Namespace) -> bool:
    """The model and its data (a transformer on text, a classifier on images, a window no longer than the
    transformer's context): one line before any work. Returns whether the data is text."""
    text = is_text_data(args.data)
    if not text and args.data != "synthetic":
        raise ConfigError(
            f"--data {args.data!r}{did_you_mean(args.data, ('synthetic', *TEXT_SOURCES, *FT_SOURCES))}: the "
            f"estimate takes synthetic (images) or text data for a language model: {ESTIMATE_TEXT}"
        )
    if args.seq_len is None:  # as train: the default follows a Hugging Face model's positions
        hf = is_hf_name(args.model)
        args.seq_len = default_seq_len(args.model, TrainConfig.seq_len) if hf else TrainConfig.seq_len
    low, high = RANGES["seq_len"]
    if text and not low <= args.seq_len <= high:
        raise ConfigError(f"--seq-len must be between {low} and {high}, got {args.seq_len}")
    check_model(args.model, text, args.seq_len if text else None)
    return text


def model_fields(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of the model and its data, as `train` would take them."""
    fields = {"model": args.model, "data": args.data, "width": args.width, "cifar_stem": args.cifar_stem,
              "moe_top_k": args.moe_top_k, "capacity_factor": args.capacity_factor}  # fmt: skip
    if is_text_data(args.data):
        return {**fields, "seq_len": args.seq_len, "vocab_size": args.vocab_size}
    return {**fields, "data": "synthetic", "image_size": args.image_size, "num_classes": args.num_classes}


def describe_input(args: argparse.Namespace, results: list[dict] | None = None) -> str:
    """The title's words for the model's input: its pixels, or its window and vocabulary."""
    if not is_text_data(args.data):
        return f"{args.model} {args.image_size}px"
    vocab = next((r["estimate"]["vocab_size"] for r in results or [] if r.get("estimate")), args.vocab_size)
    return f"{args.model} {args.seq_len} tokens/sample" + (f", vocab {vocab:,}" if vocab else "")


def add_time_arguments(parser: argparse.ArgumentParser) -> None:
    """The step-time projection's flags (stratbench.predicting.projection), shared with `advise`."""
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
    add_tf32_argument(parser)
    parser.add_argument(
        "--basis", default=None, choices=BASES,
        help="the compute time's basis for --time: roofline (each traced op priced by the roofline: with the "
        "fractions `calibrate-hw` measured where the --hardware profile has them, else published ones), efficiency "
        "(one per GPU, precision and model family, or --calibrate's), or auto (the default: --calibrate's or the "
        "--hardware file's efficiency where given, else the roofline where the GPU has fractions, else the family "
        "efficiency; docs/projection.md)",
    )  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1, help="nodes for --time")
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, help="devices per node for --time (default: the system's)"
    )
    parser.add_argument(
        "--calibrate",
        action="append",
        default=[],
        metavar="RESULT_JSON",
        help="a measured single-device run (result.json) whose achieved efficiency replaces the default; "
        "repeat it with runs at other batch sizes to also fit a fixed per-step overhead, and with one-device "
        "runs of other methods (--nproc 1) to add each method's own overhead per step",
    )


def add_tf32_argument(parser: argparse.ArgumentParser) -> None:
    """``--tf32`` as `train` takes it (TrainConfig.tf32): the projection prices fp32 at the profile's tf32 peak."""
    parser.add_argument(
        "--tf32", nargs="?", const="true", default="false", metavar="BOOL",
        help="a run with TF32 matmuls/convolutions (train --tf32): fp32 is projected at the GPU's tf32 peak",
    )  # fmt: skip


def check_tf32(args: argparse.Namespace, system) -> bool:
    """``--tf32`` read as `train` reads it; one line where `train` would refuse it (TF32 needs an NVIDIA GPU of
    the Ampere generation or newer): on a CPU, or on a profile whose GPU has no tf32 peak."""
    if not coerce("--tf32", args.tf32, bool):
        return False
    if getattr(args, "device_type", "cuda") == "cpu" or (system is not None and system.gpu.kind == "cpu"):
        raise ConfigError(f"--tf32 needs {TF32_GPUS}, not a CPU")
    if system is not None and system.gpu.peak("tf32") is None:
        raise ConfigError(
            f"--tf32: {system.gpu.name} has no TF32 (no tf32 peak in its hardware profile); it needs {TF32_GPUS}"
        )
    return True


def time_setup(args: argparse.Namespace):
    """(system, calibration) for --time, validated before any work; (None, None) without --time."""
    basis = getattr(args, "basis", None)
    if not getattr(args, "time", False):
        if basis is not None:
            raise ConfigError(f"--basis {basis} prices the step time: it needs --time")
        return None, None
    if basis == "roofline" and args.calibrate:
        raise ConfigError("--basis roofline prices each op from the roofline's fractions; --calibrate gives the "
                          "calibrated efficiency basis: give one of them")  # fmt: skip
    system = resolve(args.hardware or "h100-sxm")
    if basis == "roofline" and system.gpu.roofline is None:
        raise ConfigError(f"--basis roofline: {system.gpu.name} ({system.gpu.key}) has no roofline fractions "
                          "(hardware.yaml roofline and the gpu's generation, or `stratbench calibrate-hw`'s "
                          "measured_roofline); use --basis efficiency")  # fmt: skip
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


MAX_WORLD = est.MAX_WORLD
MAX_BATCH = 100_000_000


def check_common(args: argparse.Namespace) -> None:
    """The values every row shares (precision, world size, batch): one line before any row is computed."""
    args.precision = canonical_precision(args.precision)  # Lightning's names too (16-mixed, bf16-true, ...)
    spec_of(args.precision)
    if not 1 <= args.world_size <= MAX_WORLD:
        raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD}, got {args.world_size}")
    if not 1 <= args.batch_size <= MAX_BATCH:
        raise ConfigError(f"--batch-size must be between 1 and {MAX_BATCH}, got {args.batch_size}")
    if args.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    check_model_arguments(args)


def methods_to_estimate(args: argparse.Namespace) -> list[str]:
    """The methods to estimate (every one with ``--strategy all``); a method that uses one device whatever the
    world size is refused with a larger one (``Strategy.spans_devices``)."""
    if args.strategy == "all":
        return sorted(all_strategies())
    strategy = get_strategy(args.strategy)
    if not strategy.spans_devices and args.world_size > 1:
        raise ConfigError(
            f"{strategy.name} runs on one device; --world-size {args.world_size} needs ddp, fsdp, ... (or --strategy all)"
        )
    return [strategy.name]


def config_for(args: argparse.Namespace, strategy: str) -> TrainConfig:
    """The TrainConfig of one row (``check_common`` has run)."""
    cls = get_strategy(strategy)
    world = cls.devices_for_world(args.world_size)
    cfg = TrainConfig(
        **model_fields(args), batch_size=args.batch_size, grad_accum=args.grad_accum,
        precision=args.precision, tf32=args.tf32, strategy=strategy, nnodes=args.nnodes,
        strategy_options=strategy_options_from_args(args, strategy, strict=args.strategy != "all"),
        optimizer=args.optimizer, momentum=args.momentum, activation_checkpointing=args.activation_checkpointing,
        ac_mode=args.ac_mode, compile=args.compile,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_targets=args.lora_targets, quantize_base=args.quantize_base, float8=args.float8,
    )  # fmt: skip
    validate(cfg)
    # the method's part (the device is the target's, unknown)
    why = cls.float8_refusal(cfg, torch.device("cpu")) or cls.moe_refusal(cfg)
    if not why and cfg.lora_rank:
        why = cls.lora_refusal(cfg) or cls.quantize_refusal(cfg)
    if why:
        raise ConfigError(why)  # the method's row says so (n/a), as train would refuse it
    check_data(cfg)  # tokens:PATH that is not there: one line
    if args.strategy == "all":  # the options its row runs with (method_row completes them the same way)
        cfg = cfg.replace(strategy_options=cls.options_for_world(cfg, world))
    cls.parse_options(cfg.strategy_options)  # bad option values: one line, before any work
    # the replicas the batch is split over (a pipeline's: world / (pp x tp)), not every process
    dp = cls.data_parallel_size(cfg, world)
    if not args.max_batch and args.batch_size % (dp * args.grad_accum):
        raise ConfigError(
            f"--batch-size {args.batch_size} is not divisible by the data-parallel replicas x grad accum "
            f"({dp} x {args.grad_accum}); train refuses it too"
        )
    return cfg


def detected_device_memory() -> int | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def run(args: argparse.Namespace) -> int:
    console = table_console(wide=args.wide)  # the terminal's width (piped: COLUMNS or 120); --wide: 220+
    names = methods_to_estimate(args)
    device_memory = est.parse_bytes(args.device_memory) if args.device_memory else detected_device_memory()
    if args.max_batch and device_memory is None:
        raise ConfigError(
            "--max-batch needs --device-memory (e.g. 80GiB): no GPU was detected to read it from"
        )
    check_common(args)
    system, calibration = time_setup(args)
    args.tf32 = check_tf32(args, system)
    if system is not None and (why := float8_refusal(args.float8, system.gpu)):
        raise ConfigError(why)  # as train refuses such a device, before any work
    if system is not None:
        device_memory = est.parse_bytes(args.device_memory)
    settings = RowSettings(
        world_size=args.world_size, device_type=args.device_type, every_method=args.strategy == "all",
        max_batch=args.max_batch, device_memory=device_memory, system=system, calibration=calibration,
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, basis=args.basis or "auto",
    )  # fmt: skip
    results = method_rows(names, lambda name: config_for(args, name), settings)
    why = none_answered(results)
    if why:  # a table of n/a rows would read as an answer
        raise ConfigError(why)
    if args.json:
        out: dict = {"device_memory": device_memory, "results": results}
        if system is not None:
            out["hardware"] = hardware_summary(system, args.nodes, args.gpus_per_node, calibration)
        print(json.dumps(out, indent=2))
        return 0
    title = (
        f"{describe_input(args, results)}, global batch {args.batch_size}, {args.precision}, {args.optimizer}, "
        f"world size {args.world_size}, {args.device_type}"
    )
    if system is not None:
        print_time_table(console, results, system, args, calibration, device_memory, title)
        return 0
    print_memory_table(console, results, args, device_memory, title)
    return 0


def print_memory_table(console, results: list[dict], args: argparse.Namespace, device_memory: int | None,
                       title: str) -> None:  # fmt: skip
    """One method: its components, and whether it fits. Several (or --max-batch): one row per method, the
    columns that fit the console (all with --wide), then what --wide would add."""
    if len(results) == 1 and not args.max_batch and results[0]["estimate"] is not None:
        e = results[0]["estimate"]
        console.print(component_table(e, f"{title}, micro-batch {e['micro_batch']}", args.device_type))
        if device_memory:
            fits = "fits" if e["total_bytes"] <= device_memory else "does NOT fit"
            console.print(f"{fits} in {fmt_bytes(device_memory)} per device")
        print_formula_lines(console, results)
        return

    def build(drop: tuple[str, ...]):
        return memory_table(results, title, device_memory, args.max_batch, args.world_size, args.wide, drop)

    table, dropped = fit_table(console, build, MEMORY_DROP)
    console.print(table)
    if not args.wide:
        more = ", ".join([*dropped, "master weights, buckets, gathered, working peak"])
        console.print(f"--wide also shows: {more}", highlight=False)
    print_formula_lines(console, results)


def formula_lines(results: list[dict]) -> list[str]:
    """One line per micro-batch of the rows: a built-in transformer's activations by the published formula
    against the traced ones (the total uses the trace; docs/memory.md says why)."""
    seen: dict[int, str] = {}
    for res in results:
        e = res.get("estimate") or {}
        f = e.get("activation_formula")
        if not f or e["micro_batch"] in seen:
            continue
        diff = "" if f["difference"] is None else f" ({f['difference']:+.1%})"
        seen[e["micro_batch"]] = (
            f"cross-check, activations saved for backward at micro-batch {e['micro_batch']}: "
            f"{fmt_bytes(f['bytes'])} by the published formula (Korthikanti et al. 2022, adapted: docs/memory.md){diff} against {fmt_bytes(f['traced_bytes'])} traced; "
            "the total uses the trace"
        )
    return list(seen.values())


def units_lines(results: list[dict]) -> list[str]:
    """One line per method whose estimate assumed units gathered one at a time (FSDP: its blocks), naming them."""
    seen: dict[str, None] = {}
    for res in results:
        units = (res.get("estimate") or {}).get("units")
        if units:
            seen.setdefault(f"{res['strategy']}: {units}")
    return list(seen)


def print_formula_lines(console, results: list[dict]) -> None:
    """The lines under a table: the units each sharding row assumed, then the activation formula's cross-check."""
    for line in units_lines(results):
        console.print(line, highlight=False)  # wrapped to the terminal, as the table is
    for line in formula_lines(results):
        console.print(line, highlight=False, soft_wrap=True)


def component_table(e: dict, title: str, device_type: str):
    """One method's memory per device, component by component, then its peaks, overhead and total."""
    table = Table(title=f"memory per device: {e['strategy']} ({title})")
    for col in ("component", "on device", "on host", "note"):
        text_column(table, col, justify="right" if col.startswith("on") else "left")
    for row in e["rows"]:
        host = fmt_bytes(row["host_bytes"]) if row["host_bytes"] else "-"
        table.add_row(row["component"], fmt_bytes(row["device_bytes"]), host, row["note"])
    table.add_section()
    for label, key, note in (
        ("peak, forward/backward", "peak_fwd_bwd", "resident states + gathered + traced working peak"),
        ("peak, optimizer step", "peak_step", "resident states + gradients + step scratch"),
        ("predicted peak allocated", "peak_bytes", "compare with torch.cuda.max_memory_allocated"),
        ("per-process overhead", "overhead_bytes", f"{device_type} context + allocator slack"),
    ):
        table.add_row(label, fmt_bytes(e[key]), "", note)
    host = fmt_bytes(e["host_bytes"]) if e["host_bytes"] else "-"
    table.add_row("[bold]total per device", f"[bold]{fmt_bytes(e['total_bytes'])}", host, "what must fit")
    return table


MEMORY_COMPONENTS = {
    "params": "parameters", "grads": "gradients", "optimizer": "optimizer states", "master": "fp32 master weights",
    "buckets": "gradient buckets", "gathered": "gathered parameters", "fwd/bwd working": "forward/backward working peak",
}  # fmt: skip
"""Memory table column -> the estimate's component row it shows."""
MEMORY_COMPACT = ("params", "grads", "optimizer")
"""The components the compact memory table keeps: what sharding (ZeRO 1-3, FSDP) divides; --wide shows all."""
MEMORY_DROP = ("peak allocated", "grads", "params", "optimizer")
"""The compact memory table's columns a narrow terminal drops, first first (total per device and fits stay)."""
NO_BATCH_FITS = "even one sample per device does not fit"


def memory_table(results: list[dict], title: str, device_memory: int | None, max_batch: bool, world: int,
                 wide: bool, drop: tuple[str, ...] = ()):  # fmt: skip
    """One row per method: memory per device by component (the compact set unless ``wide``), peak, total, and
    whether it fits ``device_memory`` (when known); with ``max_batch``, the largest global batch that fits;
    without the columns in ``drop``. A method's world size is shown where it is not ``world`` (the title's); a
    row without an estimate is the method's name with "n/a (k)" under it, its reason in note k under the table
    (``NaNotes``: rows that share a reason share its note)."""
    fitting = f"largest global batch that fits {fmt_bytes(device_memory)}"
    table = Table(title=f"{fitting if max_batch else 'memory per device'}: {title}")
    cols = [*(["max global batch"] if max_batch else []), *(MEMORY_COMPONENTS if wide else MEMORY_COMPACT),
            "peak allocated", "total per device", *(["fits"] if device_memory and not max_batch else [])]  # fmt: skip
    cols = [col for col in cols if col not in drop]
    name_column(table, "method")
    for col in cols:
        text_column(table, col, justify="right")
    width = note_width([_label(res, world) for res in results])
    notes = NaNotes()
    for res in results:
        e = res["estimate"]
        if e is None:
            why = res.get("na") or res.get("no_model")
            none_fits = max_batch and not why  # --max-batch solved it: the answer is 0
            cells = ["0" if none_fits and col == "max global batch" else "" for col in cols]
            note = NO_BATCH_FITS if none_fits else notes.mark(_label(res, world), why or "no estimate")
            table.add_row(name_cell(_label(res, world), note, width), *cells)
            continue
        byname = {r["component"]: r["device_bytes"] for r in e["rows"]}
        cells = {col: fmt_bytes(byname[component]) for col, component in MEMORY_COMPONENTS.items()}
        cells.update({"max global batch": str(res.get("max_global_batch")), "peak allocated": fmt_bytes(e["peak_bytes"]),
                      "total per device": fmt_bytes(e["total_bytes"]),
                      "fits": "yes" if device_memory and e["total_bytes"] <= device_memory else "NO"})  # fmt: skip
        table.add_row(_label(res, world), *[cells[col] for col in cols])
    notes.attach(table)
    return table


def _label(res: dict, world: int) -> str:
    """A row's method: its name, and its world size where that is not ``world`` (the title's), e.g. "single
    (x1)" in a table for 4 devices."""
    own = (res.get("projection") or {}).get("world") or (res.get("estimate") or {}).get("world_size")
    options = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sorted((res.get("options") or {}).items()))
    parts = [*([f"x{own}"] if own and own != world else []), *([options] if options else [])]
    return f"{res['strategy']} ({'; '.join(parts)})" if parts else res["strategy"]


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


TIME_COLUMNS = ("step", "samples/s", "speed-up", "scaling eff.", "compute", "comm (exposed)", "optimizer", "offload",
                "dominant", "memory/device", "fits")  # fmt: skip
TIME_COMPACT = ("step", "samples/s", "scaling eff.", "dominant", "memory/device", "fits")
"""The columns of the compact --time table; --wide shows TIME_COLUMNS."""
TIME_WIDE_ONLY = ("speed-up", "compute, communication, optimizer and offload time")
TIME_DROP = ("dominant", "scaling eff.", "memory/device")
"""The compact --time table's columns a narrow terminal drops, first first."""


def print_time_table(console, results, system, args, calibration, device_memory, title) -> None:
    """The --time table, then where its compute efficiency and overlap come from and what its columns mean."""
    gpu = system.gpu

    def build(drop: tuple[str, ...]):
        return time_table(results, system, args, device_memory, title, args.wide, drop)

    table, dropped = fit_table(console, build, TIME_DROP)
    console.print(table)
    projections = [p["projection"] for p in results if (p.get("projection") or {}).get("efficiency")]
    effs = sorted({(p["efficiency"], p["efficiency_from"], p["efficiency_source"]) for p in projections})
    for eff, origin, src in effs:
        said = src if src.startswith(origin) else f"{origin}, {src}"  # default / hardware file / calibration
        if origin == "default":  # evidence from other runs, not this model's: say so
            said = f"UNCALIBRATED, {said}; --calibrate result.json from one real run replaces it"
        console.print(f"compute efficiency {eff:.1%} of {gpu.name}'s dense peak: {said}", markup=False)
    print_roofline_lines(console, projections)
    print_band_lines(console, projections)
    for recipe, share, peak, eff, src in sorted({tuple(p["float8"].values()) for p in projections if p.get("float8")}):
        console.print(
            f"float8 ({recipe}): the converted Linears' {share:.1%} of the FLOPs priced at {gpu.name}'s fp8 peak "
            f"{peak / 1e12:,.0f} TFLOP/s x {eff:.1%} ({src}); the rest at the efficiency above",
            markup=False,  # a source's "[note]" is text, not rich markup
        )
    console.print(
        f"overlap of forward/backward communication with compute: {system.overlap:.0%} ({system.overlap_source}); "
        "scaling eff. = throughput / (devices x one device at the same per-device batch); "
        "speed-up = vs single at the same global batch"
        + ("" if args.wide else f"; --wide also shows: {', '.join([*dropped, *TIME_WIDE_ONLY])}")
    )
    for note in sorted({(r.get("projection") or {}).get("placement_note") or "" for r in results} - {""}):
        console.print(note)  # tensor parallelism across nodes: priced so, but said
    print_formula_lines(console, results)


def print_band_lines(console, projections: list[dict]) -> None:
    """How sure each basis is: its held-out error band on published figures (``projection.error_band``), or that
    no published check covers it."""
    for basis in sorted({p["basis"] for p in projections if p.get("basis")}):
        band = next(p["error_band"] for p in projections if p.get("basis") == basis)
        if not band:
            console.print(f"basis: {basis}; no held-out error band (no published figure checks this basis on "
                          "this device)")  # fmt: skip
            continue
        console.print(f"basis: {basis}; held-out error band: median {band['median']:.1%}, 80th percentile "
                      f"{band['p80']:.1%}, worst {band['worst']:+.1%} over {band['rows']} {band['over']} "
                      f"({band['source']})", markup=False)  # fmt: skip


def print_roofline_lines(console, projections: list[dict]) -> None:
    """Where the roofline basis priced the compute: one line per micro-batch size of its op classes' seconds (most
    first), ops and how many of them were bandwidth-bound, naming the methods that run that micro-batch."""
    by_micro: dict[int, tuple[dict, list[str]]] = {}
    for p in projections:
        if p.get("roofline"):
            by_micro.setdefault(p["roofline"]["micro_batch"], (p["roofline"], []))[1].append(p["method"])
    for micro, (roof, methods) in sorted(by_micro.items()):
        parts = [f"{c} {r['seconds'] * 1e3:.2f} ms ({r['ops']} ops, {r['bandwidth_bound']} bandwidth-bound)"
                 for c, r in sorted(roof["by_class"].items(), key=lambda kv: -kv[1]["seconds"])]  # fmt: skip
        console.print(f"roofline of one micro-batch of {micro} ({', '.join(methods)}), {roof['seconds'] * 1e3:.2f} "
                      "ms: " + "; ".join(parts), markup=False)  # fmt: skip


def time_table(results: list[dict], system, args: argparse.Namespace, device_memory: int | None, title: str,
               wide: bool, drop: tuple[str, ...] = ()):  # fmt: skip
    """One row per method: projected step time (and with ``wide`` its parts), throughput, scaling, memory per
    device and whether it fits, without the columns in ``drop``. A method without a projection is its name with
    "n/a (k)" under it, its reason in note k under the table."""
    inter = system.inter_node.key if system.inter_node else "-"
    table = Table(title=f"projected on {args.nodes} x {args.gpus_per_node} {system.gpu.name} ({system.key}; "
                        f"intra {system.intra_node.key}, inter {inter}): {title}")  # fmt: skip
    cols = [col for col in (TIME_COLUMNS if wide else TIME_COMPACT) if col not in drop]
    name_column(table, "method")
    for col in cols:
        text_column(table, col, justify="left" if col == "dominant" else "right")
    world = args.world_size
    width = note_width([_label(res, world) for res in results])
    notes = NaNotes()
    for res in results:
        p, e = res.get("projection") or {}, res.get("estimate")
        mem = e["total_bytes"] if e else None
        fits = "-" if mem is None or not device_memory else ("yes" if mem <= device_memory else "NO")
        memory = fmt_bytes(mem) if mem is not None else "no memory model"
        if p.get("status") != "ok":
            why = p.get("reason") or res.get("na") or p.get("status") or "no projection"
            kept = {"memory/device": memory, "fits": fits}  # the memory is known without a projection
            cell = name_cell(_label(res, world), notes.mark(_label(res, world), why), width)
            table.add_row(cell, *[kept.get(col, "") for col in cols])
            continue
        cells = {
            "step": fmt_seconds(p["step_s"]), "samples/s": f"{p['throughput']:,.0f}" + (
                f" ({p['tokens_per_s']:,.0f} tokens/s)" if p.get("tokens_per_s") else ""),
            "speed-up": f"{p['speedup_vs_single']:.2f}x" if p.get("speedup_vs_single") else "-",
            "scaling eff.": f"{p['scaling_efficiency']:.0%}" if p["scaling_efficiency"] is not None else "-",
            "compute": fmt_seconds(p["compute_s"]),
            "comm (exposed)": f"{fmt_seconds(p['comm_s'])} ({fmt_seconds(p['comm_exposed_s'])})",
            "optimizer": fmt_seconds(p["optimizer_s"]), "offload": fmt_seconds(p["offload_s"]) if p["offload_s"] else "-",
            "dominant": p["dominant"], "memory/device": memory, "fits": fits,
        }  # fmt: skip
        table.add_row(_label(res, world), *[cells[col] for col in cols])
    notes.attach(table)
    return table
