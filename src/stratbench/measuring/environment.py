"""The environment written into every result (versions, devices, CPU, threads, 16-bit support) and the
device's peak FLOP/s (MFU)."""

from __future__ import annotations

import os
import platform
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from stratbench.core.precision import cpu_native_16bit
from stratbench.measuring.hardware import peak_flops_for_name
from stratbench.measuring.nvml import nvml


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """Peak dense FLOP/s of this device for the precision's compute dtype; None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    key = (
        "fp64"
        if precision == "fp64"
        else "bf16"
        if "bf16" in precision
        else "fp16"
        if "fp16" in precision
        else ("tf32" if tf32 else "fp32")
    )
    return peak_flops_for_name(torch.cuda.get_device_name(device), key)


def environment(world_size: int, device: torch.device) -> dict[str, Any]:
    """Versions, hardware and world size, written into every result."""
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        # Which kernels ran: the CPU's vector ISA as torch sees it, and any cap the user put on oneDNN / MKL.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {
            k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if k in os.environ
        },
        # Whether bf16/fp16 ran in oneDNN on this CPU: the memory estimate of a re-rendered report depends on it.
        "cpu_native_16bit": {
            "bf16": cpu_native_16bit(torch.bfloat16),
            "fp16": cpu_native_16bit(torch.float16),
        },
        "world_size": world_size,
        "device_type": device.type,
        "packages": {
            p: version(p) for p in ("torchvision", "accelerate", "deepspeed", "onnx", "onnxruntime", "numpy")
        },
    }
    if device.type == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_memory_bytes"] = [
            torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
        ]
        with suppress(Exception):
            env["nvidia_driver"] = nvml().nvml.nvmlSystemGetDriverVersion() if nvml().available else None
    return env


def cpu_name() -> str:
    with suppress(OSError), Path("/proc/cpuinfo").open() as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"
