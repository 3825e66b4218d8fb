"""The user's own code and files, as a new user hands them in: a module next to them, lazy modules, a builder or
loss that fails, a file named like a standard module, a weights file that would run code, a `last` link that leads
out of the run, a CIFAR-10 copy whose pickles name callables. Each is one line (no traceback), and bad input
writes nothing."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, fails
from stratbench.cli import main

LAZY_NET = """\
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.LazyLinear(num_classes))
"""
BOOM = "def build(num_classes):\n    raise ValueError('no layer of width -1')\n"
VECTOR_LOSS = (
    "import torch.nn.functional as F\n\n\ndef fn(logits, targets):\n"
    "    return F.cross_entropy(logits, targets, reduction='none')\n"
)
SHORT = ["--epochs", "1", "--max-steps", "2", "--batch-size", "16", "--progress", "false", "--measure-flops", "false"]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A user's folder, the working directory, that is not on sys.path (as under the console script)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder), os.getcwd())])
    return folder


def test_a_module_in_the_working_folder_is_found_after_everything_else(user_folder):
    """The working folder is appended to sys.path (found without PYTHONPATH), never put first: a user's file
    must not replace a module every other import gets."""
    from stratbench.core.user_code import import_builder

    (user_folder / "mynet_found.py").write_text("def build(num_classes):\n    return None\n")
    assert import_builder("mynet_found:build", "model")(num_classes=3) is None
    assert sys.path[-1] == str(user_folder) and sys.path[0] != str(user_folder)


def test_a_file_named_like_a_standard_module_is_refused_in_one_line(user_folder, capsys):
    (user_folder / "json.py").write_text("def build(num_classes):\n    raise SystemExit('never called')\n")
    err = fails(capsys, "train", "--model", "json:build", "--output", "out")
    assert "json.py" in err and "standard-library module 'json'" in err and "rename" in err
    assert not (user_folder / "out").exists()


def test_a_builder_that_raises_is_one_line_naming_it(user_folder, capsys):
    (user_folder / "boom.py").write_text(BOOM)
    err = fails(capsys, "train", "--model", "boom:build", "--output", "out", *SHORT)
    assert "model 'boom:build': build(num_classes=10) raised ValueError: no layer of width -1 (boom.py:2)" in err


def test_a_data_builder_that_raises_is_one_line_naming_it(user_folder, capsys):
    (user_folder / "baddata.py").write_text("def build(seed=0):\n    return {}['train']\n")
    err = fails(capsys, "train", "--data", "baddata:build", "--output", "out", *SHORT)
    assert "data 'baddata:build': build(seed=0) raised KeyError: 'train' (baddata.py:2)" in err


AUX_NET = """\
import collections
from torch import nn
Out = collections.namedtuple("Out", "logits aux")

class Net(nn.Module):  # GoogLeNet's shape: main and auxiliary logits in training, the logits alone in eval
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU())
        self.head, self.aux = nn.Linear(16, num_classes), nn.Linear(16, num_classes)

    def forward(self, x):
        h = self.body(x)
        return Out(self.head(h), self.aux(h)) if self.training else self.head(h)

def build(num_classes):
    return Net(num_classes)
