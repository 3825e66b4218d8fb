"""The device-side input pipeline against the loader pipeline, and the fast recipe.

Deterministic transforms (synthetic, digits, CIFAR-10 validation): the same batches as the loader for the same
seed. CIFAR-10 training augmentation: the loader draws crops and flips from the global torch RNG, the device
pipeline from its own per-epoch generator, so the streams differ; the tests show (1) given the loader's own
draws, the device transforms produce the loader's images (exactly at 32 px, within one grey level after a
resize, where PIL rounds to uint8), and (2) over many epochs the same per-pixel mean/std, flip rate and crop
offset distribution."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from stratbench.core.config import (
    TrainConfig,
    dump_yaml,
    expand_recipe,
    from_dict,
    load_yaml,
    optimizer_impl_kwargs,
    recipe_settings,
    validate,
)
from stratbench.core.errors import ConfigError
from stratbench.data.datasets import (
    build_data,
    in_memory_source,
    make_train_batches,
    make_val_batches,
    pipeline_of,
    select_pipeline,
    train_loader,
    val_loader,
)
from stratbench.data.device import DeviceBatches, apply_augment, epoch_seed

CPU = torch.device("cpu")


def _cfg(**kw) -> TrainConfig:
    return from_dict(TrainConfig, kw)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    """A 200-image training set (40 test images) in the real cifar-10-batches-py format, random pixels."""
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)

    def batch(n):
        return {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, n).tolist(),
        }

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(40)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(40)))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    return root


@pytest.fixture
def cifar(cifar_root, monkeypatch):
    """build_data for the fixture (torchvision md5-checks the real archive's files: skipped for the fixture)."""
    from stratbench.core.torchvision_compat import import_torchvision

    tv = import_torchvision()
    monkeypatch.setattr(tv.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(tv.datasets.cifar, "check_integrity", lambda *a, **k: True)

    def make(size: int = 32, **kw):
        cfg = _cfg(data="cifar10", data_dir=str(cifar_root), image_size=size, **kw)
        return cfg, build_data(cfg)

    return make


def _all(batches) -> list:
    return [tuple(t.clone() for t in b) for b in batches]


# ------------------------------------------------------------------------------------------------
# deterministic data: the same batches


@pytest.mark.parametrize("data", ["synthetic", "digits"])
@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (1, 3)])
def test_same_batches_as_the_loader(data, world, accum):
    cfg = _cfg(data=data, synthetic_samples=300, image_size=16, seed=7, grad_accum=accum)
    bundle = build_data(cfg)
    for rank in range(world):
        dev, dev_s = make_train_batches(cfg.replace(data_pipeline="device"), bundle, CPU, rank, world, 16)
        ldr, ldr_s = make_train_batches(cfg.replace(data_pipeline="loader"), bundle, CPU, rank, world, 16)
        assert pipeline_of(dev) == "device" and pipeline_of(ldr) == "loader"
        for epoch, skip in [(0, 0), (1, 0), (2, 48)]:  # a new order each epoch; skip = resume mid-epoch
            dev_s.set_epoch(epoch, skip=skip)
            ldr_s.set_epoch(epoch, skip=skip)
            a, b = _all(dev), _all(ldr)
            assert len(a) == len(b) == len(dev) > 0
            for (x, y), (x2, y2) in zip(a, b, strict=True):
                assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("size", [32, 48])
def test_cifar_validation_same_as_the_loader(cifar, size):
    cfg, bundle = cifar(size, data_pipeline="device")
    dev = make_val_batches(cfg, bundle, CPU, 1, 2, 16)
    ldr = val_loader(bundle.val, 16, 1, 2, 0, False)
    n = 0
    for (x, y, v), (x2, y2, v2) in zip(dev, ldr, strict=True):
        assert torch.equal(y, y2) and torch.equal(v, v2)
        if size == 32:  # ToTensor + Normalize: equal up to float rounding
            torch.testing.assert_close(x, x2, rtol=0, atol=1e-5)
        else:  # PIL rounds the resized image to uint8: one grey level is 1/255/std ~ 0.016 after Normalize
            assert (x - x2).abs().max() < 0.02 and (x - x2).abs().mean() < 0.006
        n += len(y)
    assert n == 20  # 40 samples over 2 ranks


# ------------------------------------------------------------------------------------------------
# CIFAR-10 training augmentation


