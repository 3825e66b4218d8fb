"""What expert parallelism costs (``fsdp --ep E``, ``strategies/parallel/ep_costs.py``): in memory each rank holds
experts / E of every MoE layer whole with their gradients and Adam moments, the dense parts as FSDP2 shards, and the
units it gathers hold no expert (on a 2-process run with a capacity factor it holds to the allocator peak); the
projection prices the all-to-alls at the busiest rank a calibration run's routing implies, else at a stated
default; advise offers the ep degrees a mixture of experts takes and says which fits and is fastest."""

from __future__ import annotations

import pytest

from conftest import assert_estimate_within, tiny_lm_fp64, train
from stratbench.core.config import TrainConfig
from stratbench.measuring.hardware import resolve
from stratbench.measuring.records import RunRecord
from stratbench.models.transformer import SIZES
from stratbench.predicting.advise import applicable, candidates, ep_choice
from stratbench.predicting.estimate import estimate
from stratbench.predicting.projection import calibrate, project
from stratbench.strategies.parallel.ep_costs import DEFAULT_IMBALANCE, rank_imbalance

FLAGS = [a if a != "gpt-tiny" else "gpt-moe-tiny" for a in tiny_lm_fp64(seq=32, batch=8, eval_samples=8)]
FLAGS = [*FLAGS[: FLAGS.index("--clip-grad-norm")], "--max-steps", "3", "--measure-alloc", "true"]


def cfg(ep: int, world: int, model: str = "gpt-moe-tiny") -> TrainConfig:
    return TrainConfig(
        model=model, data="text", seq_len=32, batch_size=8, precision="fp64", optimizer="adamw",
        strategy="fsdp", strategy_options={"ep": ep} if ep > 1 else {},
    )  # fmt: skip


@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_holds_its_experts_whole_and_the_dense_parts_sharded(ep):
    """Parameters, gradients and AdamW moments under --ep E (= world) are plain fsdp's: experts / E whole hold
    the elements of FSDP2's 1/world dim-0 shard of the stacked (4, ...) weights (fp64: 8 bytes an element, 2
    moments); the gathered units lose the experts (a block's 4 experts, 3 x 4 x 256 x 128 elements, no longer
    gathered: the current unit, the prefetched one and the reduce-scatter buffer of the largest) and gain the
    exchange's send and return buffers of T x k rows of dim."""
    tc = SIZES["gpt-moe-tiny"]
    plain, ep_est = estimate(cfg(1, ep), ep, "cpu"), estimate(cfg(ep, ep), ep, "cpu")
    rows, ep_rows = {r.component: r for r in plain.rows}, {r.component: r for r in ep_est.rows}
    assert ep_rows["parameters"].device_bytes == rows["parameters"].device_bytes
    assert ep_rows["gradients"].device_bytes == ep_rows["parameters"].device_bytes
    assert ep_rows["optimizer states"].device_bytes == 2 * ep_rows["parameters"].device_bytes
    tokens = 8 // ep * 32
    exchange = 2 * tokens * tc.moe_top_k * tc.dim * 8
    block_experts = 3 * tc.n_experts * tc.moe_hidden * tc.dim * 8
    want = rows["gathered parameters"].device_bytes - 3 * block_experts + exchange
    assert ep_rows["gathered parameters"].device_bytes == want
    assert f"{tc.n_experts // ep} of {tc.n_experts} experts" in ep_rows["parameters"].note


def test_the_busiest_rank_of_an_ep_group_is_read_from_the_tokens_per_expert():
    """Layer 1's ranks receive 30 + 10 and 40 + 20 rows (ep 2): 60 / 50; layer 2's balanced: 1; the largest."""
    assert rank_imbalance([[30, 10, 40, 20], [25, 25, 25, 25]], 2) == pytest.approx(1.2)
    assert rank_imbalance([[30, 10, 40, 20]], 4) == pytest.approx(1.6)
    assert rank_imbalance([[25, 25, 25, 25]], 1) == 1.0


