"""stratbench demo: the main job on the embedded default setup (what `make demo` runs)."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "the quick offline demo on this machine (tinynet on scikit-learn digits)"
ORDER = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo", help="output folder (default: runs/demo)")


def run(args: argparse.Namespace) -> int:
    from stratbench.cli import main

    return main(["train", "--model", "tinynet", "--data", "digits", "--epochs", "3", "--output", args.output])