def _loader_epoch_with_draws(bundle, seed: int):
    """One loader epoch (num_workers 0) and the crop/flip draws its transforms made: RandomCrop calls
    torch.randint twice (row, column offset), RandomHorizontalFlip torch.rand once, per image in order, after
    the one draw the DataLoader iterator takes for its base seed."""
    loader, sampler = train_loader(bundle.train, 16, 0, 1, 0, 0, False)
    sampler.set_epoch(0)
    torch.manual_seed(seed)
    batches = [x for x, _ in loader]
    torch.manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_()
    n = len(sampler)
    draws = [
        (torch.randint(0, 9, (1,)).item(), torch.randint(0, 9, (1,)).item(), bool(torch.rand(1) < 0.5))
        for _ in range(n)
    ]
    dy, dx, flip = (torch.tensor(v) for v in zip(*draws, strict=True))
    return torch.cat(batches), torch.tensor(list(sampler)), (dy, dx, flip)


@pytest.mark.parametrize("size", [32, 64])
def test_cifar_train_transform_equals_the_loaders_given_its_draws(cifar, size):
    cfg, bundle = cifar(size)
    ref, idx, params = _loader_epoch_with_draws(bundle, seed=5)
    src = in_memory_source(cfg, bundle.train, train=True)
    out = apply_augment(src.images[idx], src.augment, params)[: len(ref)]
    assert out.shape == ref.shape == (len(ref), 3, size, size)
    if size == 32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    else:
        assert (out - ref).abs().max() < 0.02 and (out - ref).abs().mean() < 0.006
    # Not vacuous: without the crop offsets (or without the flips) the images differ.
    dy, dx, flip = params
    assert (
        apply_augment(src.images[idx], src.augment, (dy * 0 + 4, dx * 0 + 4, flip))[: len(ref)] - ref
    ).abs().max() > 1
    assert (apply_augment(src.images[idx], src.augment, (dy, dx, ~flip))[: len(ref)] - ref).abs().max() > 1


def test_cifar_augmentation_statistics_match_the_loader(cifar):
    """Different random streams, same distribution: per-pixel mean/std over 25 epochs of augmented images."""
    cfg, bundle = cifar(32, data_pipeline="device")
    epochs = 25
    dev, dev_s = make_train_batches(cfg, bundle, CPU, 0, 1, 40)
    ldr, ldr_s = make_train_batches(cfg.replace(data_pipeline="loader"), bundle, CPU, 0, 1, 40)
    torch.manual_seed(0)
    stacks = {}
    for name, batches, sampler in (("device", dev, dev_s), ("loader", ldr, ldr_s)):
        xs = []
        for e in range(epochs):
            sampler.set_epoch(e)
            xs += [x for x, _ in batches]
        stacks[name] = torch.cat(xs)
    a, b = stacks["device"], stacks["loader"]
    assert a.shape == b.shape == (200 * epochs, 3, 32, 32)
    # 5,000 samples per pixel: the standard error of a per-pixel mean is ~1.2/sqrt(5000) ~ 0.017.
    mean_a, mean_b, std_a, std_b = a.mean(0), b.mean(0), a.std(0), b.std(0)
    assert (mean_a - mean_b).abs().max() < 0.12 and (mean_a - mean_b).abs().mean() < 0.03
    assert (std_a - std_b).abs().max() < 0.12 and (std_a - std_b).abs().mean() < 0.03
    # The padding shows: a corner pixel is padding (value -mean/std ~ -2) in 4/9 x 4/9 of the draws... on the
    # flipped side too, so both top corners are darker than the centre, in both pipelines.
    for m in (mean_a, mean_b):
        assert (m[:, 0, 0] < m[:, 16, 16] - 0.3).all() and (m[:, 0, 31] < m[:, 16, 16] - 0.3).all()


def test_device_draws_flip_rate_and_crop_offsets_are_uniform(cifar):
    cfg, bundle = cifar(32, data_pipeline="device")
    batches, sampler = make_train_batches(cfg, bundle, CPU, 0, 1, 40)
    dys, dxs, flips = [], [], []
    for e in range(50):
        sampler.set_epoch(e)
        _, (dy, dx, flip) = batches.epoch_plan()
        dys.append(dy)
        dxs.append(dx)
        flips.append(flip)
    dy, dx, flip = torch.cat(dys), torch.cat(dxs), torch.cat(flips)
    n = len(flip)  # 10,000 draws
    assert abs(flip.float().mean().item() - 0.5) < 4 * 0.5 / n**0.5
    for offsets in (dy, dx):
        counts = torch.bincount(offsets, minlength=9).double()
        assert offsets.min() == 0 and offsets.max() == 8  # RandomCrop(32, padding=4): offsets 0..8
        chi2 = (((counts - n / 9) ** 2) / (n / 9)).sum().item()
        assert chi2 < 26.1  # chi-square, 8 degrees of freedom, p = 0.001
    # Joint (dy, dx) uniform over the 81 cells too (independent draws).
    joint = torch.bincount(dy * 9 + dx, minlength=81).double()
    assert (((joint - n / 81) ** 2) / (n / 81)).sum().item() < 124.8  # 80 dof, p = 0.001


