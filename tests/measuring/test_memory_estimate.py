"""The memory estimate against a measurement on this machine (stratbench.measuring.memprobe): glibc's bytes in use read
after every op of a real training step, minus a baseline read before the model exists -- the quantity the
estimate's peak predicts (model states + activations + temporaries), not process RSS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from stratbench.measuring.memprobe import malloc_in_use

MLP = textwrap.dedent(
    """
    from torch import nn

    def build(num_classes):  # 1.7M parameters, no convolution: the case the old estimate put 2x off
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 256),
                             nn.ReLU(), nn.Linear(256, num_classes))
    """
)
BASE = {"data": "synthetic", "num_classes": 10}
CASES = {
    "resnet18-64px-b16": {"model": "resnet18", "image_size": 64, "batch_size": 16},
    "resnet18-32px-b8": {"model": "resnet18", "image_size": 32, "batch_size": 8},
    "resnet18-32px-bf16": {"model": "resnet18", "image_size": 32, "batch_size": 8, "precision": "bf16-mixed"},
    "resnet18-32px-adamw": {"model": "resnet18", "image_size": 32, "batch_size": 8, "optimizer": "adamw"},
    "tinynet-b32": {"model": "tinynet", "image_size": 32, "batch_size": 32},
    "mlp-1.7M-b16": {"model": "mlp_user:build", "image_size": 32, "batch_size": 16, "weight_decay": 1e-4},
}
PROBE = """
import json, sys
from stratbench.core.config import TrainConfig
from stratbench.predicting.estimate import estimate
from stratbench.measuring.memprobe import measure_cpu_step_peak
out = {}
for name, kw in json.loads(sys.argv[1]).items():
    cfg = TrainConfig(**kw)
    out[name] = {"estimated": estimate(cfg, 1, "cpu").peak_bytes, "measured": measure_cpu_step_peak(cfg)["peak_bytes"]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    (folder / "mlp_user.py").write_text(MLP)
    cases = {k: BASE | v for k, v in CASES.items()}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], cwd=folder, capture_output=True,
                          text=True, timeout=600, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.parametrize("case", list(CASES))
def test_estimated_peak_within_10_percent_of_measured(measured, case):
    m = measured[case]
    err = (m["estimated"] - m["measured"]) / m["measured"]
    assert abs(err) <= 0.10, (
        f"{case}: estimated {m['estimated'] / 2**20:.2f} MiB, measured {m['measured'] / 2**20:.2f} MiB ({err:+.1%})"
    )


@pytest.mark.distributed
@pytest.mark.skipif(malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_two_rank_fsdp_estimate_within_10_percent_of_the_run_s_own_measurement(tmp_path):
    """The run measures itself (--measure-alloc: step 2, every op, both ranks); the estimate of the busiest
    rank (2 largest units gathered + a reduce-scatter buffer, sharded states) is within 10% of it."""
    from conftest import train
    from stratbench.predicting.estimate import predict_peak_bytes

    res = train(tmp_path / "fsdp", "--strategy", "fsdp", "--model", "resnet18", "--image-size", "32", "--data", "synthetic",
                "--batch-size", "16", "--max-steps", "4", "--progress", "false", "--measure-flops", "false",
                "--measure-alloc", "true", nproc=2)  # fmt: skip
    measured = max(res["metrics"]["cpu_alloc_peak_bytes"])
    estimated = predict_peak_bytes(res["config"], 2, "cpu")
    assert abs(estimated - measured) <= 0.10 * measured, (
        estimated / 2**20,
        res["metrics"]["cpu_alloc_peak_bytes"],
    )


@pytest.mark.parametrize(
    ("name", "key", "want"),
    [
        ("NVIDIA L40", "bf16", 181e12),  # not the L4's 121e12
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA RTX A1000", "fp32", None),  # not the A100's
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A10", "fp32", 31.2e12),
        ("NVIDIA H100 NVL", "bf16", 835.5e12),  # not the SXM's 989.4e12
        ("NVIDIA H200 NVL", "bf16", 835.5e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "fp32", 51.2e12),
        ("Tesla P40", "fp32", 11.76e12),  # 3840 cores x 1531 MHz x 2 (hardware.yaml)
    ],
)
def test_peak_table_matches_whole_device_names(name, key, want):
    from stratbench.measuring.hardware import peak_flops_for_name

    assert peak_flops_for_name(name, key) == want


@pytest.mark.skipif(malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_import_meter_counts_what_an_import_allocates_and_nothing_else(tmp_path, monkeypatch):
    """--measure-alloc leaves out the modules a method imports after the baseline (1-3 MiB of code objects for
    ZeroRedundancyOptimizer, FSDP2, accelerate): the meter sees an import's own allocation, not the rest of
    the process's, and restores the import machinery when it is taken off."""
    import importlib
    import importlib._bootstrap as bootstrap
    import sys

    from stratbench.measuring.memprobe import ImportMeter

    (tmp_path / "sb_heavy_module.py").write_text("BLOCK = bytearray(3 * 2**20)\n")
    (tmp_path / "sb_holder_module.py").write_text("BLOCK = bytearray(4 * 2**20)\n")
    # a free inside an import's window (on a run: gloo's thread releasing DDP's broadcast buffer) is not the
    # import's: before, it made the meter's bytes negative and every later reading 7 MiB high (ddp on gpt-tiny)
    (tmp_path / "sb_freeing_module.py").write_text("import sb_holder_module\nsb_holder_module.BLOCK = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("sb_holder_module")
    original = bootstrap._find_and_load
    meter = ImportMeter().install()
    try:
        other = bytearray(5 * 2**20)  # not an import: not counted
        importlib.import_module("sb_heavy_module")
        import sb_heavy_module  # noqa: F401  (already loaded: costs nothing, not seen)
        importlib.import_module("sb_freeing_module")
    finally:
        meter.uninstall()
        for name in ("sb_heavy_module", "sb_holder_module", "sb_freeing_module"):
            sys.modules.pop(name, None)
    assert bootstrap._find_and_load is original
    assert meter.modules == 2
    assert 3 * 2**20 <= meter.bytes < 3 * 2**20 + 2**20, meter.bytes
    del other
