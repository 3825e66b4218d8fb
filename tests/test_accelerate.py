"""accelerate strategies on CPU: accelerate-ddp over 2 gloo processes; FSDP/DeepSpeed plugins refused here.

Equivalence against `single` in fp64 at conftest.RTOL, as for every torch-native 2-process method (see
conftest.EQUIV; accelerate-ddp reproduces ddp's curve bit for bit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import (
    COMM,
    EQUIV,
    REPO,
    RTOL,
    TINY,
    assert_comm_matches_formula,
    assert_curves_match,
    run_stratbench,
    train,
)

CPU = torch.device("cpu")


@pytest.mark.distributed
@pytest.mark.equivalence
def test_accelerate_ddp_matches_single_and_its_checkpoint_loads_into_single(tmp_path, reference_run):
    out = tmp_path / "acc"
    res = train(out, "--strategy", "accelerate-ddp", *EQUIV, *COMM, nproc=2, timeout=240)
    assert_comm_matches_formula(res)  # DDP's all_reduce Φ, under accelerate
    assert res["status"] == "ok" and res["world_size"] == 2
    curve, ref = res["metrics"]["loss_curve"], reference_run["metrics"]["loss_curve"]
    assert len(curve) == 20
    assert_curves_match(curve, ref, RTOL)
    assert sum(curve[-5:]) < 0.7 * sum(curve[:5])  # it learns
    # DDP replicates everything: each rank holds the full sizes.
    for key in ("param_bytes", "optimizer_state_bytes"):
        assert res["sharding"][key] == [reference_run["sharding"][key][0]] * 2

    launch_cfg = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert launch_cfg["distributed_type"] == "MULTI_GPU" and launch_cfg["use_cpu"] is True
    assert launch_cfg["num_processes"] == 2 and launch_cfg["mixed_precision"] == "no"

    last = out / "checkpoints" / "last"
    assert (last / "accelerate" / "model.safetensors").is_file()  # accelerator.save_state
    from stratbench.checkpoint import load_any

    state = load_any(last)
    assert set(state["optimizer"]["state"]) == set(state["model"])  # optimizer state keyed by parameter names
    consolidated = tmp_path / "acc.pt"
    run_stratbench("consolidate", str(last), str(consolidated), timeout=120)
    ev = json.loads(run_stratbench("evaluate", "--checkpoint", str(consolidated), "--device", "cpu", "--json", timeout=120).stdout)
    assert ev["val_accuracy"] == res["metrics"]["val_accuracy"]


def test_accelerate_cpu_flag_that_starts_one_process_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` runs the script once; stratbench must not pretend."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [accelerate, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "stratbench", "train", "--output", str(tmp_path / "o"),
           "--strategy", "accelerate-ddp", *TINY]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "started ONE process" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "o" / "result.json").exists()


def test_plugins_that_need_a_gpu_are_refused_on_cpu_in_one_line():
    from stratbench.config import TrainConfig
    from stratbench.strategies.base import get_strategy

    for name, needle in (("accelerate-fsdp", "FSDP plugin needs a CUDA GPU"), ("accelerate-deepspeed", "DeepSpeed plugin needs a CUDA GPU")):
        reason = get_strategy(name).check_supported(TrainConfig(strategy=name), CPU, 2)
        assert reason and needle in reason and "\n" not in reason
    reason = get_strategy("accelerate-ddp").check_supported(TrainConfig(strategy="accelerate-ddp", precision="bf16-true"), CPU, 2)
    assert "no bf16-true mode" in reason
    assert get_strategy("accelerate-ddp").check_supported(TrainConfig(strategy="accelerate-ddp"), CPU, 2) is None


def test_fsdp_launch_config_uses_todays_key_names(tmp_path):
    from stratbench.config import TrainConfig
    from stratbench.strategies.accelerate import write_accelerate_config

    cfg = TrainConfig(strategy="accelerate-fsdp", precision="bf16-mixed", device="cuda", output=str(tmp_path))
    write_accelerate_config(cfg, "accelerate-fsdp", 4, tmp_path / "a.yaml")
    doc = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert doc["distributed_type"] == "FSDP" and doc["mixed_precision"] == "bf16" and doc["num_processes"] == 4
    fsdp = doc["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP"
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