def test_augmentation_follows_the_sample_position_not_the_rank(cifar):
    """A global batch is the same tensors on 1 or 2 ranks: rank r holds positions r, r+2, ... of it."""
    cfg, bundle = cifar(32, data_pipeline="device")
    one, s1 = make_train_batches(cfg, bundle, CPU, 0, 1, 32)
    two = [make_train_batches(cfg, bundle, CPU, r, 2, 16) for r in range(2)]
    s1.set_epoch(3)
    for _, s in two:
        s.set_epoch(3)
    ranks = [_all(b) for b, _ in two]
    for k, (x, y) in enumerate(_all(one)):
        x2 = torch.stack([ranks[0][k][0], ranks[1][k][0]], 1).flatten(0, 1)  # interleave rank 0 and 1
        y2 = torch.stack([ranks[0][k][1], ranks[1][k][1]], 1).flatten()
        assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("pipeline", ["loader", "device"])
def test_accumulated_micro_batches_are_the_ranks_batches(pipeline):
    """One process with --grad-accum 2 computes on exactly the micro-batches 2 ranks take (data.virtual_rank_order):
    micro-step k of each step holds rank k's batch, so its summed gradients are the ranks' all-reduced ones, bit
    for bit. A resume (skip whole steps) keeps that order."""
    cfg = _cfg(data="synthetic", synthetic_samples=300, image_size=16, seed=3, data_pipeline=pipeline)
    one, s1 = make_train_batches(cfg.replace(grad_accum=2), build_data(cfg), CPU, 0, 1, 16)
    two = [make_train_batches(cfg, build_data(cfg), CPU, r, 2, 16) for r in range(2)]
    for epoch in (0, 1):
        s1.set_epoch(epoch)
        for _, s in two:
            s.set_epoch(epoch)
        micro, ranks = _all(one), [_all(b) for b, _ in two]
        assert len(micro) == 2 * len(ranks[0]) == 2 * len(ranks[1]) > 0
        for k, (x, y) in enumerate(micro):
            x2, y2 = ranks[k % 2][k // 2]
            assert torch.equal(x, x2) and torch.equal(y, y2), (epoch, k)
    s1.set_epoch(1, skip=3 * 32)  # resumed after 3 steps of 2 x 16
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_all(one), micro[6:], strict=True))


def test_virtual_rank_order_splits_each_step_as_ranks_would():
    from stratbench.data.sampling import virtual_rank_order

    assert virtual_rank_order(8, 8, 2) == [0, 2, 4, 6, 1, 3, 5, 7]
    # whole steps reordered, a partial last step kept as it is; one chunk: the identity
    assert virtual_rank_order(10, 4, 2) == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9]
    assert virtual_rank_order(6, 6, 1) == list(range(6))
    # 2 ranks x accumulation 2 = 4 virtual ranks: rank r's micro-step k holds virtual rank r + 2k's share
    stream = list(range(64))
    ranks = [stream[r::2] for r in range(2)]
    for r in range(2):
        mine = [ranks[r][i] for i in virtual_rank_order(32, 16, 2)]
        for k in range(2):
            assert mine[8 * k : 8 * k + 8] == stream[r + 2 * k :: 4][:8]
    with pytest.raises(ConfigError, match="does not split into 3"):
        virtual_rank_order(8, 8, 3)


