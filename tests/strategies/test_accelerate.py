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
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    cli,
    run_stratbench,
)

CPU = torch.device("cpu")


# The source's default_DDP.yml as `accelerate config` writes it, with 2 processes (this machine's cores).
SOURCE_DDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
# The source's default_FSDP.yml: FSDP1 knobs under the older key names (no fsdp_version: accelerate's default, 1).
SOURCE_FSDP_YAML = SOURCE_DDP_YAML.replace("MULTI_GPU", "FSDP").replace("num_processes: 2", "num_processes: 4") + """\
fsdp_config:
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: true
  fsdp_min_num_params: 1000000
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
"""


@pytest.fixture(scope="module")
def user_yaml_run(tmp_path_factory) -> tuple:
    """accelerate-ddp started from the user's accelerate YAML (--accelerate-config): its 2 processes, its
    method; EQUIV with the collectives, phases and allocator recorded. Returns (folder, result)."""
    root = tmp_path_factory.mktemp("accelerate")
    out = root / "acc"
    user_yaml = root / "default_DDP.yml"
    user_yaml.write_text(SOURCE_DDP_YAML)
    run_stratbench("train", "--accelerate-config", str(user_yaml), "--output", str(out), *EQUIV, *COMM, timeout=240)
    return out, json.loads((out / "result.json").read_text())


