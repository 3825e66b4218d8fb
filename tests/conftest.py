"""Shared test helpers: run `stratbench train` in a subprocess (1 or N processes) and read its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The tiny problem every cross-method test trains: tinynet on real digits, 20 steps, no normalisation layer.
# Not BatchNorm (its statistics differ between 1 and N devices), and not GroupNorm either: at width 8 each
# group is one channel, and on the digits' flat background a channel's variance is ~0, so normalising divides
# float rounding noise by sqrt(eps) - splitting the batch over 2 ranks (a different summation order, ~1e-7)
# then grows to >1e-2 relative within 20 steps (measured: 1.2e-1 at step 18 with lr 0.05, 2e-4 even at lr
# 0.002). Without normalisation the same comparison stays at ~1e-7 over all 20 steps (lr 0.02, measured).
TINY = [
    "--model", "tinynet", "--width", "8", "--norm", "none", "--data", "digits", "--batch-size", "32",
    "--epochs", "1", "--max-steps", "20", "--lr", "0.02", "--progress", "false", "--measure-flops", "false",
    "--timing-warmup-steps", "1",
]  # fmt: skip


def stratbench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratbench", *args]


def run_stratbench(*args: str, timeout: float = 300, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter; on failure show its output in the assertion."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    proc = subprocess.run(
        stratbench_cmd(*args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"stratbench {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def train(output: Path, *args: str, nproc: int = 1, timeout: float = 300, **kw) -> dict:
    """Train with the given flags (nproc > 1 goes through stratbench's torchrun launcher); return result.json."""
    run_stratbench("train", "--output", str(output), "--nproc", str(nproc), *args, timeout=timeout, **kw)
    return json.loads((Path(output) / "result.json").read_text())


def rel_close(a: list[float], b: list[float], rtol: float) -> float:
    """Largest relative difference between two loss curves (asserting equal length)."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> dict:
    """The `single` fp32 run of TINY that every method's loss curve is compared with."""
    return train(tmp_path_factory.mktemp("reference") / "single", "--strategy", "single", *TINY)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
