"""LoRA runs (`train --lora-rank 4`, gpt-tiny in fp64): one process records the trainable and total parameters and
the transform, holds gradients and optimizer state for the adapters only, and its memory estimate holds to its own
measured peak; ddp and fsdp (FSDP2) over 2 gloo processes train exactly what it trains, and on every rank the
frozen base has no gradient and no optimizer state (each rank's bytes are the adapters' or their shard)."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import (
    RTOL,
    RTOL_FP32_SAME_MICRO_BATCHES,
    assert_curves_match,
    assert_estimate_within,
    tiny_lm_fp64,
    train,
)
from stratbench.core.config import TrainConfig
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.models.transforms.lora import adapter_shapes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the lora extra)")

FLAGS = [*tiny_lm_fp64(eval_samples=8), "--max-steps", "3", "--lora-rank", "4", "--measure-alloc", "true"]


def _adapters() -> tuple[int, int]:
    """(elements, parameter count) of gpt-tiny's rank-4 adapters on every Linear but the head."""
    cfg = TrainConfig(model="gpt-tiny", data="text", seq_len=32, lora_rank=4)
    info = model_info(ModelSpec.from_config(cfg))
    shapes = adapter_shapes(info.linear_names, info.linear_features, cfg)
    return sum(n for n, _ in shapes), len(shapes)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("lora") / "single", *FLAGS)


def test_a_lora_run_records_and_holds_the_adapters_only(single):
    """result.json: transforms ['lora:r4', 'precision:fp64'], trainable = the adapters, total = base + adapters;
    gradients 8 bytes and AdamW's two states per adapter element (+ a 4-byte step each); the estimate within 10%."""
    numel, count = _adapters()
    meta = single["model_meta"]
    assert single["transforms"] == ["lora:r4", "precision:fp64"]
    assert meta["trainable_parameters"] == numel and meta["num_parameters"] == single["sharding"]["param_bytes"][0] // 8
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": "all-linear"}
    assert single["sharding"]["grad_bytes"] == single["sharding"]["trainable_param_bytes"] == [8 * numel]
    assert single["sharding"]["optimizer_state_bytes"] == [2 * 8 * numel + 4 * count]
    assert_estimate_within(single, 0.10)


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_train_what_one_process_trains(tmp_path, single, strategy):
    """The same loss curve to 1e-9 (fp64); per rank the gradients and optimizer state are the adapters' (ddp) or
    half of them (fsdp's dim-0 shards; every adapter's dim 0 is even), the frozen base's none; the gradients'
    collective (DDP's all-reduce, FSDP2's reduce-scatter), measured on step 3, carries exactly the adapters'
    bytes, and the communication formula says so."""
    res = train(tmp_path / strategy, *FLAGS, "--strategy", strategy, "--comm-volume", "true", nproc=2)
    assert res["transforms"] == ["lora:r4", "precision:fp64"] and res["world_size"] == 2
    assert_curves_match(res["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL)
    numel, count = _adapters()
    share = 2 if strategy == "fsdp" else 1
    assert res["sharding"]["grad_bytes"] == res["sharding"]["trainable_param_bytes"] == [8 * numel // share] * 2
    assert res["sharding"]["optimizer_state_bytes"] == [2 * 8 * numel // share + 4 * count] * 2
    kind = "reduce_scatter" if strategy == "fsdp" else "all_reduce"
    comm = res["metrics"]["comm"]
    for rank in comm["measured_per_rank"]:
        assert rank["per_step"][kind]["payload_bytes"] == 8 * numel
    assert comm["check"][kind]["predicted_payload_bytes"] == 8 * numel
    if strategy == "fsdp":
        assert_estimate_within(res, 0.10)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_fsdp1_trains_what_one_process_trains(tmp_path):
    """fsdp1 wraps PEFT's lora_A / lora_B (nn.Linear) as FlatParameters of their own, so every flat parameter is
    all frozen or all trained: the same curve as one process (fp64, 1e-9; without clipping, which FSDP1 does in
    fp32 only), half the adapters' gradients and state per rank, their bytes reduce-scattered and no more."""
    flags = [f for f in FLAGS if f not in ("--clip-grad-norm", "0.5")]
    ref = train(tmp_path / "single", *flags)
    res = train(tmp_path / "fsdp1", *flags, "--strategy", "fsdp1", "--comm-volume", "true", nproc=2)
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
    numel, count = _adapters()
    assert res["sharding"]["grad_bytes"] == [8 * numel // 2] * 2
    assert res["sharding"]["optimizer_state_bytes"] == [2 * 8 * numel // 2 + 4 * count] * 2
    check = res["metrics"]["comm"]["check"]["reduce_scatter"]
    assert check["measured_payload_bytes"] == check["predicted_payload_bytes"] == 8 * numel
    assert_estimate_within(res, 0.10)


FP32 = [*(f for f in FLAGS if f not in ("--precision", "fp64", "--measure-alloc", "true")), "--precision", "fp32"]
ZERO3_RTOL = 1e-6
"""ZeRO-3 with LoRA on gpt-tiny: one fp32 ulp of the loss apart from one process at step 2 (measured 9.6e-8, with
and without clipping); ZeRO-1/2 are bit-identical (RTOL_FP32_SAME_MICRO_BATCHES)."""


@pytest.fixture(scope="module")
def single_fp32_accum2(tmp_path_factory) -> dict:
    """One process, fp32, the 2 micro-batches 2 ranks compute (DeepSpeed's reference: it has no fp64)."""
    return train(tmp_path_factory.mktemp("lora") / "single-fp32", *FP32, "--grad-accum", "2")


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_deepspeed_zero_stages_train_what_one_process_trains(tmp_path, single_fp32_accum2, stage):
    """DeepSpeed is given the adapters only (``model_parameters``): under ZeRO-1/2/3 the fp32 curve equals one
    process's on the same micro-batches, and each rank's gradient partition and optimizer state hold half the
    adapters (fp32 master partitions; the frozen base has none)."""
    res = train(tmp_path / f"z{stage}", *FP32, "--strategy", "deepspeed", "--zero-stage", stage, nproc=2, timeout=240)
    rtol = ZERO3_RTOL if stage == "3" else RTOL_FP32_SAME_MICRO_BATCHES
    assert_curves_match(res["metrics"]["loss_curve"], single_fp32_accum2["metrics"]["loss_curve"], rtol)
    numel, _ = _adapters()
    for b in res["sharding"]["optimizer_state_bytes"]:
        assert abs(b - 2 * 4 * numel // 2) <= 64, res["sharding"]
