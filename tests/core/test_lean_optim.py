"""The memory-lean optimizers (--optimizer adamw8bit | adamw4bit | adafactor): the state a real step creates is
exactly the bytes the memory models price (``core.optim.state_bytes``), a method that cannot take one refuses
in one line, and a run's estimate is within 10% of the peak it measured."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_estimate_within, train
from stratbench.core.config import CHOICES, TrainConfig, from_dict, validate
from stratbench.core.errors import ConfigError
from stratbench.core.optim import optimizer_spec
from stratbench.measuring.model_trace import ModelInfo
from stratbench.predicting.estimate import estimate, model_state_bytes
from stratbench.strategies.base import get_strategy, local_bytes
from stratbench.strategies.costs import MemoryContext

OPTIMIZERS = ["sgd", "adamw", "adamw8bit", "adamw4bit", "adafactor"]
SHAPES = [
    (32, 16, 3, 3),  # a conv weight: 4608 elements, both torchao blocks divide it; Adafactor's factors of a 4-D one
    (64, 256),  # a matrix torchao quantises
    (4, 8, 160),  # 3-D: Adafactor's row factor (4, 8, 1), column factor (4, 1, 160)
    (4224,),  # 1-D over 4096: 4-bit's block (128) divides it, 8-bit's (256) does not (stays plain)
    (10, 40),  # under torchao's 4096-element threshold: plain states
    (64,),  # a bias
]


def _needs(optimizer: str) -> None:
    if optimizer.startswith("adamw") and optimizer != "adamw":
        pytest.importorskip("torchao", reason="the lean extra (pip install 'stratbench[lean]')")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_bytes_after_a_step_equal_the_formula(optimizer, dtype):
    """Sum of the bytes of ``optimizer.state`` after one real step (torchao's quantised states counted by their
    codes, scales and lookup tables, as result.json counts them) == the memory models' formula, per shape rule."""
    _needs(optimizer)
    precision = "fp32" if dtype is torch.float32 else "bf16-true"
    cfg = TrainConfig(optimizer=optimizer, precision=precision, momentum=0.9)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer_obj = optimizer_spec(cfg)(params)
    # The states are allocated before torchao's compiled update runs; eager here spares a compile per shape.
    with torch.compiler.set_stance("force_eager"):
        optimizer_obj.step()
    measured = sum(local_bytes(v) for s in optimizer_obj.state.values() for v in s.values() if torch.is_tensor(v))
    info = ModelInfo(
        numels=[math.prod(s) for s in SHAPES], dim0=[s[0] for s in SHAPES], block_units=[], layer_units=[],
        buffer_bytes=0, shapes=tuple(SHAPES),
    )  # fmt: skip
    m = MemoryContext(cfg, 1, info, None, "cpu").replicated(buckets=False)
    assert measured == m.optim + m.step_scalars, (optimizer, precision, measured, m.optim, m.step_scalars)
    if optimizer != "adamw":  # each lean one keeps less than AdamW's two states
        assert m.optim < 2 * sum(info.numels) * dtype.itemsize


def test_unknown_optimizer_and_missing_kernels_are_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError) as exc:
        validate(TrainConfig(optimizer="lion"))
    assert all(name in str(exc.value) for name in CHOICES["optimizer"]), exc.value
    with pytest.raises(ConfigError, match="optimizer_impl 'fused' does not exist for optimizer 'adafactor'.*foreach"):
        validate(TrainConfig(optimizer="adafactor", optimizer_impl="fused"))


def test_a_torchao_optimizer_without_torchao_is_refused_with_the_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"optimizer 'adamw4bit' needs torchao.*stratbench\[lean\]"):
        validate(TrainConfig(optimizer="adamw4bit"))
    validate(TrainConfig(optimizer="adafactor"))  # torch's own: nothing to install


def test_a_method_that_cannot_step_a_lean_optimizer_refuses_it_in_one_line():
    cfg = TrainConfig(model="gpt-tiny", data="synthetic-tokens", seq_len=32, optimizer="adafactor")
    cpu = torch.device("cpu")
    why = get_strategy("fsdp").check_supported(cfg.replace(strategy="fsdp"), cpu, 2)
    assert why and "'adafactor'" in why and "use sgd or adamw" in why and "\n" not in why, why
    assert get_strategy("ddp").check_supported(cfg.replace(strategy="ddp"), cpu, 2) is None
    # torchao's states are built per local shard: FSDP2 takes them (priced per dim-0 chunk), --tp's slices not
    lean = cfg.replace(optimizer="adamw8bit", strategy="fsdp")
    assert get_strategy("fsdp").check_supported(lean, cpu, 2) is None
    why = get_strategy("fsdp").check_supported(lean.replace(strategy_options={"tp": 2}), cpu, 2)
    assert why and "--tp" in why, why
    with pytest.raises(ConfigError, match="'adafactor' keeps its state per whole parameter"):
        estimate(cfg.replace(strategy="fsdp"), 2, "cpu")  # the estimate's row is n/a, never a wrong number


def test_adamw8bit_run_records_torchao_class_and_exact_states_within_10_percent_of_its_peak(tmp_path):
    """One real run (single process, 2 steps): result.json names torchao's class, its optimizer-state bytes
    equal the formula, and the estimate is within 10% of the measured allocator peak."""
    _needs("adamw8bit")
    res = train(
        tmp_path / "run", "--model", "gpt-tiny", "--data", "synthetic-tokens", "--seq-len", "64", "--batch-size",
        "8", "--epochs", "1", "--max-steps", "2", "--progress", "false", "--measure-alloc", "true",
        "--measure-flops", "false", "--timing-warmup-steps", "1", "--eval-samples", "4", "--save-every-epoch",
        "false", "--optimizer", "adamw8bit",
    )  # fmt: skip
    assert res["status"] == "ok"
    assert res["optimizer"]["class"] == "torchao.optim.adam.AdamW8bit", res["optimizer"]
    cfg = from_dict(TrainConfig, dict(res["config"]))
    assert res["sharding"]["optimizer_state_bytes"] == [model_state_bytes(cfg, 1)[0]["optimizer_state_bytes"]]
    assert_estimate_within(res, 0.10)
