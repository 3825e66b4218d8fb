"""A model's blocks by one rule (stratbench.models.blocks) for training and for predicting: the classes a model
declares, else its repeated sibling modules holding most of the parameters, else none (then --wrap size, none or
class names). fsdp trains a user's CNN with repeated blocks without --wrap and says which units it built; the
estimate and the projection price the same units and say so (before, a user's model was projected as one FSDP
unit, silently, while train refused it); a model without blocks is wrapped by size under the default --wrap auto
and said so, and refused alike by both under --wrap block, in one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import cli, fails, run_stratbench
from stratbench.cli import main
from stratbench.core.errors import ConfigError
from stratbench.models.blocks import find_blocks, why_no_blocks, wrap_units
from stratbench.models.zoo import apply_activation_checkpointing, build_model

CNN = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.conv(x))


class Net(nn.Module):  # declares nothing: its blocks are found
    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(3)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def build(num_classes):
    return Net(num_classes)


def flat(num_classes):  # no repeated modules holding most of the parameters: no blocks
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes), nn.LayerNorm(num_classes),
                         nn.LayerNorm(num_classes))


def lm(vocab_size):  # the built-in gpt-tiny as a user's model that declares no blocks
    from stratbench.models.transformer import build_transformer

    model = build_transformer("gpt-tiny", vocab_size=vocab_size)
    model._stratbench_block_types = ()
    return model
'''
IMAGES = ["--data", "synthetic", "--image-size", "16", "--num-classes", "4"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The working directory: a folder holding the user's module (``sb_blocks_user``, a name no other test
    imports: a process imports a module once), found there as the CLI finds it."""
    folder = tmp_path_factory.mktemp("blocks")
    (folder / "sb_blocks_user.py").write_text(CNN)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.syspath_prepend(str(folder))
        yield folder


# ---- the rule, in process ---------------------------------------------------------------------------
class MPTLike(nn.Module):
    """MPT's layout: blocks in a ModuleList inside a sub-model, two norms and two Linears per block, an untied head
    (every Linear together holds more than the blocks: the blocks must still win)."""

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm_1, self.norm_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    class Body(nn.Module):
        def __init__(self, d: int, n: int) -> None:
            super().__init__()
            self.wte = nn.Embedding(100, d)
            self.blocks = nn.ModuleList(MPTLike.Block(d) for _ in range(n))
            self.norm_f = nn.LayerNorm(d)

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.transformer = self.Body(d, n)
        self.lm_head = nn.Linear(d, 100)


def test_repeated_siblings_holding_most_parameters_are_the_blocks():
    blocks = find_blocks(MPTLike())
    assert blocks.types == (MPTLike.Block,) and blocks.count == 4 and not blocks.declared
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    assert find_blocks(mlp).types == (nn.Linear,) and find_blocks(mlp).count == 3
    resnet = find_blocks(build_model("resnet18", 10, cifar_stem=True))  # torchvision's, found, not listed
    assert [t.__name__ for t in resnet.types] == ["BasicBlock"] and resnet.count == 8
    tiny = find_blocks(build_model("tinynet", 1000, width=8))  # its head outweighs its blocks: declared
    assert [t.__name__ for t in tiny.types] == ["TinyBlock"] and tiny.declared and tiny.share < 0.5


def test_blocks_seen_through_activation_checkpointing_and_none_named():
    model = MPTLike()
    assert apply_activation_checkpointing(model) == 4  # the found blocks are the checkpointed ones
    assert find_blocks(model).types == (MPTLike.Block,)
    assert len(wrap_units(model, "block", 1)) == 4
    flat = nn.Sequential(nn.Linear(100, 100), nn.LayerNorm(100), nn.LayerNorm(100))
    assert find_blocks(flat) is None
    assert "the largest group: 2 x LayerNorm, 4%" in why_no_blocks(flat)
    with pytest.raises(ConfigError, match=r"no blocks to wrap.*use --wrap size"):
        wrap_units(flat, "block", 1)