"""
AUX_LOSS = (
    "import torch.nn.functional as F\n\n\ndef fn(out, targets):\n"
    "    return F.cross_entropy(out.logits, targets) + 0.3 * F.cross_entropy(out.aux, targets)\n"
)


def test_a_model_with_auxiliary_outputs_is_refused_in_one_line_or_trained_with_the_users_loss(user_folder, capsys):
    """The built-in loss names the output it got and the fix (it was an AttributeError on GoogLeNetOutputs); a
    user's loss gets the model's output as it is."""
    (user_folder / "auxnet.py").write_text(AUX_NET)
    (user_folder / "auxloss.py").write_text(AUX_LOSS)
    args = ["train", "--model", "auxnet:build", "--image-size", "8", *SHORT]
    err = fails(capsys, *args, "--output", "out")
    assert "the model's forward returned Out in training, not a tensor of logits" in err and "aux_logits=False" in err
    assert main([*args, "--output", "own", "--loss", "auxloss:fn"]) == 0
    result = json.loads((user_folder / "own" / "result.json").read_text())
    assert result["status"] == "ok" and result["metrics"]["val_accuracy"] is not None


def test_a_loss_that_is_not_a_scalar_is_one_line(user_folder, capsys):
    (user_folder / "vloss.py").write_text(VECTOR_LOSS)
    err = fails(capsys, "train", "--loss", "vloss:fn", "--output", "out", *SHORT)
    assert "loss 'vloss:fn' returned a torch.float32 tensor of shape (16,)" in err and ".mean()" in err


def test_a_model_with_lazy_modules_trains_and_is_estimated(user_folder, capsys):
    """nn.LazyLinear: a dry forward on one sample gives it its parameters before they are counted, sharded or
    saved (a ValueError traceback from torch before); the estimate sees the same model."""
    from stratbench.measuring.model_trace import ModelSpec, model_info

    (user_folder / "lazynet.py").write_text(LAZY_NET)
    assert main(["train", "--model", "lazynet:build", "--output", "out", *SHORT]) == 0
    result = json.loads((user_folder / "out" / "result.json").read_text())
    n = 3 * 4 * 9 + 4 + 16 * 10 + 10  # conv + LazyLinear(16 -> 10) created for 32 px digits
    assert result["status"] == "ok" and result["model_meta"]["num_parameters"] == n
    assert sum(model_info(ModelSpec("lazynet:build", 10, 32)).numels) == n
    assert main(["evaluate", "--checkpoint", "out/checkpoints/last"]) == 0  # rebuilt and loaded from the meta


def test_weights_that_are_not_loadable_weights_only_write_nothing(user_folder, capsys):
    torch.save({"w": torch.ones(2), "opt": Path("x")}, user_folder / "ok_but_path.pt")  # pathlib is allowed
    torch.save({"w": torch.ones(2), "run": os.getcwd}, user_folder / "code.pt")  # a callable: code on load
    (user_folder / "garbage.pt").write_bytes(b"not a torch file")
    for name, words in (("code.pt", "not loadable weights-only"), ("garbage.pt", "corrupt or not a PyTorch file")):
        err = fails(capsys, "train", "--weights", name, "--output", "out", *SHORT)
        assert name in err and words in err
        assert not (user_folder / "out").exists()  # no config.yaml, metrics.csv or result.json


def test_a_last_link_out_of_the_run_is_refused(user_folder, capsys):
    assert main(["train", "--output", "run", *SHORT]) == 0
    capsys.readouterr()
    last = user_folder / "run" / "checkpoints" / "last"
    other = user_folder / "elsewhere"
    other.mkdir()
    (other / "stratbench_meta.pt").write_bytes(b"")
    for target in (other, Path("/etc/hostname")):
        last.unlink()
        last.symlink_to(target)
        for argv in (["evaluate", "--checkpoint", "run/checkpoints/last"],
                     ["train", "--resume", "--output", "run", *SHORT]):  # fmt: skip
            err = fails(capsys, *argv)
            assert "points outside its run's checkpoints folder" in err and str(target) in err
    last.unlink()
    last.symlink_to(next(p.name for p in last.parent.iterdir() if p.name.startswith("step-")))
    assert main(["evaluate", "--checkpoint", "run/checkpoints/last"]) == 0


class _Runs:
    """A pickle global that would run code when the file is loaded."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_cifar10_copy_is_read_without_running_its_pickles(user_folder, capsys):
    """CIFAR-10's files are pickles; torchvision trusts them by md5 only. stratbench reads them with the restricted
    unpickler: a re-packed copy (other md5 sums) loads, one whose pickle names a callable is refused in one line."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from readme_tour import write_cifar10

    write_cifar10(user_folder / "data", 20, 10)
    assert main(["train", "--data", "cifar10", "--output", "ok", *SHORT, "--batch-size", "4"]) == 0
    capsys.readouterr()
    bad = user_folder / "data" / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(pickle.dumps({"data": _Runs(), "labels": [0]}, protocol=2))
    err = fails(capsys, "train", "--data", "cifar10", "--output", "bad", *SHORT)
    assert "data_batch_3" in err and "os.system" in err or "posix.system" in err
    assert not (user_folder / "pwned").exists()


def test_estimate_all_on_a_cluster_prints_every_row(capsys):
    """`--strategy all` at 16 devices: the pipeline row takes the presets' layout (4 stages x 4 replicas of
    ResNet-50's 6 pieces; it was "16 stages need 15 split points" for the whole table)."""
    assert main(["estimate", "--model", "resnet50", "--image-size", "224", "--batch-size", "512", "--precision",
                 "bf16-mixed", "--strategy", "all", "--time", "--hardware", "h100-sxm", "--nodes", "2",
                 "--gpus-per-node", "8", "--json"]) == 0  # fmt: skip
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    from stratbench.strategies.base import all_strategies

    assert set(rows) == set(all_strategies())
    assert rows["pipeline"]["options"] == {"microbatches": 8, "pp": 4}
    assert rows["pipeline"]["projection"]["status"] == "ok" and rows["ddp"]["projection"]["status"] == "ok"


def test_estimate_all_shows_a_method_that_cannot_apply_as_na(user_folder, capsys):
    """A model the pipeline cannot split, with no blocks for fsdp to wrap: the pipeline row is n/a with the reason
    (as train refuses it), fsdp wraps it by size and says so, every other row prints."""
    (user_folder / "flat.py").write_text(
        "from torch import nn\n\n\nclass Flat(nn.Module):\n    def __init__(self, num_classes):\n"
        "        super().__init__()\n        self.fc = nn.Linear(3 * 8 * 8, num_classes)\n\n"
        "    def forward(self, x):\n        return self.fc(x.flatten(1))\n\n\ndef build(num_classes):\n"
        "    return Flat(num_classes)\n"
    )
    argv = ["estimate", "--model", "flat:build", "--image-size", "8", "--batch-size", "8", "--strategy", "all",
            "--world-size", "2"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert "cannot split a Flat into pipeline stages" in rows["pipeline"]["na"]
    assert "--wrap auto: Flat declares no block classes" in rows["fsdp"]["estimate"]["units"]  # by size, said
    assert rows["ddp"]["estimate"]["total_bytes"] > 0 and rows["fsdp1"]["estimate"]["total_bytes"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "n/a" in out and "ddp" in out
