"""Long context on one node: stratbench's projection of Llama 3.1 8B on 8 H100 with context parallelism, held against
torchtitan's published table (issue 46 item 5), and the long-context picture from 8k to 256k tokens.

The published table (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 2, quoted in ``TABLE``):
FSDP + CP + torch.compile + Float8, Llama 3.1 8B, 8 GPUs, local batch size 1, full activation checkpointing; each
row doubles the sequence and the CP degree together (32k tokens per GPU throughout). Every row is predicted from the
32k row only: one efficiency calibrated so that the projection reproduces its 3,890 tokens/s per GPU (bisection, as
projection_published.py anchors a figure), then every row projected with it. Beside each error, two naive
baselines: constant tokens/s per GPU, and tokens/s per GPU scaled by the FLOPs per token (``flops_per_token``:
6 N + 12 L d T, attention growing with T), so the reader sees whether the projection beats them.

What the projection prices and what it misses:

* stratbench's ``fsdp --cp C`` is Ulysses (all-to-all of q, k, v and the output per attention, exposed:
  ``ulysses_rows``); torchtitan's CP is torch's ring attention (``context_parallel``, the rotate method
  ``allgather`` by default at torchtitan 9dec370: per attention forward an all-gather of the local K and V, in
  backward another and C ring passes of dK and dV in fp32 (torch's ``_templated_ring_attention_backward``, read in
  torch 2.13.0's ``distributed/tensor/experimental/_context_parallel/_attention.py``: the December 2024 torch the
  table ran on is not at hand); full checkpointing runs the forward's again). ``ring_rows`` prices those bytes on the same links; the table shows the
  step with them fully exposed in place of Ulysses' (an upper bound: the ring overlaps them with the blocks'
  attention) and with none (a lower bound), so the reader sees how much the choice moves the prediction;
* the rows ran float8 Linears: the projection prices them as ``--float8 tensorwise`` (the converted Linears'
  products at the fp8 peak x the Hopper fp8 default, which torchtitan's Table 1 of the same file set; the rest,
  attention included, at bf16) and calibrates the bf16 efficiency on the 32k row. It has no compile term: the
  calibration absorbs it. Beside it, the same calibration with every product priced as bf16 (``bf16 only``),
  so the reader sees what pricing float8 changes: the converted Linears' share of the FLOPs falls from 43% at
  32k to 9% at 256k, so a one-efficiency fit over-predicts the long rows more;
* the FLOP count is torch's: the attention's T x T square in full, though a causal kernel skips half.

The picture: 8B (``llama-8b-long``, Llama 3.1 8B's shape with a context of 262,144) on 8 H100 SXM 80 GB at 8k-256k
tokens, one sequence per data-parallel rank: fsdp with and without full activation checkpointing, and fsdp --cp 2 /
4 / 8 with full checkpointing: memory per GPU (stratbench's estimate: does it fit 80 GB) and projected tokens/s per
GPU with the 32k row's efficiency.

    PYTHONPATH=src python benchmarks/cp_published.py > benchmarks/cp_published_2026-11-28.md

Nothing is measured on this machine: the inputs are the published numbers, the model's counted FLOPs and shapes
(on the meta device) and the built-in hardware profile h100-sxm.
"""

from __future__ import annotations

import math
import platform
import sys
from dataclasses import dataclass

import torch

from stratbench.core.config import TrainConfig
from stratbench.measuring.comm import Collective
from stratbench.measuring.hardware import System, resolve
from stratbench.models.transformer import SIZES, flops_per_token
from stratbench.predicting.projection import Calibration, MethodProjection, collective_time, project

MODEL = "llama-8b-long"
GPUS = 8
GIB = 2**30

