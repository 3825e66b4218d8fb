"""A user's data whose input is several tensors: items ``({"ids": ..., "values": ...}, label)`` for a model whose
``forward(ids, values)`` takes them by name (a mapping: ``model(**x)``; a tuple: ``model(*x)``), trained under the
data-parallel methods as one process trains it; a method that cuts the model and feeds it one tensor refuses it in
one line, and so does the estimate (it traces a model of one input), which the report then shows as n/a."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_stratbench
from stratbench.core.inputs import call_model, check_inputs, map_inputs

TWO_INPUTS = """import torch
from torch import nn
from torch.utils.data import TensorDataset, Dataset


class Pairs(Dataset):
    def __init__(self, ids, values, labels, as_tuple):
        self.ids, self.values, self.labels, self.as_tuple = ids, values, labels, as_tuple

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = (self.ids[i], self.values[i]) if self.as_tuple else {"ids": self.ids[i], "values": self.values[i]}
        return x, self.labels[i]


def _data(as_tuple):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (192, 4), generator=g)
    values = torch.randn(192, 3, generator=g)
    labels = ((ids[:, 0] >= 5) ^ (values[:, 0] > 0)).long()
    return Pairs(ids[:160], values[:160], labels[:160], as_tuple), Pairs(ids[160:], values[160:], labels[160:], as_tuple)


def named(seed=0):
    train, val = _data(False)
    return train, val, ["same", "differ"]


def pairs(seed=0):
    train, val = _data(True)
    return train, val, ["same", "differ"]


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mix = nn.Sequential(nn.Linear(8 * 4 + 3, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, ids, values):
        return self.mix(torch.cat([self.embed(ids).flatten(1), values], dim=1))


def build(num_classes):
    return Net(num_classes)
"""


def test_several_input_tensors_are_moved_cast_and_passed_by_position_or_name():
    x = {"ids": torch.zeros(2, 3, dtype=torch.long), "values": torch.ones(2, 2)}
    half = map_inputs(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, x)
    assert half["ids"].dtype == torch.long and half["values"].dtype == torch.bfloat16
    assert call_model(lambda ids, values: (ids, values), x) == (x["ids"], x["values"])
    assert call_model(lambda a, b: b, (1, 2)) == 2
    assert check_inputs(x, "d") == "a mapping of tensors ids, values" and check_inputs((x["ids"],), "d") == "a tuple of 1 tensors"
    with pytest.raises(ValueError, match="d: an item's input must be a tensor, a tuple of tensors or a mapping"):
        check_inputs(["a"], "d")


def test_a_model_of_two_inputs_trains_alike_under_the_data_parallel_methods(tmp_path):
    (tmp_path / "twoin.py").write_text(TWO_INPUTS)
    common = ["--model", "twoin:build", "--epochs", "2", "--batch-size", "32", "--lr", "0.1"]
    run_stratbench("compare", "--data", "twoin:named", *common, "--methods", "single,ddp,deepspeed",
                   "--output", "named", cwd=tmp_path)  # fmt: skip
    records = {r["method"]: r for r in map(json.loads, (tmp_path / "named" / "results.jsonl").read_text().splitlines())}
    assert sorted(records) == ["ddp", "deepspeed", "single"]
    assert {r["status"] for r in records.values()} == {"ok"}, records
    curves = {m: r["metrics"]["loss_curve"] for m, r in records.items()}
    for m in ("ddp", "deepspeed"):  # the same micro-batches: the same run to fp32's reduction order
        assert curves[m] == pytest.approx(curves["single"], rel=1e-4, abs=1e-6), m
    rows = (tmp_path / "named" / "report.csv").read_text().splitlines()
    column = rows[0].split(",").index("predicted_peak_bytes")  # the estimate traces one input: n/a, not a guess
    assert {row.split(",")[column] for row in rows[1:]} <= {"", "n/a"}, rows
    tup = run_stratbench("train", "--data", "twoin:pairs", *common, "--max-steps", "3", "--output", "tup",
                         cwd=tmp_path)  # fmt: skip
    assert json.loads((tmp_path / "tup" / "result.json").read_text())["status"] == "ok", tup.stdout[-2000:]
    refused = run_stratbench("train", "--data", "twoin:named", *common, "--strategy", "pipeline", "--nproc", "2",
                             "--output", "pipe", cwd=tmp_path, check=False)  # fmt: skip
    assert refused.returncode != 0
    assert "pipeline cuts the model and feeds it one tensor; a model of several inputs runs under" in refused.stderr
