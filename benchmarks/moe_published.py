"""Mixtures of experts on H100: stratbench's projection of ``fsdp --ep E`` held against NVIDIA's published Megatron-Bridge
MoE pre-training throughputs (issue 47 item 4), each predicted from the dense Llama 3 8B row of the same table.

The source (``SOURCE``): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at 5776a6d90b4d ("25.11 summary typo
corrections"), which holds two releases' DGX-H100 tables: the 25.11 NeMo container's and the 25.09 one's. Rows used
(quoted in ``ROWS``): in each table, LLAMA3_8B (8 GPUs, FSDP, the anchor) and the MoE rows whose model stratbench
builds: Qwen3_30B_a3B (both tables) and DeepSeekV3 (25.09; stratbench's ``deepseek-v3-style`` has plain multi-head
attention in place of MLA and no MTP module). Qwen3_235B_a22B, GPT OSS 120B: no built-in shape, not scored.

How each MoE row is predicted, with nothing taken from it but its layout (GPUs, batch, sequence, EP degree):

1. the anchor: one bf16 efficiency found by bisection so that the projection of ``llama-8b`` under fsdp on 8 H100 SXM
   (its GBS 128, sequence 8192) reproduces the row's tokens/s per GPU (its FP8 is absorbed into that efficiency,
   and the MoE rows, FP8 too, are priced at it: the same absorption);
2. the MoE row projected as ``fsdp --sharding full --ep E`` (E the row's EP) on its GPUs, 8 per node, at its global
   batch and sequence: FLOPs from the active parameters (the meta-device counter), FSDP2's gathers of the dense parts,
   the all-to-alls priced on the links the ep group crosses (NVLink inside a node, the NICs across) on the critical
   path, at the busiest rank's share of the rows (1.0 here: the rows say "we force-balance the token distribution";
   the tokendrop rows are priced dropless: the model FLOPs are the same);
3. the naive baseline beside it: the anchor's achieved FLOP/s per GPU (its tokens/s x stratbench's FLOPs per token of
   Llama 3 8B) spent on the MoE's active FLOPs per token, no communication: dense efficiency at active FLOPs.

What the projection does not model, and Megatron runs: pipeline parallelism (the rows' PP 2 / 8 with VP: priced here
as fsdp over all GPUs), TP 2 (DeepSeekV3), grouped GEMMs' lower efficiency than a dense GEMM at the experts' small
per-expert batches (Qwen3-30B-A3B: 128 experts of hidden 768), DeepEP / overlapped all-to-all, MLA.

    PYTHONPATH=src python benchmarks/moe_published.py > benchmarks/moe_published_2026-11-28.md

Nothing is measured on this machine: the inputs are the published numbers, the models' counted FLOPs and shapes (on
the meta device) and the built-in hardware profile h100-sxm.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import torch

from stratbench.core.config import TrainConfig
from stratbench.measuring.hardware import System, resolve
from stratbench.models.transformer import SIZES
from stratbench.predicting.projection import Calibration, MethodProjection, model_flops, project

SOURCE = {
    "repo": "NVIDIA-NeMo/Megatron-Bridge",
    "path": "docs/performance-summary.md",
    "commit": "5776a6d90b4dd8692902ab2eb581369484e19283",
    "tables": "'25.11 NeMo Container / Pre-Training Performance / System: DGX-H100' (lines 86-98) and '25.09 NeMo "
    "Container / Pre-Training Performance / System: DGX-H100' (lines 125-135)",
    "unit": "Tokens / sec / GPU; the table's notes: MoE rows token-dropless with the token distribution force-balanced "
    "(25.11), 'tokendrop' rows drop over capacity (25.09)",
}
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Row:
    """One published row: release, model (the table's name and stratbench's), GPUs, precision, global batch,
    micro-batch, sequence, TP / PP / VP / EP, tokens/s per GPU and model TFLOP/s per GPU as published."""

    release: str
    name: str
    model: str
    gpus: int
    precision: str
    gbs: int
    mbs: int
    seq_len: int
    tp: int
    pp: int
    vp: str
    ep: int
    tps: float
    tflops: float

    @property
    def quoted(self) -> str:
        return (f"| {self.release} | {self.name} | {self.gpus} | {self.precision} | {self.gbs} | {self.mbs} | "
                f"{self.seq_len} | {self.tp} | {self.pp} | {self.vp} | {self.ep} | {self.tps:,.0f} | {self.tflops:g} |")  # fmt: skip


ROWS = (
    Row("25.11", "LLAMA3_8B", "llama-8b", 8, "FP8-CS", 128, 1, 8192, 1, 1, "n/a", 1, 14451, 744),
    Row("25.11", "Qwen3_30B_a3B", "qwen3-30b-a3b", 16, "FP8-CS", 512, 2, 4096, 1, 2, "24", 8, 5275, 121),
    Row("25.09", "LLAMA3_8B", "llama-8b", 8, "(not given)", 128, 1, 8192, 1, 1, "n/a", 1, 14079, 725),
    Row("25.09", "Qwen3_30B_a3B (tokendrop)", "qwen3-30b-a3b", 16, "(not given)", 512, 2, 4096, 1, 2, "24", 8,
        10494, 241),
    Row("25.09", "DeepSeekV3 (dropless)", "deepseek-v3-style", 1024, "(not given)", 8192, 1, 4096, 2, 8, "4", 64,
        1297, 338),
)  # fmt: skip


def config(row: Row) -> TrainConfig:
    """The row's model, global batch and sequence under fsdp (``--ep`` the row's EP above 1), bf16, AdamW, each rank's
    share of the batch in micro-batches of the row's MBS."""
    per_rank = row.gbs // row.gpus
    return TrainConfig(
        model=row.model, data="synthetic-tokens", seq_len=row.seq_len, vocab_size=SIZES[row.model].vocab_size,
        batch_size=row.gbs, grad_accum=max(1, per_rank // row.mbs), precision="bf16-mixed", optimizer="adamw",
        strategy="fsdp", strategy_options={"ep": row.ep} if row.ep > 1 else {},
        nnodes=max(1, row.gpus // GPUS_PER_NODE),
    )  # fmt: skip


def projected(row: Row, system: System, cal: Calibration | None) -> MethodProjection:
    nodes = max(1, row.gpus // GPUS_PER_NODE)
    return project(config(row), system, nodes, min(row.gpus, GPUS_PER_NODE), {"bf16": cal} if cal else None,
                   memory=False)  # fmt: skip


def per_gpu(p: MethodProjection, row: Row) -> float:
    return (p.tokens_per_s or 0.0) / row.gpus


def calibrated(anchor: Row, system: System) -> Calibration:
    """The bf16 efficiency with which the projection reproduces the anchor's tokens/s per GPU (bisection)."""
    lo, hi = 1e-3, 1.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        cal = Calibration(mid, "bf16", device=system.gpu.key, source="anchor")
        lo, hi = (mid, hi) if per_gpu(projected(anchor, system, cal), anchor) < anchor.tps else (lo, mid)
    eff = math.sqrt(lo * hi)
    return Calibration(eff, "bf16", device=system.gpu.key, source=f"Megatron-Bridge {anchor.release} {anchor.name} "
                       f"row ({eff:.1%} of the bf16 peak)")  # fmt: skip


def flops_per_token(row: Row) -> float:
    """stratbench's training FLOPs per token of the row's model at its sequence (active parameters, attention)."""
    return model_flops(config(row)) / row.seq_len


def exposed_a2a(p: MethodProjection) -> float:
    """Seconds per step of the projection's all-to-alls (critical: all exposed)."""
    return sum(r["seconds"] for r in p.comm_rows if r["kind"] == "all_to_all")


DISCUSSION = """## What the errors say

Every MoE row runs far below its release's dense row in the source itself: Qwen3-30B-A3B's published model TFLOP/s
per GPU is 121 (25.11) and 241 (25.09), DeepSeek-V3's 338, against Llama 3 8B's 744 and 725, so the naive baseline,
which carries the dense row's efficiency to the active FLOPs, is high on every row. The projection takes away what it
prices: the all-to-alls on the critical path (NVLink inside a node for Qwen3's EP 8; for DeepSeek-V3's EP 64, 7/8 of
each exchange over the NICs, most of its step), FSDP2's gathers of the dense parts and the attention share of a
4096-token layer. What stays is not priced: the experts' GEMMs at small per-expert batches (Qwen3-30B-A3B: 128
experts of hidden 768, each seeing T x 8 / 128 rows: grouped GEMMs well below a dense GEMM's efficiency), the
permutation and router kernels, pipeline parallelism's bubble and stage-to-stage sends (PP 2 / 8 in these rows,
priced as FSDP over all GPUs) and, the other way, Megatron's overlap of the all-to-alls (DeepEP, 1F1B A2A overlap),
which the projection leaves exposed: DeepSeek-V3, where the inter-node exchange dominates, comes out under the
published row, Qwen3-30B-A3B, whose exchange stays on NVLink, far over it. The two Qwen3-30B-A3B rows of one layout
differ by 2x between releases (dropless with a forced balance in 25.11, token-dropping in 25.09), which no layout
field tells apart. A calibration on a measured MoE step on the target GPU (`--calibrate`), not a dense one, is what
the Qwen3 errors call for."""


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def main() -> None:
    system = resolve("h100-sxm")
    print(
        "# MoE training throughput on H100: stratbench's projection against Megatron-Bridge's published rows\n"
    )
    print(f"Generated by `benchmarks/moe_published.py` on {platform.machine()} / Python {platform.python_version()} / "
          f"torch {torch.__version__} (this CPU VM: nothing is measured, the projection runs on the meta device).\n")  # fmt: skip
    print(f"Source: {SOURCE['repo']} `{SOURCE['path']}` at {SOURCE['commit']}, tables {SOURCE['tables']}; unit: "
          f"{SOURCE['unit']}. Hardware profile: h100-sxm ({system.gpu.name}), {GPUS_PER_NODE} per node.\n")  # fmt: skip
    print("## The published rows\n")
    print(
        "| release | model | GPUs | precision | GBS | MBS | seq | TP | PP | VP | EP | tokens/s/GPU | model TFLOP/s/GPU |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in ROWS:
        print(r.quoted)
    print("\n## Predictions (each MoE row from its release's LLAMA3_8B row)\n")
    print("| release | model | published tokens/s/GPU | projected | error | naive: dense efficiency at active FLOPs | "
          "error | FLOPs/token (stratbench) | published TFLOP/s / tokens/s | all-to-all s/step | step s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors, naive_errors, notes = [], [], []
    for anchor in (r for r in ROWS if r.ep == 1):
        cal = calibrated(anchor, system)
        achieved = anchor.tps * flops_per_token(anchor)
        notes.append(f"- anchor {anchor.release}: {cal.source}; Llama 3 8B at {flops_per_token(anchor) / 1e9:.1f} "
                     f"GFLOP/token by stratbench's count (the row's TFLOP/s over its tokens/s: "
                     f"{anchor.tflops * 1e3 / anchor.tps:.1f})")  # fmt: skip
        for row in (r for r in ROWS if r.release == anchor.release and r.ep > 1):
            p = projected(row, system, cal)
            got, naive = per_gpu(p, row), achieved / flops_per_token(row)
            errors.append(got / row.tps - 1)
            naive_errors.append(naive / row.tps - 1)
            print(f"| {row.release} | {row.name} | {row.tps:,.0f} | {got:,.0f} | {_pct(errors[-1])} | {naive:,.0f} | "
                  f"{_pct(naive_errors[-1])} | {flops_per_token(row) / 1e9:.1f} G | {row.tflops * 1e3 / row.tps:.1f} G "
                  f"| {exposed_a2a(p):.3f} | {p.step_s:.3f} |", flush=True)  # fmt: skip
    print()
    print("\n".join(notes))
    print()
    mean = sum(abs(e) for e in errors) / len(errors)
    naive_mean = sum(abs(e) for e in naive_errors) / len(naive_errors)
    print(
        f"Mean absolute error: projection {mean:.1%}, naive baseline {naive_mean:.1%} over {len(errors)} rows."
    )
    print("\n" + DISCUSSION)


if __name__ == "__main__":
    main()