SOURCE = {
    "repo": "pytorch/torchtitan",
    "path": "benchmarks/llama3_h100_202412_torchtitan.md",
    "commit": "31a17bfdb70bab6f62a13d21816a5339b911d6e3",
    "first": "d4c86e3758a84cf23e2e879ab3c995cba9d5e410 (docs/performance.md, 2025-01-30, PR #800)",
    "table": "Table 2 FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full "
    "activation checkpointing.",
    "versions": "torch 1963fc8 (2024-12-23), torchao eab345c (2024-12-23), torchtitan 9dec370 (2024-12-26)",
    "hardware": "Grand Teton: 8 H100 per host on NVLink, 96 GB HBM2e, 2.4 TB/s, 500 W",
    "unit": "TPS/GPU = each rank's tokens of its data-parallel batch / (seconds x CP degree) (train.py at 9dec370, "
    "lines 261 and 359-360: labels.numel() over time_delta x non_data_parallel_size): seq_len / CP per GPU and step",
}


@dataclass(frozen=True)
class Row:
    """One row of the published table: FSDP and CP degrees, sequence length, tokens/s per GPU, memory GiB."""

    fsdp: int
    cp: int
    seq_len: int
    tps: float
    memory_gib: float

    @property
    def quoted(self) -> str:
        return f"| FSDP {self.fsdp}, CP {self.cp} | {self.seq_len} | {self.tps:,.0f} | {self.memory_gib} |"


TABLE = (
    Row(8, 1, 32768, 3890, 83.9),
    Row(4, 2, 65536, 2540, 84.2),
    Row(2, 4, 131072, 1071, 84.0),
    Row(1, 8, 262144, 548, 84.5),
)
ANCHOR = TABLE[0]
SEQ_LENS = (8192, 16384, 32768, 65536, 131072, 262144)


def config(seq_len: int, cp: int, ac: bool = True, float8: bool = True) -> TrainConfig:
    """The 8B model on 8 GPUs at ``seq_len`` tokens, one sequence per data-parallel rank (8 / cp of them), bf16,
    AdamW, fsdp (``--cp cp`` above 1), full activation checkpointing where ``ac``, float8 Linears (tensorwise, as
    torchtitan's default recipe) where ``float8``."""
    return TrainConfig(
        model=MODEL, data="synthetic-tokens", seq_len=seq_len, vocab_size=SIZES[MODEL].vocab_size,
        batch_size=GPUS // cp, precision="bf16-mixed", optimizer="adamw", strategy="fsdp",
        strategy_options={"cp": cp} if cp > 1 else {}, activation_checkpointing=ac,
        float8="tensorwise" if float8 else "none",
    )  # fmt: skip


def per_gpu(p: MethodProjection) -> float:
    """Projected tokens per second per GPU."""
    return (p.tokens_per_s or 0.0) / GPUS


def calibrated(system: System, float8: bool = True) -> Calibration:
    """The bf16 efficiency with which the projection reproduces the 32k row's tokens/s per GPU (bisection:
    throughput grows with efficiency); with ``float8`` the converted Linears stay at the fp8 default."""
    cfg = config(ANCHOR.seq_len, ANCHOR.cp, float8=float8)

    def tps(eff: float) -> float:
        cal = Calibration(eff, "bf16", device=system.gpu.key, source="32k row")
        return per_gpu(project(cfg, system, 1, GPUS, {"bf16": cal}, memory=False))

    lo, hi = 1e-3, 1.0
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tps(mid) < ANCHOR.tps else (lo, mid)
    eff = math.sqrt(lo * hi)
    return Calibration(eff, "bf16", device=system.gpu.key, source=f"torchtitan Table 2's 32k row ({eff:.1%})")


