"""Run the README's "Quick tour" (or the manual's "Commands", ``--doc docs/usage.md``) as a new user would, in a fresh
folder, and report.

The commands are read from README.md (the first code block under each of ``SECTIONS``; ``\\`` continuation lines
joined, ``# ...`` comments dropped), never copied here, so the check follows the README. Each line runs in order
through bash (tilde expansion as in a shell) in one fresh temporary working folder (``--jobs 2``, as the test: two
lines at a time where they touch no common file or folder, ``dependencies``), with:

- a clean environment (``clean_env``): the ``stratbench`` console script pip installed on PATH, a fresh HOME, a
  UTF-8 locale, and nothing else: no PYTHONPATH, so neither the repository nor the working folder is on
  ``sys.path`` except as stratbench itself puts it there (user builders are "found from the working directory");
- the files the tour assumes the user already has, made here and listed in the report: the torchvision ImageNet
  weights file under its exact torch hub cache name in ``~/.cache/torch``, a tiny CIFAR-10 in the real
  ``cifar-10-batches-py`` format, user modules, YAML/JSON configs, images, a second machine's sweep folder. Files
  that a tour line writes (checkpoints, ``model.pt``, reports) are never made here: a later line reads what an
  earlier one wrote, as it would for the user;
- a few lines that would take far too long on a 2-core CPU get extra flags that shrink them (``SHRINK``; the
  test, tests/readme/test_readme_tour.py, uses ``FAST``, which shrinks more); the report lists exactly which line got
  which flags and why. Every other line runs exactly as written.

A line passes when it exits 0. A line that needs what this machine lacks (a GPU) passes only as a clear
refusal: exit code 3 (stratbench's UnsupportedError) with a one-line reason; the report quotes that line.

    nice -n 19 .venv/bin/python benchmarks/readme_tour.py \\
        --report benchmarks/readme_tour_cpu_$(date +%F).md        # ~30 lines, ~20-30 min on 2 shared CPU cores

tests/readme/test_readme.py parses every tour line with stratbench's own CLI parser (no training), using
``tour_commands`` from here.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pickle
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
HEADING = "## Quick tour"
SECTIONS = (HEADING,)
"""The README's sections whose first code block a new user runs as written, in this order."""
MANUAL = REPO / "docs" / "usage.md"
MANUAL_SECTIONS = ("## Commands", "## Your own model, your own matrix")
"""The manual's block of every command, then its first block on the user's own model (``--doc docs/usage.md`` runs
them)."""


def sections_for(doc: Path) -> tuple[str, ...]:
    """The sections of ``doc`` whose first code block is its tour: the manual's or the README's."""
    return MANUAL_SECTIONS if Path(doc).resolve() == MANUAL.resolve() else SECTIONS


# ------------------------------------------------------------------------------------------------
# the tour, read from the README


def tour_block(readme: str, heading: str = HEADING) -> list[str]:
    """The lines of the first fenced code block after ``heading``."""
    lines = readme.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == heading)
    except StopIteration:
        raise ValueError(f"README has no {heading!r} section") from None
    fence = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("```")), None)
    if fence is None:
        raise ValueError(f"no code block under {heading!r}")
    end = next((i for i in range(fence + 1, len(lines)) if lines[i].lstrip().startswith("```")), None)
    if end is None:
        raise ValueError(f"the code block under {heading!r} is not closed")
    return lines[fence + 1 : end]


def strip_comment(line: str) -> str:
    """``line`` without its shell comment: a ``#`` that starts a word outside quotes."""
    quote = None
    prev = " "
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            return line[:i].rstrip()
        prev = ch
    return line.rstrip()


