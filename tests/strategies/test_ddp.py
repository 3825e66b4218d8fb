"""dp, ddp and ddp-zero on CPU: 2-process gloo runs on loopback prove that DDP and DDP + ZeRO train exactly the
model one process trains (fp64, see conftest.EQUIV; and one fp32 check against a reference with the same
micro-batch shapes), that ZeRO really shards the optimizer state, and that a ddp-zero checkpoint (full or
sharded) resumes under ddp and under single."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import (
    COMM,
    EQUIV,
    RTOL,
    RTOL_FP32_SAME_MICRO_BATCHES,
    TINY,
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    fails,
    train,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run) -> dict[str, dict]:
    """single (the shared reference), ddp and ddp-zero fp64 runs of EQUIV; the ddp-zero one keeps its checkpoint."""
    root = tmp_path_factory.mktemp("ddp")
    out = {"root": root}
    out["single"] = reference_run
    out["ddp"] = train(root / "ddp", "--strategy", "ddp", *EQUIV, *COMM, nproc=2)
    out["ddp-zero"] = train(root / "ddp-zero", "--strategy", "ddp-zero", *EQUIV, *COMM, nproc=2)
    return out


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "ddp-zero"])
def test_communication_matches_the_formula(runs, strategy):
    """ddp: all_reduce Φ (the C++ reducer's buckets, seen through the profiler); ddp-zero: the same plus Φ of
    parameter broadcasts after the step (one per parameter). Φ: fp64 parameters here."""
    comm = assert_comm_matches_formula(runs[strategy])
    phi = sum(runs["single"]["sharding"]["param_bytes"])
    assert comm["measured"]["all_reduce"]["payload_bytes"] == phi
    if strategy == "ddp-zero":
        assert comm["measured"]["broadcast"]["payload_bytes"] == phi
    else:
        assert "broadcast" not in comm["measured"]  # a BN-free model: no buffers to broadcast


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "ddp-zero"])
def test_phases_add_up_and_the_memory_estimate_holds(runs, strategy):
    """The same runs: their five phases add up to the measured step time on both ranks, and the memory
    estimate is within 10% of the allocator peak each run measured on itself (--measure-alloc, step 2)."""
    assert_breakdown_adds_up(runs[strategy])
    assert_estimate_within(runs[strategy])


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", "ddp-zero"])
def test_loss_curve_matches_single(runs, strategy):
    res = runs[strategy]
    assert res["status"] == "ok" and res["world_size"] == 2 and res["global_batch_size"] == 32
    assert res["micro_batch_size"] == 16
    ref = runs["single"]["metrics"]["loss_curve"]
    curve = res["metrics"]["loss_curve"]
    assert len(curve) == 20
    assert ref[-1] < 0.9 * ref[0], "the reference must actually train, or equal curves prove nothing"
    assert_curves_match(curve, ref, RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ddp_grad_accum_matches_single(runs):
    """2 ranks x 2 micro-steps of 8 (all-reduce skipped on the first) = the same global batch of 32."""
    res = train(runs["root"] / "accum", "--strategy", "ddp", *EQUIV, "--grad-accum", "2", nproc=2)
    assert res["micro_batch_size"] == 8 and res["grad_accum"] == 2
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"], RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ddp_fp32_matches_single_with_the_same_micro_batches(runs, reference_fp32_same_micro_batches):
    """The fp32 check: 2 ranks x 16 against one process x 2 micro-steps of 16 holding the same samples as the
    ranks' (data.virtual_rank_order): bit for bit on any CPU (conftest.RTOL_FP32_SAME_MICRO_BATCHES)."""
    single = reference_fp32_same_micro_batches
    ddp = train(runs["root"] / "ddp-fp32", "--strategy", "ddp", *TINY, nproc=2)
    assert single["micro_batch_size"] == ddp["micro_batch_size"] == 16
    assert_curves_match(ddp["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL_FP32_SAME_MICRO_BATCHES)


@pytest.mark.distributed
def test_zero_shards_optimizer_state(runs):
    ddp = runs["ddp"]["sharding"]
    zero = runs["ddp-zero"]["sharding"]
    full = ddp["optimizer_state_bytes"]
    assert len(full) == 2 and full[0] == full[1] == ddp["param_bytes"][0] > 0  # SGD momentum: one buffer per param
    # ZeRO assigns whole parameters to ranks (greedily, largest first), so the split is only roughly even: each
    # rank holds at most half plus the largest parameter tensor (tinynet's fc is ~1/3 of the parameters).
    parts = zero["optimizer_state_bytes"]
    assert sum(parts) == full[0], "the shards must add up to the whole optimizer state"
    assert all(0.3 * full[0] <= p <= 0.7 * full[0] for p in parts), parts
    assert zero["param_bytes"] == ddp["param_bytes"] and zero["grad_bytes"] == ddp["grad_bytes"]  # replicated


def _resume_curve(runs, tmp: Path, name: str, fmt: str, resumer: str, nproc: int) -> list[float]:
    """Train ddp-zero 10 steps saving in ``fmt``, resume under ``resumer`` to step 20; return its 10 losses."""
    src = tmp / f"zero-{fmt}"
    if not (src / "checkpoints" / "last").exists():
        train(src, "--strategy", "ddp-zero", *EQUIV, "--max-steps", "10", "--checkpoint-format", fmt, nproc=2)
    ckpt = src / "checkpoints" / "last"
    assert ckpt.is_dir() == (fmt == "sharded")
    res = train(tmp / name, "--strategy", resumer, *EQUIV, "--resume-from", str(ckpt), nproc=nproc)
    assert res["resumed_from"]["step"] == 10
    return res["metrics"]["loss_curve"]


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("fmt", "resumer", "nproc"),
    [("full", "ddp", 2), ("full", "single", 1), ("sharded", "single", 1)],
)
def test_zero_checkpoint_resumes_anywhere(runs, tmp_path_factory, fmt, resumer, nproc):
    """Steps 11-20 after resuming equal the uninterrupted run's: weights, momentum and LR schedule came back."""
    tmp = runs["root"]
    curve = _resume_curve(runs, tmp, f"resume-{fmt}-{resumer}", fmt, resumer, nproc)
    assert_curves_match(curve, runs["single"]["metrics"]["loss_curve"][10:], RTOL)


@pytest.mark.distributed
def test_zero_full_checkpoint_is_name_keyed(runs):
    """The consolidated optimizer state has the layout every method writes: keyed by parameter names."""
    from stratbench.checkpoints.checkpoint import load_file

    state = load_file(runs["root"] / "ddp-zero" / "checkpoints" / "last")
    names = list(state["model"])
    assert sorted(state["optimizer"]["state"]) == sorted(n for n in names if not n.endswith("num_batches_tracked"))
    assert state["optimizer"]["param_groups"][0]["params"] == names
    assert all(isinstance(v["momentum_buffer"], torch.Tensor) for v in state["optimizer"]["state"].values())


# ---- refusals: one clear line, non-zero exit, before any work ------------------------------------


def _error_line(capsys, *args: str) -> str:
    """The one line ``train`` refuses with, in this process (the refusal comes before any process starts)."""
    return fails(capsys, "train", *args)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2+ GPUs: dp can run")
def test_dp_refuses_without_two_gpus(tmp_path, capsys):
    line = _error_line(capsys, "--output", str(tmp_path), "--strategy", "dp", *TINY)
    assert "needs >= 2 CUDA GPUs, found" in line and "dp/fp32" in line
    assert not (tmp_path / "result.json").exists()


def _preflight_error(*args: str) -> str:
    """The UnsupportedError line preflight gives for these flags, in-process (no subprocess needed)."""
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.errors import UnsupportedError
    from stratbench.training.engine import preflight

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = resolve_config(parser.parse_args([*TINY, *args]))
    with pytest.raises(UnsupportedError) as info:
        preflight(cfg, world_size=2)
    return str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="SyncBatchNorm runs on CUDA")
def test_sync_bn_refused_on_cpu():
    assert "--sync-bn needs CUDA" in _preflight_error("--strategy", "ddp", "--sync-bn")


def test_bad_checkpoint_format():
    line = _preflight_error("--strategy", "ddp-zero", "--checkpoint-format", "zip")
    assert "'zip'" in line and "full, sharded" in line


def test_batch_must_divide_by_world_size(tmp_path, capsys):
    line = _error_line(capsys, "--output", str(tmp_path), "--strategy", "ddp", "--nproc", "2", *TINY, "--batch-size", "33")
    assert "batch_size 33" in line and "world size" in line


def test_dp_state_dict_uses_plain_names():
    """DataParallel's ``module.`` prefix must not leak into checkpoints (on CPU it wraps without replicating)."""
    from torch import nn

    from stratbench.core.dist import DistEnv
    from stratbench.core.precision import Precision
    from stratbench.strategies.dp import DataParallelStrategy

    strategy = DataParallelStrategy(None, DistEnv(), Precision("fp32", torch.device("cpu")), None)
    model = nn.DataParallel(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    assert list(strategy.checkpoint_io.model_state_dict(model)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(strategy.checkpoint_io.optimizer_state_dict(model, opt)["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
