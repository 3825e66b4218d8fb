"""The GPU utilisation sampler's window: the timed steps only. NVML itself needs an NVIDIA driver (the gpu tests
read it for real); here a stand-in device answers with the utilisation the test sets, so that what the sampler
keeps can be checked on any machine."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from stratbench.measuring.nvml import UtilisationSampler


class FakeDevice:
    """What NVML answers for one GPU: the utilisation the test sets, and a used-memory figure."""

    def __init__(self) -> None:
        self.util = 0
        self.lock = threading.Lock()

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802 (NVML's names)
        with self.lock:
            return SimpleNamespace(gpu=self.util)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return SimpleNamespace(used=1 << 30)


def sampler(fake: FakeDevice, interval: float) -> UtilisationSampler:
    s = UtilisationSampler([torch.device("cuda", 0)], interval=interval)
    s.nv = SimpleNamespace(available=True, nvml=fake, handle=lambda device: "gpu0")
    return s


def test_restart_window_drops_the_warm_up_samples():
    fake = FakeDevice()
    s = sampler(fake, interval=0.01)
    s.start()
    time.sleep(0.2)  # the warm-up: compiling, the GPU idle
    with fake.lock:
        fake.util = 90
    time.sleep(0.03)  # a sample at 90 is taken before the window restarts
    s.restart_window()
    time.sleep(0.2)
    s.stop()
    out = s.summary()
    assert out["gpu_util_mean_pct"] == [90] and out["gpu_util_peak_pct"] == [90]
    assert out["nvml_used_peak_bytes"] == [1 << 30]


def test_a_window_shorter_than_the_interval_still_has_a_sample():
    fake = FakeDevice()
    fake.util = 40
    s = sampler(fake, interval=60.0)
    s.start()
    time.sleep(0.05)
    s.restart_window()  # the timed steps take less than one interval
    s.stop()
    assert s.summary()["gpu_util_mean_pct"] == [40]


def test_without_restart_every_sample_counts():
    fake = FakeDevice()
    s = sampler(fake, interval=0.01)
    s.start()
    time.sleep(0.1)
    with fake.lock:
        fake.util = 100
    time.sleep(0.1)
    s.stop()
    mean = s.summary()["gpu_util_mean_pct"][0]
    assert 0 < mean < 100
