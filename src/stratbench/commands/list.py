"""stratbench list: every registered strategy and precision, with what each needs."""

from __future__ import annotations

import argparse
import dataclasses

NAME = "list"
HELP = "list the training methods (strategies) and precisions, with what each needs"
ORDER = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="also say whether each can run on this machine")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from stratbench.config import TrainConfig
    from stratbench.dist import resolve_device
    from stratbench.precision import SPECS, slow_on, supported_on
    from stratbench.strategies.base import all_strategies

    device = resolve_device("auto")
    import sys

    console = Console(width=None if sys.stdout.isatty() else 220)  # piped: don't squeeze into 80 columns
    table = Table(title="strategies (--strategy)")
    table.add_column("name", no_wrap=True)
    for col in ("what it is", "needs", "launcher", "options"):
        table.add_column(col)
    if args.check:
        table.add_column(f"here ({device.type}, {torch.cuda.device_count()} GPU)")
    for name, cls in sorted(all_strategies().items()):
        opts = ", ".join("--" + f.name.replace("_", "-") for f in dataclasses.fields(cls.Options)) or "-"
        row = [name, cls.description, cls.requirements, cls.launcher, opts]
        if args.check:
            world = 2 if cls.needs_process_group else 1
            reason = cls.check_supported(TrainConfig(strategy=name, nproc=world), device, world)
            row.append("yes" if reason is None else f"no: {reason}")
        table.add_row(*row)
    console.print(table)
    ptable = Table(title="precisions (--precision)")
    ptable.add_column("name", no_wrap=True)
    for col in ("what it is", "weights", "compute"):
        ptable.add_column(col)
    if args.check:
        ptable.add_column(f"here ({device.type})")
    for name, spec in SPECS.items():
        row = [
            name,
            spec.description,
            str(spec.param_dtype).replace("torch.", ""),
            str(spec.compute_dtype).replace("torch.", ""),
        ]
        if args.check:
            reason = supported_on(spec, device) or slow_on(spec, device)
            row.append("yes" if reason is None else reason)
        ptable.add_row(*row)
    console.print(ptable)
    return 0
