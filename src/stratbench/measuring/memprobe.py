"""Measured CPU memory of one training step, the way ``stratbench.predicting.estimate`` defines its peak: bytes the
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
import gc
import threading
from typing import Any

import torch
from torch import nn

from stratbench.core.optim import optimizer_spec
from stratbench.core.precision import Precision
from stratbench.data.datasets import default_image_size
from stratbench.measuring.model_trace import ModelSpec, micro_batch


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


class ImportMeter:
    """Bytes in use that module imports added while the meter is installed: the malloc reading around every
    outermost ``import`` that loads a module (nested imports count in their parent's; an import of a module
    already loaded costs nothing and is not seen). Installed by wrapping ``importlib._bootstrap._find_and_load``,
    the one function through which both the ``import`` statement and ``importlib.import_module`` load a new
    module; where it is missing (another Python), nothing is measured and ``bytes`` stays 0. Garbage collection
    waits while an import runs, so that its reading holds only what the import allocated, and an import that
    reads less in use after than before counts 0 (the malloc reading is the process's: another thread freed)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.modules = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._original = None

    def install(self) -> ImportMeter:
        import importlib._bootstrap as bootstrap

        original = getattr(bootstrap, "_find_and_load", None)
        if original is None or self._original is not None or malloc_in_use() is None:
            return self
        local = self._local

        def find_and_load(name, import_):
            if getattr(local, "depth", 0):
                return original(name, import_)
            local.depth = 1
            # A garbage collection that happens to run inside the import would free objects that are not the
            # import's (the reading would even go negative): collection waits until the import is done.
            collecting = gc.isenabled()
            gc.disable()
            before = malloc_in_use() or 0
            try:
                return original(name, import_)
            finally:
                local.depth = 0
                if collecting:
                    gc.enable()
                with self._lock:
                    # An import adds; a free that lands in its window is another thread's (gloo's worker
                    # releasing DDP's start-up broadcast buffer, a flat copy of the parameters): not counted.
                    self.bytes += max(0, (malloc_in_use() or 0) - before)
                    self.modules += 1

        self._original = original
        bootstrap._find_and_load = find_and_load
        return self

    def uninstall(self) -> None:
        import importlib._bootstrap as bootstrap

        if self._original is not None:
            bootstrap._find_and_load = self._original
            self._original = None


def measure_cpu_step_peak(cfg: Any, steps: int = 2) -> dict[str, int]:
    """Train ``steps`` steps of ``cfg`` (single process, CPU, synthetic batches of the run's micro-batch) and
    return the peak bytes in use above the baseline during the last one (the first creates optimizer state)."""
    from torch.utils._python_dispatch import TorchDispatchMode

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
            readings.append((malloc_in_use() or 0) - meter.bytes)
            return out

    meter = ImportMeter().install()
    try:
        base = malloc_in_use() or 0
        model = precision.convert_module(spec.build())
        optimizer = optimizer_spec(cfg)(model.parameters())
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: readings.append((malloc_in_use() or 0) - meter.bytes)
            )
        for step in range(steps):
            readings.clear()
            sampled = step == steps - 1  # eager while sampled: compile cannot trace under a dispatch mode
            with Sample() if sampled else _null(), torch.compiler.set_stance("force_eager" if sampled else "default"):
                x = precision.convert_input(torch.randn(batch, 3, size, size))
                y = torch.randint(0, spec.num_classes, (batch,))
                with precision.autocast():
                    loss = loss_fn(precision.loss_input(model(x)), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del x, y, loss
    finally:
        meter.uninstall()
    return {
        "peak_bytes": max(readings) - base,
        "baseline_bytes": base,
        "import_bytes": meter.bytes,
        "samples": len(readings),
    }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
