"""stratbench list: every registered strategy and precision, with what each needs."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from rich.table import Table

from stratbench.core.config import TrainConfig
from stratbench.core.dist import resolve_device
from stratbench.core.precision import SPECS, slow_on, supported_on
from stratbench.core.tables import name_column, table_console, text_column
from stratbench.strategies.base import all_strategies

NAME = "list"
HELP = "list the training methods (strategies) and precisions, with what each needs"
ORDER = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="also say whether each can run on this machine")
    parser.add_argument(
        "--wide", action="store_true", help="every column (needs, launcher, options), wider than the terminal"
    )


def run(args: argparse.Namespace) -> int:
    device = resolve_device("auto")
    console = table_console(wide=args.wide)
    here = f"here ({device.type}, {torch.cuda.device_count()} GPU)" if args.check else None
    console.print(strategy_table(device, here, args.wide))
    console.print(precision_table(device, f"here ({device.type})" if args.check else None, args.wide))
    if not args.wide:
        console.print("--wide also shows: what each needs, its launcher and its options", highlight=False)
    return 0


def short(description: str) -> str:
    """A description without its tail after "; " (option hints such as "--schedule gpipe|1f1b|..."): the
    compact table's "what it is"."""
    return description.split("; ")[0]


def strategy_table(device, here: str | None, wide: bool):
    """One row per registered strategy: name, what it is (short unless ``wide``), with ``wide`` what it needs,
    its launcher and options, and with ``here`` (a header) whether it can run on ``device``."""
    table = Table(title="strategies (--strategy)")
    name_column(table, "name")
    for col in ("what it is", "needs", "launcher", "options") if wide else ("what it is",):
        text_column(table, col)
    if here:
        text_column(table, here)
    for name, cls in sorted(all_strategies().items()):
        row = [name, cls.description if wide else short(cls.description)]
        if wide:
            opts = ", ".join("--" + f.name.replace("_", "-") for f in dataclasses.fields(cls.Options)) or "-"
            row += [cls.requirements, cls.launcher, opts]
        if here:
            world = 2 if cls.needs_process_group else 1
            cfg = TrainConfig(strategy=name, nproc=world, **cls.check_settings)
            reason = cls.refusal(cfg, device, world)
            on = f" (on {cfg.model})" if cls.check_settings else ""
            row.append(f"yes{on}" if reason is None else f"no{on}: {reason}")
        table.add_row(*row)
    return table


def precision_table(device, here: str | None, wide: bool):
    """One row per precision: name, what it is (short unless ``wide``), weight and compute dtypes, and with
    ``here`` (a header) whether ``device`` supports it (or runs it slowly)."""
    table = Table(title="precisions (--precision)")
    name_column(table, "name")
    for col in ("what it is", "weights", "compute"):
        text_column(table, col)
    if here:
        text_column(table, here)
    for name, spec in SPECS.items():
        row = [
            name,
            spec.description if wide else short(spec.description),
            str(spec.param_dtype).replace("torch.", ""),
            str(spec.compute_dtype).replace("torch.", ""),
        ]
        if here:
            reason = supported_on(spec, device) or slow_on(spec, device)
            row.append("yes" if reason is None else reason)
        table.add_row(*row)
    return table