# ---- as a user runs it ---------------------------------------------------------------------------------
def test_fsdp_trains_a_user_cnn_without_wrap_and_says_which_units(tmp_path):
    (tmp_path / "mymod.py").write_text(CNN)
    out = tmp_path / "run"
    proc = run_stratbench(
        "train", "--model", "mymod:build", *IMAGES, "--strategy", "fsdp", "--nproc", "2", "--batch-size", "8",
        "--epochs", "1", "--max-steps", "2", "--eval-samples", "8", "--progress", "false", "--output", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    res = json.loads((out / "result.json").read_text())
    assert res["status"] == "ok" and res["world_size"] == 2
    log = proc.stdout + proc.stderr  # rank 0's log, as the terminal shows it
    assert "FSDP units: 3 x Block (repeated sibling modules, 93% of the parameters), then the root" in log, log[-3000:]


def test_estimate_time_prices_and_names_the_units_train_builds(tmp_path):
    (tmp_path / "mymod.py").write_text(CNN)
    out = run_stratbench(
        "estimate", "--model", "mymod:build", *IMAGES, "--time", "--strategy", "fsdp", "--nodes", "2",
        "--batch-size", "64", cwd=tmp_path,
    ).stdout  # fmt: skip
    out = " ".join(out.split())  # the line wraps at the terminal's width
    assert "fsdp: FSDP units: 3 x Block (repeated sibling modules, 93% of the parameters), then the root" in out


def test_a_user_model_that_declares_no_blocks_is_projected_as_the_declared_one(user):
    """gpt-tiny built by a user's module that declares no blocks: the same 4 units, so the same projection on
    64 GPUs as the built-in (before: one unit, one gather per phase, a slower step)."""
    lm = ["--data", "text", "--seq-len", "64", "--time", "--strategy", "fsdp", "--nodes", "8", "--batch-size", "512"]
    rows = [json.loads(cli("estimate", "--model", m, *lm, "--json"))["results"][0] for m in ("gpt-tiny", "sb_blocks_user:lm")]
    declared, found = (r["projection"] for r in rows)
    assert found["step_s"] == pytest.approx(declared["step_s"], rel=1e-9)
    assert found["comm_rows"] == declared["comm_rows"] and {c["calls"] for c in found["comm_rows"]} == {5}
    assert "4 x TransformerBlock (repeated sibling modules" in rows[1]["estimate"]["units"]


def test_a_model_without_blocks_falls_back_to_size_units_and_says_so_or_is_refused_under_wrap_block(user, capsys):
    """fsdp's default --wrap auto takes a model without blocks (a user's plain CNN or MLP) by size and says so in
    the line the estimate prints and train logs; an explicit --wrap block is refused in one line, as by train."""
    flat = ["--model", "sb_blocks_user:flat", *IMAGES, "--strategy", "fsdp", "--world-size", "2", "--batch-size", "8"]
    err = fails(capsys, "estimate", *flat, "--wrap", "block")
    assert "fsdp --wrap block: no blocks to wrap: Sequential declares no block classes" in err
    assert "use --wrap size" in err
    out = " ".join(cli("estimate", *flat).split())
    assert "FSDP units: the root only, the whole model in one unit (--wrap auto: Sequential declares no block " in out
    assert "so units by size)" in out
    # --wrap none is priced as what it builds, and said
    out = cli("estimate", *flat, "--wrap", "none")
    assert "FSDP units: the root only, the whole model in one unit (--wrap none" in " ".join(out.split())
    # advise: the fsdp plans are priced (by size) beside the others
    main(["advise", "--model", "sb_blocks_user:flat", *IMAGES, "--devices", "2", "--device-memory", "513MiB"])
    out = " ".join(capsys.readouterr().out.split())
    assert "no blocks to wrap" not in out and "fsdp --sharding full" in out and "ddp: 512" in out, out


def test_an_estimate_with_every_row_na_exits_non_zero_saying_why(user, capsys):
    err = fails(capsys, "estimate", "--model", "sb_blocks_user:flat", *IMAGES, "--strategy", "all", "--world-size", "2",
                "--batch-size", "8", "--activation-checkpointing")  # fmt: skip
    assert err.startswith("stratbench estimate: error: no method could be estimated:"), err
    assert "activation checkpointing: no blocks to recompute" in err


def test_find_blocks_counts_without_memory():
    """The rule reads shapes only: a model on the meta device (any size) has the same blocks."""
    with torch.device("meta"):
        model = MPTLike(d=4096, n=8)
    assert find_blocks(model).count == 8
