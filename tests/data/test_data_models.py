"""Data sets, models and precision plug-ins, on small inputs."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError, DataError
from stratbench.core.precision import Precision
from stratbench.data.datasets import build_data, digits_arrays, split_batch
from stratbench.models.zoo import build_model, load_weights, residual_block_types


def test_synthetic_is_deterministic():
    cfg = TrainConfig(data="synthetic", image_size=24, num_classes=7, synthetic_samples=40)
    a, b = build_data(cfg), build_data(cfg)
    assert len(a.train) == 40 and len(a.val) == 10 and a.num_classes == 7
    x, y = a.train[3]
    assert x.shape == (3, 24, 24) and 0 <= int(y) < 7
    torch.testing.assert_close(a.train[5][0], b.train[5][0])


def test_digits_split_is_fixed_and_disjoint():
    a, b = build_data(TrainConfig(data="digits")), build_data(TrainConfig(data="digits", seed=99))
    assert len(a.train) + len(a.val) == 1797 and len(a.val) == 359
    torch.testing.assert_close(a.val.tensors[0], b.val.tensors[0])  # the split does not move with --seed
    assert a.train[0][0].shape == (3, 32, 32)
    train_rows = {t.numpy().tobytes() for t in a.train.tensors[0][:, 0]}
    # The 8x8 set has a few exact duplicate images; nearly every validation image is unseen in training.
    overlap = sum(t.numpy().tobytes() in train_rows for t in a.val.tensors[0][:, 0])
    assert overlap < 10


def _write_cifar_fixture(root, n_train=20, n_test=10):
    """A tiny data set in the real cifar-10-batches-py format."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n):
        return {"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(n_train // 5)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(n_test)))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))


def test_cifar10_reads_the_real_format(tmp_path, monkeypatch):
    from stratbench.core.torchvision_compat import import_torchvision

    cifar = import_torchvision().datasets.CIFAR10
    _write_cifar_fixture(tmp_path)
    # torchvision md5-checks the files of the real archive; the fixture is generated, so skip the check.
    monkeypatch.setattr(cifar, "_check_integrity", lambda self: True)
    monkeypatch.setattr(import_torchvision().datasets.cifar, "check_integrity", lambda *a, **k: True)
    bundle = build_data(TrainConfig(data="cifar10", data_dir=str(tmp_path), image_size=64))
    assert len(bundle.train) == 20 and len(bundle.val) == 10
    assert bundle.class_names[0] == "airplane"
    x, y = bundle.train[0]
    assert x.shape == (3, 64, 64)  # the --image-size resize of the source experiment (224 there)


def test_imagefolder(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.fromarray(np.full((40, 40, 3), i * 40, dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    bundle = build_data(TrainConfig(data="imagefolder", data_dir=str(tmp_path), image_size=32))
    assert bundle.class_names == ["cat", "dog"] and len(bundle.train) + len(bundle.val) == 10
    assert bundle.train[0][0].shape == (3, 32, 32)


def test_bad_data_errors(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        build_data(TrainConfig(data="cifar10", data_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="divide"):
        split_batch(100, 3, 1)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnets_with_cifar_stem(name):
    model = build_model(name, 10, cifar_stem=True)
    assert model.conv1.stride == (1, 1)
    assert residual_block_types(model)
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_tinynet_has_no_batchnorm():
    model = build_model("tinynet", 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_weights_skip_the_mismatched_head(tmp_path):
    src = build_model("resnet18", 1000)  # an "ImageNet" file
    torch.save(src.state_dict(), tmp_path / "r18.pt")
    model = build_model("resnet18", 10)
    skipped = load_weights(model, str(tmp_path / "r18.pt"))
    assert skipped == ["fc.bias", "fc.weight"]
    torch.testing.assert_close(model.conv1.weight, src.conv1.weight)
    with pytest.raises(CheckpointError, match="no tensor that fits"):
        torch.save({"x": torch.ones(1)}, tmp_path / "other.pt")
        load_weights(model, str(tmp_path / "other.pt"))


def test_user_model_builder(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\ndef build(num_classes):\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))\n"
        "def not_a_model(num_classes):\n    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("my_models:build", 7)
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 7)
    with pytest.raises(ConfigError, match="not an nn.Module"):
        build_model("my_models:not_a_model", 7)
    with pytest.raises(ConfigError, match="cannot import"):
        build_model("no_such_pkg.mod:build", 10)


def test_fp16_mixed_counts_skipped_steps():
    p = Precision("fp16-mixed", torch.device("cpu"))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    p.backward(model(torch.randn(3, 4)).sum() * float("inf"))
    p.unscale(opt)
    assert p.step(opt) is False and p.skipped_steps == 1
    torch.testing.assert_close(model.weight, before)  # the inf step was skipped
    opt.zero_grad()
    p.backward(model(torch.randn(3, 4)).sum())
    p.unscale(opt)
    assert p.step(opt) is True and p.skipped_steps == 1


@pytest.mark.parametrize(("name", "dtype"), [("fp16-true", torch.float16), ("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_precision_converts_weights(name, dtype):
    p = Precision(name, torch.device("cpu"))
    model = p.convert_module(torch.nn.Linear(4, 2))
    assert model.weight.dtype == dtype
    with p.autocast():
        out = model(p.convert_input(torch.randn(3, 4)))
    assert out.dtype == (torch.bfloat16 if "bf16" in name else torch.float16)


def test_digits_are_scikit_learns_read_without_importing_it():
    """The digits file scikit-learn ships, read without `import sklearn.datasets` (scipy, pandas: ~1.8 s of every
    process that trains on digits): the same images and targets as load_digits, in a fresh interpreter."""
    script = (
        "import sys; from stratbench.data.datasets import digits_arrays; x, y = digits_arrays(); "
        "print(x.shape, y.shape, 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(1797,", "8,", "8)", "(1797,)", "False"], out
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    ref = load_digits()
    assert np.array_equal(images, ref.images) and np.array_equal(targets, ref.target)
