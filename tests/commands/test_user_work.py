"""The user's own work: pretrained weights by name, Lightning precision names, underscore flags, user model and
data builders, plain weight exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli, run_stratbench, train
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.errors import CheckpointError, ConfigError

RESNET18_FILE = "resnet18-f37072fd.pth"  # torchvision's ResNet18_Weights.IMAGENET1K_V1, as torch.hub names it


def _fake_imagenet_resnet18(torch_home: Path) -> dict[str, torch.Tensor]:
    """A small stand-in for torchvision's ImageNet resnet18 file, written under its exact hub cache name: the
    first convolution with recognisable values and the 1000-class head (which a 10-class model must skip)."""
    state = {
        "conv1.weight": torch.full((64, 3, 7, 7), 0.125),
        "fc.weight": torch.zeros(1000, 512),
        "fc.bias": torch.zeros(1000),
    }
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state, folder / RESNET18_FILE)
    return state


def test_weights_by_name_resolve_to_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    with pytest.raises(CheckpointError) as err:  # offline, not cached: one line naming file and folder
        from_dict(TrainConfig, {"model": "resnet18", "weights": "imagenet"})
    msg = str(err.value)
    assert "\n" not in msg and RESNET18_FILE in msg and str(tmp_path / "th" / "hub" / "checkpoints") in msg
    assert "--download" in msg
    _fake_imagenet_resnet18(tmp_path / "th")
    for name in ("imagenet", "IMAGENET1K_V1", "DEFAULT"):
        cfg = from_dict(TrainConfig, {"model": "resnet18", "weights": name})
        assert cfg.weights == str(tmp_path / "th" / "hub" / "checkpoints" / RESNET18_FILE)
    with pytest.raises(ConfigError, match="IMAGENET1K_V2.*choose one of: imagenet, DEFAULT, IMAGENET1K_V1"):
        from_dict(TrainConfig, {"model": "resnet18", "weights": "IMAGENET1K_V2"})
    with pytest.raises(ConfigError, match="only for torchvision models"):
        from_dict(TrainConfig, {"model": "tinynet", "weights": "imagenet"})


def test_train_from_imagenet_weights_offline(tmp_path):
    """`stratbench train --weights imagenet` with the file in TORCH_HOME's hub cache and no network."""
    state = _fake_imagenet_resnet18(tmp_path / "th")
    env = {"TORCH_HOME": str(tmp_path / "th")}
    out = tmp_path / "run"
    res = train(out, "--model", "resnet18", "--weights", "imagenet", "--data", "synthetic", "--synthetic-samples",
                "16", "--image-size", "32", "--batch-size", "8", "--epochs", "1", "--max-steps", "1", "--lr", "1e-9",
                "--progress", "false", "--measure-flops", "false", env=env)  # fmt: skip
    assert res["status"] == "ok"
    assert sorted(res["weights_skipped"]) == ["fc.bias", "fc.weight"]  # the 1000-class head
    assert res["config"]["weights"].endswith(RESNET18_FILE)
    ckpt = torch.load(out / "checkpoints" / "last", map_location="cpu", weights_only=False)
    conv1 = ckpt["model"]["conv1.weight"]
    assert torch.allclose(conv1, state["conv1.weight"], atol=1e-5)  # loaded, then one step at lr 1e-9
    proc = run_stratbench("train", "--model", "resnet18", "--weights", "IMAGENET1K_V1", "--output", str(tmp_path / "x"),
                          env={"TORCH_HOME": str(tmp_path / "empty")}, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"put {RESNET18_FILE}" in proc.stderr
        and str(tmp_path / "empty" / "hub" / "checkpoints") in proc.stderr
    )


