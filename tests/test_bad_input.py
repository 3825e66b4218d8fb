"""Bad input gets one clear line naming the bad value (and the allowed ones) before any work, and a
non-zero exit."""

from __future__ import annotations

import pytest
import torch

from stratbench.cli import main


def _fails(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--strategy", "zero9", "single"),
        ("--precision", "fp8", "bf16-mixed"),
        ("--model", "vgg", "resnet50"),
        ("--data", "mnist", "digits"),
        ("--optimizer", "lion", "adamw"),
    ],
)
def test_unknown_choice(capsys, tmp_path, flag, value, allowed):
    err = _fails(capsys, "train", "--output", str(tmp_path), flag, value)
    assert repr(value) in err and allowed in err


@pytest.mark.parametrize(("flag", "value"), [("--batch-size", "0"), ("--epochs", "-1"), ("--grad-accum", "0")])
def test_non_positive(capsys, tmp_path, flag, value):
    err = _fails(capsys, "train", "--output", str(tmp_path), flag, value)
    assert flag[2:].replace("-", "_") in err and value in err


def test_not_a_number(capsys, tmp_path):
    err = _fails(capsys, "train", "--output", str(tmp_path), "--epochs", "three")
    assert "'three'" in err and "int" in err


def test_missing_cifar_dir_says_where_to_put_it(capsys, tmp_path):
    err = _fails(capsys, "train", "--output", str(tmp_path), "--data", "cifar10", "--data-dir", str(tmp_path / "nowhere"))
    assert "cifar-10-batches-py" in err and "--download" in err


def test_missing_imagefolder(capsys, tmp_path):
    err = _fails(capsys, "train", "--output", str(tmp_path), "--data", "imagefolder", "--data-dir", str(tmp_path / "nope"))
    assert "nope" in err


def test_batch_must_divide(capsys, tmp_path):
    err = _fails(capsys, "train", "--output", str(tmp_path), "--batch-size", "30", "--grad-accum", "4")
    assert "30" in err and "global" in err


def test_corrupt_checkpoint(capsys, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    err = _fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(bad))
    assert "corrupt" in err and str(bad) in err


def test_foreign_checkpoint(capsys, tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, foreign)
    err = _fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(foreign))
    assert "not a stratbench checkpoint" in err


def test_missing_checkpoint_and_weights(capsys, tmp_path):
    err = _fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(tmp_path / "gone.pt"))
    assert "not found" in err
    err = _fails(capsys, "train", "--output", str(tmp_path / "o"), "--weights", str(tmp_path / "w.pt"))
    assert "not found" in err


def test_unknown_yaml_key(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochz: 3\n")
    err = _fails(capsys, "train", "--config", str(cfg))
    assert "'epochz'" in err and "epochs" in err


def test_tf32_needs_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    err = _fails(capsys, "train", "--output", str(tmp_path), "--tf32")
    assert "tf32" in err.lower() and "cpu" in err


def test_list_names_every_strategy_and_precision(capsys):
    assert main(["list", "--check"]) == 0
    out = capsys.readouterr().out
    from stratbench.precision import SPECS
    from stratbench.strategies.base import all_strategies

    for name in [*all_strategies(), *SPECS]:
        assert name in out
