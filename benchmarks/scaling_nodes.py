"""The multi-node scaling picture of issue 45: Llama 3 8B and 70B on 2-32 nodes of 8 x H100 SXM, at 400 Gb/s per GPU
(hardware.yaml's h100-sxm: one NDR NIC per GPU) and at 100 Gb/s per GPU (benchmarks/published_hardware.yaml's
h100-sxm-100g: the same node with 100 Gb/s rails), four ways of sharding across nodes:

* **fsdp**: FSDP2 full sharding over every GPU (its gathers and reduce-scatters span all the nodes);
* **HSDP**: fsdp ``replicate`` = the node count (shard within the node's 8 GPUs, replicas across nodes: the
  gradients' all-reduce of 1/8 of the model is the only traffic on the NICs);
* **ZeRO-3**: DeepSpeed stage 3 over every GPU;
* **ZeRO++**: ZeRO-3 with hpZ 8 (backward's gather inside the node), qwZ (int8 weights) and qgZ (int4 gradients by
  a hierarchical all-to-all).

Each is projected as ``stratbench estimate --time`` would (``stratbench.predicting.projection.project``, the
default efficiency for H100 bf16 transformers: no calibration, nothing measured here), weak scaling: each GPU
computes --per-gpu sequences of --seq-len tokens per step (8192, Llama 3's; or 2048, the small-batch regime in which
the ZeRO++ paper measured its gains; no accumulation), bf16-mixed, AdamW, activation checkpointing (the 70B does not
fit otherwise). The table gives the step, tokens/s per GPU, the exposed communication and the
communication per step and rank on each link, counted as stratbench's run records count them
(docs/communication.md): a call whose group sits on one node is intra-node, one whose group spans nodes
inter-node, its ring's wire bytes (``wire_factor``) either way; and what of the inter-node calls crosses the NICs
as the projection prices them (the hierarchical ring: a node's ranks reduce among themselves first, so a group
spanning nodes sends 1/8 of its bytes over the NICs).

HSDP (fsdp's ``replicate``) and ZeRO++ (deepspeed's ``zero_hpz``, ``zero_quantized_weights``,
``zero_quantized_gradients``) are issue 45's items 1 and 2: where this stratbench does not take the option yet,
their rows are n/a with the reason; rerun after the merge.

    PYTHONPATH=src python benchmarks/scaling_nodes.py --out benchmarks/scaling_nodes_h100_DATE
    PYTHONPATH=src python benchmarks/scaling_nodes.py --seq-len 2048 --out benchmarks/scaling_nodes_h100_s2048_DATE

writes OUT.md (the numbers and the command) and OUT.png (tokens/s per GPU vs nodes, one panel per model and link).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.torchvision_compat import guard_torchvision_import
from stratbench.measuring.comm import wire_factor
from stratbench.measuring.hardware import System, resolve
from stratbench.predicting.projection import MethodProjection, project
from stratbench.strategies.base import get_strategy

HERE = Path(__file__).resolve().parent
SYSTEMS = {"400 Gb/s": "h100-sxm", "100 Gb/s": f"{HERE / 'published_hardware.yaml'}:h100-sxm-100g"}
"""Link per GPU between nodes -> hardware profile (8 x H100 SXM5 on NVLink 4 per node either way)."""
MODELS = {
    8192: {"Llama 3 8B": "published_models:llama3_8b", "Llama 3 70B": "published_models:llama3_70b"},
    2048: {
        "Llama 3 8B": "published_models:llama3_8b_s2048",
        "Llama 3 70B": "published_models:llama3_70b_s2048",
    },
}
"""Sequence length -> model builders (benchmarks/published_models.py: torchtitan's shapes)."""
NODES = (2, 4, 8, 16, 32)
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Method:
    """One way of sharding: a strategy and its options (``nodes`` fills in the node count where it appears)."""

    label: str
    strategy: str
    options: tuple[tuple[str, Any], ...] = ()

    def strategy_options(self, nodes: int) -> dict[str, Any]:
        return {k: nodes if v == "nodes" else v for k, v in self.options}


METHODS = (
    Method("fsdp", "fsdp"),
    Method("HSDP", "fsdp", (("replicate", "nodes"),)),
    Method("ZeRO-3", "deepspeed", (("zero_stage", 3),)),
    Method("ZeRO++", "deepspeed", (("zero_stage", 3), ("zero_hpz", GPUS_PER_NODE), ("zero_quantized_weights", True),
                                   ("zero_quantized_gradients", True))),
)  # fmt: skip


def config(model: str, m: Method, nodes: int, per_gpu: int, seq_len: int) -> TrainConfig:
    """The run of ``m`` on ``nodes`` nodes: ``per_gpu`` sequences per GPU per step (a token model reads its
    ``seq_len`` tokens from an image of 3 x side x side values, as benchmarks/projection_published.py's)."""
    side = math.ceil(math.sqrt(seq_len / 3))
    return TrainConfig(
        model=model, image_size=side, num_classes=1000, data="synthetic", precision="bf16-mixed",
        optimizer="adamw", activation_checkpointing=True, batch_size=per_gpu * nodes * GPUS_PER_NODE,
        strategy=m.strategy, strategy_options=m.strategy_options(nodes), nnodes=nodes,
    )  # fmt: skip


def unknown_option(m: Method, nodes: int) -> str | None:
    """Why this stratbench cannot take ``m``'s options (issue 45's before its merge), in one line; None if it can."""
    options = m.strategy_options(nodes)
    known = {f.name for f in dataclasses.fields(get_strategy(m.strategy).Options)}
    if unknown := sorted(set(options) - known):
        return f"{m.strategy} here has no option {', '.join(unknown)} (issue 45: rerun after it is merged)"
    try:
        get_strategy(m.strategy).parse_options(options)
    except ConfigError as exc:
        return str(exc)
    return None


def link_bytes(p: MethodProjection) -> dict[str, float]:
    """Bytes one rank sends per step on each link: a row whose group sits on one node intra-node, one whose group
    spans nodes inter-node (all of it: its ring crosses the NICs on every step), wire bytes by the ring model; and
    ``nic``, what of the inter-node calls the projection prices on the NICs (``collective_time``'s hierarchical
    form: the ring over the ``m`` nodes of each rank's 1/``g`` share; an all-to-all's peers off the node)."""
    out = {"intra": 0.0, "inter": 0.0, "nic": 0.0}
    for r in p.comm_rows:
        kind, payload, n, g, m = (
            r["kind"],
            r["payload_bytes"],
            r["group_size"],
            r["ranks_per_node"],
            r["nodes"],
        )
        out["intra" if m <= 1 else "inter"] += payload * wire_factor(kind, n)
        if m > 1:
            g = min(g, n)
            if kind == "all_to_all":
                out["nic"] += payload * (n - g) / n
            elif kind == "send_recv":
                out["nic"] += payload
            else:
                out["nic"] += payload / g * wire_factor(kind, m)
    return out


def project_one(
    model: str, m: Method, system: System, nodes: int, per_gpu: int, seq_len: int
) -> MethodProjection | str:
    """``m``'s projection on ``nodes`` nodes of ``system``, or why there is none."""
    if why := unknown_option(m, nodes):
        return why
    try:
        return project(config(model, m, nodes, per_gpu, seq_len), system, nodes, GPUS_PER_NODE, memory=False)
    except ConfigError as exc:
        return str(exc)


def sweep(per_gpu: int, seq_len: int) -> dict[tuple[str, str, str, int], MethodProjection | str]:
    """Every (model, link, method, nodes) projection."""
    out = {}
    for mname, model in MODELS[seq_len].items():
        for link, key in SYSTEMS.items():
            system = resolve(key)
            t0 = time.time()
            for m in METHODS:
                for n in NODES:
                    out[(mname, link, m.label, n)] = project_one(model, m, system, n, per_gpu, seq_len)
            print(f"{mname} at {link}: {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def table(results: dict, seq_len: int) -> list[str]:
    """The markdown table: one row per model, link, nodes and method."""
    lines = [
        "| model | link per GPU | nodes (GPUs) | method | step (s) | tokens/s per GPU | comm exposed (s) | "
        "comm / step: intra (GB) | inter (GB) | of which on the NICs (GB) | dominant |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mname, link, label, n), p in results.items():
        head = f"| {mname} | {link} | {n} ({n * GPUS_PER_NODE}) | {label} |"
        if isinstance(p, str) or p.status != "ok":
            why = p if isinstance(p, str) else p.reason or p.status
            lines.append(f"{head} n/a: {why} | | | | | | |")
            continue
        b = link_bytes(p)
        tok = p.throughput * seq_len / p.world
        lines.append(f"{head} {p.step_s:.2f} | {tok:,.0f} | {p.comm_exposed_s:.2f} | {_gb(b['intra'])} | "
                     f"{_gb(b['inter'])} | {_gb(b['nic'])} | {p.dominant} |")  # fmt: skip
    return lines


def plot(results: dict, out: Path, per_gpu: int, seq_len: int) -> None:
    """Tokens/s per GPU vs nodes: one panel per model and link, one line per method (n/a points left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODELS[seq_len]), len(SYSTEMS), figsize=(12, 8), squeeze=False)
    for i, mname in enumerate(MODELS[seq_len]):
        for j, link in enumerate(SYSTEMS):
            ax = axes[i][j]
            for m in METHODS:
                pts = [(n, results[(mname, link, m.label, n)]) for n in NODES]
                pts = [
                    (n, p.throughput * seq_len / p.world)
                    for n, p in pts
                    if not isinstance(p, str) and p.throughput
                ]
                if pts:
                    ax.plot([n for n, _ in pts], [y for _, y in pts], "-o", ms=4, label=m.label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(NODES, [str(n) for n in NODES])
            ax.set_title(f"{mname}, {link} per GPU between nodes", fontsize=9)
            ax.set_xlabel("nodes of 8 x H100 SXM (NVLink 4 inside)")
            ax.set_ylabel("projected tokens/s per GPU")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{seq_len}-token sequences, {per_gpu} per GPU per step, bf16-mixed, AdamW, activation "
                 "checkpointing; stratbench projection at the default efficiency (nothing measured)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-gpu", type=int, default=1, help="sequences per GPU per step")
    ap.add_argument("--seq-len", type=int, choices=sorted(MODELS), default=8192, help="tokens per sequence")
    ap.add_argument("--out", default="scaling_nodes")
    ap.add_argument("--no-chart", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))  # published_models
    guard_torchvision_import()  # published_models imports torchvision, which a CPU torch cannot import unaided
    importlib.import_module("published_models")
    t0 = time.time()
    results = sweep(args.per_gpu, args.seq_len)
    lines = table(results, args.seq_len)
    out = Path(args.out)
    cmd = "PYTHONPATH=src python benchmarks/scaling_nodes.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        f"# Llama 3 8B and 70B on 2-32 nodes of 8 x H100, {args.per_gpu} x {args.seq_len} tokens per GPU: fsdp vs HSDP vs "
        "ZeRO-3 vs ZeRO++ (projected)", "",
        f"`{cmd}` ({time.time() - t0:.0f} s on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())};"
        " nothing measured: stratbench's projection at its default efficiency).", "",
        "comm / step, per rank: intra = the wire bytes of calls whose group sits on one node, inter = those of calls"
        " whose group spans nodes (as run records count them); of which on the NICs = what of the inter-node calls the"
        " projection prices on the NICs (hierarchical: each node's ranks combine first, 1/8 of the bytes leave it)."
        " HSDP = fsdp replicate = nodes; ZeRO++ = deepspeed zero_stage 3 + zero_hpz 8 + qwZ + qgZ.", "",
        *lines, "",
    ])  # fmt: skip
    print(text)
    out.with_suffix(".md").write_text(text)
    if not args.no_chart:
        plot(results, out, args.per_gpu, args.seq_len)


if __name__ == "__main__":
    main()