@pytest.mark.distributed
def test_accelerate_ddp_phases_add_up_and_the_memory_estimate_holds(user_yaml_run):
    """The phases (accelerate's backward and optimizer step inside them) add up to the step time on both
    ranks; the estimate is within 10% of the allocator peak, accelerate's own modules imported after the
    baseline left out."""
    _, res = user_yaml_run
    assert_breakdown_adds_up(res)
    assert_estimate_within(res)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_accelerate_ddp_from_the_users_yaml_matches_single_and_its_checkpoint_loads_into_single(
    user_yaml_run, tmp_path, reference_run
):
    """Started from the user's accelerate YAML (--accelerate-config): its 2 processes, its method."""
    out, res = user_yaml_run
    assert_comm_matches_formula(res)  # DDP's all_reduce Φ, under accelerate
    assert res["status"] == "ok" and res["world_size"] == 2 and res["strategy"] == "accelerate-ddp"
    assert res["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert res["optimizer"]["wrapper"] == "accelerate.optimizer.AcceleratedOptimizer"
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
    from stratbench.checkpoints.checkpoint import load_any

    state = load_any(last)
    assert set(state["optimizer"]["state"]) == set(state["model"])  # optimizer state keyed by parameter names
    consolidated = tmp_path / "acc.pt"
    cli("consolidate", last, consolidated)
    ev = json.loads(cli("evaluate", "--checkpoint", consolidated, "--device", "cpu", "--json"))
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
    from stratbench.core.config import TrainConfig
    from stratbench.strategies.base import get_strategy

    for name, needle in (("accelerate-fsdp", "FSDP plugin needs a CUDA GPU"), ("accelerate-deepspeed", "DeepSpeed plugin needs a CUDA GPU")):
        reason = get_strategy(name).check_supported(TrainConfig(strategy=name), CPU, 2)
        assert reason and needle in reason and "\n" not in reason
    reason = get_strategy("accelerate-ddp").check_supported(TrainConfig(strategy="accelerate-ddp", precision="bf16-true"), CPU, 2)
    assert "no bf16-true mode" in reason
    assert get_strategy("accelerate-ddp").check_supported(TrainConfig(strategy="accelerate-ddp"), CPU, 2) is None


def test_fsdp_launch_config_uses_todays_key_names(tmp_path):
    from stratbench.core.config import TrainConfig
    from stratbench.strategies.accelerate import write_accelerate_config

    cfg = TrainConfig(strategy="accelerate-fsdp", precision="bf16-mixed", device="cuda", output=str(tmp_path))
    write_accelerate_config(cfg, "accelerate-fsdp", 4, tmp_path / "a.yaml")
    doc = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert doc["distributed_type"] == "FSDP" and doc["mixed_precision"] == "bf16" and doc["num_processes"] == 4
    fsdp = doc["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP"
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def _round_trip(cfg, world: int, tmp_path):
    """write_accelerate_config, then --accelerate-config on the written file: the resolved run config."""
    from stratbench.cli import build_parser
    from stratbench.commands.train import resolve_config
    from stratbench.strategies.accelerate import write_accelerate_config

    path = tmp_path / f"{cfg.strategy}.yaml"
    write_accelerate_config(cfg, cfg.strategy, world, path)
    return resolve_config(build_parser().parse_args(["train", "--accelerate-config", str(path)]))


def test_written_accelerate_yaml_round_trips_through_accelerate_config(tmp_path):
    """Every YAML stratbench writes reads back as the same method, precision, processes and plugin knobs."""
    from stratbench.core.config import TrainConfig
    from stratbench.strategies.base import get_strategy

    fsdp1 = {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
             "fsdp_transformer_layer_cls_to_wrap": "Bottleneck,BasicBlock", "fsdp_backward_prefetch": "BACKWARD_POST",
             "fsdp_forward_prefetch": True, "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": True,
             "fsdp_sync_module_states": True, "fsdp_use_orig_params": True, "fsdp_cpu_ram_efficient_loading": True}  # fmt: skip
    fsdp2 = {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_min_num_params": 5000, "fsdp_offload_params": True}
    cases = [
        (TrainConfig(strategy="accelerate-ddp", device="cpu"), 2),
        (TrainConfig(strategy="accelerate-fsdp", precision="bf16-mixed", device="cuda", strategy_options=fsdp1,
                     activation_checkpointing=True), 8),  # fmt: skip
        (TrainConfig(strategy="accelerate-fsdp", precision="fp16-mixed", device="cuda", strategy_options=fsdp2), 4),
        (TrainConfig(strategy="accelerate-deepspeed", device="cuda", strategy_options={"zero_stage": 3}), 2),
    ]
    for cfg, world in cases:
        back = _round_trip(cfg.replace(output=str(tmp_path / "o")), world, tmp_path)
        assert (back.strategy, back.precision, back.nproc) == (cfg.strategy, cfg.precision, world)
        assert back.activation_checkpointing == cfg.activation_checkpointing
        strategy = get_strategy(cfg.strategy)
        if cfg.strategy == "accelerate-fsdp":  # every knob, as the strategy reads it
            assert strategy.parse_options(back.strategy_options) == strategy.parse_options(cfg.strategy_options)
    assert back.strategy_options["deepspeed_config"] == str(tmp_path / "o" / "deepspeed_config.json")
    assert _round_trip(cases[0][0], 2, tmp_path).device == "cpu"


def test_the_sources_fsdp_yaml_is_read_knob_for_knob_and_refused_on_cpu_in_one_line(tmp_path, capsys):
    from accelerate import FullyShardedDataParallelPlugin

    from stratbench.cli import build_parser, main
    from stratbench.commands.train import resolve_config
    from stratbench.strategies.accelerate_fsdp import AccelerateFSDP, fsdp_plugin_kwargs

    user = tmp_path / "default_FSDP.yml"
    user.write_text(SOURCE_FSDP_YAML)
    cfg = resolve_config(build_parser().parse_args(["train", "--accelerate-config", str(user), "--nproc", "2"]))
    assert cfg.strategy == "accelerate-fsdp" and cfg.nproc == 2 and cfg.precision == "fp32"  # the flag wins
    opts = AccelerateFSDP.parse_options(cfg.strategy_options)
    assert (opts.fsdp_version, opts.fsdp_sharding_strategy, opts.fsdp_backward_prefetch) == (1, "FULL_SHARD", "BACKWARD_PRE")
    assert opts.fsdp_forward_prefetch and opts.fsdp_sync_module_states and opts.fsdp_use_orig_params
    assert (opts.fsdp_min_num_params, opts.fsdp_state_dict_type) == (1_000_000, "SHARDED_STATE_DICT")
    # accelerate itself accepts these knobs (sync_module_states needs a device to broadcast on: not built here).
    plugin = FullyShardedDataParallelPlugin(**{**fsdp_plugin_kwargs(opts), "sync_module_states": False})
    assert plugin.forward_prefetch is True and plugin.use_orig_params is True and plugin.min_num_params == 1_000_000
    assert plugin.backward_prefetch.name == "BACKWARD_PRE" and plugin.sharding_strategy.name == "FULL_SHARD"
    assert main(["train", "--accelerate-config", str(user), "--output", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FSDP plugin needs a CUDA GPU" in err
    for text, words in (
        (SOURCE_FSDP_YAML + "  fsdp_version: 3\n", "fsdp_version must be 1 or 2, got 3"),
        (SOURCE_FSDP_YAML.replace("fsdp_sharding_strategy: 1", "fsdp_sharding_strategy: HALF"),
         "fsdp_sharding_strategy must be one of: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2; got 'HALF'"),
        (SOURCE_FSDP_YAML + "  fsdp_version: 2\n", "fsdp_backward_prefetch, fsdp_forward_prefetch, fsdp_sync_module_states, fsdp_use_orig_params exist(s) in FSDP1 only"),
        (SOURCE_DDP_YAML.replace("MULTI_GPU", "XLA"), "distributed_type XLA is not supported; choose one of: MULTI_GPU"),
        (SOURCE_DDP_YAML + "fancy_key: 1\n", "unknown key(s) fancy_key; known:"),
    ):  # fmt: skip
        user.write_text(text)
        assert main(["train", "--accelerate-config", str(user), "--output", str(tmp_path / "o")]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()
