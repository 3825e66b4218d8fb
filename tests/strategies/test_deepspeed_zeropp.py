"""DeepSpeed ZeRO++ (--zero-hpz, --zero-quantized-weights, --zero-quantized-gradients) on CPU: hpZ on 4 gloo
processes against `single --grad-accum 4` and its formula; the refusals, the config and the quantised rows
without processes (qwZ and qgZ need DeepSpeed's CUDA quantizer: benchmarks/gpu_session.sh runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import (
    RTOL_FP32_FOUR_RANKS,
    TINY,
    assert_comm_matches_formula,
    assert_curves_match,
    train,
)
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.strategies.costs import MemoryContext
from stratbench.strategies.deepspeed import DeepSpeed, DeepSpeedOptions
from stratbench.strategies.parallel.deepspeed_config import build_ds_config
from stratbench.strategies.parallel.zero import quant_groups

CPU = torch.device("cpu")
RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
"""ZeRO-3 settings under which every parameter is freed after forward and gathered again for backward (a small
model otherwise stays gathered: the persistence threshold and the prefetcher keep it), so hpZ's backward
all-gather runs."""


@pytest.mark.distributed
@pytest.mark.equivalence
def test_hpz_trains_like_single_and_sends_what_its_formula_says(tmp_path):
    """hpZ (S = 2 of 4 ranks, set by the flag over a user's JSON) reproduces `single --grad-accum 4` up to the order
    of the 4-rank gradient sum (conftest.RTOL_FP32_FOUR_RANKS), as plain ZeRO-3 does; its collectives equal the
    formula to the byte: forward all-gather over the 4 ranks, the backward one from the secondary partition over 2,
    the gradients reduce-scattered over 4."""
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": RELEASE_ALL}))
    steps = ["--max-steps", "4"]
    res = train(tmp_path / "hpz", "--strategy", "deepspeed", "--zero-stage", "3", "--zero-hpz", "2",
                "--deepspeed-config", str(user), *TINY, *steps, "--comm-volume", "true", nproc=4, timeout=300)  # fmt: skip
    ref = train(tmp_path / "single", "--strategy", "single", *TINY, *steps, "--grad-accum", "4")
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL_FP32_FOUR_RANKS)
    comm = assert_comm_matches_formula(res, tol=0.0)
    phi = sum(-(-n // 4) * 4 for n in model_info(ModelSpec.from_config(_cfg())).numels) * 4  # fp32, padded to 4
    assert comm["measured"]["all_gather"]["payload_bytes"] == 2 * phi, comm["measured"]
    gathers = {r["phase"]: r for r in comm["predicted"] if r["kind"] == "all_gather"}
    assert (gathers["forward"]["group_size"], gathers["forward"]["dim"]) == (4, "")
    assert (gathers["backward"]["group_size"], gathers["backward"]["dim"]) == (2, "hpz")
    zero = json.loads((Path(res["config"]["output"]) / "deepspeed_config.json").read_text())["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2 and zero["stage3_max_reuse_distance"] == 0
    assert res["mesh"] == {"dp": 2, "hpz": 2}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"model": "tinynet", "width": 8, "norm": "none", "data": "digits", "batch_size": 32,
                          "strategy": "deepspeed", **kw})  # fmt: skip


def _cost(cfg: TrainConfig, world: int, **opts):
    """(comm_model's rows, mesh_dims, memory_model) of deepspeed ZeRO-3 with ``opts``, priced for a GPU run."""
    options = DeepSpeedOptions(zero_stage=3, **opts)
    ctx = MemoryContext(cfg, world, model_info(ModelSpec.from_config(cfg)), options, "cuda")
    cost = DeepSpeed.cost
    return cost.comm_model(ctx), cost.mesh_dims(ctx), cost.memory_model(ctx, 0)


def test_zeropp_bad_input_is_one_line_before_any_work(tmp_path, monkeypatch):
    """Stage < 3, S < 1, S not dividing a node's ranks or larger than the node (--nnodes, or one machine's
    world), a JSON disagreeing with a flag: ConfigError naming the numbers; qwZ / qgZ on CPU: a refusal
    with DeepSpeed's reason (what `list --check` and a compare cell show)."""
    cfg = _cfg()
    for opts, msg in [
        ({"zero_hpz": 2}, "--zero-hpz 2 needs --zero-stage 3 .* got stage 2"),
        ({"zero_stage": 1, "zero_quantized_gradients": True}, "--zero-quantized-gradients needs --zero-stage 3"),
        ({"zero_stage": 3, "zero_hpz": 0}, "--zero-hpz must be a positive integer"),
        ({"zero_stage": 3, "zero_hpz": 3}, "--zero-hpz 3 does not divide the node's ranks: 4 ranks per node .*1, 2, 4"),
        ({"zero_stage": 3, "zero_hpz": 8}, "--zero-hpz 8 is larger than the node: 4 ranks per node"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            build_ds_config(cfg, DeepSpeedOptions(**opts), 4)
    with pytest.raises(ConfigError, match="--zero-hpz 8 is larger than the node: 4 ranks per node .world 8 over 2 nodes"):
        build_ds_config(cfg.replace(nnodes=2), DeepSpeedOptions(zero_stage=3, zero_hpz=8), 8)
    with monkeypatch.context() as m:  # a launcher's node: torchrun --nproc-per-node 2 --nnodes 2
        m.setenv("LOCAL_WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match="--zero-hpz 4 is larger than the node: 2 ranks per node .world 4 over 2 nodes"):
            build_ds_config(cfg, DeepSpeedOptions(zero_stage=3, zero_hpz=4), 4)
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}))
    with pytest.raises(ConfigError, match="zero_hpz_partition_size is 4 but --zero-hpz gives 2"):
        build_ds_config(cfg, DeepSpeedOptions(deepspeed_config=str(user), zero_hpz=2), 4)
    for flag in ("zero_quantized_weights", "zero_quantized_gradients"):
        why = DeepSpeed.check_supported(_cfg(strategy_options={"zero_stage": 3, flag: True}), CPU, 4)
        assert "CUDA-only" in why and "This op had not been implemented on CPU backend" in why, why
    assert DeepSpeed.check_supported(_cfg(strategy_options={"zero_stage": 3, "zero_hpz": 2}), CPU, 4) is None


def test_zeropp_keys_reach_the_config_from_flags_and_from_a_users_json(tmp_path):
    flags = build_ds_config(_cfg(), DeepSpeedOptions(zero_stage=3, zero_hpz=2, zero_quantized_weights=True,
                                                     zero_quantized_gradients=True), 4)["zero_optimization"]  # fmt: skip
    assert (flags["zero_hpz_partition_size"], flags["zero_quantized_weights"], flags["zero_quantized_gradients"]) == (2, True, True)
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True}}))
    opts = DeepSpeedOptions(deepspeed_config=str(user))
    assert build_ds_config(_cfg(), opts, 4)["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert "CUDA-only" in DeepSpeed.check_supported(_cfg(strategy_options={"deepspeed_config": str(user)}), CPU, 4)
    assert "zero_hpz_partition_size" not in build_ds_config(_cfg(), DeepSpeedOptions(zero_stage=3), 4)["zero_optimization"]


def test_zeropp_rows_memory_and_mesh_without_processes(tmp_path):
    """hpZ's backward gather over S (dim hpz, none where DeepSpeed keeps the parameters gathered) and its
    secondary partition's memory; qwZ: int8 weights and fp32 block scales (DeepSpeed's block rule); qgZ on 2
    nodes: int4 all-to-alls inside the node (L ranks) then across (one rank per node) at 1/L, for the gradients
    DeepSpeed's rule takes; on one node qgZ keeps the reduce-scatter."""
    release = tmp_path / "release.json"
    release.write_text(json.dumps({"zero_optimization": RELEASE_ALL}))
    cfg = _cfg().replace(nnodes=2)
    info = model_info(ModelSpec.from_config(cfg))
    phi = sum(-(-n // 8) * 8 for n in info.numels)  # elements, each parameter padded to the world (8)
    rows, mesh, _ = _cost(cfg, 8, zero_hpz=4)
    assert mesh == {"dp": 2, "hpz": 4} and not [r for r in rows if r.phase == "backward" and r.kind == "all_gather"]
    rows, _, hpz = _cost(cfg, 8, zero_hpz=4, deepspeed_config=str(release))
    back = [r for r in rows if r.phase == "backward" and r.kind == "all_gather"]
    assert [(r.payload_bytes, r.group_size, r.dim) for r in back] == [(phi * 4, 4, "hpz")]
    _, _, plain = _cost(cfg, 8, deepspeed_config=str(release))
    assert hpz.gathered - plain.gathered == phi // 4 * 4  # the secondary partition: 1/S of the fp32 parameters
    rows, _, _ = _cost(cfg, 8, zero_quantized_weights=True, deepspeed_config=str(release))
    int8 = [r for r in rows if r.note.startswith("int8")]
    scales = [r for r in rows if r.note.startswith("fp32 block scales of")]
    assert [r.payload_bytes for r in int8] == [phi, phi]  # forward and backward, one byte per weight
    want = sum(4 * quant_groups(-(-n // 8)) * 8 for n in info.numels)
    assert [r.payload_bytes for r in scales] == [want, want]
    assert (quant_groups(64_000), quant_groups(2**21), quant_groups(24), quant_groups(8 * 8009)) == (8, 512, 1, 8009)
    rows, mesh, _ = _cost(cfg, 8, zero_quantized_gradients=True)
    assert mesh == {"node": 2, "local": 4}
    a2a = [r for r in rows if r.kind == "all_to_all"]
    taken = [s for n, s in zip(info.numels, info.param_shapes, strict=True) if len(s) > 1 and n % 16 == 0]
    numel = [torch.Size(s).numel() for s in taken]
    assert [(r.group_size, r.dim) for r in a2a] == [(4, "local"), (4, "local"), (2, "node"), (2, "node")]
    assert [r.payload_bytes for r in a2a] == [
        sum(numel) // 2, sum(4 * max(s[0], s[1], 8) for s in taken),
        sum(n // 8 for n in numel), sum(max(s[0], s[1], 8) for s in taken),
    ]  # fmt: skip
    one_node, _, _ = _cost(_cfg(), 4, zero_quantized_gradients=True)
    assert not [r for r in one_node if r.kind == "all_to_all"] and [r for r in one_node if r.kind == "reduce_scatter"]