def test_seed_preset_uses_cached_imagenet_weights(tmp_path, monkeypatch):
    from stratbench.compare.matrix import load_matrix
    from stratbench.compare.report import Footnotes, build_rows, columns_for

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    random_init = load_matrix("seed", None)
    assert "weights" not in random_init.base and "random init" in random_init.description
    folder = tmp_path / "th" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, folder / "resnet50-11ad3fa6.pth")  # IMAGENET1K_V2
    pretrained = load_matrix("seed", None)
    assert pretrained.base["weights"] == "imagenet" and "ImageNet weights" in pretrained.description
    cell = pretrained.cells[0]
    recs = [{"status": "skipped", "method": c.method, "precision": c.precision, "world_size": c.world_size,
             "config": c.train_config("x"), "metrics": {}} for c in (cell, random_init.cells[0])]  # fmt: skip
    rows = build_rows(recs, Footnotes())
    assert ("init", "init") in columns_for(rows)
    assert [r.text["init"] for r in rows] == ["imagenet", "random"]


@pytest.mark.parametrize(
    ("given", "resolved"),
    [("32-true", "fp32"), ("16-mixed", "fp16-mixed"), ("bf16-mixed", "bf16-mixed"), ("16-true", "fp16-true"),
     ("bf16-true", "bf16-true"), ("64-true", "fp64"), ("fp16-mixed", "fp16-mixed")],
)  # fmt: skip
def test_lightning_precision_names(given, resolved):
    assert from_dict(TrainConfig, {"precision": given}).precision == resolved


def test_lightning_precision_names_in_a_matrix_and_estimate():
    from stratbench.cli import main
    from stratbench.compare.matrix import build_matrix

    m = build_matrix({"cells": [{"method": "single", "precision": ["32-true", "bf16-mixed", "16-mixed"]}]})
    assert [c.precision for c in m.cells] == ["fp32", "bf16-mixed", "fp16-mixed"]
    assert main(["estimate", "--precision", "16-mixed", "--model", "tinynet"]) == 0
    assert main(["estimate", "--precision", "16-bad", "--model", "tinynet"]) != 0


def test_underscore_flags_are_accepted():
    from stratbench.cli import build_parser, normalise_flags
    from stratbench.commands.compare import overrides_from
    from stratbench.commands.train import resolve_config

    argv = ["train", "--batch_size", "8", "--max_steps=3", "--strategy", "deepspeed", "--deepspeed_config", "ds.json",
            "--zero_stage", "2", "--precision", "bf16-mixed"]  # fmt: skip
    assert normalise_flags(argv)[1:4] == ["--batch-size", "8", "--max-steps=3"]
    assert normalise_flags(["train", "--", "--a_b"]) == ["train", "--", "--a_b"]  # after "--": left alone
    cfg = resolve_config(build_parser().parse_args(normalise_flags(argv)))
    assert cfg.batch_size == 8 and cfg.max_steps == 3
    assert cfg.strategy_options == {"deepspeed_config": "ds.json", "zero_stage": "2"}
    args = build_parser().parse_args(normalise_flags(["compare", "--batch_size", "32", "--image_size", "16"]))
    assert overrides_from(args) == {"batch_size": 32, "image_size": 16}


def test_underscore_flags_and_lightning_precision_end_to_end(tmp_path):
    res = train(tmp_path / "run", "--model", "tinynet", "--width", "8", "--data", "synthetic", "--synthetic_samples",
                "64", "--image_size", "16", "--batch_size", "16", "--max_steps", "2", "--epochs", "1", "--precision",
                "32-true", "--progress", "false", "--measure_flops", "false")  # fmt: skip
    assert res["status"] == "ok" and res["precision"] == "fp32" and res["config"]["batch_size"] == 16
    assert res["metrics"]["steps"] == 2


USER_MODEL = """
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, num_classes))
"""
USER_DATA = """
import torch
from torch.utils.data import TensorDataset


def build(image_size=None, seed=0):
    size = image_size or 12
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 3, size, size, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of the first channel's mean
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:]), ["negative", "positive"]
"""

