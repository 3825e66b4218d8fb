"""The model transforms (stratbench.models.transforms): one registry in one documented order, applied by every
method's set-up at the same point, and recorded in result.json in the order applied."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re

import pytest
import torch
from torch import nn

import stratbench.models.transforms as transforms
from conftest import train
from stratbench.core.config import TrainConfig
from stratbench.core.dist import DistEnv
from stratbench.core.precision import Precision
from stratbench.measuring.records import RunRecord
from stratbench.models.transformer import Transformer, TransformerConfig
from stratbench.models.transforms import (
    FORWARD_SHARE,
    ORDER,
    Cost,
    Phase,
    Transform,
    flops_factor,
    traced,
)
from stratbench.strategies.single import SingleDevice


def _defined_transforms() -> list[type[Transform]]:
    """Every Transform subclass defined in a module of the package (what a new transform's file adds)."""
    found = []
    for info in pkgutil.iter_modules(transforms.__path__):
        module = importlib.import_module(f"{transforms.__name__}.{info.name}")
        classes = [
            c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__
        ]
        found += [c for c in classes if issubclass(c, Transform) and c is not Transform]
    return found


def test_every_transform_has_one_place_in_the_order_a_phase_and_a_cost():
    """A transform's file without its line in ORDER (or listed twice) fails here, as does one with no cost."""
    defined = _defined_transforms()
    assert defined, "no transform found in the package"
    assert sorted(c.__name__ for c in defined) == sorted(type(t).__name__ for t in ORDER)
    names = [t.name for t in ORDER]
    assert len(set(names)) == len(names), names
    for t in ORDER:
        assert isinstance(t.cost, Cost) and isinstance(t.phase, Phase), t.name
        said = {k: v for k, v in dataclasses.asdict(t.cost).items() if k != "flops_factor"}
        assert t.cost.flops_factor > 0 and any(said.values()), (
            f"{t.name}: say what it changes (or why nothing)"
        )
    phases = [t.phase for t in ORDER]
    assert phases == sorted(phases), "the transforms before the method's wrap come first"


def test_the_order_is_the_documented_one():
    """The package docstring's numbered list is ORDER, each with the phase it names."""
    documented = re.findall(r"^(\d+)\. ``(\w+)``\s+(before|after) the wrap", transforms.__doc__, re.MULTILINE)
    assert [name for _, name, _ in documented] == [t.name for t in ORDER]
    assert [int(n) for n, _, _ in documented] == list(range(1, len(ORDER) + 1))
    for (_, _, where), t in zip(documented, ORDER, strict=True):
        assert (where == "before") == (t.phase is Phase.BEFORE_WRAP), t.name
    assert [t.name for t in ORDER] == ["float8", "lora", "activation_checkpointing", "precision", "quantize_base", "compile"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit's deprecated names
def test_setup_applies_them_around_the_methods_wrap_in_order():
    """Strategy.setup: activation checkpointing, then the cast, then the method's wrap, then compile on the
    module the loop runs; the method's own reference (what it checkpoints) is the uncompiled one."""
    cfg = TrainConfig(activation_checkpointing=True, precision="fp64", compile=True)
    strategy = SingleDevice(cfg, DistEnv(), Precision("fp64", torch.device("cpu")), None)
    tc = TransformerConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=24)
    model, _ = strategy.setup(Transformer(tc), lambda params: torch.optim.SGD(params, lr=0.1))
    assert strategy.transforms.applied == ["activation_checkpointing", "precision:fp64", "compile"]
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and model._orig_mod is strategy.model
    assert {p.dtype for p in strategy.model.parameters()} == {torch.float64}
    wrapped = [m for m in strategy.model.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == tc.n_layers


def test_nothing_applied_where_nothing_is_asked():
    strategy = SingleDevice(TrainConfig(), DistEnv(), Precision("fp32", torch.device("cpu")), None)
    model = nn.Linear(2, 3)
    out, _ = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    assert out is model and strategy.transforms.applied == []


def test_the_cost_side_reads_the_pipeline():
    """The projection's FLOPs factor and the estimate's traced transforms come from the transforms a config
    asks for: recomputation adds the forward's share (4/3, the value used before), cast and compile none."""
    ac = TrainConfig(activation_checkpointing=True, precision="bf16-true", compile=True)
    assert flops_factor(ac) == 1.0 + FORWARD_SHARE == 4 / 3
    assert flops_factor(TrainConfig(precision="bf16-true", compile=True)) == 1.0
    assert tuple(t.name for t in traced(ac)) == ("activation_checkpointing",) and traced(TrainConfig()) == ()
    labels = [t.label(ac) for t in transforms.chosen(ac)]
    assert labels == ["activation_checkpointing", "precision:bf16", "compile"]


@pytest.mark.parametrize("old", [{}, {"transforms": None}])
def test_a_record_from_before_reads_as_no_transforms(old):
    assert RunRecord.from_dict({"status": "ok", "metrics": {}, **old}).transforms == []


def test_train_records_the_transforms_in_the_order_applied(tmp_path):
    """A real run (the CLI's train): result.json lists what its set-up applied, in order."""
    res = train(
        tmp_path / "run", "--model", "gpt-tiny", "--data", "text", "--seq-len", "16", "--batch-size", "4",
        "--epochs", "1", "--max-steps", "2", "--eval-samples", "4", "--progress", "false",
        "--measure-flops", "false", "--timing-warmup-steps", "0", "--precision", "fp64",
        "--activation-checkpointing", "true",
    )  # fmt: skip
    assert res["status"] == "ok"
    assert res["transforms"] == ["activation_checkpointing", "precision:fp64"]
    assert RunRecord.from_dict(res).transforms == res["transforms"]
