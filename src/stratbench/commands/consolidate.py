"""stratbench consolidate: any checkpoint (a sharded folder from fsdp, ddp-zero, deepspeed, ...) -> one file."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratbench.checkpoints.checkpoint import add_trust_argument, consolidate, trusted
from stratbench.core.tables import fmt_bytes

NAME = "consolidate"
HELP = "turn a sharded checkpoint folder into one full checkpoint file that every method (and single) loads"
ORDER = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    parser.add_argument("checkpoint", help="checkpoint file or sharded folder (e.g. runs/x/checkpoints/last)")
    parser.add_argument(
        "output", help="file to write (atomically); an existing folder receives OUTPUT/model.pt"
    )
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it is an existing file")


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        out = consolidate(Path(args.checkpoint), Path(args.output), force=args.force)
    print(f"wrote {out} ({fmt_bytes(out.stat().st_size)})")
    return 0