def test_resume_continues_the_epoch_exactly(cifar):
    cfg, bundle = cifar(32, data_pipeline="device")
    batches, sampler = make_train_batches(cfg, bundle, CPU, 1, 2, 10)
    sampler.set_epoch(2)
    full = _all(batches)
    sampler.set_epoch(2, skip=30)
    rest = _all(batches)
    assert len(rest) == len(full) - 3
    for (x, y), (x2, y2) in zip(rest, full[3:], strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    sampler.set_epoch(3)
    assert not torch.equal(_all(batches)[0][0], full[0][0])  # a new epoch: new order and new draws
    assert epoch_seed(0, 1) != epoch_seed(1, 0)


def test_resize_and_channels_last_on_the_device_pipeline(cifar):
    cfg, bundle = cifar(64, data_pipeline="device", channels_last=True)
    batches, sampler = make_train_batches(cfg, bundle, CPU, 0, 1, 8)
    sampler.set_epoch(0)
    x, y = next(iter(batches))
    assert x.shape == (8, 3, 64, 64) and x.dtype == torch.float32 and y.dtype == torch.long
    assert x.is_contiguous(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------------
# choosing the pipeline


def test_select_pipeline():
    assert select_pipeline(_cfg(data="cifar10"), CPU) == "loader"  # auto on CPU: the loader, as before
    assert select_pipeline(_cfg(data="digits", data_pipeline="device"), CPU) == "device"
    assert select_pipeline(_cfg(data="digits", data_pipeline="loader"), torch.device("cuda")) == "loader"
    assert select_pipeline(_cfg(data="imagefolder", data_dir="."), torch.device("cuda")) == "loader"
    with pytest.raises(ConfigError, match="data_pipeline 'device' needs an in-memory data set"):
        validate(_cfg(data="imagefolder", data_dir=".", data_pipeline="device"))
    with pytest.raises(ConfigError, match="unknown data_pipeline 'gpu'; choose one of: auto, loader, device"):
        validate(_cfg(data_pipeline="gpu"))


def test_auto_on_cpu_keeps_the_loader():
    cfg = _cfg(data="digits")
    batches, sampler = make_train_batches(cfg, build_data(cfg), CPU, 0, 1, 16)
    assert (
        pipeline_of(batches) == "loader"
        and pipeline_of(make_val_batches(cfg, build_data(cfg), CPU, 0, 1, 16)) == "loader"
    )


def test_device_batches_are_their_own_sampler():
    cfg = _cfg(data="digits", data_pipeline="device")
    batches, sampler = make_train_batches(cfg, build_data(cfg), CPU, 0, 1, 16)
    assert isinstance(batches, DeviceBatches) and sampler is batches


# ------------------------------------------------------------------------------------------------
# the fast recipe


def test_fast_recipe_settings_per_machine():
    gpu = recipe_settings("fast", cuda=True, bf16=True)
    assert gpu == {"precision": "bf16-mixed", "channels_last": True, "data_pipeline": "device", "optimizer_impl": "fused",
                   "cudnn_benchmark": True, "pin_memory": True, "compile": True}  # fmt: skip
    assert recipe_settings("fast", cuda=True, bf16=False)["precision"] == "fp16-mixed"  # e.g. V100, T4
    assert recipe_settings("fast", cuda=False, bf16=True)["compile"] is False  # not measured on CPU: off
    # torch's fused SGD has no DTensor rule (FSDP2): the recipe takes foreach there, and fused is refused.
    assert recipe_settings("fast", cuda=True, bf16=True, strategy="fsdp")["optimizer_impl"] == "foreach"
    assert (
        recipe_settings("fast", cuda=True, bf16=True, strategy="fsdp", optimizer="adamw")["optimizer_impl"]
        == "fused"
    )
    assert _cfg(recipe="fast", strategy="fsdp").optimizer_impl == "foreach"
    with pytest.raises(
        ConfigError, match="optimizer_impl 'fused' does not work with strategy 'fsdp' and optimizer 'sgd'"
    ):
        validate(_cfg(strategy="fsdp", optimizer_impl="fused"))
    with pytest.raises(ConfigError, match="unknown recipe 'slow'; choose one of: fast"):
        recipe_settings("slow", cuda=False, bf16=True)


def test_recipe_expands_into_the_resolved_config_and_explicit_knobs_win(tmp_path):
    cfg = _cfg(recipe="fast", device="cpu", compile=True, optimizer_impl="foreach")
    assert (
        cfg.recipe == "fast" and cfg.precision == "bf16-mixed" and cfg.channels_last and cfg.cudnn_benchmark
    )
    assert cfg.data_pipeline == "device" and cfg.compile is True and cfg.optimizer_impl == "foreach"
    assert _cfg(recipe="fast", device="cpu", channels_last=False).channels_last is False
    dump_yaml(cfg, tmp_path / "config.yaml")  # what result.json/config.yaml show, and re-reading is stable
    data = load_yaml(tmp_path / "config.yaml")
    assert data["optimizer_impl"] == "foreach" and data["precision"] == "bf16-mixed"
    assert from_dict(TrainConfig, data) == cfg and expand_recipe(dict(data)) == data
    assert _cfg().precision == "fp32" and _cfg().data_pipeline == "auto"  # no recipe: nothing changes
    with pytest.raises(ConfigError, match="unknown recipe"):
        _cfg(recipe="fastest")


def test_recipe_from_the_command_line():
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = resolve_config(
        parser.parse_args(["--recipe", "fast", "--device", "cpu", "--channels-last", "false"])
    )
    assert cfg.precision == "bf16-mixed" and cfg.channels_last is False and cfg.optimizer_impl == "fused"


@pytest.mark.parametrize("impl", ["default", "foreach", "fused", "for-loop"])
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.AdamW])
def test_optimizer_impl_kwargs_make_a_working_optimizer(impl, opt):
    p = torch.nn.Parameter(torch.ones(4))
    o = opt([p], lr=0.1, **optimizer_impl_kwargs(impl))
    p.grad = torch.ones(4)
    o.step()
    assert (p.detach() < 1).all()
    with pytest.raises(ConfigError, match="unknown optimizer_impl 'apex'"):
        validate(_cfg(optimizer_impl="apex"))


