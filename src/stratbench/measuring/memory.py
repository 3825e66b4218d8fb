"""Memory: the device's bytes in use, the CPU process's peak RSS, and a phase's peaks (allocator, NVML, RSS)
reset per phase."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field

import torch


def _read_status_kb(key: str) -> int | None:
    with suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def reset_cpu_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def current_memory_bytes(device: torch.device) -> int | None:
    """Memory in use now: allocated by the CUDA caching allocator, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    kb = _read_status_kb("VmRSS")
    return kb * 1024 if kb is not None else None


def cpu_peak_rss_bytes() -> int:
    kb = _read_status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


@dataclass
class MemoryPhase:
    """Peak memory of one phase (training, evaluation) on each reported device; reset at phase start."""

    devices: list[torch.device]
    peak_allocated: list[int] = field(default_factory=list)
    peak_reserved: list[int] = field(default_factory=list)
    cpu_peak_rss: int = 0
    cpu_reset_ok: bool = False

    def start(self) -> None:
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        self.cpu_reset_ok = reset_cpu_peak_rss()

    def stop(self) -> None:
        self.peak_allocated = [torch.cuda.max_memory_allocated(d) for d in self.devices if d.type == "cuda"]
        self.peak_reserved = [torch.cuda.max_memory_reserved(d) for d in self.devices if d.type == "cuda"]
        self.cpu_peak_rss = cpu_peak_rss_bytes()

    def peak_bytes(self) -> list[int]:
        """The headline figure: allocator peak on GPUs, process peak RSS on CPU."""
        return self.peak_allocated if self.peak_allocated else [self.cpu_peak_rss]
