"""What only a GPU can show: CUDA memory and utilisation in the result, every precision on CUDA, DataParallel's
per-GPU memory, SyncBatchNorm equivalence, model-parallel and pipeline (NCCL) on 2 GPUs. Marked ``gpu``: skipped
where torch sees no CUDA device (CI); the 2-GPU tests skip with one GPU (benchmarks/gpu_session.sh runs them all)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, max_rel_diff, train

pytestmark = pytest.mark.gpu

SMALL = ["--model", "resnet18", "--cifar-stem", "--data", "synthetic", "--image-size", "32", "--synthetic-samples",
         "512", "--batch-size", "64", "--epochs", "1", "--max-steps", "8", "--progress", "false", "--device", "cuda"]  # fmt: skip


def needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs >= {n} CUDA GPUs, found {torch.cuda.device_count()}")


@pytest.mark.parametrize("precision", ["fp32", "fp16-true", "bf16-true", "fp16-mixed", "bf16-mixed"])
def test_every_precision_on_one_gpu(tmp_path, precision):
    needs_gpus(1)
    if "bf16" in precision and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    res = train(tmp_path, *SMALL, "--precision", precision)
    m = res["metrics"]
    assert res["status"] == "ok" and m["peak_memory_kind"] == "cuda_max_allocated"
    assert m["peak_memory_bytes"][0] > 0 and m["peak_reserved_bytes"][0] >= m["peak_memory_bytes"][0]
    assert m["gpu_util_mean_pct"] and m["gpu_util_mean_pct"][0] is not None  # NVML sampler ran
    assert m["flops_per_sample"] and m["flops_per_sample"] > 0


def test_dataparallel_reports_every_gpu_and_trains_like_single(tmp_path):
    needs_gpus(2)
    single = train(tmp_path / "single", *TINY, "--device", "cuda")
    dp = train(tmp_path / "dp", "--strategy", "dp", *TINY, "--device", "cuda")
    assert len(dp["metrics"]["peak_memory_bytes"]) == torch.cuda.device_count()
    assert max_rel_diff(dp["metrics"]["loss_curve"], single["metrics"]["loss_curve"]) < 1e-3


def test_sync_batchnorm_ddp_matches_single(tmp_path):
    """With SyncBatchNorm, batch statistics are over the global batch, so a BatchNorm model trains under DDP as
    it does on one device (without it, each rank normalises over its half)."""
    needs_gpus(2)
    args = ["--model", "resnet18", "--cifar-stem", "--data", "digits", "--batch-size", "32", "--epochs", "1",
            "--max-steps", "10", "--lr", "0.01", "--progress", "false", "--device", "cuda"]  # fmt: skip
    single = train(tmp_path / "single", *args)
    ddp = train(tmp_path / "ddp", "--strategy", "ddp", "--sync-bn", *args, nproc=2)
    assert max_rel_diff(ddp["metrics"]["loss_curve"], single["metrics"]["loss_curve"]) < 1e-3


def test_model_parallel_places_stages_on_two_gpus_and_trains_like_single(tmp_path):
    """model-parallel: the stages' weights on cuda:0 and cuda:1 (memory reported for both), the same losses as
    one GPU (fp64: only the GPUs' own reduction order differs), and a checkpoint `single` loads."""
    needs_gpus(2)
    from conftest import EQUIV

    args = [*EQUIV, "--device", "cuda"]
    single = train(tmp_path / "single", *args)
    mp = train(tmp_path / "mp", "--strategy", "model-parallel", "--devices", "2", "--balance", "flops", *args)
    assert mp["status"] == "ok" and mp["model_parallel"]["devices"] == ["cuda:0", "cuda:1"]
    assert len(mp["metrics"]["peak_memory_bytes"]) == 2 and min(mp["metrics"]["peak_memory_bytes"]) > 0
    assert max_rel_diff(mp["metrics"]["loss_curve"], single["metrics"]["loss_curve"]) < 1e-9
    resumed = train(tmp_path / "resumed", *args, "--init-from", str(tmp_path / "mp" / "checkpoints" / "last"))
    assert resumed["status"] == "ok"


@pytest.mark.parametrize("precision", ["fp64", "fp16-mixed"])
def test_pipeline_over_nccl_on_two_gpus(tmp_path, precision):
    """pipeline, one stage per GPU over NCCL (1f1b, 4 micro-batches). fp64: the losses of one GPU (as the CPU
    test, 1e-9). fp16-mixed: the loss x 2^10 overflows for the first steps (as in test_pipeline); the found-inf
    all-reduce (NCCL, on the GPU) makes both stages skip the steps `single --grad-accum 4` skips and end with its
    scale; the curve within 1e-2 (cuDNN may reduce in another order than on one GPU; fp16 rounds at 1e-3)."""
    needs_gpus(2)
    import os

    from conftest import BIG_LOSS, EQUIV

    args = [*EQUIV, "--precision", precision, "--device", "cuda", "--dist-timeout-s", "120"]
    env, rtol = None, 1e-9
    if precision == "fp16-mixed":
        (tmp_path / "bigloss.py").write_text(BIG_LOSS)
        args += ["--loss", "bigloss:loss", "--lr", str(0.02 / 2**10), "--weight-decay", "0"]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
        rtol = 1e-2
    single = train(tmp_path / "single", *args, "--grad-accum", "4", env=env)
    pp = train(tmp_path / "pp", "--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4", *args,
               nproc=2, env=env)  # fmt: skip
    assert pp["status"] == "ok" and pp["world_size"] == 2, pp.get("reason")
    assert max_rel_diff(pp["metrics"]["loss_curve"], single["metrics"]["loss_curve"]) < rtol
    assert len(pp["metrics"]["peak_memory_bytes"]) == 2 and min(pp["metrics"]["peak_memory_bytes"]) > 0
    skipped = single["metrics"]["skipped_steps"]
    assert [r["skipped_steps"] for r in pp["pipeline"]["ranks"]] == [skipped, skipped]
    if precision == "fp16-mixed":
        assert skipped >= 3 and [r["loss_scale"] for r in pp["pipeline"]["ranks"]] == [2.0**16 / 2**skipped] * 2


@pytest.mark.parametrize("fsdp_version", ["2", "1"])
def test_accelerate_fsdp_trains_like_single_on_one_gpu(tmp_path, fsdp_version):
    """accelerate-fsdp runs only on CUDA. Its FSDP2 path once prepared the model alone, which accelerate refuses
    ("a model and optimizer must be passed together", the first time it ran: an H200 on 2026-11-26); both FSDP
    versions must train, and on one GPU a fully sharded model is the whole model: single's loss curve."""
    needs_gpus(1)
    single = train(tmp_path / "single", *TINY, "--device", "cuda", "--precision", "bf16-mixed")
    acc = train(tmp_path / "acc", "--strategy", "accelerate-fsdp", "--fsdp-version", fsdp_version, *TINY,
                "--device", "cuda", "--precision", "bf16-mixed")  # fmt: skip
    assert acc["status"] == "ok", acc.get("reason")
    assert max_rel_diff(acc["metrics"]["loss_curve"], single["metrics"]["loss_curve"]) < 1e-2