USER_LOSS = """
import torch.nn.functional as F


def shifted(logits, targets):
    return F.cross_entropy(logits, targets) + 10.0  # cross-entropy's gradient, a recognisable value
"""


def _user_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    """A user's folder with their own model and data modules, and a command that starts stratbench the way the
    console script does: from a script elsewhere, so that the working directory is not on sys.path by itself."""
    import sys

    work = tmp_path / "work"
    work.mkdir()
    (work / "mynet.py").write_text(USER_MODEL)
    (work / "mydata.py").write_text(USER_DATA)
    (work / "myloss.py").write_text(USER_LOSS)
    launcher = tmp_path / "bin" / "stratbench_script.py"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom stratbench.cli import main\nsys.exit(main())\n")
    return work, [sys.executable, str(launcher)]


def _run_in(work: Path, cmd: list[str], *args: str, check: bool = True):
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "src")  # stratbench only, not the user's folder
    proc = subprocess.run([*cmd, *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_user_model_and_data_from_the_working_directory(tmp_path):
    import json
    import sys

    from safetensors.torch import load_file

    work, cmd = _user_folder(tmp_path)
    _run_in(work, cmd, "train", "--model", "mynet:build", "--data", "mydata:build", "--loss", "myloss:shifted",
            "--batch-size", "16", "--epochs", "3", "--lr", "0.1", "--output", "out", "--progress", "false",
            "--measure-flops", "false")  # fmt: skip
    res = json.loads((work / "out" / "result.json").read_text())
    assert res["status"] == "ok" and res["model"] == "mynet:build" and res["data"] == "mydata:build"
    assert res["loss"] == {"name": "myloss:shifted", "validation_loss": "cross-entropy"}
    assert res["metrics"]["steps"] == 3 * 128 // 16
    assert res["metrics"]["val_accuracy"] >= 0.75  # the user's data set is learnable; chance is ~0.5
    # The user's loss trained it (every step's loss carries its +10); validation stays plain cross-entropy.
    assert all(10.0 < x < 11.0 for x in res["metrics"]["loss_curve"])
    assert res["metrics"]["val_loss"] < 1.0
    # export and bench-infer take the same user builder
    _run_in(work, cmd, "export", "--checkpoint", "out/checkpoints/last", "--output", "mynet.safetensors")
    _run_in(work, cmd, "export", "--checkpoint", "out/checkpoints/last", "--output", "mynet.pt")
    sys.path.insert(0, str(work))
    try:
        import mynet
    finally:
        sys.path.remove(str(work))
    x = torch.randn(4, 3, 12, 12)
    outs = []
    for state in (
        load_file(str(work / "mynet.safetensors")),
        torch.load(work / "mynet.pt", weights_only=True),
    ):
        model = mynet.build(num_classes=2).eval()
        model.load_state_dict(state, strict=True)
        outs.append(model(x))
    assert torch.equal(outs[0], outs[1])
    bench = _run_in(work, cmd, "bench-infer", "--model", "mynet:build", "--image-size", "12", "--num-classes", "2",
                    "--batch-sizes", "2", "--backends", "eager-fp32", "--iters", "5", "--warmup", "1")  # fmt: skip
    assert "eager-fp32" in bench.stdout
    bad = _run_in(work, cmd, "train", "--data", "nosuch:build", "--output", "x", check=False)
    assert (
        bad.returncode != 0
        and "cannot import 'build' from 'nosuch'" in bad.stderr
        and str(work) in bad.stderr
    )


def test_export_plain_weights_load_into_torchvision_without_stratbench(tmp_path):
    """--format safetensors|state-dict: files a PyTorch user loads into torchvision's resnet18 with no stratbench."""
    import subprocess
    import sys

    out = tmp_path / "run"
    train(out, "--model", "resnet18", "--data", "synthetic", "--synthetic-samples", "16", "--image-size", "32",
          "--batch-size", "8", "--epochs", "1", "--max-steps", "1", "--progress", "false", "--measure-flops", "false")  # fmt: skip
    ckpt = str(out / "checkpoints" / "last")
    cli("export", "--checkpoint", ckpt, "--output", tmp_path / "w.safetensors")
    cli("export", "--checkpoint", ckpt, "--format", "state-dict", "--output", tmp_path / "w.weights")
    out = cli("export", "--checkpoint", ckpt, "--format", "safetensors", "--fp16", "--output", tmp_path / "h.safetensors")
    assert "max abs diff" in out
    # A fresh interpreter in which stratbench cannot be imported: plain torch, torchvision and safetensors only.
    script = f"""
import sys
sys.modules["stratbench"] = None  # importing stratbench would fail
import torch
from safetensors.torch import load_file
try:
    import torchvision
except RuntimeError:  # PyPI's CUDA torchvision on a CPU torch (see PLATFORM_NOTES): define the two ops first
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    for m in [m for m in sys.modules if m.startswith("torchvision")]:
        del sys.modules[m]
    import torchvision
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
outs = []
for state in (load_file({str(tmp_path / "w.safetensors")!r}), torch.load({str(tmp_path / "w.weights")!r}, weights_only=True),
              {{k: v.float() for k, v in load_file({str(tmp_path / "h.safetensors")!r}).items()}}):
    m = torchvision.models.resnet18(num_classes=10).eval()
    m.load_state_dict(state, strict=True)
    outs.append(m(x))
assert torch.equal(outs[0], outs[1]), "safetensors and state dict differ"
assert (outs[2] - outs[0]).abs().max() < 0.05, "fp16 copy too far off"
print("loaded", len(state), "tensors")
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded" in res.stdout


def test_loss_choice_and_mistyped_prefixes_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    """--loss cross-entropy (with --label-smoothing) builds torch's loss; bad values are one line naming the
    allowed ones, before any work."""
    import torch.nn.functional as F

    from stratbench.cli import main
    from stratbench.training.losses import build_loss

    logits, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 0, 1])
    fn = build_loss(from_dict(TrainConfig, {"loss": "cross-entropy", "label_smoothing": 0.2}))
    assert torch.equal(fn(logits, y), F.cross_entropy(logits, y, label_smoothing=0.2))
    assert not torch.equal(fn(logits, y), F.cross_entropy(logits, y))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notaloss.py").write_text("def one(x):\n    return x\n")
    for flags, words in (
        (["--loss", "mse"], "unknown loss 'mse'; choose one of: cross-entropy (with --label-smoothing X), or a function as 'package.module:function'"),
        (["--label-smoothing", "1.5"], "label_smoothing must be between 0 and 1, got 1.5"),
        (["--loss", "notaloss:one"], "loss 'notaloss:one' is not a loss: it must take (logits, targets)"),
        (["--loss", "notaloss:one", "--label-smoothing", "0.1"], "--label-smoothing applies to cross-entropy only"),
        (["--loss", "nosuch:fn"], "loss 'nosuch:fn': cannot import 'fn' from 'nosuch'"),
        (["--data", "jsnl:x.jsonl"], "(did you mean 'jsonl:'?)"),  # a mistyped prefix reads as a builder
        (["--data", "hf-datset:x"], "(did you mean 'hf-dataset:'?)"),
        (["--model", "hff:x", "--data", "text"], "(did you mean 'hf:'?)"),
    ):  # fmt: skip
        assert main(["train", "--output", str(tmp_path / "out"), *flags]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out").exists()


TORCHVISION_NET = """
import torchvision
from torch import nn


def build(num_classes):
    # a torchvision building block, as a user's model takes it
    stem = torchvision.ops.misc.Conv2dNormActivation(3, 8, kernel_size=3, norm_layer=None)
    return nn.Sequential(stem, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
"""


def test_a_user_module_that_imports_torchvision_works_everywhere(tmp_path):
    """`import torchvision` in the user's own module: PyPI's CUDA torchvision on the CPU torch fails to import
    ("operator torchvision::nms does not exist") unless stratbench's guard is in place before the user's import —
    in train, estimate and compare alike (each a fresh process). compare plans its cell with the user's model
    (imported and priced in compare's own process) and skips it for a 1 KiB device: its training would be one
    more fresh `stratbench train`, which the first command is (~5 s)."""
    work, cmd = _user_folder(tmp_path)
    (work / "tvnet.py").write_text(TORCHVISION_NET)
    data = ["--data", "synthetic", "--synthetic-samples", "32", "--image-size", "12", "--batch-size", "8"]
    short = ["--max-steps", "2", "--epochs", "1", "--measure-flops", "false"]
    _run_in(work, cmd, "train", "--model", "tvnet:build", *data, *short, "--progress", "false", "--output", "run")
    assert json.loads((work / "run" / "result.json").read_text())["status"] == "ok"
    est = _run_in(work, cmd, "estimate", "--model", "tvnet:build", "--image-size", "12", "--batch-size", "8")
    assert "total per device" in est.stdout
    _run_in(work, cmd, "compare", "--preset", "quick", "--model", "tvnet:build", *data, *short, "--only", "single",
            "--precision", "fp32", "--device-memory", "1KiB", "--output", "cmp")  # fmt: skip
    rows = [json.loads(line) for line in (work / "cmp" / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["skipped"] and "does not fit (estimate" in rows[0]["reason"], rows


def test_compare_methods_options_and_names_are_checked_before_any_cell(tmp_path, capsys):
    """--methods, --precisions and --method-option: a mistyped method, preset or option is one line with the
    closest names; an option reaches only its method's cells; a preset run on another model is titled so."""
    from conftest import fails
    from stratbench.api import plan_sweep

    err = fails(capsys, "compare", "--methods", "single,dpp", "--output", str(tmp_path / "a"))
    assert "unknown method 'dpp' (did you mean 'dp' or 'ddp'?)" in err
    err = fails(capsys, "compare", "--preset", "quik", "--output", str(tmp_path / "a"))
    assert "unknown preset 'quik' (did you mean 'quick'" in err
    err = fails(capsys, "compare", "--methods", "fsdp", "--method-option", "fsdp.wrapp=size")
    assert "fsdp has no option 'wrapp' (did you mean 'wrap'?)" in err
    err = fails(capsys, "compare", "--methods", "fsdp", "--method-option", "fsdp.sharding=half")
    assert "sharding" in err and "half" in err
    err = fails(capsys, "compare", "--preset", "quick", "--precisions", "fp32")
    assert "--precisions lists the precisions of --methods" in err
    assert not (tmp_path / "a").exists()
    sweep = plan_sweep(methods="single,fsdp", precisions="fp32,bf16", method_options=["fsdp.wrap=size"],
                       output=tmp_path / "b")  # fmt: skip
    cells = {(c.method, c.precision): c.options for c in sweep.matrix.cells}
    assert cells == {("single", "fp32"): {}, ("single", "bf16-mixed"): {}, ("fsdp", "fp32"): {"wrap": "size"},
                     ("fsdp", "bf16-mixed"): {"wrap": "size"}}  # fmt: skip
    quick = plan_sweep("quick", model="resnet18", method_options={"deepspeed": {"zero_stage": 2}},
                       only=["deepspeed*"], output=tmp_path / "c")  # fmt: skip
    assert quick.matrix.heading == "quick on resnet18" and quick.matrix.description.startswith("resnet18 on digits")
    assert {c.options.get("zero_stage") for c in quick.matrix.cells if c.method == "deepspeed"} == {2}
    assert plan_sweep("quick", output=tmp_path / "d").matrix.heading == "quick"
    named = {plan_sweep(methods="single", model="mynet:build", data=d).matrix.name for d in ("a:build", "b:build")}
    assert named == {"mynet-build-on-a-build", "mynet-build-on-b-build"}  # two data sets: two default folders
