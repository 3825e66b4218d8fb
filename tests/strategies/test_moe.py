"""gpt-moe-tiny (4 experts, top-2, dropless, the load-balancing loss in the training loss) in fp64: ddp, ddp-zero and
fsdp over 2 gloo processes train what one process trains on the same micro-batches, route the same tokens to the same
experts, and the memory estimate holds to the measured peak.

The load-balancing loss is each micro-batch's (``models.moe``: Switch's shares of one batch, as transformers'
Mixtral computes it on each device), so R ranks are compared with one process that accumulates R micro-batches
(``--grad-accum 2``): the data order gives its micro-batches exactly the ranks' samples (conftest's
RTOL_FP32_SAME_MICRO_BATCHES), and each micro-batch then has the same loss, gradient and routing counts."""

from __future__ import annotations

import pytest

from conftest import RTOL, assert_curves_match, assert_estimate_within, ok_curve, tiny_lm_fp64, train

FLAGS = [
    *[a if a != "gpt-tiny" else "gpt-moe-tiny" for a in tiny_lm_fp64(seq=32, batch=8, eval_samples=8)],
    "--max-steps", "4", "--measure-alloc", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("moe") / "single", *FLAGS, "--grad-accum", "2")


def test_one_process_records_active_and_total_parameters_routing_and_holds_its_estimate(single):
    """result.json's moe: 1.87M of 3.05M parameters active, every one of 4 steps x 8 x 32 tokens x 2 experts
    routed in each of the 4 layers and none dropped, a load-balancing loss >= 1 (1 is uniform); MFU's FLOPs are
    the active ones; the memory estimate within 10% of the allocator peak."""
    moe = single["moe"]
    assert moe["active_parameters"] == single["model_meta"]["active_parameters"] == 1_872_576
    assert moe["total_parameters"] == single["model_meta"]["num_parameters"] == 3_052_224
    assert moe["layers"] == 4 and moe["routing"] == "dropless" and moe["dropped_tokens"] == 0
    assert [sum(row) for row in moe["tokens_per_expert"]] == [4 * 8 * 32 * 2] * 4
    assert moe["load_imbalance"] == max(moe["load_imbalance_per_layer"]) >= 1
    assert moe["aux_loss"] >= 1 - 1e-12
    assert_estimate_within(single, 0.10)


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "ddp-zero", "fsdp"])
def test_ddp_ddp_zero_and_fsdp_train_and_route_what_one_process_does(tmp_path, single, strategy):
    """The loss curve (cross-entropy + 0.01 x the load-balancing loss) within 1e-9 of one process's, the same
    tokens per expert in every layer, the same mean load-balancing loss; fsdp (each block a unit) with activation
    checkpointing, whose recomputed forwards are not counted again."""
    extra = ["--activation-checkpointing", "true"] if strategy == "fsdp" else []
    res = train(tmp_path / strategy, *FLAGS, "--strategy", strategy, *extra, nproc=2)
    assert_curves_match(ok_curve(res), single["metrics"]["loss_curve"], RTOL)
    assert res["moe"]["tokens_per_expert"] == single["moe"]["tokens_per_expert"]
    assert res["moe"]["aux_loss"] == pytest.approx(single["moe"]["aux_loss"], rel=1e-9)
    if strategy == "fsdp":
        assert res["transforms"][0] == "activation_checkpointing"


def test_top_1_with_a_capacity_factor_drops_and_counts_the_assignments_past_capacity(tmp_path):
    """--moe-top-k 1 --capacity-factor 1.0: 1.28M parameters active (1 of 4 experts), assignments dropped once the
    router favours an expert (each expert keeps at most 256 x 1 / 4 = 64 of a micro-batch's 256), their share of
    the 4 steps x 256 tokens x 4 layers reported; checkpoint meta holds the routing that inference rebuilds; the memory
    estimate within 10% of the allocator peak."""
    res = train(tmp_path / "cap", *FLAGS, "--moe-top-k", "1", "--capacity-factor", "1.0")
    moe = res["moe"]
    assert moe["top_k"] == 1 and moe["routing"] == "capacity factor 1"
    assert moe["active_parameters"] == res["model_meta"]["active_parameters"] == 1_282_752
    assert (res["model_meta"]["moe_top_k"], res["model_meta"]["capacity_factor"]) == (1, 1.0)
    assert [sum(row) for row in moe["tokens_per_expert"]] == [4 * 8 * 32] * 4
    assert 0 < moe["dropped_tokens"] < 4 * 8 * 32 * 4 * 3 / 4
    assert moe["dropped_fraction"] == moe["dropped_tokens"] / (4 * 8 * 32 * 4)
    assert_estimate_within(res, 0.10)  # the trace applies the capacity as the layer does (measured +0.4%)
