"""NVML (nvidia-ml-py): device memory and a background sampler of GPU utilisation during training."""

from __future__ import annotations

import os
import statistics
import threading
from contextlib import suppress

import torch


class _Nvml:
    """Thin wrapper over nvidia-ml-py; ``available`` is False where there is no NVIDIA driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.available = True
        except Exception:
            self.nvml = None

    def handle(self, device: torch.device):
        # NVML numbers GPUs physically; map through CUDA_VISIBLE_DEVICES when it is set.
        index = device.index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            parts = [p.strip() for p in visible.split(",") if p.strip()]
            if index < len(parts) and parts[index].isdigit():
                index = int(parts[index])
            elif index < len(parts):
                return self.nvml.nvmlDeviceGetHandleByUUID(parts[index])
        return self.nvml.nvmlDeviceGetHandleByIndex(index)


_NVML: _Nvml | None = None


def nvml() -> _Nvml:
    global _NVML
    if _NVML is None:
        _NVML = _Nvml()
    return _NVML


class UtilisationSampler:
    """Background thread sampling NVML GPU utilisation and used memory every ``interval`` seconds.

    The utilisation is the timed steps' own: ``restart_window`` (called before the first step after the timing
    warm-up) drops the samples taken so far, so that torch.compile's compilation, cuDNN's autotuning and the
    first allocations do not count (they read 7-8% for a compiled ResNet-50 whose timed steps kept the GPU
    busy: an H200, 2026-11-26), and ``stop`` takes one last sample when a window shorter than ``interval``
    has none (NVML's figure covers its own last sample period, up to 1 s)."""

    def __init__(self, devices: list[torch.device], interval: float = 0.1) -> None:
        self.devices = [d for d in devices if d.type == "cuda"]
        self.interval = interval
        self.nv = nvml() if self.devices else None
        self.util: list[list[int]] = [[] for _ in self.devices]
        self.used_peak: list[int] = [0 for _ in self.devices]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return bool(self.nv and self.nv.available and self.devices)

    def start(self) -> None:
        if not self.active:
            return
        self.handles = [self.nv.handle(d) for d in self.devices]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="nvml-sampler")
        self._thread.start()

    def _sample(self) -> None:
        nv = self.nv.nvml
        for i, h in enumerate(self.handles):
            with suppress(Exception):
                self.util[i].append(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                self.used_peak[i] = max(self.used_peak[i], nv.nvmlDeviceGetMemoryInfo(h).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def restart_window(self) -> None:
        """Keep only the samples from now on (the used-memory peak stays the whole run's)."""
        self.util = [[] for _ in self.devices]

    def stop(self) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None
            if any(not u for u in self.util):
                self._sample()

    def latest(self) -> float | None:
        """The most recent utilisation sample of the first device (for per-step logs); None without NVML."""
        return self.util[0][-1] if self.active and self.util and self.util[0] else None

    def summary(self) -> dict[str, list[float | None]]:
        if not self.active:
            return {"gpu_util_mean_pct": [], "gpu_util_peak_pct": [], "nvml_used_peak_bytes": []}
        return {
            "gpu_util_mean_pct": [statistics.fmean(u) if u else None for u in self.util],
            "gpu_util_peak_pct": [max(u) if u else None for u in self.util],
            "nvml_used_peak_bytes": list(self.used_peak),
        }