def test_gpu_fast_preset_uses_the_recipe_and_seed_keeps_the_source_settings():
    from stratbench.compare.matrix import load_matrix

    fast = load_matrix("gpu-fast", None, world_size=1)
    assert {c.config["recipe"] for c in fast.cells} == {"fast"} and fast.gpu_only
    assert {c.world_size for c in fast.cells} == {1}
    names = {c.name for c in fast.cells}
    assert {"single", "ddp", "fsdp", "fsdp1", "ddp-zero", "deepspeed-z3", "accelerate-fsdp"} <= names
    seed = load_matrix("seed", None, world_size=2)
    assert all("recipe" not in c.config for c in seed.cells)


# ------------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
def test_device_pipeline_on_cuda_gives_the_cpu_batches(cifar):
    cfg, bundle = cifar(64, data_pipeline="device")
    cuda = torch.device("cuda")
    on_gpu, s_gpu = make_train_batches(cfg, bundle, cuda, 0, 1, 16)
    on_cpu, s_cpu = make_train_batches(cfg, bundle, CPU, 0, 1, 16)
    s_gpu.set_epoch(1)
    s_cpu.set_epoch(1)
    for (x, y), (x2, y2) in zip(on_gpu, on_cpu, strict=True):
        assert x.device.type == "cuda" and torch.equal(y.cpu(), y2)
        torch.testing.assert_close(x.cpu(), x2, rtol=0, atol=1e-4)  # same draws; interpolation kernels differ


@pytest.mark.gpu
def test_auto_picks_the_device_pipeline_on_cuda():
    cfg = _cfg(data="digits")
    batches, _ = make_train_batches(cfg, build_data(cfg), torch.device("cuda"), 0, 1, 16)
    assert pipeline_of(batches) == "device"


@pytest.mark.gpu
def test_fast_recipe_trains_on_cuda(tmp_path):
    from conftest import train

    res = train(tmp_path, "--recipe", "fast", "--model", "resnet18", "--cifar-stem", "--data", "synthetic",
                "--image-size", "32", "--synthetic-samples", "1024", "--batch-size", "128", "--epochs", "1",
                "--max-steps", "8", "--progress", "false", "--device", "cuda", timeout=600)  # fmt: skip
    assert res["status"] == "ok"
    c = res["config"]
    assert c["recipe"] == "fast" and c["compile"] is True and c["data_pipeline"] == "device"
    assert c["precision"] == ("bf16-mixed" if torch.cuda.is_bf16_supported() else "fp16-mixed")


@pytest.mark.gpu
def test_device_batches_never_make_the_host_wait_for_the_gpu(cifar):
    """After an epoch's plan is on the device, making a batch launches kernels only: no synchronising call
    (a blocking copy or a .item()) that would stall the host behind the GPU at every step."""
    cfg, bundle = cifar(224, data_pipeline="device", channels_last=True)
    batches, sampler = make_train_batches(cfg, bundle, torch.device("cuda"), 0, 1, 16)
    sampler.set_epoch(0)
    it = iter(batches)
    next(it)  # the epoch's plan: indices and draws copied once
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            x, y = next(it)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.shape == (16, 3, 224, 224) and x.is_contiguous(memory_format=torch.channels_last)
