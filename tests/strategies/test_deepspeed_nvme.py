"""ZeRO-Infinity's NVMe offload (`--offload-optimizer/--offload-params nvme`): the configuration and its refusals,
and two real 2-rank ZeRO-3 runs that swap to files and train plain ZeRO-3's model bit for bit. The runs need
DeepSpeed's async_io op: conftest starts its build in the background at nice 19 when the session's tests are
collected (scripts/async_io_build.py: cold, ~4.5 min of CPU on 2 cores, cached per venv after), and this file is
collected last (conftest.LAST), so that the build has the rest of the suite to use what the suite leaves idle."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import async_io_build
from conftest import DEEPSPEED, DEEPSPEED_TIMEOUT, TINY, ok_curve, train, zygote
from stratbench.strategies.op_builds import extensions_cache_dir

pytestmark = pytest.mark.distributed

DS = DEEPSPEED
TIMEOUT = DEEPSPEED_TIMEOUT
_curve = ok_curve


def test_nvme_offload_needs_a_path_stage_3_and_the_async_io_op(tmp_path):
    """--offload-optimizer nvme: ZeRO-Infinity's folder and stage are checked, and where DeepSpeed's async_io op
    cannot be built (no libaio) the run is refused in one line naming the op and the package."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from stratbench.core.config import TrainConfig
    from stratbench.core.errors import ConfigError
    from stratbench.strategies.deepspeed import DeepSpeed, DeepSpeedOptions
    from stratbench.strategies.parallel.deepspeed_config import build_ds_config

    cfg = TrainConfig(strategy="deepspeed", batch_size=32)
    with pytest.raises(ConfigError, match="--offload-optimizer nvme needs --nvme-path DIR"):
        build_ds_config(cfg, DeepSpeedOptions(zero_stage=3, offload_optimizer="nvme"), 2)
    with pytest.raises(ConfigError, match=r"nvme \(ZeRO-Infinity\) needs --zero-stage 3, got stage 2"):
        build_ds_config(cfg, DeepSpeedOptions(zero_stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)), 2)
    with pytest.raises(ConfigError, match="--offload-optimizer must be one of: none, cpu, nvme; got 'disk'"):
        build_ds_config(cfg, DeepSpeedOptions(offload_optimizer="disk"), 2)
    opts = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": str(tmp_path)}
    ds = build_ds_config(cfg, DeepSpeedOptions(**opts), 2)
    assert ds["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path)
    assert ds["zero_optimization"]["offload_param"]["device"] == "nvme"
    reason = DeepSpeed.check_supported(cfg.replace(strategy_options=opts), __import__("torch").device("cpu"), 2)
    if not AsyncIOBuilder().is_compatible():
        assert reason is not None and "\n" not in reason
        assert "async_io op" in reason and "libaio-dev" in reason
    else:  # libaio present: only a missing compiler could stop it
        assert reason is None or "ninja" in reason or "compiler" in reason
    with pytest.raises(ConfigError, match="is not a folder"):
        DeepSpeed.check_supported(cfg.replace(strategy_options={**opts, "nvme_path": str(tmp_path / "no")}), __import__("torch").device("cpu"), 2)


# ZeRO-Infinity's NVMe offload. DeepSpeed swaps only tensors of 1 MiB and more (MIN_AIO_BYTES, whatever the aio
# block size): TINY's width 8 (24,538 parameters) would swap nothing. At width 64 each of 2 ranks swaps its fp32
# master partition and momentum (632,133 elements), the gradients of the 256x256x3x3 conv (589,824 elements, the
# only parameter whose half reaches 1 MiB) and, under --offload-params nvme, that conv's weights.
# The reference is plain ZeRO-3 on the same problem, and the check is bit for bit: swapping tensors through files
# moves bytes, it must not change one. That holds by construction on any CPU (the same kernels on the same shapes
# in the same order): measured identical under no cap and the SSE4.1 cap. Against `single --grad-accum 2` it does
# not: at width 64 ZeRO-3 itself is 1.8e-6 from `single` at step 6 with AVX2 but 1.6e-5 under the SSE4.1 cap (the
# summation order, amplified; CI saw it). ZeRO-3 equals `single` at width 8: test_zero3_with_cpu_offload_*.
NVME_PROBLEM = [*TINY, "--width", "64", "--max-steps", "6"]
NVME_BIG_PARAM = 256 * 256 * 3 * 3


@pytest.fixture(scope="module")
def async_io_op() -> float:
    """Skip where DeepSpeed's async_io op cannot be built (no libaio: `make install` installs libaio-dev as root);
    else wait for its build (with the pin_memory op it loads) into stratbench's extensions cache, which conftest
    started in the background when the session began (scripts/async_io_build.py): cold it takes minutes on 2 cores
    (see docs/deepspeed_accelerate.md), cached about a second. Returns the seconds since it started."""
    reason = async_io_build.unavailable()
    if reason:
        pytest.skip(reason)
    return async_io_build.wait()


@pytest.fixture(scope="module")
def nvme_reference(tmp_path_factory) -> dict:
    """Plain ZeRO-3 (no offload) on NVME_PROBLEM over 2 ranks: what the nvme runs must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "zero3-fp32-w64"
    return train(out, *DS, "--zero-stage", "3", *NVME_PROBLEM, nproc=2, timeout=TIMEOUT)


@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first one may build the async_io op (cold: minutes)
@pytest.mark.parametrize("params", [False, True], ids=["optimizer", "optimizer+params"])
def test_zero3_with_nvme_offload_swaps_to_files_and_trains_the_same_model(
    tmp_path, params, async_io_op, nvme_reference
):
    swap = tmp_path / "nvme"
    swap.mkdir()
    flags = ["--zero-stage", "3", "--offload-optimizer", "nvme", "--nvme-path", str(swap)]
    flags += ["--offload-params", "nvme"] if params else []
    out = tmp_path / "run"
    if params:
        res = train(out, *DS, *flags, *NVME_PROBLEM, nproc=2, timeout=TIMEOUT)
    else:  # as a user whose earlier async_io build was killed (a test timeout, ^C): its lock is still there
        # Ranks forked from the zygote, as train() runs them, with the copied cache in their environment: each
        # loads the op through DeepSpeed and torch's cpp_extension, which is where the lock is met (the launcher
        # and torchrun never load it; through them, with fresh interpreters, this test took 33 s instead of
        # 10-15 s on 2 cores). Without the takeover the ranks wait on the lock until TIMEOUT.
        cache = _cache_with_a_killed_builds_lock(tmp_path / "ext")
        argv = ["train", "--output", str(out), "--nproc", "2", *DS, *flags, *NVME_PROBLEM]
        ranks = zygote().start(argv, 2, env={"TORCH_EXTENSIONS_DIR": str(cache)}, name=out.name)
        code, logs = ranks.wait(TIMEOUT), ranks.log_tail(1 << 20)
        assert code == 0, logs[-6000:]
        assert f"removed {cache / 'async_io' / 'lock'}, left by a build that was killed" in logs, logs[-6000:]
        res = json.loads((out / "result.json").read_text())
    assert len(_curve(res)) == 6
    assert _curve(res) == _curve(nvme_reference)  # bit for bit: see the comment on NVME_PROBLEM
    for rank in (0, 1):
        folder = swap / "zero_stage_3" / "optimizer" / f"rank{rank}"
        files = {p.name: p.stat().st_size for p in folder.glob("*.tensor.swp")}
        master = [n for n in files if re.fullmatch(r"\d+_\d+\.tensor\.swp", n)]
        momentum = [n for n in files if n.startswith("momentum_buffer-")]
        grads = [n for n in files if "_gradient_" in n]
        assert len(master) == len(momentum) == 1 and grads, files
        assert files[master[0]] == files[momentum[0]] >= 4 * 632_133, files  # the rank's fp32 partition
        # Weights swapped in fp32 (DeepSpeed itself picks bf16 on a CPU: see zero_init_keeps_dtype).
        params_folder = swap / "zero_stage_3" / "float32params" / f"rank{rank}"
        swapped = sorted(p.stat().st_size for p in params_folder.glob("*_param.tensor.swp"))
        assert swapped == ([4 * NVME_BIG_PARAM // 2] if params else []), swapped
    ds = json.loads((out / "deepspeed_config.json").read_text())["zero_optimization"]
    assert ds["offload_optimizer"] == {"device": "nvme", "pin_memory": False, "nvme_path": str(swap)}
    # One buffer holds the largest partition (DeepSpeed's default: 1e8 elements, 2 GB page-locked per rank).
    if params:
        assert ds["offload_param"]["buffer_size"] == NVME_BIG_PARAM // 2


def _cache_with_a_killed_builds_lock(folder: Path) -> Path:
    """A copy of stratbench's op cache (the ops built, so nothing compiles) whose async_io folder holds the lock of
    a build killed with SIGKILL: torch's own lock file (``FileBaton``), taken by a process that was then killed.
    Before op_builds, every run that needed the op waited on it forever, silently."""
    shutil.copytree(extensions_cache_dir(), folder)
    lock = folder / "async_io" / "lock"
    hold = "import sys, time; from torch.utils.file_baton import FileBaton; FileBaton(sys.argv[1]).try_acquire(); time.sleep(600)"
    builder = subprocess.Popen([sys.executable, "-c", hold, str(lock)])
    while not lock.exists():
        time.sleep(0.05)
    builder.kill()
    builder.wait()
    return folder


def test_nvme_is_refused_in_one_line_where_async_io_cannot_be_built(tmp_path, monkeypatch, capsys):
    """Where libaio is missing, DeepSpeed's own check (a test program calling io_submit, linked with -laio) fails:
    `stratbench train` refuses before any work, in one line naming the op and the package."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from stratbench.cli import main

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    out = tmp_path / "out"
    swap = tmp_path / "nvme"
    swap.mkdir()
    flags = ["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme"]
    flags += ["--nvme-path", str(swap)]
    assert main(["train", "--output", str(out), *DS, *flags, *TINY, "--nproc", "2"]) != 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "cannot run here: nvme offload needs DeepSpeed's async_io op" in lines[0]
    assert "apt-get install libaio-dev" in lines[0]
    assert not out.exists() and not any(swap.iterdir())


def test_nvme_gradient_pieces_parameter_buffers_and_checkpoints_without_processes(tmp_path):
    """The two sizes stratbench sets for nvme: the gradient pieces DeepSpeed swaps start on an I/O boundary (its
    O_DIRECT reads into a misaligned address transfer nothing), and the parameter swap buffers fit the model.
    A checkpoint of an nvme-offloaded optimizer is refused in one line (its state is in raw swap files)."""
    import torch

    from stratbench.core.errors import CheckpointError
    from stratbench.strategies.parallel.deepspeed_engine import read_deepspeed_checkpoint

    swapped = tmp_path / "ckpt" / "deepspeed" / "offloaded_tensors" / "rank00"
    swapped.mkdir(parents=True)
    (swapped / "0_17.tensor.swp").write_bytes(b"\0" * 4096)
    with pytest.raises(CheckpointError, match="checkpoint of an --offload-optimizer nvme run"):
        read_deepspeed_checkpoint(tmp_path / "ckpt", {"deepspeed_tag": "deepspeed", "zero_stage": 3})

    from stratbench.models.zoo import TinyNet
    from stratbench.strategies.parallel.deepspeed_engine import (
        aligned_gradient_pieces,
        size_nvme_param_buffers,
    )

    grads = [torch.arange(1000.0), torch.arange(300.0), torch.arange(512.0)]
    pieces, offsets = aligned_gradient_pieces(grads, [800, 1800, 2048], 256, lambda t: t.numel() >= 500)
    # head, aligned body, tail; too small to swap: whole; already aligned: whole
    assert offsets == [800, 1024, 1792, 1800, 2048]
    assert [p.numel() for p in pieces] == [224, 768, 8, 300, 512]
    assert torch.equal(torch.cat(pieces[:3]), grads[0])
    model = TinyNet(width=64, norm="none")
    zero = {"offload_param": {"device": "nvme", "nvme_path": "/x"}}
    size_nvme_param_buffers(zero, model, 2)
    assert zero["offload_param"]["buffer_size"] == NVME_BIG_PARAM // 2
    zero = {"offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_size": 10**8}}
    size_nvme_param_buffers(zero, model, 2)
    assert zero["offload_param"]["buffer_size"] == 10**8  # the JSON's value is kept