@pytest.mark.distributed
def test_ep_2_with_a_capacity_factor_holds_its_estimate(tmp_path):
    """fsdp --ep 2 --capacity-factor 1.25 on 2 processes (fp64): the estimate within 10% of the busier rank's
    allocator peak (measured +2.7%; plain fsdp priced the experts as gathered shards: +16.4% on such a run)."""
    res = train(
        tmp_path / "ep", *FLAGS, "--strategy", "fsdp", "--ep", "2", "--capacity-factor", "1.25", nproc=2
    )
    assert res["moe"]["routing"] == "capacity factor 1.25"
    assert_estimate_within(res, 0.10)


def test_the_projection_prices_the_exchanges_at_the_busiest_rank_measured_else_the_default():
    """fsdp --ep 2 on 2 H100: the all-to-alls' bytes are the balanced formula's x the busiest rank's share, read
    from a one-device MoE calibration run's result.json (``moe.tokens_per_expert``: ranks of 2 experts receiving
    100 + 60 and 20 + 20 rows: 160 / 100), on the critical path, the source said; without a routed calibration x
    the stated default."""
    system, c = resolve("h100-sxm"), cfg(2, 2).replace(precision="bf16-mixed")
    routed = [[100, 60, 20, 20]] * SIZES["gpt-moe-tiny"].n_layers
    run = {
        "status": "ok", "world_size": 1, "config": c.replace(strategy="single", strategy_options={}).to_dict(),
        "environment": {"device_type": "cuda", "gpus": ["NVIDIA H100 80GB HBM3"]},
        "metrics": {"step_time_median_s": 0.05}, "moe": {"tokens_per_expert": routed},
    }  # fmt: skip
    cal = calibrate([RunRecord.from_dict(run)], system)["bf16"]
    assert cal.tokens_per_expert == routed

    def a2a(calibration) -> list[dict]:
        rows = project(c, system, 1, 2, calibration, memory=False).comm_rows
        return [r for r in rows if r["kind"] == "all_to_all"]

    plain, busy = a2a(None), a2a({"bf16": cal})
    assert len(plain) == len(busy) == 2 and all(r["critical"] for r in plain + busy)
    for p, b in zip(plain, busy, strict=True):
        assert b["payload_bytes"] == pytest.approx(p["payload_bytes"] / DEFAULT_IMBALANCE * 1.6, rel=1e-6)
        assert f"measured ({cal.source})" in b["note"] and "default" in p["note"]


def test_advise_offers_the_ep_degrees_a_mixture_of_experts_takes_and_names_the_fastest_that_fits():
    """4 devices: gpt-moe-tiny (4 experts) is offered fsdp --ep 4, a dense gpt-tiny no ep plan; ``ep_choice`` names
    the fastest degree of those that fit, or says none fits."""

    def eps(model: str) -> list[str]:
        plans, _ = applicable(cfg(1, 4, model), candidates(4), 4, "cpu")
        return [p.label for p in plans if "ep" in dict(p.options)]

    assert "fsdp --sharding full --ep 4" in eps("gpt-moe-tiny") and eps("gpt-tiny") == []
    ranking = [
        {"plan": "fsdp --sharding full", "fits": True, "step_s": 0.5},
        {"plan": "fsdp --sharding full --ep 2", "fits": True, "step_s": 0.3},
        {"plan": "fsdp --sharding full --ep 4", "fits": True, "step_s": 0.2},
        {"plan": "fsdp --sharding full --ep 8", "fits": False, "step_s": 0.1},
    ]
    line = ep_choice(ranking)
    assert (
        line.startswith("expert parallelism: --ep 4 is the fastest degree that fits")
        and "--ep 8 does not fit" in line
    )
    assert (
        ep_choice(ranking[3:]).startswith("expert parallelism: no degree fits")
        and ep_choice(ranking[:1]) is None
    )
