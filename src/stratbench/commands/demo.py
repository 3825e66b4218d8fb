"""stratbench demo: the main job on this machine - `compare --preset quick` (what `make demo` runs)."""

from __future__ import annotations

import argparse

from stratbench.cli import main

NAME = "demo"
HELP = "the quick offline comparison on this machine: every CPU-capable method on tinynet/digits, one report"
ORDER = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", default="runs/demo", help="sweep folder (default: runs/demo); rerunning resumes"
    )


def run(args: argparse.Namespace) -> int:

    return main(["compare", "--preset", "quick", "--output", args.output])