def ring_rows(seq_len: int, cp: int, ac: bool = True) -> list[Collective]:
    """torch's ring attention (``context_parallel``, rotate method allgather) per optimizer step of one rank, one
    sequence: per attention forward an all-gather of the local K and V (bf16; payload: the gathered T x 2 x kv
    heads x head_dim), in backward another all-gather and C passes of the local dK and dV (fp32) to the next rank;
    full checkpointing runs each forward's all-gather again in backward."""
    tc = SIZES[MODEL]
    kv = seq_len * 2 * tc.n_kv_heads * tc.head_dim  # elements of K and V over the whole sequence
    layers = tc.n_layers
    gathers_bwd = 2 if ac else 1
    fwd = Collective("all_gather", kv * 2 * layers, layers, "forward", cp, "ring: K, V all-gathered")
    bwd = Collective("all_gather", kv * 2 * layers * gathers_bwd, layers * gathers_bwd, "backward", cp,
                     "ring: K, V all-gathered (backward, recomputed forward)")  # fmt: skip
    dkv = Collective("send_recv", kv // cp * 4 * cp * layers, cp * layers, "backward", cp, "ring: dK, dV on")
    return [fwd, bwd, dkv]


def ring_seconds(seq_len: int, cp: int, system: System) -> float:
    """Seconds per step of ``ring_rows`` on one node's links (the projection's alpha-beta prices)."""
    return sum(collective_time(r.kind, r.payload_bytes, r.calls, r.group_size, system, GPUS)
               for r in ring_rows(seq_len, cp))  # fmt: skip


def cp_seconds(p: MethodProjection) -> tuple[float, float]:
    """(seconds, of them exposed) of the projection's context-parallel rows (Ulysses' all-to-alls: critical, so
    every second is exposed)."""
    s = sum(r["seconds"] for r in p.comm_rows if r.get("dim") == "cp")
    return s, sum(r["seconds"] for r in p.comm_rows if r.get("dim") == "cp" and r.get("critical"))


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def causal_flops_per_token(seq_len: int) -> float:
    """``flops_per_token`` with the attention's square counted causal (half: what a causal kernel computes)."""
    tc = SIZES[MODEL]
    return flops_per_token(tc, seq_len) - 6.0 * tc.n_layers * tc.dim * seq_len


@dataclass
class Prediction:
    """One published row against the projection (Ulysses' rows, and the ring's bytes in their place) and the
    baselines, in tokens/s per GPU; memory in GiB (None: not estimated)."""

    row: Row
    projected: float
    bf16_only: float
    ring_exposed: float
    ring_hidden: float
    flops_scaled: float
    causal_scaled: float
    cp_s: float
    ring_s: float
    step_s: float
    memory_gib: float | None = None

    def error(self, value: float) -> float:
        return value / self.row.tps - 1


def predict_rows(system: System, cal: Calibration, plain: Calibration, memory: bool = True) -> list[Prediction]:
    """Every published row projected with the 32k row's efficiency ``cal`` (float8 priced) and ``plain`` (every
    product as bf16), with the baselines."""
    tc = SIZES[MODEL]
    out = []
    for r in TABLE:
        p = project(config(r.seq_len, r.cp), system, 1, GPUS, {"bf16": cal}, memory=memory)
        bf16 = per_gpu(project(config(r.seq_len, r.cp, float8=False), system, 1, GPUS, {"bf16": plain}, memory=False))
        cp_s, cp_exposed = cp_seconds(p)
        ring = ring_seconds(r.seq_len, r.cp, system) if r.cp > 1 else 0.0
        base = (p.step_s or 0.0) - cp_exposed  # the step without context-parallel traffic
        tokens = r.seq_len // r.cp  # per GPU and step: one sequence per data-parallel rank
        anchor = ANCHOR.tps * flops_per_token(tc, ANCHOR.seq_len) / flops_per_token(tc, r.seq_len)
        causal = ANCHOR.tps * causal_flops_per_token(ANCHOR.seq_len) / causal_flops_per_token(r.seq_len)
        mem = None if p.memory_bytes is None else p.memory_bytes / GIB
        out.append(Prediction(r, per_gpu(p), bf16, tokens / (base + ring), tokens / base, anchor, causal, cp_s, ring,
                              p.step_s or 0.0, mem))  # fmt: skip
    return out


def table_line(x: Prediction) -> str:
    """The row of the published table: every number the test checks is in it."""
    r = x.row
    mem = "-" if x.memory_gib is None else f"{x.memory_gib:.1f} | {_pct(x.memory_gib / r.memory_gib - 1)}"
    return (f"| FSDP {r.fsdp}, CP {r.cp} | {r.seq_len:,} | {r.tps:,.0f} | {x.projected:,.0f} | "
            f"{_pct(x.error(x.projected))} | {x.bf16_only:,.0f} | {_pct(x.error(x.bf16_only))} | "
            f"{x.ring_exposed:,.0f} to {x.ring_hidden:,.0f} | "
            f"{_pct(x.error(x.ring_exposed))} to {_pct(x.error(x.ring_hidden))} | {ANCHOR.tps:,.0f} | "
            f"{_pct(x.error(ANCHOR.tps))} | {x.flops_scaled:,.0f} | {_pct(x.error(x.flops_scaled))} | "
            f"{x.cp_s:.2f} s / {x.ring_s:.2f} s of {x.step_s:.1f} s | {r.memory_gib} | {mem} |")  # fmt: skip


def summary(preds: list[Prediction]) -> list[str]:
    """One line per predictor: its errors on the held-out rows (all but the 32k row) and their mean absolute."""
    held = preds[1:]
    out = []
    for label, get in (("projection (Ulysses rows, float8 priced)", lambda x: x.projected),
                       ("projection, every product priced as bf16", lambda x: x.bf16_only),
                       ("projection, ring bytes fully exposed", lambda x: x.ring_exposed),
                       ("FLOPs-scaled baseline (6N + 12 L d T)", lambda x: x.flops_scaled),
                       ("FLOPs-scaled, attention counted causal (6N + 6 L d T)", lambda x: x.causal_scaled),
                       ("constant baseline", lambda x: ANCHOR.tps)):  # fmt: skip
        errs = [x.error(get(x)) for x in held]
        out.append(f"{label}: {', '.join(_pct(e) for e in errs)} on the 64k, 128k and 256k rows; mean absolute "
                   f"{sum(map(abs, errs)) / len(errs):.1%}")  # fmt: skip
    return out


def reading(preds: list[Prediction]) -> list[str]:
    """What the numbers say, computed: how far the ring's bytes move the projection, how close it stays to the
    FLOPs baseline, and the estimate's memory against the published."""
    moved = max(
        max(abs(x.ring_exposed / x.projected - 1), abs(x.ring_hidden / x.projected - 1)) for x in preds
    )
    share = max(max(x.cp_s, x.ring_s) / x.step_s for x in preds)
    gap = max(abs(x.error(x.bf16_only) - x.error(x.flops_scaled)) for x in preds)
    f8 = max(abs(x.error(x.projected) - x.error(x.bf16_only)) for x in preds)
    out = [
        f"CP traffic is at most {share:.1%} of a projected step (Ulysses' all-to-alls or the ring's all-gathers and "
        f"dK/dV passes on NVLink): pricing the ring's bytes instead of Ulysses' moves no row by more than "
        f"{moved:.1%}, exposed or hidden.",
        f"Priced as bf16, the projection stays within {gap * 100:.1f} points of the FLOPs-scaled baseline on every "
        "row: at 32k tokens per GPU the step is compute, and what the projection adds over the FLOPs count is the "
        f"communication, this small. Pricing the float8 Linears moves a row by up to {f8 * 100:.1f} points: their "
        "share of the FLOPs falls as the attention's grows with the sequence.",
    ]
    mems = [x for x in preds if x.memory_gib is not None]
    if mems:
        errs = [x.memory_gib / x.row.memory_gib - 1 for x in mems]
        out.append(f"Memory: the estimate is {_pct(min(errs))} to {_pct(max(errs))} off the published peaks (the "
                   "same 32k tokens per GPU on every row, so the same estimate); both exceed an 80 GB H100 "
                   f"({80e9 / GIB:.1f} GiB): torchtitan's H100s have 96 GB.")  # fmt: skip
    return out


def published_table(preds: list[Prediction]) -> None:
    """Print the published rows against the projection and the baselines."""
    print("| parallelism | sequence | published tokens/s/GPU | projected (Ulysses rows, float8) | error | bf16 only | "
          "error | with the ring's bytes (fully exposed to hidden) | error | constant | error | FLOPs-scaled | error | "
          "CP comm per step: Ulysses / ring, of the step | published memory GiB | estimated GiB | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in preds:
        print(table_line(x))


def picture(system: System, cal: Calibration) -> None:
    """Print the long-context picture: memory per GPU (fits or not) and tokens/s per GPU, one line per setup."""
    setups = [("fsdp", 1, False), ("fsdp + full AC", 1, True)] + [
        (f"fsdp --cp {c} + full AC", c, True) for c in (2, 4, 8)
    ]
    print("| setup | " + " | ".join(f"{t // 1024}k" for t in SEQ_LENS) + " |")
    print("|---|" + "---|" * len(SEQ_LENS))
    for label, cp, ac in setups:
        cells = []
        for t in SEQ_LENS:
            p = project(config(t, cp, ac), system, 1, GPUS, {"bf16": cal})
            gib = (p.memory_bytes or 0) / GIB
            cells.append(f"{gib:.1f} GiB {'fits' if p.fits else 'NO'}, {per_gpu(p):,.0f} tok/s")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    system = resolve("h100-sxm")
    cal, plain = calibrated(system), calibrated(system, float8=False)
    print("# Long context: Llama 3.1 8B on 8 H100, fsdp + context parallelism, against torchtitan's CP table")
    print()
    print("Command: `PYTHONPATH=src python benchmarks/cp_published.py` (benchmarks/cp_published.py says what it "
          f"does). Machine: {platform.machine()} CPU VM, torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}; nothing is measured here: the meta device counts the model, h100-sxm prices "
          "it.")  # fmt: skip
    print()
    print(f"Source: {SOURCE['repo']} `{SOURCE['path']}` at {SOURCE['commit']} (first published in "
          f"{SOURCE['first']}): {SOURCE['table']} Versions: {SOURCE['versions']}. Hardware: {SOURCE['hardware']}. "
          f"Unit: {SOURCE['unit']}. "
          "CP: torch's `context_parallel` (ring attention; torchtitan's `--experimental.context_parallel_rotate_"
          "method` defaults to allgather), the rows as printed:")  # fmt: skip
    print()
    for r in TABLE:
        print(f"    {r.quoted}")
    print()
    f8 = project(config(ANCHOR.seq_len, ANCHOR.cp), system, 1, GPUS, {"bf16": cal}, memory=False).float8
    print(f"Calibration: one bf16 efficiency, {cal.efficiency:.2%} of h100-sxm's dense bf16 peak, reproduces the "
          f"32k row (FSDP 8, CP 1: no CP traffic) with the float8 Linears ({f8['flops_share']:.0%} of its FLOPs) at "
          f"the fp8 default, {f8['efficiency']:.1%} of the fp8 peak ({f8['source']}); every other row is predicted "
          "with it. It holds what the projection does not price: torch.compile and the 500 W HBM2e part's peak "
          f"against the h100-sxm profile's (H100 SXM5 80 GB). Every product priced as bf16 instead: "
          f"{plain.efficiency:.2%} (the bf16-only columns).")  # fmt: skip
    print()
    preds = predict_rows(system, cal, plain)
    published_table(preds)
    print()
    print("Errors on the held-out rows:")
    print()
    for line in summary(preds) + reading(preds):
        print(f"- {line}")
    print()
    print("## The picture: 8B on 8 H100 SXM 80 GB, one sequence per data-parallel rank")
    print()
    print("Estimated memory per GPU (fits 80 GB or NO) and projected tokens/s per GPU with the 32k row's "
          "efficiency (torchtitan's compile in it) and float8 Linears as torchtitan ran them.")  # fmt: skip
    print()
    picture(system, cal)


if __name__ == "__main__":
    main()
