"""MFU shares the whole model's work over every device a run occupies (tp, pp and pp x tp read as single does on the
same work), --peak-tflops lets a CPU run report it, and `train` records the machine's load and warns in one line
when the machine was busy (the rule compare's report flags cells by)."""

from __future__ import annotations

import json

import pytest

from conftest import fails, run_stratbench
from stratbench.cli import main
from stratbench.measuring import load as load_mod
from stratbench.measuring.load import BUSY_FACTOR, is_busy
from stratbench.measuring.metrics import mfu_metrics

FLOPS_PER_SAMPLE = 3.0e9
"""The whole model's forward + backward FLOPs per sample (stated, as torch's counter would give them)."""
BATCH = 64
PEAK = 100e12
"""100 TFLOP/s per device."""


@pytest.mark.parametrize(
    ("layout", "devices", "step_ms"),
    [
        ("single", 1, 480.0),
        ("tp=2", 2, 240.0),  # one replica over 2 devices: the same work in half the time
        ("pp=2", 2, 240.0),
        ("pp2 x tp2", 4, 120.0),
        ("dp2 x tp2", 4, 120.0),  # fsdp --tp 2 on 4: 2 replicas of 2 devices
    ],
)
def test_mfu_is_the_same_as_single_on_the_same_work(layout, devices, step_ms):
    """The same global batch of the same model: a layout that splits it over N devices and is N times faster does
    the same work per device per second, so its MFU is single's (to the rounding of the step times, in ms)."""
    single = mfu_metrics(FLOPS_PER_SAMPLE, BATCH / 0.480, 1, PEAK)
    got = mfu_metrics(FLOPS_PER_SAMPLE, BATCH / (step_ms / 1e3), devices, PEAK)
    assert single["mfu"] == pytest.approx(FLOPS_PER_SAMPLE * BATCH / 0.480 / PEAK)  # 0.4%: the stated formula
    assert got["mfu"] == pytest.approx(single["mfu"], rel=0.5e-3 / (step_ms / 1e3)), layout
    assert got["mfu_devices"] == devices and got["peak_flops_per_device"] == PEAK
    assert got["achieved_flops_per_device"] == pytest.approx(single["achieved_flops_per_device"])
    assert mfu_metrics(FLOPS_PER_SAMPLE, BATCH / 0.48, devices, None)["mfu"] is None  # no peak: no MFU


@pytest.mark.distributed
def test_a_cpu_tensor_parallel_run_reports_mfu_over_its_devices_with_peak_tflops(tmp_path):
    """A real `train --strategy tp --nproc 2` (one replica over 2 processes: data-parallel size 1) with a stated
    peak: MFU appears, counted over the 2 devices from the run's own throughput (before the fix: over 1, 2x too
    high). The run also records the machine's load and warns where it was busy."""
    out = tmp_path / "tp"
    proc = run_stratbench(
        "train", "--strategy", "tp", "--nproc", "2", "--model", "gpt-tiny", "--data", "text", "--seq-len", "16",
        "--batch-size", "8", "--max-steps", "4", "--timing-warmup-steps", "1", "--eval-samples", "8",
        "--progress", "false", "--peak-tflops", "0.5", "--output", str(out), timeout=240, cwd=tmp_path,
    )  # fmt: skip
    m = json.loads((out / "result.json").read_text())["metrics"]
    assert m["flops_per_sample"] and m["throughput_samples_per_s"] and m["mfu_devices"] == 2
    expected = m["flops_per_sample"] * m["throughput_samples_per_s"] / 2 / 0.5e12
    assert m["mfu"] == pytest.approx(expected, rel=1e-12) and m["peak_flops_source"] == "--peak-tflops"
    mfu_row = next(ln for ln in proc.stdout.splitlines() if "MFU" in ln)
    assert f"{m['mfu'] * 100:.1f}%" in mfu_row
    assert m["host_load_mean"] is not None and m["host_cpu_count"] >= 1
    busy = is_busy(m["host_load_mean"], m["host_cpu_count"], m["host_others_share"])
    assert m["host_busy"] is busy and 0 <= m["host_others_share"] <= 1
    warnings = [ln for ln in proc.stderr.splitlines() if "the machine was busy" in ln]
    assert len(warnings) == (1 if busy else 0), proc.stderr[-3000:]


