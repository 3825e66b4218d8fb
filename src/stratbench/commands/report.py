"""stratbench report: re-render a finished or partial sweep, or merge several sweeps (e.g. two machines) into one."""

from __future__ import annotations

import argparse
from pathlib import Path

from stratbench.compare.calibration import check_results_file
from stratbench.compare.report import load_sweeps, print_table, render_loaded
from stratbench.core.errors import ConfigError
from stratbench.core.lock import check_output_folder
from stratbench.measuring.hardware import resolve

NAME = "report"
HELP = "re-render the report of a compare sweep folder, or merge several sweep folders into one report"
ORDER = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dirs", nargs="+", metavar="DIR", help="sweep folder(s) written by stratbench compare"
    )
    parser.add_argument(
        "--output", help="report folder (default: the sweep folder itself; required with several)"
    )
    parser.add_argument("--title", help="report title (default: from the sweeps' names)")
    parser.add_argument("--hardware", metavar="SYSTEM|FILE",
                        help="profile for the predicted-step column (a built-in system or a `stratbench probe` "
                             "file; default: the built-in one of the device each cell ran on)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.dirs]
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"sweep folder not found: {d}")
    if len(dirs) > 1 and not args.output:
        raise ConfigError(
            "merging several sweeps needs --output DIR (the folders' own reports are left as they are)"
        )
    for d in dirs:
        check_results_file(d)
    if args.hardware:
        resolve(args.hardware)
    sweeps = load_sweeps(dirs)  # a bad sweep.json, or two folders holding the same cells: one line, nothing written
    out = Path(args.output) if args.output else dirs[0]
    check_output_folder(
        out, "--output" if args.output else "report folder (the sweep folder; --output names another)"
    )
    paths, records = render_loaded(sweeps, out, args.title, args.hardware)
    print_table(records)
    print(f"report: {paths['md']}, {paths['html']}, {paths['csv']}")
    return 0
