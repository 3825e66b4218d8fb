"""The scaling picture no one here can afford to measure: projected throughput vs number of GPUs (1..1024) per
method for one model on one hardware profile, with the points where a method does not fit in the device's memory
drawn hollow on a dashed line (memory from `stratbench estimate`, time from `stratbench.predicting.projection`). Weak
scaling: the per-device batch is fixed, the global batch grows with the GPUs; 8 GPUs per node, then nodes.

    PYTHONPATH=src python benchmarks/projection_chart.py --hardware h100-sxm --model tinynet --width 4096 \
        --image-size 32 --per-device-batch 8 --precision bf16-mixed --optimizer adamw \
        --out benchmarks/projection_scaling_h100-sxm_2026-11-22

writes OUT.png (the chart) and OUT.md (the numbers, with the command).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

METHODS = [
    ("ddp", {}),
    ("ddp-zero", {}),
    ("fsdp grad-op", {"sharding": "grad-op"}),
    ("fsdp full", {"sharding": "full"}),
    ("deepspeed z1", {"zero_stage": 1}),
    ("deepspeed z2", {"zero_stage": 2}),
    ("deepspeed z3", {"zero_stage": 3}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model", default="tinynet")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--per-device-batch", type=int, default=8)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--max-gpus", type=int, default=1024)
    ap.add_argument("--calibrate", action="append", default=[])
    ap.add_argument("--out", default="projection_scaling")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stratbench.core.config import TrainConfig
    from stratbench.measuring.hardware import resolve
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.predicting.projection import load_calibration, project

    system = resolve(args.hardware)
    calibration = load_calibration(args.calibrate, system) if args.calibrate else None
    gpus = [2**k for k in range(0, 11) if 2**k <= args.max_gpus]
    base = TrainConfig(
        model=args.model, width=args.width, image_size=args.image_size, num_classes=args.num_classes,
        data="synthetic", precision=args.precision, optimizer=args.optimizer, batch_size=args.per_device_batch,
    )  # fmt: skip
    params = model_info(ModelSpec.from_config(base)).total
    t0 = time.time()
    rows: dict[str, list] = {}
    single = project(base.replace(strategy="single"), system, 1, 1, calibration)
    for label, options in METHODS:
        strategy = label.split()[0]
        rows[label] = []
        for n in gpus[1:]:
            gpn = min(n, system.gpus_per_node)
            cfg = base.replace(strategy=strategy, strategy_options=options, batch_size=args.per_device_batch * n,
                               nnodes=n // gpn)  # fmt: skip
            p = project(cfg, system, n // gpn, gpn, calibration)
            rows[label].append((n, p))
        print(f"{label}: done ({time.time() - t0:.0f} s)", file=sys.stderr)

    fig, ax = plt.subplots(figsize=(9, 6))
    ideal = [single.throughput * n for n in gpus]
    ax.plot(gpus, ideal, color="0.8", lw=1, label="linear (1 GPU x N)")
    ax.plot([1], [single.throughput], "ko", fillstyle="full" if single.fits else "none",
            label=f"single ({'fits' if single.fits else 'does not fit'})")  # fmt: skip
    for label, pts in rows.items():
        xs = [n for n, p in pts if p.status == "ok"]
        ys = [p.throughput for n, p in pts if p.status == "ok"]
        fit = [p.fits for n, p in pts if p.status == "ok"]
        (line,) = ax.plot(xs, ys, ls=":", lw=1)
        c = line.get_color()
        ax.plot([x for x, f in zip(xs, fit, strict=True) if f], [y for y, f in zip(ys, fit, strict=True) if f],
                "-o", color=c, label=label, ms=4)  # fmt: skip
        ax.plot([x for x, f in zip(xs, fit, strict=True) if not f], [y for y, f in zip(ys, fit, strict=True) if not f],
                "o", color=c, fillstyle="none", ms=6)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"GPUs ({system.gpus_per_node} per node, {system.intra_node.key} inside, "
                  f"{system.inter_node.key if system.inter_node else '-'} between nodes)")  # fmt: skip
    ax.set_ylabel("projected samples/s")
    ax.set_title(
        f"{args.model} (width {args.width}, {params / 1e9:.2f}B params) {args.image_size}px, {args.precision}, "
        f"{args.optimizer}, {args.per_device_batch}/GPU on {system.gpu.name}\n"
        "hollow markers on dotted lines: does not fit in the GPU's memory (stratbench estimate)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out)
    fig.savefig(out.with_suffix(".png"), dpi=110)

    cmd = "PYTHONPATH=src python benchmarks/projection_chart.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Projected scaling: {args.model} width {args.width} ({params / 1e9:.2f}B parameters) on {system.key}",
        "",
        f"Command: `{cmd}` (a projection, nothing measured; efficiency: {single.efficiency_source}, "
        f"{single.efficiency:.0%} of the dense {args.precision} peak; overlap {system.overlap:.0%}, {system.overlap_source}).",
        "",
        "Samples/s per method and GPU count; `*` = does not fit in "
        f"{system.gpu.memory_bytes / 1e9:.0f} GB (estimated memory per device in GiB in brackets); "
        "the dominant term of the step after the slash.",
        "",
        "| GPUs | " + " | ".join(rows) + " |",
        "|---|" + "---|" * len(rows),
        f"| 1 (single) | {single.throughput:,.0f}{'' if single.fits else '*'} ({single.memory_bytes / 2**30:.0f}) |"
        + " |" * (len(rows) - 1),
    ]
    for i, n in enumerate(gpus[1:]):
        cells = []
        for pts in rows.values():
            p = pts[i][1]
            if p.status != "ok":
                cells.append(p.status)
                continue
            mark = "" if p.fits else "*"
            mem = f"{p.memory_bytes / 2**30:.0f}" if p.memory_bytes else "-"
            cells.append(f"{p.throughput:,.0f}{mark} ({mem}) / {p.dominant[:4]}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
