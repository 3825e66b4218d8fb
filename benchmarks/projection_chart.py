"""The scaling picture no one here can afford to measure: projected throughput (and, with --memory-panel, memory per
GPU) vs number of GPUs per method for one model on one hardware profile, with the points where a method does not
fit in the device's memory drawn hollow on a dotted line (memory from `stratbench estimate`, time from
`stratbench.predicting.projection`). 8 GPUs per node, then nodes.

Two method sets. ``data-parallel`` (DDP, FSDP, DeepSpeed ZeRO), weak scaling: the per-device batch is fixed, the
global batch grows with the GPUs:

    PYTHONPATH=src python benchmarks/projection_chart.py --hardware h100-sxm --model tinynet --width 4096 \
        --image-size 32 --per-device-batch 8 --precision bf16-mixed --optimizer adamw \
        --out benchmarks/projection_scaling_h100-sxm_2026-11-22

``tp-3d`` (FSDP, FSDP + activation checkpointing, 2D fsdp --tp 2/4/8, 3D pipeline --pp P --tp T) for a language
model, strong scaling: one global batch of sequences at every GPU count, each rank (each tensor-parallel group, each
pipeline micro-batch) computing --micro-batch sequences at a time, the rest accumulated; a method whose data-parallel
ranks outnumber the sequences is n/a there. --published ID... adds published figures (published.yaml) beside the
projection of their own setup (held out unless the efficiency default was set from them: said in the table):

    PYTHONPATH=src python benchmarks/projection_chart.py --methods tp-3d --model llama-8b --seq-len 8192 \
        --vocab-size 128256 --global-batch 256 --micro-batch 1 --min-gpus 8 --max-gpus 1024 --memory-panel \
        --published torchtitan-llama3-8b-h100-bf16-8gpu,torchtitan-llama3-8b-h100-bf16-128gpu \
        --out benchmarks/projection_scaling_llama-8b_h100-sxm_2026-11-25

writes OUT.png (the chart) and OUT.md (the numbers, with the command).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from projection_published import load_published

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import System, resolve
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.predicting.projection import MethodProjection, load_calibration, project


@dataclass(frozen=True)
class Method:
    label: str
    strategy: str
    options: tuple[tuple[str, int | str], ...] = ()
    checkpointing: bool = False

    @property
    def ranks_per_replica(self) -> int:
        """Devices one data-parallel replica spans: its tensor-parallel x pipeline ranks."""
        opts = dict(self.options)
        return int(opts.get("tp", 1)) * int(opts.get("pp", 1))


METHOD_SETS = {
    "data-parallel": [
        Method("ddp", "ddp"),
        Method("ddp-zero", "ddp-zero"),
        Method("fsdp grad-op", "fsdp", (("sharding", "grad-op"),)),
        Method("fsdp full", "fsdp", (("sharding", "full"),)),
        Method("deepspeed z1", "deepspeed", (("zero_stage", 1),)),
        Method("deepspeed z2", "deepspeed", (("zero_stage", 2),)),
        Method("deepspeed z3", "deepspeed", (("zero_stage", 3),)),
    ],
    "tp-3d": [
        Method("fsdp", "fsdp"),
        Method("fsdp + AC", "fsdp", (), True),
        Method("fsdp tp2", "fsdp", (("tp", 2),)),
        Method("fsdp tp4", "fsdp", (("tp", 4),)),
        Method("fsdp tp8", "fsdp", (("tp", 8),)),
        Method("3D pp2 x tp4", "pipeline", (("pp", 2), ("tp", 4))),
        Method("3D pp4 x tp8", "pipeline", (("pp", 4), ("tp", 8))),
    ],
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--methods", choices=sorted(METHOD_SETS), default="data-parallel")
    ap.add_argument("--model", default="tinynet")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=0, help="a language model's window (synthetic tokens); 0: images")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--per-device-batch", type=int, default=8, help="weak scaling (data-parallel set)")
    ap.add_argument("--global-batch", type=int, default=256, help="strong scaling (tp-3d set): sequences per step")
    ap.add_argument("--micro-batch", type=int, default=1, help="tp-3d: samples each replica computes at a time")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--min-gpus", type=int, default=1)
    ap.add_argument("--max-gpus", type=int, default=1024)
    ap.add_argument("--memory-panel", action="store_true", help="a second panel: estimated memory per GPU")
    ap.add_argument("--published", default="", help="comma-separated published.yaml ids to show beside")
    ap.add_argument("--calibrate", action="append", default=[])
    ap.add_argument("--out", default="projection_scaling")
    return ap.parse_args()


def base_config(args: argparse.Namespace) -> TrainConfig:
    if args.seq_len:
        return TrainConfig(model=args.model, data="synthetic-tokens", seq_len=args.seq_len,
                           vocab_size=args.vocab_size, precision=args.precision, optimizer=args.optimizer)  # fmt: skip
    return TrainConfig(model=args.model, width=args.width, image_size=args.image_size, num_classes=args.num_classes,
                       data="synthetic", precision=args.precision, optimizer=args.optimizer)  # fmt: skip


def config_for(base: TrainConfig, args: argparse.Namespace, m: Method, n: int) -> TrainConfig | str:
    """The config of ``m`` on ``n`` GPUs, or why it cannot run there. data-parallel: the per-device batch x n.
    tp-3d: the global batch over n / (tp x pp) replicas, each computing --micro-batch samples at a time (a
    pipeline's micro-batches, else gradient accumulation)."""
    cfg = base.replace(strategy=m.strategy, strategy_options=dict(m.options), activation_checkpointing=m.checkpointing)
    if args.methods == "data-parallel":
        return cfg.replace(batch_size=args.per_device_batch * n)
    if n % m.ranks_per_replica:
        return f"{n} GPUs do not divide into replicas of {m.ranks_per_replica}"
    replicas = n // m.ranks_per_replica
    per_replica, rest = divmod(args.global_batch, replicas * args.micro_batch)
    if not per_replica or rest:
        return f"{args.global_batch} sequences do not split over {replicas} replicas x {args.micro_batch}"
    if m.strategy == "pipeline":
        return cfg.replace(batch_size=args.global_batch, strategy_options=dict(m.options, microbatches=per_replica))
    return cfg.replace(batch_size=args.global_batch, grad_accum=per_replica)


def project_methods(base, args, system, calibration, gpus) -> dict[str, list[tuple[int, MethodProjection | str]]]:
    """Per method, (GPUs, its projection or why there is none) at every GPU count it can run on."""
    rows: dict[str, list] = {}
    t0 = time.time()
    for m in METHOD_SETS[args.methods]:
        rows[m.label] = []
        for n in gpus:
            if n < max(2, m.ranks_per_replica):
                continue
            cfg = config_for(base, args, m, n)
            gpn = min(n, system.gpus_per_node)
            if isinstance(cfg, str):
                rows[m.label].append((n, cfg))
                continue
            rows[m.label].append((n, _project(cfg.replace(nnodes=n // gpn), system, n // gpn, gpn, calibration)))
        print(f"{m.label}: done ({time.time() - t0:.0f} s)", file=sys.stderr)
    return rows


def _project(cfg, system, nodes, gpn, calibration) -> MethodProjection | str:
    """The projection with its memory estimate; where only the estimate refuses the config (the estimator splits a
    pipeline's batch over every rank, not over its replicas: fewer sequences than GPUs), the projection without
    memory (fits unknown, drawn hollow, "?" in the table)."""
    try:
        return project(cfg, system, nodes, gpn, calibration)
    except ConfigError:
        pass
    try:
        return project(cfg, system, nodes, gpn, calibration, memory=False)
    except ConfigError as exc:
        return str(exc)


def published_rows(ids: str, base: TrainConfig, system: System, calibration) -> list[dict]:
    """Each published figure (tokens/s per GPU) beside the projection of its own setup (its method, batch per GPU
    and GPUs; selective activation checkpointing is not modelled) and the projection's error."""
    entries = {e["id"]: e for e in load_published()}
    out = []
    for pid in [x for x in ids.split(",") if x]:
        e = entries[pid]
        n, per_gpu = e["gpus"], e["batch_per_gpu"]
        cfg = base.replace(strategy=e["method"], batch_size=per_gpu * n, nnodes=e["nodes"])
        p = project(cfg, system, e["nodes"], n // e["nodes"], calibration)
        predicted = p.tokens_per_s / n
        out.append({"id": pid, "gpus": n, "published": e["throughput"], "predicted": predicted,
                    "error": predicted / e["throughput"] - 1, "memory": p.memory_bytes, "source": e["source"]})  # fmt: skip
    return out


def _points(pts, attr):
    ok = [(n, p) for n, p in pts if not isinstance(p, str) and p.status == "ok"]
    return [(n, attr(p), bool(p.fits)) for n, p in ok if attr(p)]


def _draw(ax, pts, color, label):
    (line,) = ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], ls=":", lw=1, color=color)
    c = line.get_color()
    fit = [(x, y) for x, y, f in pts if f]
    ax.plot([x for x, _ in fit], [y for _, y in fit], "-o", color=c, label=label, ms=4)
    ax.plot([x for x, _, f in pts if not f], [y for _, y, f in pts if not f], "o", color=c, fillstyle="none", ms=6)
    return c


def plot(args, system, rows, single, published, params, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = bool(args.seq_len)
    fig, axes = plt.subplots(1, 2 if args.memory_panel else 1, figsize=(15 if args.memory_panel else 9, 6))
    ax, mem_ax = (axes[0], axes[1]) if args.memory_panel else (axes, None)
    speed = (lambda p: p.tokens_per_s / p.world) if lm else (lambda p: p.throughput)
    if single is not None:
        ideal = [single.throughput * n for n in (1, args.max_gpus)]
        ax.plot([1, args.max_gpus], ideal, color="0.8", lw=1, label="linear (1 GPU x N)")
        ax.plot([1], [single.throughput], "ko", fillstyle="full" if single.fits else "none",
                label=f"single ({'fits' if single.fits else 'does not fit'})")  # fmt: skip
    for label, pts in rows.items():
        c = _draw(ax, _points(pts, speed), None, label)
        if mem_ax is not None:
            _draw(mem_ax, _points(pts, lambda p: (p.memory_bytes or 0) / 2**30), c, label)  # no estimate: left out
    for r in published:
        ax.plot([r["gpus"]], [r["published"]], "k*", ms=12)
        ax.annotate(f"published {r['published']:,} ({r['error']:+.0%})", (r["gpus"], r["published"]),
                    textcoords="offset points", xytext=(6, -14), fontsize=8)  # fmt: skip
    xlabel = (f"GPUs ({system.gpus_per_node} per node, {system.intra_node.key} inside, "
              f"{system.inter_node.key if system.inter_node else '-'} between nodes)")  # fmt: skip
    for a in [x for x in (ax, mem_ax) if x is not None]:
        a.set_xscale("log", base=2)
        a.set_xlabel(xlabel)
        a.grid(True, which="both", alpha=0.3)
    if lm:
        ax.set_ylabel("projected tokens/s per GPU")
    else:
        ax.set_yscale("log")
        ax.set_ylabel("projected samples/s")
    if mem_ax is not None:
        mem_ax.axhline(system.gpu.memory_bytes / 2**30, color="r", lw=1, ls="--", label=f"{system.gpu.name}")
        mem_ax.set_yscale("log")
        mem_ax.set_ylabel("estimated memory per GPU (GiB)")
        mem_ax.legend(fontsize=8)
    fig.suptitle(f"{title(args, params)} on {system.gpu.name}\n"
                 "hollow markers on dotted lines: does not fit in the GPU's memory (stratbench estimate)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def title(args, params: int) -> str:
    if args.seq_len:
        return (f"{args.model} ({params / 1e9:.2f}B params), {args.seq_len} tokens, {args.precision}, {args.optimizer},"
                f" {args.global_batch} sequences per step, {args.micro_batch} per rank at a time")  # fmt: skip
    return (f"{args.model} (width {args.width}, {params / 1e9:.2f}B params) {args.image_size}px, {args.precision}, "
            f"{args.optimizer}, {args.per_device_batch}/GPU")  # fmt: skip


def _cell(p: MethodProjection | str, lm: bool) -> str:
    if isinstance(p, str):
        return "n/a"
    if p.status != "ok":
        return p.status
    mark = "?" if p.fits is None else "" if p.fits else "*"
    mem = f"{p.memory_bytes / 2**30:.0f}" if p.memory_bytes else "-"
    speed = p.tokens_per_s / p.world if lm else p.throughput
    return f"{speed:,.0f}{mark} ({mem}) / {p.dominant[:4]}"


def table(rows, gpus, single, lm: bool) -> list[str]:
    lines = ["| GPUs | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    if single is not None:
        lines.append(f"| 1 (single) | {single.throughput:,.0f}{'' if single.fits else '*'} "
                     f"({single.memory_bytes / 2**30:.0f}) |" + " |" * (len(rows) - 1))  # fmt: skip
    for n in gpus:
        cells = [next((_cell(p, lm) for k, p in pts if k == n), "") for pts in rows.values()]
        if any(cells):
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def machine() -> str:
    """This machine in words: CPU model and cores, Python and torch (the projection is arithmetic, but say where)."""
    import os

    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()  # fmt: skip
    return f"{cpu}, {os.cpu_count()} cores, no GPU, Python {platform.python_version()}, torch {torch.__version__}"


def write_md(args, system, rows, gpus, single, published, params, out: Path) -> None:
    lm = bool(args.seq_len)
    cmd = "PYTHONPATH=src python benchmarks/projection_chart.py " + " ".join(sys.argv[1:])
    ref = single or next(p for pts in rows.values() for _, p in pts if not isinstance(p, str) and p.status == "ok")
    unit = "tokens/s per GPU" if lm else "Samples/s"
    lines = [
        f"# Projected scaling: {title(args, params)} on {system.key}",
        "",
        f"Command: `{cmd}` (a projection, nothing measured; computed on {machine()}; efficiency: "
        f"{ref.efficiency_source}, {ref.efficiency:.1%} of the dense "
        f"{args.precision} peak; overlap {system.overlap:.0%}, {system.overlap_source}).",
        "",
        f"{unit} per method and GPU count; `*` = does not fit in {system.gpu.memory_bytes / 1e9:.0f} GB (estimated "
        "memory per device in GiB in brackets; `?` and `-`: no estimate); the dominant term of the step after the "
        "slash; n/a: the method cannot run there (too few sequences for its replicas).",
        "",
        *table(rows, gpus, single, lm),
    ]
    if published:
        lines += ["", "| published | GPUs | published tokens/s/GPU | projected | error | projected memory (GiB) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['id']} ({r['source']['repo']} {r['source']['path']}) | {r['gpus']} | {r['published']:,} | "
                  f"{r['predicted']:,.0f} | {r['error']:+.1%} | {(r['memory'] or 0) / 2**30:.0f} |" for r in published]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    args = parse_args()
    system = resolve(args.hardware)
    calibration = load_calibration(args.calibrate, system) if args.calibrate else None
    gpus = [2**k for k in range(0, 11) if args.min_gpus <= 2**k <= args.max_gpus]
    base = base_config(args)
    params = model_info(ModelSpec.from_config(base)).total
    single = None
    if args.methods == "data-parallel":
        single = project(base.replace(strategy="single", batch_size=args.per_device_batch), system, 1, 1, calibration)
    rows = project_methods(base, args, system, calibration, gpus)
    published = published_rows(args.published, base, system, calibration)
    out = Path(args.out)
    plot(args, system, rows, single, published, params, out)
    write_md(args, system, rows, gpus, single, published, params, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
