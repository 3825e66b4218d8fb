"""Windows of steps recorded in detail: a profiler trace (``--profile``), allocator snapshots and the
collectives a rank issues (communication volume)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from stratbench.core.files import atomic_output
from stratbench.measuring.commvol import CommRecorder
from stratbench.measuring.memprobe import ImportMeter, malloc_in_use


class TraceWindow:
    """--profile N: a torch.profiler trace of N steps after the timing warm-up (and after the --comm-volume
    steps, which use the profiler too), written per rank to OUTPUT/traces/rank{r}.json atomically, and linked
    as OUTPUT/traces/plugins/profile/RUN/rank{r}.pt.trace.json (RUN: the output folder's name), where
    TensorBoard's PyTorch profiler plug-in finds it (``tensorboard --logdir OUTPUT/traces``: it takes every
    folder holding ``*.pt.trace.json`` files as a run, each file as a worker)."""

    def __init__(self, cfg: Any, env: Any) -> None:
        self.first = max(cfg.timing_warmup_steps, 3 if getattr(cfg, "comm_volume", False) else 0)
        self.steps = cfg.profile
        self.path = Path(cfg.output) / "traces" / f"rank{env.rank}.json"
        run = Path(cfg.output).resolve().name or "run"
        self.tensorboard_path = (
            self.path.parent / "plugins" / "profile" / run / f"rank{env.rank}.pt.trace.json"
        )
        self.cuda = env.device.type == "cuda"
        self.recorder: torch.profiler.profile | None = None
        self.done = False

    def before_step(self, steps_done: int) -> None:
        if steps_done == self.first and self.recorder is None and not self.done:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.recorder = torch.profiler.profile(activities=acts, record_shapes=True)
            self.recorder.__enter__()

    def after_step(self, steps_done: int) -> None:
        if self.recorder is not None and steps_done >= self.first + self.steps:
            self.finish()

    def finish(self) -> None:
        if self.recorder is None:
            return

        prof, self.recorder, self.done = self.recorder, None, True
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(self.path, ".json") as tmp:
            prof.export_chrome_trace(str(tmp))
        link_or_copy(self.path, self.tensorboard_path)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` becomes the same file as ``source`` (a hard link: no second copy of a large trace; a copy
    where the file system has no hard links), swapped in with one rename."""
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


class AllocWindow:
    """--measure-alloc (CPU): glibc's bytes in use after every op of step 2, above the baseline read before the
    model was built (stratbench.measuring.memprobe): the allocator-level peak the memory estimate predicts, which the
    process RSS hides under ~0.4 GiB of libraries. None where glibc's mallinfo2 is missing. Step 2: the first
    with optimizer state, and not step 3, where --comm-volume's profiler would add its own buffers (and its
    dispatch would see each collective twice). Modules imported after the baseline (a method's own: 1-3 MiB
    of code objects for ZeroRedundancyOptimizer, FSDP2 or accelerate) are measured apart (``ImportMeter``)
    and left out: they are no part of the step's memory."""

    STEP = 1

    def __init__(self) -> None:
        self.baseline: int | None = None
        self.peak: int | None = None
        self.resident: int | None = None
        """Bytes in use when step 2 starts (model states, library caches): the part of the peak that stays."""
        self.imports: int | None = None
        self._meter = None
        self._mode = None
        self._eager = None
        self._readings: list[int] = []

    def start_baseline(self) -> None:

        self._meter = ImportMeter().install()
        self.baseline = malloc_in_use()

    def _in_use(self) -> int:

        return (malloc_in_use() or 0) - (self._meter.bytes if self._meter is not None else 0)

    def before_step(self, steps_done: int) -> None:
        if self.baseline is None or steps_done != self.STEP:
            return
        from torch.utils._python_dispatch import TorchDispatchMode

        readings, in_use = self._readings, self._in_use
        self.resident = in_use() - self.baseline

        class Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                readings.append(in_use())
                return out

        self._mode = Sample()
        self._mode.__enter__()
        # torch.compile cannot trace under a Python dispatch mode: a compiled call (torchao's optimizer step, with
        # fullgraph) would fail, a plain one falls back to eager anyway; every call runs eagerly while it samples.
        self._eager = torch.compiler.set_stance("force_eager")

    def after_step(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self._eager.__exit__(None, None, None)
        if self._readings and self.baseline is not None:
            self.peak = max(self._readings) - self.baseline
        self.close()

    def close(self) -> None:
        """Stop metering imports (after step 2, or at the end of a run that had fewer steps)."""
        if self._meter is not None:
            self._meter.uninstall()
            self.imports, self._meter = self._meter.bytes, None

    def summary(self) -> dict[str, int | None]:
        self.close()
        return {"peak": self.peak, "resident": self.resident, "imports": self.imports}


class CommWindow:
    """Runs the collective recorder (``stratbench.measuring.commvol``) from the third step (DDP rebuilds its buckets at the
    start of the second and broadcasts the new layout once) to the end of the timing warm-up, at least one
    step, so that its cost stays out of the measured step times when the warm-up is 3 steps or more."""

    def __init__(self, group_size: int) -> None:

        self.recorder = CommRecorder(group_size)
        self.first = 2
        self.recorded = 0

    def before_step(self, steps_done: int) -> None:
        if steps_done == self.first and not self.recorder.active and self.recorder.result is None:
            self.recorder.start()

    def after_step(self, steps_done: int, warmup: int) -> None:
        if self.recorder.active:
            self.recorded += 1
            if steps_done >= max(self.first + 1, warmup):
                self.recorder.stop(self.recorded)

    def finish(self) -> dict[str, Any] | None:
        """This rank's measurement, or None when the run had too few steps (< 3) to record one."""
        if self.recorder.active:
            self.recorder.stop(max(1, self.recorded))
        return self.recorder.result.to_dict() if self.recorder.result is not None else None


def column_max(rows: list[list[int]]) -> list[int]:
    """Per device, the largest value over the phases (each phase reports one value per device)."""
    return [max(col) for col in zip(*rows, strict=False)] if rows and rows[0] else []