def joined_commands(lines: list[str]) -> list[str]:
    """One code block's commands, one string each: ``\\`` continuation lines joined, comments and blank lines
    dropped."""
    commands: list[str] = []
    pending = ""
    for raw in lines:
        line = strip_comment(raw)
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = (pending + line.strip()).strip(), ""
        if line:
            commands.append(line)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def tour_commands(readme: str, sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """The commands of each section's first code block (``joined_commands``), in order."""
    return [c for heading in sections for c in joined_commands(tour_block(readme, heading))]


def code_blocks(text: str) -> list[list[str]]:
    """The lines of every fenced code block of a page, block by block."""
    blocks: list[list[str]] = []
    inside = False
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            inside = not inside
            if inside:
                blocks.append([])
        elif inside:
            blocks[-1].append(raw)
    return blocks


def is_sketch(command: str) -> bool:
    """A documented line that is not a command to run as it stands: ``...`` or ``[optional]`` parts, a quoted
    error (``stratbench train: error``), or a line sent to the background (``&``)."""
    first = command.split(" ", 2)[1:2]
    return "..." in command or " [" in command or bool(first and first[0].endswith(":")) or command.endswith("&")


def doc_commands(text: str) -> list[str]:
    """Every ``stratbench`` command in any fenced code block of a page (``joined_commands``), except sketches
    (``is_sketch``)."""
    return [
        c for block in code_blocks(text) for c in joined_commands(block)
        if c.startswith("stratbench ") and not is_sketch(c)
    ]  # fmt: skip


def tour_argv(command: str) -> list[str]:
    """A tour command as argv, without the leading ``stratbench`` (what ``stratbench.cli.main`` receives)."""
    argv = shlex.split(command)
    if not argv or argv[0] != "stratbench":
        raise ValueError(f"not a stratbench command: {command!r}")
    return argv[1:]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag V`` / ``--flag=V`` (underscore spelling too), or None."""
    names = {flag, flag.replace("-", "_")}
    for i, tok in enumerate(argv):
        name, eq, value = tok.partition("=")
        if name in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return None


# ------------------------------------------------------------------------------------------------
# lines shrunk for a 2-core CPU


@dataclass(frozen=True)
class Shrink:
    name: str
    matches: object  # callable(argv) -> bool
    flags: tuple[str, ...]
    reason: str


SHRINK = (
    Shrink(
        "resnet50 at 224 px",
        lambda a: (
            a[:1] == ["train"]
            and flag_value(a, "--model") == "resnet50"
            and flag_value(a, "--image-size") == "224"
        ),
        ("--epochs", "1", "--max-steps", "2", "--batch-size", "8"),
        "ResNet-50 at 224x224 under the recipe's bf16 autocast took ~130 s per step of 16 images on this shared "
        "2-core CPU (no native bf16): as written (3 epochs of 200 images at batch 64, 3 evaluations at 224 px) "
        "over an hour. 2 steps of 8 and one evaluation still run the recipe, the model, the CIFAR-10 files and "
        "the 224 px resize as written.",
    ),
    Shrink(
        "compare with repeats",
        lambda a: a[:1] == ["compare"] and int(flag_value(a, "--repeats") or 1) > 1,
        ("--only", "single,ddp", "--only", "fp32"),
        "--repeats 3 runs every cell of the quick preset 3 times (~3 x 10 min here); two cells (single and ddp, "
        "fp32) x 3 repeats still give the median and min-max columns the line is about.",
    ),
    Shrink(
        "compare on Ray",
        lambda a: a[:1] == ["compare"] and flag_value(a, "--executor") == "ray",
        ("--only", "single,ddp", "--only", "fp32"),
        "the quick preset again (~10 min here), on a Ray started for the line: two cells (single and ddp, fp32) "
        "still go through Ray's placement groups and node runners.",
    ),
    Shrink(
        "compare on SLURM",
        lambda a: a[:1] == ["compare"] and flag_value(a, "--executor") == "slurm",
        ("--only", "single,ddp", "--only", "fp32"),
        "the quick preset again (~10 min here), as SLURM jobs on the tour's own single-node SLURM "
        "(scripts/local_slurm.sh): two cells (single and ddp, fp32) still go through sbatch, srun and squeue.",
    ),
    Shrink(
        "seed preset without --dry-run",
        lambda a: a[:1] == ["compare"] and flag_value(a, "--preset") == "seed" and "--dry-run" not in a,
        ("--dry-run",),
        "the seed preset is the source experiment (ResNet-50, CIFAR-10 at 224, 5 epochs, every method): hours on 2 "
        "CPU cores.",
    ),
)


def _is(command: str):
    return lambda a: a[:1] == [command]


FAST = (
    Shrink("resnet50 at 224 px, one tiny step", SHRINK[0].matches,
           ("--epochs", "1", "--max-steps", "1", "--batch-size", "2", "--image-size", "64"),
           "without native bf16 (an AVX2 CPU) one step of the recipe's bf16 ResNet-50 at 224 px took 170 s: one "
           "step of 2 images at 64 px still runs the recipe, the model, the CIFAR-10 files and their resize"),
    Shrink("train, short", _is("train"), ("--epochs", "1", "--max-steps", "3", "--batch-size", "8"),
           "the test checks that each line works as written from a user's folder, not how it trains: 3 steps of 8 "
           "samples (one evaluation, one checkpoint) run the same code path as 3 epochs"),
    Shrink("compare with repeats, one short cell", SHRINK[1].matches, ("--only", "single", "--only", "fp32", "--max-steps", "3"),
           "one cell (single, fp32) of 3 steps, 3 times: the repeats, their median and min-max columns"),
    Shrink("compare --calibrate, one short 2-process cell", lambda a: a[:1] == ["compare"] and "--calibrate" in a,
           ("--only", "ddp", "--only", "fp32", "--max-steps", "6"),
           "one cell (ddp, fp32, 2 processes) of 6 steps (3 after the 3 warm-up steps, which a calibration run needs "
           "timed): its calibration (the probe, single at both batches, ddp on one process) runs first and "
           "predicts the row"),
    Shrink("compare on a Ray of its own, one short cell", SHRINK[2].matches,
           ("--only", "single", "--only", "fp32", "--max-steps", "3", "--ray-address", "local"),
           "one cell (single, fp32) of 3 steps on a Ray started for the line (`local`: the suite's own two-node "
           "test cluster, tests/compare/test_ray.py, may be up at the same time, and `auto` would join it)"),
    Shrink("compare on the tour's SLURM, one short cell", SHRINK[3].matches,
           ("--only", "single", "--only", "fp32", "--max-steps", "3"),
           "one cell (single, fp32) of 3 steps as a SLURM job on the tour's own single-node SLURM "
           "(scripts/local_slurm.sh up, started for the tour where it can be: root with the packages or apt-get)"),
    Shrink("ft-quick, a short pretraining and one short LoRA cell",
           lambda a: a[:1] == ["compare"] and flag_value(a, "--preset") == "ft-quick" and "--dry-run" not in a,
           ("--only", "single+lora", "--max-steps", "3", "--pretrain-steps", "3"),
           "the pretraining run of 3 steps and one cell (single + LoRA, fp32) of 3 steps started from it: the "
           "pretrain stage, the cell's --init-from and the fine-tuning columns of the report"),
    Shrink("compare --methods on the user's model, as written", lambda a: a[:1] == ["compare"] and "--methods" in a,
           (), "already short (4 steps of each of 4 cells on the user's 128 images): every method it names runs, "
           "fsdp on a model with no repeated blocks among them"),
    Shrink("compare, one short cell", lambda a: a[:1] == ["compare"] and "--dry-run" not in a,
           ("--only", "single", "--only", "fp32", "--max-steps", "3"),
           "one cell (single, fp32) of 3 steps: the sweep, its process, record and report (the --calibrate line "
           "and the From Python block run 2-process cells)"),
    Shrink("bench-infer, two batch sizes", _is("bench-infer"),
           ("--batch-sizes", "1,8", "--warmup", "1", "--iters", "3", "--min-iters", "2",
            "--backends", "eager-fp32,onnxruntime-cpu"),
           "two batch sizes, a few iterations, eager fp32 and onnxruntime (torch.compile's compilation alone took "
           "~40 s here; the benchmark's tour runs every backend)"),
    Shrink("probe, two payloads", _is("probe"), ("--sizes", "4KiB,1MiB", "--repeats", "3"),
           "two payload sizes, 3 calls each: the processes, the collectives and the profile it writes"),
)  # fmt: skip
"""The test's shrinks (tests/readme/test_readme_tour.py): the tour in a few minutes on 2 cores, every line still run."""


def shrink_for(argv: list[str], shrinks: tuple[Shrink, ...] = SHRINK) -> Shrink | None:
    return next((s for s in shrinks if s.matches(argv)), None)


def plan_lines(commands: list[str], shrinks: tuple[Shrink, ...] = SHRINK) -> list[Line]:
    """The tour's lines in order, each with the extra flags of the first shrink that matches it."""
    lines = []
    for n, cmd in enumerate(commands, 1):
        s = shrink_for(tour_argv(cmd), shrinks)
        lines.append(Line(n, cmd, s.flags if s else (), s))
    return lines


# ------------------------------------------------------------------------------------------------
# what the user already has


USER_MODEL = """\
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, num_classes))
"""
USER_DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(image_size=None, seed=0):
    size = image_size or 12
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 3, size, size, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of the first channel's mean
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:]), ["negative", "positive"]
"""
USER_LOSS = """\
import torch.nn.functional as F


