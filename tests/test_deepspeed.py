"""The deepspeed strategy on CPU: 2 gloo processes through stratbench's torchrun launcher.

DeepSpeed has no fp64 mode (its ZeRO optimizers keep fp32 master weights, gradient partitions and optimizer
state whatever the weights' dtype), so its equivalence is checked in fp32, where it holds by construction too:
against `single` with the same micro-batch shapes (conftest.RTOL_FP32_SAME_SHAPES; ZeRO-2 and ZeRO-3 with offload
reproduce ddp's fp32 curve bit for bit), and ZeRO-1 with accumulation against ddp with accumulation, which it
reproduces bit for bit (measured 0.0 under the AVX2 and SSE4.1 caps); ddp itself matches `single` in fp64.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import (
    COMM,
    RTOL_FP32_SAME_SHAPES,
    TINY,
    assert_comm_matches_formula,
    assert_curves_match,
    run_stratbench,
    train,
)

pytestmark = pytest.mark.distributed

DS = ["--strategy", "deepspeed"]
TIMEOUT = 240


def _curve(res: dict) -> list[float]:
    assert res["status"] == "ok", res.get("reason")
    return res["metrics"]["loss_curve"]


def _half(rank_bytes: list[int], full: int) -> None:
    """Each of the 2 ranks holds about half (flat partitions are padded to an alignment: a few bytes)."""
    assert len(rank_bytes) == 2
    for b in rank_bytes:
        assert 0.45 * full <= b <= 0.55 * full, (rank_bytes, full)


@pytest.fixture(scope="module")
def zero2(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("ds") / "z2", *DS, "--zero-stage", "2", *TINY, *COMM, nproc=2, timeout=TIMEOUT)


def _fp32(fp64_bytes: int) -> int:
    """The fp64 reference's byte count as fp32 (DeepSpeed's states are fp32)."""
    return fp64_bytes // 2


@pytest.mark.equivalence
def test_zero2_matches_single_and_shards_gradients_and_optimizer_state(zero2, reference_run, reference_fp32_same_shapes):
    assert_curves_match(_curve(zero2), _curve(reference_fp32_same_shapes), RTOL_FP32_SAME_SHAPES)
    full = reference_run["sharding"]
    _half(zero2["sharding"]["optimizer_state_bytes"], _fp32(full["optimizer_state_bytes"][0]))
    _half(zero2["sharding"]["grad_bytes"], _fp32(full["grad_bytes"][0]))
    assert zero2["sharding"]["param_bytes"] == [_fp32(full["param_bytes"][0])] * 2  # ZeRO-2 replicates parameters
    assert_comm_matches_formula(zero2)  # fp32: gradients all-reduced (Φ), updated partitions all-gathered (Φ)
    cfg = json.loads((Path(zero2["config"]["output"]) / "deepspeed_config.json").read_text())
    assert cfg["train_batch_size"] == 32 and cfg["train_micro_batch_size_per_gpu"] == 16
    assert cfg["zero_optimization"]["stage"] == 2 and "fp16" not in cfg and "bf16" not in cfg


@pytest.mark.equivalence
def test_zero1_grad_accum_2_matches_ddp(tmp_path, reference_run):
    """Accumulation maps onto DeepSpeed's boundary: loss/2 from the loop, scale_wrt_gas=False, one step(). It
    reproduces ddp's accumulation bit for bit; ddp's accumulation matches `single` in fp64 (test_ddp)."""
    res = train(tmp_path / "z1", *DS, "--zero-stage", "1", *TINY, "--grad-accum", "2", nproc=2, timeout=TIMEOUT)
    ddp = train(tmp_path / "ddp", "--strategy", "ddp", *TINY, "--grad-accum", "2", nproc=2, timeout=TIMEOUT)
    assert res["micro_batch_size"] == ddp["micro_batch_size"] == 8
    assert len(_curve(res)) == 20
    assert_curves_match(_curve(res), _curve(ddp), 1e-12)
    _half(res["sharding"]["optimizer_state_bytes"], _fp32(reference_run["sharding"]["optimizer_state_bytes"][0]))


@pytest.mark.equivalence
def test_zero3_resume_equals_uninterrupted_and_consolidates_for_single(tmp_path, zero2, reference_run):
    """ZeRO-3 trained as 10 steps + resume to 20 reproduces the uninterrupted ZeRO-2 run exactly; the
    consolidated checkpoint, loaded into a single-device model, gives the same val accuracy."""
    out = tmp_path / "z3"
    first = train(out, *DS, "--zero-stage", "3", *TINY, "--max-steps", "10", nproc=2, timeout=TIMEOUT)
    meta_dir = out / "checkpoints" / "last"
    assert (meta_dir / "stratbench_meta.pt").is_file()
    second = train(out, *DS, "--zero-stage", "3", *TINY, "--resume", nproc=2, timeout=TIMEOUT)
    assert second["resumed_from"]["step"] == 10 and second["metrics"]["steps"] == 10
    assert _curve(first) + _curve(second) == _curve(zero2)  # exact: same reductions, exact resume
    full = reference_run["sharding"]
    _half(second["sharding"]["param_bytes"], _fp32(full["param_bytes"][0]))
    _half(second["sharding"]["optimizer_state_bytes"], _fp32(full["optimizer_state_bytes"][0]))

    consolidated = tmp_path / "z3.pt"
    run_stratbench("consolidate", str(meta_dir), str(consolidated), timeout=120)
    ev = json.loads(run_stratbench("evaluate", "--checkpoint", str(consolidated), "--device", "cpu", "--json", timeout=120).stdout)
    assert ev["val_accuracy"] == second["metrics"]["val_accuracy"]


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_bf16_trains_under_every_zero_stage(tmp_path, stage, reference_run):
    res = train(tmp_path / f"bf16-z{stage}", *DS, "--zero-stage", stage, *TINY, "--precision", "bf16-mixed", *COMM, nproc=2, timeout=TIMEOUT)
    curve = _curve(res)
    assert len(curve) == 20 and all(x == x for x in curve)
    # bf16 weights and activations: close to fp64 early, and it learns (the fp64 run goes from ~2.3 to ~1.1 here).
    assert abs(curve[0] - reference_run["metrics"]["loss_curve"][0]) < 0.05
    assert sum(curve[-5:]) < 0.7 * sum(curve[:5])
    cfg = json.loads((tmp_path / f"bf16-z{stage}" / "deepspeed_config.json").read_text())
    assert cfg["bf16"]["enabled"] is True
    # fp32 optimizer state (momentum over the fp32 master partitions).
    _half(res["sharding"]["optimizer_state_bytes"], _fp32(reference_run["sharding"]["optimizer_state_bytes"][0]))
    # bf16 traffic: stages 1/2 all-reduce the gradients and all-gather the updated partitions, stage 3
    # all-gathers every parameter and reduce-scatters the gradients (deepspeed.deepspeed_comm).
    comm = assert_comm_matches_formula(res)
    phi_bf16 = sum(reference_run["sharding"]["param_bytes"]) // 4
    main = "reduce_scatter" if stage == "3" else "all_reduce"
    assert abs(comm["measured"][main]["payload_bytes"] - phi_bf16) <= 16, comm["measured"]


def test_conflicting_user_json_is_one_clear_error(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2}}))
    out = tmp_path / "out"
    proc = run_stratbench("train", "--output", str(out), *DS, "--deepspeed-config", str(user), *TINY, "--nproc", "2", check=False, timeout=60)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "train_batch_size is 64" in lines[0] and "--batch-size" in lines[0] and "32" in lines[0]
    assert not (out / "result.json").exists()  # refused before any work


def test_option_errors_and_refusals_need_no_processes():
    from stratbench.config import TrainConfig
    from stratbench.errors import ConfigError
    from stratbench.strategies.deepspeed import DeepSpeed, DeepSpeedOptions, build_ds_config

    cpu = __import__("torch").device("cpu")
    cfg = TrainConfig(strategy="deepspeed", batch_size=32, precision="fp16-mixed", clip_grad_norm=1.0, grad_accum=2)
    ds = build_ds_config(cfg, DeepSpeedOptions(zero_stage=3, offload_params="cpu"), 2)
    assert ds["fp16"]["loss_scale"] == 0 and ds["gradient_clipping"] == 1.0 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu" and ds["train_micro_batch_size_per_gpu"] == 8
    with pytest.raises(ConfigError, match="--offload-params cpu needs --zero-stage 3"):
        build_ds_config(cfg, DeepSpeedOptions(zero_stage=2, offload_params="cpu"), 2)
    bf16 = TrainConfig(strategy="deepspeed", precision="bf16-true")
    assert "fp32 master weights" in DeepSpeed.check_supported(bf16, cpu, 2)
    assert "no fp64 mode" in DeepSpeed.check_supported(TrainConfig(strategy="deepspeed", precision="fp64"), cpu, 2)
    adam = TrainConfig(strategy="deepspeed", strategy_options={"ds_optimizer": "fused"}, optimizer="adamw")
    assert "needs a GPU" in DeepSpeed.check_supported(adam, cpu, 2)


def test_list_does_not_import_deepspeed():
    code = "import sys; from stratbench.strategies.base import all_strategies; all_strategies(); print('deepspeed' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.equivalence
def test_zero3_with_cpu_offload_trains_the_same_model(tmp_path, reference_fp32_same_shapes):
    """ZeRO-Offload (optimizer and parameters on the CPU) changes where states live, not the arithmetic."""
    res = train(tmp_path / "offload", *DS, "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
                *TINY, nproc=2, timeout=TIMEOUT)  # fmt: skip
    assert_curves_match(_curve(res), _curve(reference_fp32_same_shapes), RTOL_FP32_SAME_SHAPES)
    cfg = json.loads((tmp_path / "offload" / "deepspeed_config.json").read_text())
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