def test_peak_tflops_must_be_positive(tmp_path, capsys):
    err = fails(capsys, "train", "--peak-tflops", "0", "--output", tmp_path / "x")
    assert err.endswith("peak_tflops must be a positive number of TFLOP/s, got 0.0")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("per_core", [4.0, 0.25])
def test_train_records_the_load_and_warns_in_one_line_when_busy(tmp_path, capsys, monkeypatch, per_core):
    """The load average is read through ``measuring.load`` (patched here to a busy and an idle machine): result.json
    keeps its mean and the cores, and a busy run says so in one line on stderr."""
    load = per_core * load_mod.cpu_count()
    monkeypatch.setattr(load_mod, "load_average", lambda: load)
    monkeypatch.setattr(load_mod, "_machine_busy_s", lambda: None)  # the other reading: not read here
    out = tmp_path / "run"
    code = main(["train", "--model", "tinynet", "--width", "4", "--data", "synthetic", "--synthetic-samples", "64",
                 "--batch-size", "16", "--max-steps", "3", "--epochs", "1", "--progress", "false",
                 "--measure-flops", "false", "--output", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    m = json.loads((out / "result.json").read_text())["metrics"]
    assert m["host_load_mean"] == load and m["host_cpu_count"] == load_mod.cpu_count()
    busy = load > BUSY_FACTOR * m["host_cpu_count"]
    assert m["host_busy"] is busy
    warnings = [ln for ln in err.splitlines() if "the machine was busy" in ln]
    if busy:
        assert (
            len(warnings) == 1
            and f"mean 1-minute load average {load:.1f} on {m['host_cpu_count']} cores" in warnings[0]
        )
    else:
        assert not warnings


def test_other_processes_cpu_marks_a_run_busy_at_once(tmp_path, capsys):
    """The load average lags by a minute: a short run beside a busy process stays under its rule. The machine's
    CPU time less the run's own does not: a run of about a second beside one spinning process (it takes a
    core of this 2-core machine from the run's 2 threads) records that share and warns, naming it."""
    import os
    import signal
    import subprocess
    import sys

    # The spinning process must not be a child of this one: a run counts its own children as its own work (data
    # loader workers). A launcher starts it and exits, so it is nobody's child here; it says its pid once spinning.
    spin = "print('spinning', flush=True)\nwhile True: pass"
    launcher = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {spin!r}], stdout=subprocess.PIPE, "
                "stderr=subprocess.DEVNULL, text=True)\nprint(p.pid, p.stdout.readline().strip(), flush=True)")
    pid, state = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60,
                                check=True).stdout.split()  # fmt: skip
    try:
        assert state == "spinning"  # it spins before the run's window opens
        code = main(["train", "--model", "tinynet", "--width", "4", "--data", "synthetic", "--synthetic-samples",
                     "2048", "--batch-size", "16", "--max-steps", "100", "--epochs", "1", "--progress", "false",
                     "--measure-flops", "false", "--output", str(tmp_path / "run")])  # fmt: skip
    finally:
        os.kill(int(pid), signal.SIGKILL)
    err = capsys.readouterr().err
    assert code == 0, err
    m = json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]
    assert m["host_others_share"] > load_mod.OTHERS_LIMIT and m["host_busy"], m
    assert [ln for ln in err.splitlines() if "the machine was busy" in ln and "other processes took" in ln], err


def test_the_runs_own_children_are_not_other_work():
    """CpuShare counts a child process's CPU as the run's own (data loader workers): a child that spins for
    0.65 s of CPU adds at least 0.6 s to the own seconds, so a node's others share stays near what really ran beside it."""
    import subprocess
    import sys

    share = load_mod.CpuShare()
    share.sample()
    # 0.65 s of spinning: the kernel's tick (10 ms) may count a hair under what the child measured itself
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.65: pass"])
    child.wait()
    share.sample()
    got = share.summary()
    assert got is not None and got["own_cpu_s"] >= 0.6 and got["machine_cpu_s"] >= got["own_cpu_s"] * 0.9
    assert load_mod.others_share([got], 1) <= got["machine_cpu_s"] / got["window_s"]
    two = [{"window_s": 2.0, "machine_cpu_s": 3.0, "own_cpu_s": 1.0}, {"window_s": 1.9, "machine_cpu_s": 2.9, "own_cpu_s": 1.0}]
    assert load_mod.others_share(two, 2) == pytest.approx(0.25)  # 3.0 - 2 x 1.0 over 2 cores x 2 s
    assert load_mod.others_share([], 2) is None
