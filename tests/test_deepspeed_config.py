"""DeepSpeed's config builder (``strategies.parallel.deepspeed_config``), a table of rules, against a snapshot of what the
imperative builder it replaced produced (``build_ds_config`` of commit a0a2f16, run on these cases): the same
dict, or the same error, for ZeRO stages 0-3, offload to cpu/nvme, fp32/fp16/bf16, gradient accumulation,
clipping, the optimizer choices and a user's JSON (its "auto" values, optimizer and scheduler blocks, conflicts).
No DeepSpeed needed: the builder is plain Python."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.strategies.deepspeed import DeepSpeedOptions
from stratbench.strategies.parallel.deepspeed_config import build_ds_config
from stratbench.strategies.parallel.zero import deepspeed_memory

SNAPSHOT = Path(__file__).with_name("snapshots") / "deepspeed_config.json"


def _case(cfg=None, opts=None, world=2, total_steps=None, config_optimizer=True, user=None) -> dict[str, Any]:
    return {"cfg": cfg or {}, "opts": opts or {}, "world": world, "total_steps": total_steps,
            "config_optimizer": config_optimizer, "user": user}  # fmt: skip


CASES: dict[str, dict[str, Any]] = {
    f"stage{stage}-{precision}": _case({"precision": precision}, {"zero_stage": stage})
    for stage in (None, 0, 1, 2, 3)
    for precision in ("fp32", "fp16-mixed", "bf16-mixed")
}
CASES |= {
    "accum4-clip-world4": _case(
        {"batch_size": 64, "grad_accum": 4, "clip_grad_norm": 1.0}, {"zero_stage": 2}, 4
    ),
    "accum2-stage3-bf16": _case({"grad_accum": 2, "precision": "bf16-mixed"}, {"zero_stage": 3}, 1),
    "sgd-momentum": _case({"optimizer": "sgd", "momentum": 0.9}, {"zero_stage": 1}),
    "offload-opt-stage1": _case({}, {"zero_stage": 1, "offload_optimizer": "cpu"}),
    "offload-opt-stage2-fp16": _case(
        {"precision": "fp16-mixed"}, {"zero_stage": 2, "offload_optimizer": "cpu"}
    ),
    "offload-params-stage3": _case({}, {"zero_stage": 3, "offload_params": "cpu"}),
    "offload-both-stage3": _case({}, {"zero_stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}),
    "offload-none": _case({}, {"zero_stage": 2, "offload_optimizer": "none", "offload_params": "none"}),
    "nvme-opt-stage3": _case({}, {"zero_stage": 3, "offload_optimizer": "nvme", "nvme_path": "/nvme"}),
    "nvme-params-stage3": _case({}, {"zero_stage": 3, "offload_params": "nvme", "nvme_path": "/nvme"}),
    "nvme-no-path": _case({}, {"zero_stage": 3, "offload_optimizer": "nvme"}),
    "nvme-stage2": _case({}, {"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/nvme"}),
    "offload-params-stage2": _case({}, {"zero_stage": 2, "offload_params": "cpu"}),
    "offload-opt-stage0": _case({}, {"zero_stage": 0, "offload_optimizer": "cpu"}),
    "offload-disk": _case({}, {"offload_optimizer": "disk"}),
    "stage5": _case({}, {"zero_stage": 5}),
    "ds-fused": _case({"optimizer": "adamw"}, {"ds_optimizer": "fused"}),
    "ds-cpu-adam": _case({"optimizer": "adamw"}, {"ds_optimizer": "cpu-adam", "offload_optimizer": "cpu"}),
    "no-config-optimizer": _case({}, {"zero_stage": 2}, config_optimizer=False),
    "json-optimizer-refused": _case({}, {}, config_optimizer=False, user={"optimizer": {"type": "AdamW"}}),
    "json-scheduler-refused": _case({}, {}, config_optimizer=False, user={"scheduler": {"type": "WarmupLR"}}),
    "json-adam-auto": _case(
        {"lr": 0.01, "weight_decay": 0.1},
        {},
        user={"optimizer": {"type": "adamw", "params": {"lr": "auto", "weight_decay": "auto", "eps": 1e-6}}},
    ),
    "json-adam-torch-adam": _case(
        {}, {"ds_optimizer": "fused"}, user={"optimizer": {"type": "Adam", "params": {"torch_adam": False}}}
    ),
    "json-sgd": _case(
        {"momentum": 0.8}, {}, user={"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}}
    ),
    "json-sgd-fused": _case({}, {"ds_optimizer": "fused"}, user={"optimizer": {"type": "SGD"}}),
    "json-optimizer-bad-type": _case({}, {}, user={"optimizer": {"type": "Lamb"}}),
    "json-optimizer-not-object": _case({}, {}, user={"optimizer": "AdamW"}),
    "json-optimizer-unknown-auto": _case(
        {}, {}, user={"optimizer": {"type": "AdamW", "params": {"foo": "auto"}}}
    ),
    "json-warmup-lr": _case({"lr_warmup_steps": 5}, {}, user={"scheduler": {"type": "WarmupLR"}}),
    "json-warmup-decay": _case(
        {},
        {},
        total_steps=40,
        user={
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": "auto", "warmup_max_lr": "auto"},
            },
        },
    ),
    "json-warmup-decay-no-steps": _case({}, {}, user={"scheduler": {"type": "WarmupDecayLR"}}),
    "json-warmup-cosine": _case(
        {"lr_warmup_steps": 3},
        {},
        total_steps=7,
        user={"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1}}},
    ),
    "json-scheduler-bad-type": _case({}, {}, user={"scheduler": {"type": "OneCycle"}}),
    "json-scheduler-zero-warmup": _case(
        {}, {}, user={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}
    ),
    "json-scheduler-unknown-auto": _case(
        {}, {}, user={"scheduler": {"type": "WarmupLR", "params": {"x": "auto"}}}
    ),
    "json-batch-auto": _case(
        {"grad_accum": 2, "clip_grad_norm": 0.5},
        {},
        user={
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        },
    ),
    "json-batch-agrees": _case(
        {"grad_accum": 2, "clip_grad_norm": 1},
        {},
        user={
            "train_batch_size": 64,
            "train_micro_batch_size_per_gpu": 16,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1,
        },
    ),
    "json-batch-conflict": _case({}, {}, user={"train_batch_size": 128}),
    "json-micro-conflict": _case({}, {}, user={"train_micro_batch_size_per_gpu": 3}),
    "json-accum-conflict": _case({}, {}, user={"gradient_accumulation_steps": 3}),
    "json-clip-conflict": _case({"clip_grad_norm": 1.0}, {}, user={"gradient_clipping": 2.0}),
    "json-fp16-block": _case(
        {"precision": "fp16-mixed"},
        {},
        user={"fp16": {"enabled": "auto", "loss_scale": 128, "hysteresis": "auto"}},
    ),
    "json-fp16-under-fp32": _case({}, {}, user={"fp16": {"enabled": True}}),
    "json-fp16-disabled-under-fp32": _case({}, {}, user={"fp16": {"enabled": False, "loss_scale": 0}}),
    "json-bf16-off-conflict": _case({"precision": "bf16-mixed"}, {}, user={"bf16": {"enabled": False}}),
    "json-bf16-extra": _case({"precision": "bf16-mixed"}, {}, user={"bf16": {"immediate_grad_update": True}}),
    "json-zero-auto": _case(
        {},
        {},
        user={
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "overlap_comm": True,
                "contiguous_gradients": False,
                "sub_group_size": 1000,
            }
        },
    ),
    "json-zero-stage-auto": _case({}, {}, user={"zero_optimization": {"stage": "auto"}}),
    "json-zero-stage-agrees": _case({}, {"zero_stage": 1}, user={"zero_optimization": {"stage": 1}}),
    "json-zero-stage-conflict": _case({}, {"zero_stage": 2}, user={"zero_optimization": {"stage": 3}}),
    "json-offload-block": _case(
        {},
        {},
        user={
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
            }
        },
    ),
    "json-offload-none-block": _case(
        {}, {}, user={"zero_optimization": {"offload_optimizer": {"device": "none"}}}
    ),
    "json-offload-conflict": _case(
        {},
        {"offload_optimizer": "cpu"},
        user={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
    ),
    "json-offload-not-object": _case({}, {}, user={"zero_optimization": {"offload_param": "cpu"}}),
    "json-nvme-path-from-json": _case(
        {},
        {"offload_params": "nvme"},
        user={
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/from/json"}}
        },
    ),
    "json-nvme-option-wins": _case(
        {},
        {"offload_params": "nvme", "nvme_path": "/opt"},
        user={
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/from/json"}}
        },
    ),
    "json-extra-keys": _case({}, {}, user={"steps_per_print": 5, "wall_clock_breakdown": True}),
    "json-not-object": _case({}, {}, user=[1, 2]),
}


def build(case: dict[str, Any], tmp_path: Path, builder=build_ds_config, options=DeepSpeedOptions) -> Any:
    """The builder's dict for ``case``, or {"error": its message} (the JSON's path written as <json>)."""
    opts = dict(case["opts"])
    if case["user"] is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(case["user"]))
        opts["deepspeed_config"] = str(path)
    cfg = TrainConfig().replace(**case["cfg"])
    try:
        return builder(cfg, options(**opts), case["world"], case["total_steps"],
                       config_optimizer=case["config_optimizer"])  # fmt: skip
    except ConfigError as exc:
        return {"error": str(exc).replace(str(tmp_path / "ds.json"), "<json>")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rules_build_what_the_old_builder_built(name, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # pin_memory follows the machine
    expected = json.loads(SNAPSHOT.read_text())[name]
    got = json.loads(json.dumps(build(CASES[name], tmp_path)))
    assert got == expected
    assert list(_paths(got)) == list(
        _paths(expected)
    )  # the same key order: deepspeed_config.json is the same file


def _paths(value: Any, prefix: str = "") -> Any:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield prefix + key
            yield from _paths(inner, prefix + key + ".")


def test_the_snapshot_covers_every_case_and_both_outcomes():
    snapshot = json.loads(SNAPSHOT.read_text())
    assert set(snapshot) == set(CASES)
    errors = [k for k, v in snapshot.items() if "error" in v]
    assert 10 < len(errors) < len(snapshot) - 30  # conflicts refused, and most cases build a config
    stages = {v["zero_optimization"]["stage"] for v in snapshot.values() if "error" not in v}
    assert stages == {0, 1, 2, 3}


def test_reduce_bucket_size_is_written_checked_and_counted(tmp_path):
    """--reduce-bucket-size goes into zero_optimization, must be positive and agree with the JSON's; the
    memory model counts the bucket it sets (stages 1-3 allocate it whole), not DeepSpeed's 5e8 default."""
    ds = build(_case({}, {"zero_stage": 2, "reduce_bucket_size": 1_000_000}), tmp_path)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1_000_000
    bad = build(_case({}, {"zero_stage": 2, "reduce_bucket_size": 0}), tmp_path)
    assert bad["error"] == "--reduce-bucket-size must be a positive number of elements, got 0"
    clash = build(_case({}, {"reduce_bucket_size": 10}, user={"zero_optimization": {"reduce_bucket_size": 20}}),
                  tmp_path)  # fmt: skip
    assert "zero_optimization.reduce_bucket_size is 20 but --reduce-bucket-size gives 10" in clash["error"]

    class Info:
        total, numels, largest_layer = 1000, [1000], 1000

    class Ctx:
        info, world, param_bytes, half, opt_slots, adam, cfg = Info(), 2, 4, False, 0, False, TrainConfig()
        numels, trainable_numels = [1000], [1000]  # MemoryContext's: every parameter, the trained ones

        def flat_optim_bytes(self, numel: int, itemsize: int | None = None) -> int:
            return 0  # no optimizer state (opt_slots 0): the bucket is the point here

    assert deepspeed_memory(Ctx(), ds["zero_optimization"]).buckets == 1_000_000 * 4
