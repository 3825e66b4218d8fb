"""stratbench advise: which method and precision to use for a model on the devices at hand, and why."""

from __future__ import annotations

import argparse
import json
import textwrap

import torch

from stratbench.commands.estimate import (
    add_model_arguments,
    add_tf32_argument,
    check_model_arguments,
    check_tf32,
    describe_input,
    model_fields,
)
from stratbench.core.config import CHOICES, TrainConfig, canonical_precision, validate
from stratbench.core.errors import ConfigError
from stratbench.core.precision import SPECS, spec_of
from stratbench.core.tables import fmt_bytes, table_console
from stratbench.data.datasets import check_data
from stratbench.measuring.hardware import System, resolve
from stratbench.predicting.advise import Advice, advise, default_precision
from stratbench.predicting.estimate import parse_bytes
from stratbench.predicting.projection import BASES, load_calibration

NAME = "advise"
HELP = (
    "recommend a training method and precision for a model and devices (do you really need FSDP/DeepSpeed?)"
)
ORDER = 41


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch per optimizer step")
    parser.add_argument("--optimizer", default="adamw", choices=CHOICES["optimizer"])
    parser.add_argument(
        "--precision",
        help=f"force a precision: {', '.join(SPECS)} (default: bf16-mixed where supported, else fp16-mixed)",
    )
    parser.add_argument("--devices", type=int, help="number of GPUs (default: detected)")
    parser.add_argument("--device-memory", help="memory of one device, e.g. 24GiB (default: detected)")
    parser.add_argument(
        "--goal", default="speed", choices=("fit", "speed"), help="fastest method that fits, or just fit"
    )
    parser.add_argument(
        "--hardware",
        help="with --goal speed: rank the plans that fit by projected step time on this system (h100-sxm, "
        "a100-sxm, ..., or a profile file); without it, the simplest plan that fits",
    )
    parser.add_argument(
        "--calibrate", action="append", default=[], metavar="RESULT_JSON",
        help="measured single-device run(s) for the projection's compute efficiency (and one-device runs of "
        "other methods for their own overhead)",
    )  # fmt: skip
    parser.add_argument(
        "--basis", default="auto", choices=BASES,
        help="with --hardware: the projected compute's basis, as estimate --time --basis (default auto: "
        "--calibrate's efficiency where given, else the per-op roofline where the GPU has fractions)",
    )  # fmt: skip
    add_tf32_argument(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    system, calibration = hardware_setup(args)
    tf32 = check_tf32(args, system)
    devices, memory = devices_and_memory(args, system)
    precision = canonical_precision(args.precision) or default_precision("cuda", _bf16_supported())
    spec_of(precision)
    check_model_arguments(args)
    base = TrainConfig(
        **model_fields(args), batch_size=args.batch_size, precision=precision, tf32=tf32, optimizer=args.optimizer,
    )  # fmt: skip
    validate(base)
    check_data(base)
    result = advise(base, devices, memory, args.goal, "cuda", system=system, calibration=calibration,
                    basis=args.basis)  # fmt: skip
    if args.json:
        print_json(result, precision)
    else:
        print_advice(args, result, precision, devices, memory)
    return 0 if result.plan else 1


def hardware_setup(args: argparse.Namespace) -> tuple[System | None, dict | None]:
    """(system, calibration) with --hardware (--calibrate needs it), else (None, None)."""
    if not args.hardware:
        if args.calibrate:
            raise ConfigError("--calibrate needs --hardware (the system whose step time it calibrates)")
        return None, None
    system = resolve(args.hardware)
    return system, load_calibration(args.calibrate, system) if args.calibrate else None


def devices_and_memory(args: argparse.Namespace, system: System | None) -> tuple[int, int]:
    """The devices to plan for and the memory of one: given, else the detected GPUs', else (memory only) the
    hardware system's GPU's."""
    has_gpu = torch.cuda.is_available()
    devices = args.devices if args.devices is not None else (torch.cuda.device_count() if has_gpu else None)
    if devices is not None:  # checked before memory: a refused batch is named even where no GPU is detected
        check_devices_and_batch(devices, args.batch_size)
    memory = parse_bytes(args.device_memory) if args.device_memory else (
        torch.cuda.get_device_properties(0).total_memory if has_gpu
        else int(system.gpu.memory_bytes) if system is not None else None
    )  # fmt: skip
    if devices is None or memory is None:
        uneven = devices is not None and args.batch_size % devices
        raise ConfigError(
            (f"--batch-size {args.batch_size} is not divisible by --devices {devices} (the data-parallel plans "
             "split it evenly), and " if uneven else "")
            + "no GPU detected: give the devices to plan for, e.g. --devices 4 --device-memory 24GiB"
        )  # fmt: skip
    if memory <= 0:
        raise ConfigError(f"--device-memory must be positive, got {args.device_memory!r}")
    return devices, memory


def _bf16_supported() -> bool:
    """The detected GPU has bf16 (no GPU: the plan is for one that has)."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def print_json(result: Advice, precision: str) -> None:
    plan = result.plan
    print(json.dumps({
        "method": plan.strategy if plan else None,
        "options": dict(plan.options) if plan else None,
        "activation_checkpointing": plan.activation_checkpointing if plan else None,
        "precision": precision,
        "estimated_bytes_per_device": result.estimate.total_bytes if result.estimate else None,
        "ranking": result.ranking,
        "fine_tuning": result.fine_tuning or None,
        "overrides": result.overrides,
        "micro_batch": result.estimate.micro_batch if result.estimate else None,
        "reasons": result.reasons,
        "train_command": result.train_command,
        "compare_command": result.compare_command,
    }, indent=2))  # fmt: skip


def print_advice(args: argparse.Namespace, result: Advice, precision: str, devices: int, memory: int) -> None:
    console = table_console()  # the terminal's width; piped: COLUMNS or 120
    console.print(f"[bold]{describe_input(args)}[/], global batch {args.batch_size}, {args.optimizer}, "
                  f"{devices} x {fmt_bytes(memory)}, goal: {args.goal}")  # fmt: skip
    bullets(console, result.reasons)
    if result.plan is None:
        console.print("[red]no method fits[/]")
        return
    what = f"{result.fine_tuning}, {result.plan.label}, micro-batch {result.estimate.micro_batch}" if result.fine_tuning else result.plan.label
    console.print(
        f"[bold green]recommended:[/] {what}, precision {precision} "
        f"({'bf16 needs no loss scaling' if precision.startswith('bf16') else 'fp16 with dynamic loss scaling'}), "
        f"estimated {fmt_bytes(result.estimate.total_bytes)} per device"
    )
    # one line each, however long (the terminal wraps them): a command to copy must not be cut by a newline
    console.print(f"next:  {result.train_command}", soft_wrap=True, highlight=False)
    console.print(f"then:  {result.compare_command}", soft_wrap=True, highlight=False)


def bullets(console, lines: list[str]) -> None:
    """A bulleted list whose long items wrap under their own text (a hanging indent), not under the bullet."""
    for line in lines:
        text = textwrap.fill(
            line,
            max(20, console.width),
            initial_indent="  - ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )  # flags and names whole
        console.print(text, soft_wrap=True, markup=False)


def check_devices_and_batch(devices: int, batch_size: int) -> None:
    """A device count stratbench plans for and a positive global batch (whether a plan's data-parallel ranks
    split it evenly is asked per plan: ``predicting.advise.applicable``)."""
    if not 1 <= devices <= 4096:
        raise ConfigError(f"--devices must be between 1 and 4096, got {devices}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
