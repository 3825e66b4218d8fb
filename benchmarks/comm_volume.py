"""Communication volume per optimizer step, measured against each method's formula, for every 2-process method
that runs on this machine. Writes benchmarks/comm_volume_<device>_<date>.md.

    python benchmarks/comm_volume.py [--width 8] [--precision fp32] [--out DIR]

Each method trains the test problem (tinynet, digits, global batch 32) for 4 steps with --comm-volume; the
collectives of step 3 are recorded (torch.profiler) and compared per kind with the method's CostModel.comm_model.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = [
    ("ddp", []),
    ("ddp-zero", []),
    ("fsdp full", ["--strategy", "fsdp", "--sharding", "full"]),
    ("fsdp grad-op", ["--strategy", "fsdp", "--sharding", "grad-op"]),
    ("fsdp none", ["--strategy", "fsdp", "--sharding", "none"]),
    ("fsdp1 FULL_SHARD", ["--strategy", "fsdp1"]),
    ("fsdp1 SHARD_GRAD_OP", ["--strategy", "fsdp1", "--sharding-strategy", "SHARD_GRAD_OP"]),
    ("deepspeed ZeRO-0", ["--strategy", "deepspeed", "--zero-stage", "0"]),
    ("deepspeed ZeRO-1", ["--strategy", "deepspeed", "--zero-stage", "1"]),
    ("deepspeed ZeRO-2", ["--strategy", "deepspeed", "--zero-stage", "2"]),
    ("deepspeed ZeRO-3", ["--strategy", "deepspeed", "--zero-stage", "3"]),
    ("accelerate-ddp", ["--strategy", "accelerate-ddp"]),
]


def run(label: str, args: list[str], width: int, precision: str, root: Path, model: str = "tinynet") -> dict:
    out = root / label.replace(" ", "_")
    if not any(a == "--strategy" for a in args):
        args = ["--strategy", label, *args]
    cmd = [sys.executable, "-m", "stratbench", "train", "--output", str(out), "--nproc", "2", *args,
           *(["--model", "tinynet", "--width", str(width), "--norm", "none"] if model == "tinynet" else ["--model", model, "--image-size", "16"]), "--data", "digits", "--batch-size", "32",
           "--max-steps", "4", "--timing-warmup-steps", "3", "--progress", "false", "--measure-flops", "false",
           "--precision", precision, "--comm-volume", "true"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    path = out / "result.json"
    if not path.exists():
        return {"status": "failed", "reason": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument(
        "--model", default="tinynet", help="tinynet (no norm) or e.g. resnet18 (BatchNorm buffers; at 16 px)"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    a = ap.parse_args()
    lines = [
        f"# Communication per optimizer step, measured vs formula ({a.precision}, "
        f"{a.model if a.model != 'tinynet' else f'tinynet width {a.width}'})",
        "",
        f"Command: `python benchmarks/comm_volume.py --width {a.width} --precision {a.precision} --model {a.model}` "
        f"({dt.date.today()}). 2 processes, gloo, loopback; the collectives of step 3 recorded by torch.profiler "
        "(stratbench.measuring.commvol); formula: each method's `comm_model` (docs/communication.md). Payload is the "
        "full-size tensor of each call; wire = bytes each rank sends under the ring model.",
        "",
        "| method | kind | calls | measured payload | formula payload | error | wire / rank |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    env = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, args in METHODS:
            res = run(label, args, a.width, a.precision, Path(tmp), a.model)
            env = env or res.get("environment")
            comm = (res.get("metrics") or {}).get("comm") or {}
            if res.get("status") != "ok" or "check" not in comm:
                lines.append(f"| {label} | {res.get('status')}: {res.get('reason')} | | | | | |")
                continue
            for kind, c in comm["check"].items():
                meas = comm["measured"].get(kind, {})
                err = c["error_pct"]
                lines.append(
                    f"| {label} | {kind} | {meas.get('calls', 0):.0f} | {c['measured_payload_bytes']:,.0f} B | "
                    f"{c['predicted_payload_bytes']:,} B | {'n/a' if err is None else f'{err:+.3f}%'} | "
                    f"{meas.get('wire_bytes', 0):,.0f} B |"
                )
            print(label, "ok", flush=True)
    if env:
        lines += ["", f"Machine: {env.get('cpu') or env.get('device_name')}; torch {env.get('torch')}; "
                  f"packages {env.get('packages')}."]  # fmt: skip
    what = f"w{a.width}" if a.model == "tinynet" else a.model
    name = f"comm_volume_cpu_{a.precision}_{what}_{dt.date.today()}.md"
    (a.out / name).write_text("\n".join(lines) + "\n")
    print(a.out / name)


if __name__ == "__main__":
    main()