def fn(logits, targets):
    return F.cross_entropy(logits, targets)
"""
USER_QA = "".join(
    json.dumps({"instruction": f"What does {name}() do?", "output": f"{name}(): {what}"}) + "\n"
    for name, what in [(n, w) for _ in range(4) for n, w in (
        ("len", "Return the number of items in a container."),
        ("abs", "Return the absolute value of the argument."),
        ("sorted", "Return a new list containing all items from the iterable in ascending order."),
        ("print", "Prints the values to a stream, or to sys.stdout by default."),
        ("range", "Return an object that produces a sequence of integers."),
        ("zip", "Iterate over several iterables in parallel, producing tuples."),
        ("min", "Return the smallest item of an iterable or of two or more arguments."),
        ("max", "Return the largest item of an iterable or of two or more arguments."),
        ("sum", "Return the sum of a start value (default: 0) plus an iterable of numbers."),
        ("repr", "Return the canonical string representation of the object."))]
)  # fmt: skip
"""The user's instruction data: Alpaca records (instruction, output), one JSON object a line."""
RUN_YAML = """\
model: tinynet
width: 8
data: digits
batch_size: 32
epochs: 1
output: runs/yaml
"""
# The source's ZeRO-2 JSON (tests/strategies/test_deepspeed.py SEED_ZERO2), with its optimizer and scheduler blocks.
SOURCE_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
        "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}  # fmt: skip
# The source's default_DDP.yml as `accelerate config` writes it (tests/strategies/test_accelerate.py), 2 processes.
SOURCE_DDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
GPU_SWEEP = REPO / "benchmarks" / "gpu_h100_2026-11-22" / "cells"

