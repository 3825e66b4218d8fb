"""LoRA runs (`train --lora-rank 4`, gpt-tiny in fp64): one process records the trainable and total parameters and
the transform, holds gradients and optimizer state for the adapters only, and its memory estimate holds to its own
measured peak; ddp and fsdp (FSDP2) over 2 gloo processes train exactly what it trains, and on every rank the
frozen base has no gradient and no optimizer state (each rank's bytes are the adapters' or their shard)."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import RTOL, assert_curves_match, assert_estimate_within, tiny_lm_fp64, train
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
    half of them (fsdp's dim-0 shards; every adapter's dim 0 is even), the frozen base's none."""
    res = train(tmp_path / strategy, *FLAGS, "--strategy", strategy, nproc=2)
    assert res["transforms"] == ["lora:r4", "precision:fp64"] and res["world_size"] == 2
    assert_curves_match(res["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL)
    numel, count = _adapters()
    share = 2 if strategy == "fsdp" else 1
    assert res["sharding"]["grad_bytes"] == res["sharding"]["trainable_param_bytes"] == [8 * numel // share] * 2
    assert res["sharding"]["optimizer_state_bytes"] == [2 * 8 * numel // share + 4 * count] * 2
    if strategy == "fsdp":
        assert_estimate_within(res, 0.10)
