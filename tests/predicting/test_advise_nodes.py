"""advise over several nodes (issue 45): HSDP, ZeRO-3 + hpZ and ZeRO++ among the plans, each with the flags train
takes, only where the devices span nodes of a known size; and the llm-nodes preset's cells (in process)."""

from __future__ import annotations

import shlex

import pytest
import torch

from stratbench.cli import build_parser
from stratbench.commands.train import resolve_config
from stratbench.compare.matrix import build_matrix, plan
from stratbench.compare.presets import PRESETS
from stratbench.core.config import TrainConfig
from stratbench.predicting.advise import applicable, candidates, commands, plan_config
from stratbench.strategies.base import get_strategy

BASE = TrainConfig(model="gpt-tiny", data="text", seq_len=32, batch_size=64, precision="bf16-mixed")


def test_node_plans_only_where_the_devices_span_nodes_of_a_known_size():
    labels = [p.label for p in candidates(32, 8)]
    hsdp, hpz = "fsdp --sharding full --replicate 4", "deepspeed --zero-stage 3 --zero-hpz 8"
    assert labels.index("fsdp --sharding grad-op") < labels.index(hsdp) < labels.index("fsdp --sharding full")
    assert labels.index("fsdp --sharding full") < labels.index(hpz)
    assert any("--zero-quantized-weights True --zero-quantized-gradients True" in x for x in labels)
    for devices, per_node in ((8, 8), (32, None), (12, 8)):  # one node, an unknown node, no whole nodes
        assert not any("replicate" in x or "hpz" in x for x in (p.label for p in candidates(devices, per_node)))


def test_each_node_plan_is_a_train_command_that_runs_its_checks():
    """The plans' commands parse and pass train's checks on 4 nodes of 8 (HSDP's shard group and hpZ's partition
    in a node); ZeRO++'s quantised collectives are dropped where DeepSpeed's CUDA quantizer cannot be built."""
    plans = [p for p in candidates(32, 8) if "replicate" in p.label or "hpz" in p.label]
    usable, _ = applicable(BASE, plans, 32, "cuda")
    assert {p.label for p in plans} - {p.label for p in usable} <= {plans[-1].label}
    for p in plans:
        cfg = plan_config(BASE, p, 32).replace(nnodes=4)
        train, _ = commands(cfg, p, 32)
        args = build_parser().parse_args(shlex.split(train)[1:] + ["--nnodes", "4", "--nproc", "8"])
        run, cls = resolve_config(args), get_strategy(p.strategy)
        assert cls.parse_options(run.strategy_options) == cls.parse_options(cfg.strategy_options), train
        why = cls.check_supported(run, torch.device("cuda"), 32)
        assert why is None or "quantizer" in why, why


def test_llm_nodes_runs_every_sharding_over_two_loopback_nodes():
    matrix = build_matrix(PRESETS["llm-nodes"]())
    cells = {c.name: c for c in matrix.cells}
    assert list(cells) == ["ddp", "fsdp", "hsdp", "deepspeed-z3", "deepspeed-z3-hpz2", "deepspeed-zero++"]
    assert {(c.world_size, c.nodes) for c in matrix.cells} == {(4, 2)}
    assert cells["hsdp"].options == {"replicate": 2} and cells["deepspeed-z3-hpz2"].options["zero_hpz"] == 2
    for name in ("deepspeed-z3", "deepspeed-z3-hpz2"):  # released after forward: hpZ's backward gather shows
        assert cells[name].options["stage3_max_reuse_distance"] == 0, name
    refused = {p.cell.name: p.reason for p in plan(matrix) if p.status is not None}
    if not torch.cuda.is_available():
        assert list(refused) == ["deepspeed-zero++"] and "CUDA-only" in refused["deepspeed-zero++"], refused
    else:
        pytest.skip("a GPU machine: the llm-nodes cells' CPU refusals do not apply")