def write_cifar10(root: Path, n_train: int = 200, n_test: int = 50) -> dict[str, str]:
    """A tiny CIFAR-10 in the real ``cifar-10-batches-py`` format (5 training batches, a test batch, the meta
    file; random pixels); returns each file's md5."""
    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def batch(label: str, n: int) -> dict:
        return {
            "batch_label": label,
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "filenames": [f"img_{i}.png" for i in range(n)],
        }

    files = {f"data_batch_{i}": batch(f"training batch {i} of 5", n_train // 5) for i in range(1, 6)}
    files["test_batch"] = batch("testing batch 1 of 1", n_test)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    files["batches.meta"] = {"label_names": names, "num_cases_per_batch": n_train // 5, "num_vis": 3072}
    md5 = {}
    for name, obj in files.items():
        blob = pickle.dumps(obj)
        (folder / name).write_bytes(blob)
        md5[name] = hashlib.md5(blob).hexdigest()
    return md5


def write_imagenet_weights(torch_home: Path, model: str) -> Path:
    """torchvision's ImageNet weights file of ``model`` (its DEFAULT), under the exact name torch.hub caches it as
    (the last part of the weights' URL) in TORCH_HOME/hub/checkpoints: the model's full 1000-class state dict,
    randomly initialised (the real file is a download away; its layout is what stratbench reads)."""
    from urllib.parse import urlparse

    import torch

    from stratbench.core.torchvision_compat import import_torchvision

    tv = import_torchvision()
    weights = tv.models.get_model_weights(model).DEFAULT
    path = torch_home / "hub" / "checkpoints" / Path(urlparse(weights.url).path).name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(tv.models.get_model(model, weights=None, num_classes=1000).state_dict(), path)
    return path


def write_images(work: Path) -> list[str]:
    """``some.png`` and ``more_images/`` (two PNGs in a subfolder, as predict searches folders recursively)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    made = []
    for rel in ("some.png", "more_images/a.png", "more_images/nested/b.png"):
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(path)
        made.append(rel)
    return made


def write_gpu_sweep(folder: Path) -> int:
    """A sweep folder from another machine: the committed H100 cells (benchmarks/gpu_h100_2026-11-22/cells, one
    result.json each) as the results.jsonl lines ``stratbench compare`` appends."""
    from stratbench.compare.runner import RESULTS, machine_of

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for cell in sorted(p for p in GPU_SWEEP.iterdir() if (p / "result.json").is_file()):
        res = json.loads((cell / "result.json").read_text())
        label = cell.name.split("_")[0]
        lines.append(
            {
                "id": cell.name,
                "method": res["strategy"],
                "label": label,
                "precision": res["precision"],
                "world_size": res["world_size"],
                "batch_size": res["global_batch_size"],
                "strategy_options": res["config"].get("strategy_options") or {},
                "cell_config": {},
                "status": res["status"],
                "reason": res.get("reason", ""),
                "machine": machine_of(res.get("environment")),
                "environment": res.get("environment") or {},
                "config": res["config"],
                "data_parallel_size": res.get("data_parallel_size"),
                "per_device_batch_size": res.get("per_device_batch_size"),
                "global_batch_size": res.get("global_batch_size"),
                "model": res.get("model"),
                "data": res.get("data"),
                "metrics": res.get("metrics") or {},
                "sharding": res.get("sharding") or {},
                "elapsed_s": None,
                "returncode": 0,
                "cell_dir": None,
                "log": None,
                "recorded_at": "2026-11-22T00:00:00+0000",
            }
        )
    (folder / RESULTS).write_text("".join(json.dumps(r, default=str) + "\n" for r in lines))
    return len(lines)


def stratbench_script() -> Path:
    """The ``stratbench`` console script pip installed beside this interpreter (``make install``)."""
    script = Path(sys.executable).parent / "stratbench"
    if not script.is_file():
        raise SystemExit(f"no stratbench console script beside {sys.executable}: run `make install` first")
    return script


def clean_env(home: Path) -> dict[str, str]:
    """What a new user's shell has: PATH with the venv's bin first, a HOME of their own, a UTF-8 locale; no
    PYTHONPATH, no TORCH_HOME, nothing of the test runner's environment."""
    path = os.pathsep.join([str(stratbench_script().parent), "/usr/local/bin", "/usr/bin", "/bin"])
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": str(home / "tmp")}


def make_fixtures(root: Path, commands: list[str], *, cifar: tuple[int, int] = (200, 50)) -> tuple[dict[str, str], list[str]]:
    """The user's files (``root/home`` is their HOME, ``root/work`` the folder they run the tour in); returns the
    environment for the tour and one line per fixture. ``cifar``: training and test images of the CIFAR-10 copy."""
    home, work = root / "home", root / "work"
    for d in (home, work, home / "tmp"):
        d.mkdir(parents=True)
    notes = [f"`stratbench` on PATH: the console script pip installed (`{stratbench_script()}`); a clean environment: "
             "PATH, HOME, LANG only (no PYTHONPATH, no TORCH_HOME)"]  # fmt: skip
    argvs = [tour_argv(c) for c in commands]
    notes += _data_fixtures(argvs, home, work, cifar)
    notes += _user_files(commands, argvs, work)
    return clean_env(home), notes


def _data_fixtures(argvs: list[list[str]], home: Path, work: Path, cifar: tuple[int, int]) -> list[str]:
    """CIFAR-10 copies where the tour's lines look for them, and the torch hub's ImageNet weights files."""
    notes = []
    for d in sorted({flag_value(a, "--data-dir") or "data" for a in argvs if flag_value(a, "--data") == "cifar10"}):
        where = home / d[2:] if d.startswith("~/") else work / d
        write_cifar10(where, *cifar)
        notes.append(f"`{d}/cifar-10-batches-py`: a tiny CIFAR-10 in the real pickle format ({cifar[0]} training "
                     f"images in 5 batch files, {cifar[1]} test images, random pixels)")  # fmt: skip
    pretrained = sorted({flag_value(a, "--model") or "tinynet" for a in argvs
                         if flag_value(a, "--weights") in ("imagenet", "DEFAULT")})  # fmt: skip
    for model in pretrained:
        path = write_imagenet_weights(home / ".cache" / "torch", model)
        notes.append(f"`~/.cache/torch/hub/checkpoints/{path.name}` (the torch hub cache): torchvision's {model} "
                     f"ImageNet (DEFAULT) weights file under its exact name, a {model} state dict with the "
                     f"1000-class head ({path.stat().st_size / 2**20:.0f} MiB, random values)")  # fmt: skip
    return notes


USER_MLP = """\
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, num_classes))
"""


def _rows_csv(n: int = 240, seed: int = 0) -> str:
    """A table of six numeric features and a learnable yes/no label (the sign of a linear mix)."""
    import random

    rng = random.Random(seed)
    lines = ["f0,f1,f2,f3,f4,f5,label"]
    for _ in range(n):
        f = [rng.gauss(0, 1) for _ in range(6)]
        lines.append(",".join(f"{v:.4f}" for v in f) + ("," + ("yes" if f[0] + 0.5 * f[1] - f[2] > 0 else "no")))
    return "\n".join(lines) + "\n"


USER_FILES = {
    "mynet.py": (USER_MODEL, "`build(num_classes)`, a small CNN"),
    "mydata.py": (USER_DATA, "`build(image_size, seed)` -> (train, val, class names), 160 random images"),
    "myloss.py": (USER_LOSS, "`fn(logits, targets)`"),
    "mlp.py": (USER_MLP, "`build(num_classes)`, an MLP whose first layer is lazy"),
    "rows.csv": (_rows_csv(), "a table: 240 rows of six numeric features and a yes/no label"),
    "qa.jsonl": (USER_QA, "40 instruction records (Alpaca's `instruction` and `output`), one JSON object a line"),
    "run.yaml": (RUN_YAML, "tinynet width 8 on digits, batch 32, 1 epoch, output runs/yaml"),
    "zero_stage2_config.json": (json.dumps(SOURCE_ZERO2, indent=2),
                                "the source's ZeRO-2 JSON (optimizer, scheduler, CPU offload, `auto` values)"),
    "default_DDP.yml": (SOURCE_DDP_YAML, "the source's `accelerate config` YAML for DDP, 2 processes"),
}  # fmt: skip


def _user_files(commands: list[str], argvs: list[list[str]], work: Path) -> list[str]:
    """The user's modules and config files that the tour names, images for predict, another machine's sweep."""
    notes = []
    text = "\n".join(commands)
    for name, (content, what) in USER_FILES.items():
        if name.removesuffix(".py") + (":" if name.endswith(".py") else "") in text:
            (work / name).write_text(content)
            notes.append(f"`{name}`: {what}")
    if any(a[:1] == ["predict"] for a in argvs):
        made = write_images(work)
        notes.append("images for predict: " + ", ".join(f"`{m}`" for m in made) + " (random pixels, 40x48)")
    written = {flag_value(b, "--output") for b in argvs if b[:1] == ["compare"]}
    for a in argvs:
        if a[:1] != ["report"]:
            continue
        for d in a[1:]:
            if d.startswith("-"):
                break
            if d != flag_value(a, "--output") and d not in written:  # a sweep no tour line writes: another machine's
                n = write_gpu_sweep(work / d)
                notes.append(f"`{d}`: a sweep folder from another machine: the {n} committed H100 cells of "
                             f"`benchmarks/gpu_h100_2026-11-22/cells` as `results.jsonl` records")  # fmt: skip
    return notes


# ------------------------------------------------------------------------------------------------
# running


@dataclass
class Line:
    n: int
    command: str  # as in the README
    extra: tuple[str, ...] = ()
    shrink: Shrink | None = None
    rc: int | None = None
    seconds: float = 0.0
    outcome: str = ""
    tail: list[str] = field(default_factory=list)
    refusal: str = ""
    script: str = ""  # a python line: the script's text (what it touches is read from it)

    @property
    def run_as(self) -> str:
        return " ".join([self.command, *self.extra])


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop the line's process and everything it started (torchrun's workers have their own sessions)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_line(line: Line, work: Path, env: dict[str, str], logs: Path, timeout: float) -> None:
    """Run one line through bash in ``work``; its output goes to ``logs/NN.log``; killed after ``timeout``."""
    log = logs / f"{line.n:02d}.log"
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["bash", "-c", line.run_as], cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            line.rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            line.rc = None
    line.seconds = time.monotonic() - t0
    text = _ANSI.sub("", log.read_bytes().decode("utf-8", "replace"))
    lines = [ln.rstrip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
    if line.rc == 0:
        line.outcome = "pass"
    elif line.rc == 3 and lines and re.search(r"\b(GPU|CUDA|cuda)\b", lines[-1]):
        line.outcome = "refused: needs a GPU"
        line.refusal = lines[-1]
    elif line.rc == 3 and lines and "--executor slurm" in lines[-1]:  # no SLURM of the tour's own here
        line.outcome = "refused: needs SLURM"
        line.refusal = lines[-1]
    else:
        line.outcome = "timeout" if line.rc is None else "FAIL"
    if line.outcome not in ("pass",):
        line.tail = lines[-15:]


DEFAULT_OUTPUTS = {"train": "runs/train", "probe": "probe.yaml"}
"""Where a command writes when its line names no --output (compare: runs/compare-PRESET)."""
_PATHLIKE = re.compile(r"[/~]|\.(pt|pth|onnx|safetensors|csv|ya?ml|json|png|jpe?g|py)$")


def _place(token: str) -> str | None:
    """The file or folder of the user's a token names, as far as lines can share it: the first two parts of a path
    (``runs/ddp/checkpoints/last`` -> ``runs/ddp``), the module file of ``mod:fn``; None for a token that names
    none (a number, a model name, a size)."""
    if token.startswith("-") or not token:
        return None
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", token):
        return token.split(":")[0].replace(".", "/") + ".py"
    if not _PATHLIKE.search(token):
        return None
    return "/".join(Path(token.removeprefix("./")).parts[:2])


def touches(line: Line) -> set[str] | None:
    """The files and folders of the user's that ``line`` reads or writes (named in it, or a command's default
    output); None for a line that is not a stratbench command and whose files are not known (a barrier)."""
    if line.script:  # a python script: the paths of its string literals
        return {p for lit in re.findall(r"[\"']([^\"'\s]+)[\"']", line.script) if (p := _place(lit))}
    try:
        argv = tour_argv(line.run_as)
    except ValueError:
        return None
    places = {p for tok in argv[1:] for part in tok.split("=", 1)[-1:] if (p := _place(part))}
    if not flag_value(argv, "--output"):
        preset = flag_value(argv, "--preset")
        default = DEFAULT_OUTPUTS.get(argv[0])
        if argv[0] == "compare" and preset:
            default = f"runs/compare-{preset}"
        if default:
            places.add(default)
    return places


def dependencies(lines: list[Line]) -> dict[int, set[int]]:
    """For each line, the earlier lines it must wait for: those touching a file or folder it touches (a later line
    reads what an earlier one wrote, as the user's would; two lines never write one place at once). A line whose
    files are unknown waits for every earlier line, and every later line waits for it."""
    deps: dict[int, set[int]] = {}
    for i, line in enumerate(lines):
        mine = touches(line)
        deps[line.n] = set()
        for earlier in lines[:i]:
            theirs = touches(earlier)
            if mine is None or theirs is None or mine & theirs:
                deps[line.n].add(earlier.n)
    return deps


def run_lines(
    lines: list[Line], work: Path, env: dict[str, str], logs: Path, timeout: float, jobs: int = 1,
    announce: Callable[[Line, bool], None] | None = None,
) -> None:  # fmt: skip
    """Run the lines, ``jobs`` at a time: each starts, in README order, once the lines it depends on have ended
    (``dependencies``). ``announce(line, ended)`` is called as each line starts and ends."""
    deps, done = dependencies(lines), set()
    pending = list(lines)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        running: dict[Future, Line] = {}
        while pending or running:
            ready = [ln for ln in pending if deps[ln.n] <= done]
            for line in ready[: max(1, jobs) - len(running)]:
                pending.remove(line)
                if announce:
                    announce(line, False)
                running[pool.submit(run_line, line, work, env, logs, timeout)] = line
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                fut.result()
                line = running.pop(fut)
                done.add(line.n)
                if announce:
                    announce(line, True)


def start_slurm(lines: list[Line]) -> tuple[Path | None, str]:
    """A SLURM of the tour's own (scripts/local_slurm.sh up: one node on loopback) when a line runs
    ``--executor slurm``, as the Ray line starts a Ray of its own: its state folder (None: no such line, or it
    could not start here, and the line must then be refused in one line) and a note for the report."""
    if not any(flag_value(tour_argv(ln.run_as), "--executor") == "slurm" for ln in lines if not ln.script):
        return None, ""
    state = Path("/tmp") / f"stratbench-slurm-tour-{os.getpid()}"  # its unix sockets' paths must stay short
    up = subprocess.run(["bash", str(REPO / "scripts" / "local_slurm.sh"), "up", str(state)], capture_output=True,
                        text=True, timeout=600)  # fmt: skip
    if up.returncode != 0:
        stop_slurm(state)
        why = (up.stderr or up.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"no SLURM of the tour's own could start here ({why[0]}): the `--executor slurm` line is refused"
    return state, (f"a single-node SLURM of the tour's own (`scripts/local_slurm.sh up {state}`), its "
                   "`SLURM_CONF` in the tour's environment, as a login node's shell has it")  # fmt: skip


def stop_slurm(state: Path | None) -> None:
    if state is not None:
        subprocess.run(["bash", str(REPO / "scripts" / "local_slurm.sh"), "down", str(state)], capture_output=True,
                       timeout=300)  # fmt: skip
        shutil.rmtree(state, ignore_errors=True)


PYTHON_SECTION = "### From Python"


PYTHON_FAST = ("epochs=1", "epochs=1, max_steps=3")
"""FAST's shrink of the "From Python" block: its two runs and its sweep's cells stop after 3 steps (an epoch of
digits is 44 steps; the whole epochs took ~20 s more of the test for the same calls and records)."""


def python_line(readme: str, work: Path, n: int, fast: bool = False) -> Line:
    """The README's "From Python" block as the script a user saves in their folder (``nb.py``), as a line to run
    with the venv's ``python`` (``fast``: with PYTHON_FAST's shrink, which must find what it shrinks)."""
    script = "\n".join(tour_block(readme, PYTHON_SECTION)) + "\n"
    if fast:
        old, new = PYTHON_FAST
        assert script.count(old) == 2, f"the From Python block no longer has two {old!r}: update PYTHON_FAST"
        script = script.replace(old, new)
    (work / "nb.py").write_text(script)
    return Line(n, "python nb.py", script=script)


class Tour:
    """The tour (``FAST`` shrinks, then the "From Python" block) in ``root`` as tests/readme/test_readme_tour.py runs
    it: fixtures, then every line, ``jobs`` at a time where they share no file (``run_lines``); each line's
    outcome is on it, its output in ``logs``."""

    def __init__(
        self, root: Path, readme: Path = README, shrinks: tuple[Shrink, ...] = FAST, jobs: int = 2,
        only: tuple[str, ...] = (),
    ) -> None:
        """``only``: run just the page's lines that start with one of these (the manual's lines the suite runs);
        the page's "From Python" block runs where it has one and no ``only`` is given."""
        self.root, self.readme, self.jobs = Path(root), Path(readme).read_text(), jobs
        self.fast = shrinks is FAST
        self.commands = tour_commands(self.readme, sections_for(Path(readme)))
        if only:
            self.commands = [c for c in self.commands if c.startswith(only)]
        self.python = not only and f"\n{PYTHON_SECTION}\n" in self.readme
        self.lines = plan_lines(self.commands, shrinks)
        self.env: dict[str, str] = {}

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def work(self) -> Path:
        return self.root / "work"

    def run(self, timeout: float = 600) -> None:
        self.env, _ = make_fixtures(self.root, self.commands, cifar=(40, 8))
        # The test runs two lines at once beside a second test process, on 2 cores: one intra-op thread each (a
        # one-process line would take both cores, and its OpenMP threads then spin waiting for a core another
        # process holds: twice the CPU for the same line, measured). Multi-process lines already get cores /
        # processes (launching.launch.threads_per_process), which reads this variable the same way.
        self.env["OMP_NUM_THREADS"] = "1"
        self.logs.mkdir()
        if self.python:
            self.lines.append(python_line(self.readme, self.work, len(self.lines) + 1, fast=self.fast))
        slurm, _ = start_slurm(self.lines)
        if slurm is not None:
            self.env["SLURM_CONF"] = str(slurm / "slurm.conf")
        try:
            run_lines(self.lines, self.work, self.env, self.logs, timeout, jobs=self.jobs)
        finally:
            stop_slurm(slurm)


# ------------------------------------------------------------------------------------------------
# report


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"Python {platform.python_version()}"]
    for pkg in (
        "stratbench",
        "torch",
        "torchvision",
        "deepspeed",
        "accelerate",
        "onnx",
        "onnxruntime",
        "mlflow",
        "wandb",
    ):
        for dist in (pkg, f"{pkg}-skinny"):  # mlflow's extra may be mlflow-skinny
            try:
                parts.append(f"{dist} {version(dist)}")
                break
            except PackageNotFoundError:
                continue
        else:
            parts.append(f"{pkg} (not installed)")
    return ", ".join(parts)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores (shared with other jobs), {gpu}, {platform.system()} {platform.release()}"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "src", "README.md"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + (" (with uncommitted changes to src/README)" if dirty else "")
    except OSError:
        return "unknown"


def render(
    lines: list[Line], notes: list[str], command: str, total_s: float, note: str = "",
    block: str = 'README.md\'s "Quick tour" block',
) -> str:
    passed = sum(ln.outcome == "pass" for ln in lines)
    refused = sum(ln.outcome.startswith("refused") for ln in lines)
    failed = len(lines) - passed - refused
    out = [
        f"# {'README quick tour' if block.startswith('README') else 'The manual'} on CPU, "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Every command of {block}, run in order by `benchmarks/readme_tour.py` in one "
        "fresh temporary working folder (fresh HOME and TORCH_HOME).",
        "",
        f"- **Result: {passed} of {len(lines)} lines passed, {refused} refused as needing a GPU, {failed} failed; "
        f"total {total_s / 60:.1f} min.**",
        f"- Made by: `{command}`",
        f"- Commit: {_commit()}",
        f"- Machine: {machine()}",
        f"- Versions: {versions()}",
        "- Every line ran under `nice -n 19` on a machine shared with other jobs: the times are wall-clock times "
        "of a busy 2-core machine, not benchmarks.",
        *(["", note] if note else []),
        "",
        "## Lines",
        "",
        "| # | command (as run) | exit | seconds | result |",
        "|---|---|---|---|---|",
    ]
    for ln in lines:
        rc = "timeout" if ln.rc is None else str(ln.rc)
        out.append(f"| {ln.n} | `{ln.command}`" + (f" + `{' '.join(ln.extra)}`" if ln.extra else "")
                   + f" | {rc} | {ln.seconds:.1f} | {ln.outcome} |")  # fmt: skip
    out += ["", "## Extra flags (lines shrunk for a 2-core CPU)", ""]
    shrunk = [ln for ln in lines if ln.extra]
    if not shrunk:
        out.append("None: every line ran exactly as written.")
    for ln in shrunk:
        out.append(f"- line {ln.n} (`{ln.command}`) got `{' '.join(ln.extra)}`: {ln.shrink.reason}")
    if shrunk:
        out += ["", "Every other line ran exactly as written."]
    out += ["", "## Fixtures (files the tour assumes the user has)", ""]
    out += [f"- {n}" for n in notes]
    out += ["", "Everything else a line reads (checkpoints under `runs/`, `model.pt`, sweep folders of this machine) "
            "was written by an earlier line of the tour."]  # fmt: skip
    refusals = [ln for ln in lines if ln.refusal]
    if refusals:
        out += ["", "## Refusals (lines that need a GPU)", ""]
        out += [f"- line {ln.n}: `{ln.refusal}`" for ln in refusals]
    failures = [ln for ln in lines if ln.outcome in ("FAIL", "timeout")]
    if failures:
        out += ["", "## Failures: last lines of output", ""]
        for ln in failures:
            out += [f"### line {ln.n}: `{ln.run_as}`", "", "```", *ln.tail, "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", "--readme", dest="readme", default=str(README),
                    help="the page whose tour to run: README.md (its Quick tour) or docs/usage.md (its Commands)")
    ap.add_argument("--report", help="markdown report to write (default: print it)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per line (default 1800)")
    ap.add_argument(
        "--keep", help="run in this folder (must not exist) and keep it, instead of a temporary one"
    )
    ap.add_argument("--stop-after", type=int, help="run only the first N lines (debugging)")
    ap.add_argument("--note", default="", help="a paragraph for the report (e.g. what earlier runs found)")
    ap.add_argument("--fast", action="store_true", help="the test's shrinks (FAST): every line, a few steps each")
    ap.add_argument("--jobs", type=int, default=1, help="lines run at once where they share no file (default 1)")
    args = ap.parse_args(argv)

    commands = tour_commands(Path(args.readme).read_text(), sections_for(Path(args.readme)))
    if args.stop_after:
        commands = commands[: args.stop_after]
    lines = plan_lines(commands, FAST if args.fast else SHRINK)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="readme_tour_"))
    root.mkdir(parents=True, exist_ok=bool(not args.keep))
    slurm = None
    try:
        env, notes = make_fixtures(root, commands, cifar=(40, 8) if args.fast else (200, 50))
        logs = root / "logs"
        logs.mkdir()
        slurm, note = start_slurm(lines)
        notes += [note] if note else []
        if slurm is not None:
            env["SLURM_CONF"] = str(slurm / "slurm.conf")
        t0 = time.monotonic()

        def announce(ln: Line, ended: bool) -> None:
            if not ended:
                print(f"[{ln.n}/{len(lines)}] {ln.run_as}", flush=True)
                return
            print(f"    [{ln.n}] -> {ln.outcome} (exit {ln.rc}, {ln.seconds:.1f} s)", flush=True)
            for t in ln.tail:
                print(textwrap.indent(t, "       "), flush=True)

        run_lines(lines, root / "work", env, logs, args.timeout, args.jobs, announce)
        total = time.monotonic() - t0
    finally:
        stop_slurm(slurm)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    command = "nice -n 19 .venv/bin/python benchmarks/readme_tour.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    manual = sections_for(Path(args.readme)) == MANUAL_SECTIONS
    block = 'docs/usage.md\'s "Commands" block' if manual else 'README.md\'s "Quick tour" block'
    report = render(lines, notes, command.strip(), total, args.note, block)
    if args.report:
        Path(args.report).write_text(report)
        print(f"report: {args.report}")
    else:
        print(report)
    return 0 if all(ln.outcome == "pass" or ln.outcome.startswith("refused") for ln in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
