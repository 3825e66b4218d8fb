"""Measured CPU memory of one training step, the way ``stratbench.estimate`` defines its peak: bytes the
allocator hands out (not process RSS, which adds ~0.4 GiB of libraries and keeps freed pages).

On Linux/glibc torch's CPU allocator takes its memory from ``malloc``; glibc's ``mallinfo2`` reports the bytes
in use (small blocks in the arenas + large ``mmap``-ed blocks). A ``TorchDispatchMode`` reads it after every
op of a forward, backward and optimizer step (gradient hooks too), and the measured peak is the largest
reading minus a baseline read just before the model is built: model states + activations + temporaries, what
the estimate predicts. Threads are pinned to 1 so that no extra malloc arenas appear mid-step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch
from torch import nn


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    lib = ctypes.CDLL(name)
    if not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _MallInfo2
    return lib


_LIBC = _libc()


def malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back (None where glibc's mallinfo2 is missing)."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def measure_cpu_step_peak(cfg: Any, steps: int = 2) -> dict[str, int]:
    """Train ``steps`` steps of ``cfg`` (single process, CPU, synthetic batches of the run's micro-batch) and
    return the peak bytes in use above the baseline during the last one (the first creates optimizer state)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from stratbench.data import default_image_size
    from stratbench.engine import optimizer_spec
    from stratbench.estimate import ModelSpec, micro_batch
    from stratbench.precision import Precision

    if malloc_in_use() is None:
        raise RuntimeError("measuring CPU memory needs glibc's mallinfo2 (Linux, glibc >= 2.33)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, size = micro_batch(cfg, 1), default_image_size(cfg)
    spec = ModelSpec.from_config(cfg)
    precision = Precision(cfg.precision, torch.device("cpu"))
    loss_fn = nn.CrossEntropyLoss()
    readings: list[int] = []

    class Sample(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            readings.append(malloc_in_use() or 0)
            return out

    base = malloc_in_use() or 0
    model = precision.convert_module(spec.build())
    optimizer = optimizer_spec(cfg)(model.parameters())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: readings.append(malloc_in_use() or 0))
    for step in range(steps):
        readings.clear()
        with Sample() if step == steps - 1 else _null():
            x = precision.convert_input(torch.randn(batch, 3, size, size))
            y = torch.randint(0, spec.num_classes, (batch,))
            with precision.autocast():
                loss = loss_fn(precision.loss_input(model(x)), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del x, y, loss
    return {"peak_bytes": max(readings) - base, "baseline_bytes": base, "samples": len(readings)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
