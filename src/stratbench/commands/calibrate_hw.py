"""stratbench calibrate-hw: measure the roofline's achievable fractions per op class on this device (large and small
matrix products, convolutions, depthwise convolutions, attention, elementwise, reductions and norms, gathers) and
write them into a hardware profile, where `estimate --time --basis roofline --hardware FILE` prices each op with
them ("roofline with measured fractions"). What is measured and how: stratbench.predicting.calibrate_hw.
"""

from __future__ import annotations

import argparse
import json
import shlex
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.table import Table

from stratbench.core.errors import ConfigError
from stratbench.core.tables import table_console
from stratbench.measuring.hardware import System, builtin, resolve
from stratbench.predicting.calibrate_hw import (
    CASES,
    SCALES,
    Calibration,
    describe_rate,
    measure,
    profile_text,
    section,
    system_for,
    system_mapping,
    unmeasured_note,
    write_profile,
)

NAME = "calibrate-hw"
HELP = "measure the roofline's achievable fractions per op class on this device; write them into a hardware profile"
ORDER = 43


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hardware", default=None,
        help="the profile whose peak and memory bandwidth the fractions are of: a YAML file (on a CPU, one "
        "`stratbench probe` wrote; required there), FILE:SYSTEM or a built-in system (default on a GPU: the "
        "built-in system of the GPU found)",
    )  # fmt: skip
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--sizes", default="auto", choices=("auto", *SCALES),
        help="case sizes: tiny (seconds), cpu (under a minute on 2 cores), gpu; auto: gpu on CUDA, else cpu",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per case (the median is kept)")
    parser.add_argument(
        "--output", default=None,
        help="profile to write (YAML; default: the --hardware file, else calibrate-hw.yaml)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the written entry as JSON")


def run(args: argparse.Namespace) -> int:
    device, scale, system, base, out = check_args(args)
    cal = measure(system.gpu, device, scale, args.repeats)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    flags = [("--hardware", args.hardware), ("--device", device.type), ("--sizes", scale),
             ("--repeats", str(args.repeats)), ("--output", str(out))]  # fmt: skip
    command = shlex.join(["stratbench", "calibrate-hw", *(x for f in flags if f[1] for x in f)])
    source = (f"measured by `{command}` on {cal.device} (torch {torch.__version__}) at {when}; "
              f"{unmeasured_note(system.gpu, cal.skipped)}")  # fmt: skip
    entry = section(cal, system.gpu, source)
    header = f"# measured_roofline.{system.gpu.key}: written by `{command}` at {when}\n"
    own = {} if base or system.key in builtin().systems else {system.key: system_mapping(system)}
    if own:
        header += f"# systems.{system.key}: {system.source}\n"
    write_profile(out, profile_text(base, system.key, system.gpu.key, entry, header, own))
    if args.json:
        print(json.dumps({"profile": str(out), "gpu": system.gpu.key, "measured_roofline": entry}, indent=2))
        return 0
    print_report(cal, system, entry, out)
    return 0


def check_args(args: argparse.Namespace) -> tuple[torch.device, str, System, Path | None, Path]:
    """(device, sizes, the profile's system, its file or None, the file to write), every value checked before
    anything is measured."""
    if args.repeats < 3:
        raise ConfigError(f"--repeats must be at least 3, got {args.repeats}")
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here; use --device cpu")
    scale = args.sizes if args.sizes != "auto" else ("gpu" if kind == "cuda" else "cpu")
    if scale == "gpu" and kind == "cpu":
        raise ConfigError("--sizes gpu on a CPU would take far too long; choose one of: tiny, cpu")
    system, base = profile_of(args.hardware, kind)
    out = Path(args.output) if args.output else (base or Path("calibrate-hw.yaml"))
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--output {out}: write the profile as .yaml")
    return torch.device(kind), scale, system, base, out


def profile_of(spec: str | None, kind: str) -> tuple[System, Path | None]:
    """The system whose GPU is measured and the hardware file it comes from (None: a built-in one); one line where
    the profile's device is not this one."""
    if spec is None:
        if kind == "cpu":
            raise ConfigError("calibrate-hw on a CPU needs --hardware FILE: a profile `stratbench probe` wrote "
                              "(its peak and memory bandwidth are what the fractions are of)")  # fmt: skip
        name = torch.cuda.get_device_name(0)
        gpu = builtin().gpu_for_device(name)
        if gpu is None:
            raise ConfigError(
                f"GPU {name!r} is not in the hardware profiles; give --hardware FILE with its gpu"
            )
        return system_for(gpu, builtin()), None
    system = resolve(spec)
    path = spec if Path(spec).is_file() else spec.rpartition(":")[0]
    base = Path(path) if Path(path).is_file() else None
    if system.gpu.kind != kind:
        raise ConfigError(f"--hardware {spec}: its device {system.gpu.name} is a {system.gpu.kind} one, this run's "
                          f"is {kind}; choose --device {system.gpu.kind} or another profile")  # fmt: skip
    if kind == "cuda" and not system.gpu.matches(torch.cuda.get_device_name(0)):
        raise ConfigError(f"--hardware {spec}: its GPU {system.gpu.name} is not this one "
                          f"({torch.cuda.get_device_name(0)})")  # fmt: skip
    return system, base


def print_report(cal: Calibration, system: System, entry: dict, out: Path) -> None:
    console = table_console()
    first = cal.precisions[0]
    table = Table(title=f"calibrate-hw on {cal.device}: achieved fractions of {describe_rate(system.gpu, first)} "
                        f"(median per call; launch {cal.launch * 1e6:.2f} us)")  # fmt: skip
    for col in ("case", "precision", "shape", "ms per call", "classes", "compute", "bandwidth"):
        table.add_column(col, justify="left" if col in ("case", "classes") else "right")
    for c in entry["cases"]:
        classes = ", ".join(sorted({f"{cls}.{t}" for cls, t in CASES[c["case"]]}))
        table.add_row(c["case"], c["precision"], "x".join(map(str, c["shape"])), f"{c['seconds'] * 1e3:.3f}",
                      classes, f"{c['compute']:.3f}", f"{c['bandwidth']:.3f}")  # fmt: skip
    console.print(table)
    console.print("fractions written (" + first + "): " + "; ".join(
        f"{cls} {v['compute']:.3g}/{v['bandwidth']:.3g}" for cls, v in entry["fractions"].items()), markup=False)  # fmt: skip
    console.print(f"profile written: {out}  (use: stratbench estimate --time --basis roofline --hardware {out})",
                  markup=False)  # fmt: skip
