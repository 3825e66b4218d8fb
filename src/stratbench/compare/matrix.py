"""The comparison matrix: cells (method x precision x world size x batch size) on one model and data set.

A matrix is a small mapping - the same shape for the built-in presets and for a user's YAML file::

    name: my-sweep
    base: {model: tinynet, data: digits, epochs: 2, batch_size: 64}   # TrainConfig options of every cell
    world_size: 2                        # processes of multi-process methods (default 2)
    cells:                               # each entry is expanded as a product of its list values
      - {method: single, precision: [fp32, bf16-mixed]}
      - {method: [ddp, fsdp], precision: [fp32, bf16-mixed]}
      - {method: deepspeed, options: [{zero_stage: 1}, {zero_stage: 3}], label: "deepspeed-z{zero_stage}"}
      - {method: single, precision: fp32, config: {tf32: true}, label: "single+tf32"}
      - {method: ddp, precision: fp32, world_size: 4, nodes: 2}  # 2 processes on each of 2 nodes
    pretrain: {model: gpt-tiny, data: text, max_steps: 200}  # optional: one run before the cells (below)

``pretrain`` (TrainConfig options) is one ``single`` run the sweep makes once, before its cells, into
``OUTPUT/pretrain``; every cell starts from its last checkpoint (``init_from``), so that a fine-tuning matrix
compares methods on a trained model. A rerun keeps a finished pretraining run (``compare.pretrain``).

Instead of ``cells`` a file may give ``methods``/``precisions``/``world_sizes``/``batch_sizes`` lists (one product).
Before anything runs, ``plan`` decides for each cell whether it can run here, and why not.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stratbench.checkpoints.checkpoint import last_checkpoint
from stratbench.core.config import TrainConfig, canonical_precision, from_dict, load_yaml
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, StratbenchError, UnsupportedError, did_you_mean
from stratbench.core.precision import SPECS, configure_tf32, slow_on, spec_of
from stratbench.core.tables import fmt_bytes
from stratbench.data.datasets import check_one_batch
from stratbench.models.transformer import SIZES
from stratbench.models.zoo import pretrained_available
from stratbench.predicting.estimate import estimate, parse_bytes
from stratbench.strategies.base import all_strategies
from stratbench.strategies.parallel.pipeline_parallel import pipeline_layout
from stratbench.training import engine

STATUSES = ("ok", "failed", "oom", "timeout", "nan", "skipped")
"""Outcome of a cell: ok, failed (crash or bad config), oom, timeout, nan (loss became NaN/inf), skipped (cannot run here)."""

# Options that belong to the sweep, not to a cell: compare sets them per cell (output, processes, progress).
SWEEP_OWNED = (
    "output",
    "strategy",
    "precision",
    "nproc",
    "strategy_options",
    "nnodes",
    "resume",
    "resume_from",
    "progress",
)
ENTRY_KEYS = ("method", "precision", "world_size", "batch_size", "options", "config", "label", "nodes")


def slug(text: str) -> str:
    """``text`` as a file name's part: every run of other characters than letters, digits, '.', '+' and '-' one
    '-' (a cell's id, a ``--methods`` sweep's name from its model and data)."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-")


@dataclass(frozen=True)
class Cell:
    """One training run of the sweep; ``config`` holds only the options set explicitly (base + the cell's own)."""

    method: str
    precision: str
    world_size: int
    config: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    nodes: int = 1
    """Machines the cell's ``world_size`` processes spread over (``procs_per_node`` on each)."""
    start: str = ""
    """The digest of the matrix's pretraining run the cell starts from ('' where it has none): a cell recorded
    from another pretraining run is another cell."""

    @property
    def procs_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def shape(self) -> str:
        """``x2``, or ``x4 on 2 nodes``: how the display names the cell's processes."""
        return f"x{self.world_size}" + (f" on {self.nodes} nodes" if self.nodes > 1 else "")

    @property
    def batch_size(self) -> int:
        return int(self.config.get("batch_size", TrainConfig.batch_size))

    @property
    def name(self) -> str:
        """Method label shown in the table (e.g. ``deepspeed-z2``); the method name when no label was given."""
        return self.label or self.method

    @property
    def id(self) -> str:
        """Stable id from everything that changes the run: readable part + hash (resume matches on it)."""
        key = {"method": self.method, "precision": self.precision, "world_size": self.world_size,
               "options": self.options, "config": self.config}  # fmt: skip
        if self.start:
            key["start"] = self.start
        nodes = ""
        if self.nodes > 1:  # one node keeps the ids of the sweeps recorded before cells had nodes
            key["nodes"] = self.nodes
            nodes = f"n{self.nodes}"
        digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"{slug(self.name)}_{self.precision}_w{self.world_size}{nodes}_b{self.batch_size}_{digest}"

    def train_config(self, output: str | Path, progress: bool = True) -> dict[str, Any]:
        """The YAML mapping the cell's ``stratbench train --config`` reads."""
        return {
            **self.config,
            "strategy": self.method,
            "precision": self.precision,
            "strategy_options": dict(self.options),
            "nproc": self.procs_per_node,
            **({"nnodes": self.nodes} if self.nodes > 1 else {}),
            "output": str(output),
            "progress": progress,
        }


@dataclass
class Matrix:
    """A named list of cells plus what the whole sweep needs (``gpu_only``: its numbers only mean something on GPUs)."""

    name: str
    description: str
    cells: list[Cell]
    base: dict[str, Any] = field(default_factory=dict)
    gpu_only: bool = False
    timeout_s: float = 900.0
    device_memory: int | None = None
    """Memory of one device (bytes): a cell whose estimate exceeds it is not run but recorded as 'does not fit
    (estimate X of Y)' (``--device-memory`` or the matrix's ``device_memory``)."""
    pretrain: dict[str, Any] | None = None
    """The options of one ``single`` run made before the cells, whose last checkpoint every cell starts from
    (``init_from``, unless the cell sets its own); None: the cells start as their configs say."""
    title: str = ""
    """What the report is titled (the name where empty): a preset run on the user's model says so."""

    @property
    def heading(self) -> str:
        """The report's title: the title where one was given or made, else the name."""
        return self.title or self.name

    def uses_gpus(self, cell: Cell) -> bool:
        """The cell's processes each need a GPU reserved for them (an executor that reserves resources asks):
        its device is cuda, or auto in a matrix that measures GPUs."""
        device = str(cell.config.get("device", "auto"))
        return device == "cuda" or (device == "auto" and self.gpu_only)


# ------------------------------------------------------------------------------------------------
# presets


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def preset_quick(world_size: int | None = None) -> dict[str, Any]:
    """Every CPU-capable method with 2 processes on tinynet/digits, fp32 and bf16-mixed; < 10 min on 2 cores."""
    both = ["fp32", "bf16-mixed"]
    world = world_size or 2
    # tinynet's 5 pieces: stem, blocks.0-2, head; world 2: 2 stages, 4 micro-batches
    pipe = pipeline_layout(world, pieces=5)
    return {
        "name": "quick",
        "description": "tinynet (width 8) on scikit-learn digits at 16x16, 2 epochs, global batch 64; "
        "every method that runs on a CPU with 2 processes, fp32 and bf16-mixed",
        # Small enough that 18 cells finish in minutes on 2 CPU cores; large enough that all methods learn.
        "base": {
            "model": "tinynet",
            "width": 8,
            "data": "digits",
            "image_size": 16,
            "epochs": 2,
            "batch_size": 64,
            "measure_flops": False,
            "timing_warmup_steps": 3,
        },  # fmt: skip
        "world_size": world,
        "timeout_s": 300,
        "cells": [
            {"method": "single", "precision": both},
            {"method": ["ddp", "ddp-zero", "fsdp", "fsdp1"], "precision": both},
            {
                "method": "deepspeed",
                "precision": both,
                "options": [{"zero_stage": s} for s in (1, 2, 3)],
                "label": "deepspeed-z{zero_stage}",
            },  # fmt: skip
            {"method": "accelerate-ddp", "precision": both},
            {
                "method": "pipeline",
                "precision": both,
                "options": [{"schedule": s, **pipe} for s in ("gpipe", "1f1b")],
                "label": "pipeline-{schedule}",
            },  # fmt: skip
            # Rows that need what this machine may lack; listed so the report says why they are missing.
            {"method": "single", "precision": ["fp16-mixed", "fp16-true"]},
            {"method": "dp", "precision": "fp32", "world_size": 1},
            {"method": ["accelerate-fsdp", "accelerate-deepspeed"], "precision": "fp32"},
        ],
    }


def preset_seed(world_size: int | None = None, download: bool = False) -> dict[str, Any]:
    """The source experiment: ResNet-50, CIFAR-10 at 224x224, 5 epochs, global batch 128, every method (+ bf16).

    Like the source it fine-tunes torchvision's ImageNet weights when they are in the torch hub cache (or
    ``download`` is set); otherwise it starts from random weights, and the report's ``init`` column says which."""

    world = world_size or max(2, _gpu_count())
    pretrained = download or pretrained_available("resnet50", "imagenet")
    multi = [
        "ddp",
        "accelerate-ddp",
        "fsdp",
        "accelerate-fsdp",
        "ddp-zero",
        "deepspeed",
        "accelerate-deepspeed",
    ]
    init = (
        "torchvision's ImageNet weights, as the source"
        if pretrained
        else "random init: torchvision's ImageNet file is not in the torch hub cache; add --download or --weights"
    )
    return {
        "name": "seed",
        "description": f"the source template's experiment: ResNet-50 ({init}) on "
        f"CIFAR-10 at 224x224, 5 epochs, global batch 128; multi-device methods on {world} GPUs",
        "base": {
            "model": "resnet50",
            "data": "cifar10",
            "image_size": 224,
            "epochs": 5,
            "batch_size": 128,
            "num_workers": 4,
            **({"weights": "imagenet"} if pretrained else {}),
        },
        "world_size": world,
        "gpu_only": True,
        "timeout_s": 4 * 3600,
        "cells": [
            {"method": "single", "precision": ["fp32", "fp16-true", "fp16-mixed", "bf16-mixed"]},
            {"method": "dp", "precision": ["fp32", "bf16-mixed"], "world_size": 1},
            {"method": multi, "precision": ["fp32", "bf16-mixed"]},
            # the source's pipeline parallelism: ResNet-50 in up to 4 stages, one per GPU, replicated over the
            # other GPUs (pipeline_layout; BatchNorm sees a micro-batch: docs/pipeline.md)
            {
                "method": "pipeline",
                "precision": ["fp32", "bf16-mixed"],
                "options": [{"schedule": s, **pipeline_layout(world, pieces=6)} for s in ("gpipe", "1f1b")],
                "label": "pipeline-{schedule}",
            },  # fmt: skip
        ],
    }


def preset_gpu_precision() -> dict[str, Any]:
    """Every precision on one GPU for ResNet-50 (throughput, memory, MFU) on synthetic 224x224 images."""
    return {
        "name": "gpu-precision",
        "description": "every precision on one GPU: ResNet-50, synthetic 224x224 images, global batch 128, "
        "1 epoch of 40 steps; MFU from the device's peak FLOP/s",
        "base": {
            "model": "resnet50",
            "data": "synthetic",
            "image_size": 224,
            "synthetic_samples": 5120,
            "epochs": 1,
            "batch_size": 128,
            "num_workers": 4,
        },  # fmt: skip
        "world_size": 1,
        "gpu_only": True,
        "timeout_s": 1800,
        "cells": [
            {"method": "single", "precision": ["fp32", "fp16-true", "bf16-true", "fp16-mixed", "bf16-mixed"]},
            {"method": "single", "precision": "fp32", "config": {"tf32": True}, "label": "single+tf32"},
            {
                "method": "single",
                "precision": "bf16-mixed",
                "config": {"channels_last": True},
                "label": "single+channels-last",
            },
        ],
    }


def _fast_precision() -> str:
    """The fast recipe's precision on this machine: bf16-mixed, or fp16-mixed on a GPU without bf16."""
    import torch

    return "fp16-mixed" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bf16-mixed"


def preset_gpu_fast(world_size: int | None = None) -> dict[str, Any]:
    """The source experiment's model, data and batch with the fast recipe instead of the source's settings
    (those stay in ``seed``): every method, multi-device ones on every visible GPU (one GPU: world size 1)."""
    world = world_size or max(1, _gpu_count())
    multi = ["ddp", "ddp-zero", "fsdp", "fsdp1", "accelerate-ddp", "accelerate-fsdp", "accelerate-deepspeed"]
    return {
        "name": "gpu-fast",
        "description": "the source experiment (ResNet-50, CIFAR-10 at 224x224, 5 epochs, global batch 128) with "
        "the fast recipe (bf16-mixed, channels-last, device-side input pipeline, fused optimizer, cudnn.benchmark, "
        f"torch.compile on CUDA); every method, multi-device methods on {world} GPU(s)",
        "base": {
            "model": "resnet50",
            "data": "cifar10",
            "image_size": 224,
            "epochs": 5,
            "batch_size": 128,
            "recipe": "fast",
        },
        "world_size": world,
        "gpu_only": True,
        "timeout_s": 3600,
        "cells": [
            {"method": "single", "precision": _fast_precision()},
            {"method": "dp", "precision": _fast_precision(), "world_size": 1},
            {"method": multi, "precision": _fast_precision()},
            {
                "method": "deepspeed",
                "precision": _fast_precision(),
                "options": [{"zero_stage": s} for s in (0, 1, 2, 3)],
                "label": "deepspeed-z{zero_stage}",
            },
        ],
    }


LLM_QUICK_BASE: dict[str, Any] = {
    "model": "gpt-tiny",
    "data": "text",
    "seq_len": 128,
    "batch_size": 16,
    "max_steps": 40,
    "optimizer": "adamw",
    "lr": 1e-3,
    "eval_samples": 64,
    "timing_warmup_steps": 3,
}
"""gpt-tiny on the standard library's bytes: 40 steps of 16 windows of 128 tokens, AdamW (its two state slots
make the model states the part of memory sharding divides)."""

SMALL_DS_BUCKET = 1_000_000
"""DeepSpeed's reduce bucket for the tiny model: 1M elements (4 MB in fp32) instead of its default 5e8 (1.86 GiB
allocated whole on every rank, more than everything else a gpt-tiny rank holds)."""


def preset_llm_quick(world_size: int | None = None) -> dict[str, Any]:
    """Every CPU-capable method with 2 processes on gpt-tiny and real text; < 10 min on 2 cores."""
    world = world_size or 2
    ds = [{"zero_stage": s, "reduce_bucket_size": SMALL_DS_BUCKET} for s in (1, 2, 3)]
    offload = {"zero_stage": 2, "offload_optimizer": "cpu", "reduce_bucket_size": SMALL_DS_BUCKET}
    pipe = pipeline_layout(world, pieces=6)  # gpt-tiny's pieces: tok_embeddings, layers.0-3, head
    return {
        "name": "llm-quick",
        "description": "gpt-tiny (1.87M parameters, 4 blocks) on byte-level text of the Python standard library, "
        "sequence 128, global batch 16, 40 steps of AdamW; every method that runs on a CPU with "
        f"{world} processes, fp32 (bf16 on a CPU without native bf16: ~4.4 s a step, 18x fp32)",
        "base": dict(LLM_QUICK_BASE),
        "world_size": world,
        "timeout_s": 300,
        "cells": [
            {"method": ["single", "ddp", "ddp-zero", "fsdp", "fsdp1", "accelerate-ddp"], "precision": "fp32"},
            {
                "method": "fsdp",
                "precision": "fp32",
                "config": {"activation_checkpointing": True},
                "label": "fsdp+ac",
            },
            {"method": "deepspeed", "precision": "fp32", "options": ds, "label": "deepspeed-z{zero_stage}"},
            {"method": "deepspeed", "precision": "fp32", "options": offload, "label": "deepspeed-z2-offload"},
            {
                "method": "pipeline",
                "precision": "fp32",
                "options": [{"schedule": s, **pipe} for s in ("gpipe", "1f1b")],
                "label": "pipeline-{schedule}",
            },
            {"method": "tp", "precision": "fp32"},
            # Rows that need what this machine may lack; listed so the report says why they are missing.
            {"method": "dp", "precision": "fp32", "world_size": 1},
            {"method": ["accelerate-fsdp", "accelerate-deepspeed"], "precision": "fp32"},
            ZERO_PP_CELL | {"precision": "fp32", "options": ZERO_PP_CELL["options"] | {"reduce_bucket_size": SMALL_DS_BUCKET}},  # fmt: skip
        ],
    }


ZERO_PP_CELL: dict[str, Any] = {
    "method": "deepspeed",
    "label": "deepspeed-zero++",
    "options": {"zero_stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
"""DeepSpeed ZeRO++'s quantised collectives on ZeRO-3: int8 weight all-gathers (qwZ) and int4 gradient
all-to-alls (qgZ); their kernels are CUDA-only, so on a CPU the row is skipped with DeepSpeed's reason."""


def hsdp_cells(world: int, nodes: int, precision: str) -> list[dict[str, Any]]:
    """HSDP (fsdp --replicate R: sharded inside each group of world/R ranks, replicated across) and ZeRO-3 with
    hpZ's secondary partition of the same size, where the devices form 2 or more groups of 2 or more; the groups
    are the nodes where there are several, else halves of the world."""
    groups = nodes if nodes > 1 else 2
    if world < 4 or world % groups or world // groups < 2:
        return []
    return [
        {"method": "fsdp", "precision": precision, "options": {"replicate": groups}, "label": "hsdp"},
        {"method": "deepspeed", "precision": precision, "label": f"deepspeed-z3-hpz{world // groups}",
         "options": {"zero_stage": 3, "zero_hpz": world // groups}},
    ]  # fmt: skip


def preset_llm_nodes() -> dict[str, Any]:
    """Sharding across nodes on one machine: 2 loopback nodes of 2 processes each (one launcher per node, as on
    a cluster), every cell's collectives split into the bytes that stay in a node and those that cross."""
    base = LLM_QUICK_BASE | {"seq_len": 64, "max_steps": 12, "eval_samples": 32}
    # DeepSpeed's default buckets are GBs of host memory per rank; its default reuse distance (1e9 elements) keeps
    # a model under ~1B parameters gathered from forward to backward, so ZeRO-3 (and hpZ) would gather it once:
    # 0 releases each block after its forward, as in a large model's run.
    small = {"reduce_bucket_size": SMALL_DS_BUCKET, "stage3_max_reuse_distance": 0,
             "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}  # fmt: skip
    hsdp, hpz = hsdp_cells(4, 2, "fp32")
    cells = [
        {"method": ["ddp", "fsdp"], "precision": "fp32"},
        hsdp,
        {"method": "deepspeed", "precision": "fp32", "options": {"zero_stage": 3, **small}, "label": "deepspeed-z3"},
        hpz | {"options": hpz["options"] | small},
        ZERO_PP_CELL | {"precision": "fp32", "options": ZERO_PP_CELL["options"] | small},
    ]
    for cell in cells:
        cell["nodes"] = 2
    return {
        "name": "llm-nodes",
        "description": "gpt-tiny (1.87M parameters) on byte-level text of the Python standard library, sequence 64, "
        "global batch 16, 12 steps of AdamW in fp32, on 2 nodes x 2 processes (loopback): full sharding over "
        "all 4 ranks against HSDP (sharded in a node, replicated across) and ZeRO-3 against hpZ (the backward "
        "gather in a node); each cell's comm / step says how many bytes crossed between the nodes",
        "base": base,
        "world_size": 4,
        "timeout_s": 600,
        "cells": cells,
    }


AUTOTP_CELL = {
    "method": "deepspeed",
    "label": "deepspeed-autotp",
    "options": {"autotp_size": 2, "zero_stage": 1},
}
"""DeepSpeed's AutoTP over groups of 2 ranks, ZeRO-1 over the data-parallel rest."""


def preset_llm_tp() -> dict[str, Any]:
    """Tensor parallelism against the data-parallel methods on 2 and 4 CPU processes (llm-quick's model, data and
    steps): tp alone, 2D (fsdp --tp 2) and 3D (pipeline --pp 2 --tp 2), and the libraries' own, DeepSpeed's
    AutoTP (2, and 2 x ZeRO-1 on 4) and accelerate's (a row that says why it cannot run on CPU), beside ddp
    and fsdp."""
    autotp = AUTOTP_CELL | {"options": AUTOTP_CELL["options"] | {"reduce_bucket_size": SMALL_DS_BUCKET}}
    cells: list[dict[str, Any]] = []
    for world in (2, 4):
        cells += [
            {"method": ["ddp", "fsdp", "tp"], "precision": "fp32", "world_size": world},
            autotp | {"precision": "fp32", "world_size": world},
        ]
    cells += [
        {"method": "fsdp", "precision": "fp32", "world_size": 4, "options": {"tp": 2}, "label": "fsdp+tp"},
        {"method": "pipeline", "precision": "fp32", "world_size": 4, "label": "pipeline+tp",
         "options": {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4}},
        {"method": "accelerate-tp", "precision": "fp32", "world_size": 2},
    ]  # fmt: skip
    return {
        "name": "llm-tp",
        "description": "gpt-tiny (1.87M parameters, 4 heads) on byte-level text, sequence 128, global batch 16, 40 "
        "steps of AdamW in fp32: tensor parallelism (tp, fsdp x tp, pipeline x tp) beside ddp and fsdp on 2 and 4 "
        "processes (with DeepSpeed's AutoTP; accelerate's tp runs on GPUs only); on one CPU's cores every process "
        "shares the same cores, so this measures the methods' "
        "overheads and memory per rank, not a speed-up",
        "base": dict(LLM_QUICK_BASE),
        "world_size": 2,
        "timeout_s": 600,
        "cells": cells,
    }


def preset_llm_fit(world_size: int | None = None) -> dict[str, Any]:
    """Where a method stops fitting: llm-quick's model and data with a per-device memory budget that the
    replicated methods exceed and the sharded ones keep within; the cells over it are not run."""
    spec = preset_llm_quick(world_size)
    return spec | {
        "name": "llm-fit",
        "description": "gpt-tiny (1.87M parameters) on byte-level text of the Python standard library, sequence 32, "
        "global batch 4, 40 steps of AdamW in fp32, so that the model states (16 bytes a parameter) are most of "
        f"a rank's memory; {spec['world_size']} processes under a budget of 26 MiB per device: a method whose "
        "memory estimate exceeds it is marked 'does not fit' and not run",
        "base": spec["base"] | {"batch_size": 4, "seq_len": 32},
        "device_memory": "26MiB",
        "cells": [
            {"method": ["single", "ddp", "ddp-zero", "fsdp"], "precision": "fp32"},
            {
                "method": "fsdp",
                "precision": "fp32",
                "config": {"activation_checkpointing": True},
                "label": "fsdp+ac",
            },
            {
                "method": "deepspeed",
                "precision": "fp32",
                "label": "deepspeed-z{zero_stage}",
                "options": [{"zero_stage": s, "reduce_bucket_size": SMALL_DS_BUCKET} for s in (1, 2, 3)],
            },
        ],
    }


def _tensor_parallel_cells(world: int, precision: str) -> list[dict[str, Any]]:
    """tp and accelerate-tp over every device, DeepSpeed's AutoTP over groups of 2, and 2D (fsdp --tp 2) where
    the devices form 2 or more groups of 2."""
    if world < 2:
        return []
    cells = [{"method": ["tp", "accelerate-tp"], "precision": precision}]
    if world % 2 == 0:
        cells.append(AUTOTP_CELL | {"precision": precision})
    if world >= 4 and world % 2 == 0:
        cells.append({"method": "fsdp", "precision": precision, "options": {"tp": 2}, "label": "fsdp+tp"})
    return cells


def preset_llm() -> dict[str, Any]:
    """The 1B-class Llama at sequence 2048 on the GPUs here, bf16-mixed, each method within the device's memory
    (and fsdp with float8 Linears, ``--float8 tensorwise``, where the GPU has float8 units)."""
    world = max(1, _gpu_count())
    return {
        "name": "llm",
        "description": f"llama-1b (1.24B parameters) on synthetic tokens (vocabulary 128256), sequence 2048, global "
        f"batch {4 * world}, 30 steps of AdamW in bf16-mixed; every method on {world} GPU(s); a method whose "
        "memory estimate exceeds the device is marked 'does not fit' and not run",
        "base": {
            "model": "llama-1b",
            "data": "synthetic-tokens",
            "vocab_size": 128256,
            "seq_len": 2048,
            "batch_size": 4 * world,
            "max_steps": 30,
            "optimizer": "adamw",
            "lr": 3e-4,
            "eval_samples": 16,
            "timing_warmup_steps": 5,
        },
        "world_size": world,
        "gpu_only": True,
        "timeout_s": 1800,
        "device_memory": "auto",
        "cells": [
            {"method": "single", "precision": "bf16-mixed"},
            {
                "method": "single",
                "precision": "bf16-mixed",
                "config": {"activation_checkpointing": True},
                "label": "single+ac",
            },  # fmt: skip
            {"method": ["ddp", "fsdp", "fsdp1"], "precision": "bf16-mixed"},
            *_tensor_parallel_cells(world, "bf16-mixed"),
            {
                "method": "fsdp",
                "precision": "bf16-mixed",
                "config": {"activation_checkpointing": True},
                "label": "fsdp+ac",
            },  # fmt: skip
            {
                "method": "fsdp",
                "precision": "bf16-mixed",
                "config": {"activation_checkpointing": True, "ac_mode": "selective"},
                "label": "fsdp+sac",
            },  # fmt: skip
            # torchtitan's float8 recipe (float8 Linears, bf16 elsewhere); without --compile, as the other rows. A GPU
            # without float8 units (compute capability below 8.9) refuses it in one line: recorded as skipped.
            {
                "method": "fsdp",
                "precision": "bf16-mixed",
                "config": {"float8": "tensorwise"},
                "label": "fsdp+fp8",
            },
            {
                "method": "deepspeed",
                "precision": "bf16-mixed",
                "options": [{"zero_stage": s} for s in (1, 2, 3)],
                "label": "deepspeed-z{zero_stage}",
            },  # fmt: skip
            {
                "method": "deepspeed",
                "precision": "bf16-mixed",
                "options": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
                "label": "deepspeed-z3-offload",
            },  # fmt: skip
            *hsdp_cells(world, 1, "bf16-mixed"),
            *([{"method": "fsdp", "precision": "bf16-mixed", "options": {"cp": 2}, "label": "fsdp-cp2"}]
              if world % 2 == 0 else []),  # fmt: skip
            *([ZERO_PP_CELL | {"precision": "bf16-mixed"}] if world > 1 else []),
        ],
    }


FINE_TUNE_VARIANTS: list[dict[str, Any]] = [
    {"name": "full", "config": {}},
    {"name": "lora", "config": {"lora_rank": 8}},
    {"name": "lora+8bit", "config": {"lora_rank": 8, "optimizer": "adamw8bit"}},
    {"name": "qlora", "config": {"lora_rank": 8, "quantize_base": "nf4"}},
]
"""What a fine-tuning preset trains of the model: everything (full), LoRA adapters of rank 8 (the base frozen),
LoRA with torchao's 8-bit AdamW states, QLoRA (rank 8 over a 4-bit NF4 base); each under every method of the preset (a method that refuses one is
recorded as skipped with its one-line reason)."""


def fine_tune_cells(methods: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
    """One cell entry per variant (``FINE_TUNE_VARIANTS``) and method entry (``method``, optional ``options`` and
    ``label``): the full fine-tuning cell keeps the method's own label, the others add the variant's name."""
    entries = []
    for variant in FINE_TUNE_VARIANTS:
        for m in methods:
            name = m.get("label") or m["method"]
            label = name if variant["name"] == "full" else f"{name}+{variant['name']}"
            entries.append({"method": m["method"], "precision": precision, "config": dict(variant["config"]),
                            "options": dict(m.get("options") or {}), **({"label": label} if label != m["method"] else {})})  # fmt: skip
    return entries


FT_QUICK_PRETRAIN: dict[str, Any] = {
    "model": "gpt-tiny",
    "data": "text",
    "seq_len": 128,
    "batch_size": 8,
    "max_steps": 200,
    "optimizer": "adamw",
    "lr": 2e-3,
    "eval_samples": 64,
    "measure_flops": False,
}
"""The pretraining run of ft-quick: gpt-tiny, 200 steps of 8 windows of 128 bytes of the standard library's
source (AdamW): a model that has learnt bytes and code before it is fine-tuned."""


def preset_ft_quick(world_size: int | None = None) -> dict[str, Any]:
    """Fine-tuning on a CPU: gpt-tiny first trained on text (the sweep's pretrain run), then fine-tuned on the
    shipped instruction set fully, with LoRA, with LoRA + 8-bit AdamW and with QLoRA under single, ddp, fsdp and
    ZeRO-3 (a method that cannot take a variant is a skipped cell with its one-line reason)."""
    world = world_size or 2
    methods = [{"method": "single"}, {"method": "ddp"}, {"method": "fsdp"},
               {"method": "deepspeed", "label": "deepspeed-z3",
                "options": {"zero_stage": 3, "reduce_bucket_size": SMALL_DS_BUCKET}}]  # fmt: skip
    return {
        "name": "ft-quick",
        "description": "gpt-tiny (1.87M parameters) trained 200 steps on byte-level text of the Python standard "
        "library (the sweep's pretrain run, once: OUTPUT/pretrain), then fine-tuned from it on instruct-stdlib "
        "(400 question/answer pairs from the standard library's docstrings, the loss on the answers), sequence "
        "256, global batch 8, 20 steps in fp32: full fine-tuning (AdamW), LoRA r8 (AdamW), LoRA r8 with 8-bit AdamW "
        f"and QLoRA (LoRA r8 over a 4-bit NF4 base) under single, ddp, fsdp and DeepSpeed ZeRO-3 on {world} "
        "processes",
        "base": {
            "model": "gpt-tiny",
            "data": "instruct-stdlib",
            "seq_len": 256,
            "batch_size": 8,
            "max_steps": 20,
            "optimizer": "adamw",
            "lr": 1e-3,
            "measure_flops": False,
            "timing_warmup_steps": 3,
        },
        "pretrain": dict(FT_QUICK_PRETRAIN),
        "world_size": world,
        "timeout_s": 300,
        "cells": fine_tune_cells(methods, "fp32"),
    }


GPU_LARGE_BASE: dict[str, Any] = {
    "data": "synthetic-tokens",
    "seq_len": 2048,
    "max_steps": 20,
    "optimizer": "adamw",
    "activation_checkpointing": True,
    "eval_samples": 8,
    "timing_warmup_steps": 5,
}
"""What the GPU presets of an 8B-30B model share (llm-ft, llm-moe): synthetic tokens at sequence 2048, 20 steps of
AdamW with activation checkpointing, 5 warm-up steps; each adds its model, vocabulary, batch and learning rate."""


def preset_llm_ft() -> dict[str, Any]:
    """Fine-tuning Llama-3-8B's shapes at sequence 2048 on the GPUs here: full fine-tuning with FSDP and ZeRO-3,
    LoRA under single, ddp and fsdp, bf16-mixed, activation checkpointing, each within the device's memory."""
    world = max(1, _gpu_count())
    full = [{"method": "fsdp"}, {"method": "deepspeed", "label": "deepspeed-z3", "options": {"zero_stage": 3}}]
    lora = [{"method": "single"}, {"method": "ddp"}, {"method": "fsdp"}]
    cells = [entry for entry in fine_tune_cells(lora, "bf16-mixed") if entry["config"]]  # LoRA variants only
    return {
        "name": "llm-ft",
        "description": f"llama-8b (Llama-3-8B's shapes, 8.03B parameters) on synthetic tokens (vocabulary 128256), "
        f"sequence 2048, global batch {world}, 20 steps in bf16-mixed with activation checkpointing: full "
        f"fine-tuning with FSDP and ZeRO-3, LoRA r8, LoRA r8 with 8-bit AdamW and QLoRA under single, ddp and fsdp, on "
        f"{world} GPU(s); a cell whose memory estimate exceeds the device is marked 'does not fit' and not run",
        "base": dict(GPU_LARGE_BASE, model="llama-8b", vocab_size=128256, batch_size=world, lr=2e-5),
        "world_size": world,
        "gpu_only": True,
        "timeout_s": 3600,
        "device_memory": "auto",
        "cells": [*fine_tune_cells(full, "bf16-mixed")[: len(full)], *cells],
    }


def preset_llm_moe() -> dict[str, Any]:
    """Qwen3-30B-A3B's shapes (128 experts, top-8; 30.5B parameters, 3.3B active) at sequence 2048 on the GPUs here,
    bf16-mixed with activation checkpointing: fsdp, fsdp with expert parallelism over every GPU and DeepSpeed-MoE at
    ZeRO-1/2 over every GPU, each within the device's memory (built for a node of 8 80 GB GPUs: one GPU holds none)."""
    world = max(1, _gpu_count())
    experts = SIZES["qwen3-30b-a3b"].n_experts
    ep = world if world > 1 and experts % world == 0 else 1
    tag = f"-ep{ep}" if ep > 1 else ""
    ds = [{"zero_stage": s, "ep": ep} for s in (1, 2)]
    return {
        "name": "llm-moe",
        "description": f"qwen3-30b-a3b (Qwen3-30B-A3B's shapes: {experts} experts, top-8, 30.5B parameters, 3.3B "
        f"active) on synthetic tokens (vocabulary 151936), sequence 2048, global batch {world}, 20 steps of AdamW in "
        f"bf16-mixed with activation checkpointing: fsdp{f', fsdp --ep {ep}' if ep > 1 else ''} and DeepSpeed-MoE"
        f"{f' --ep {ep}' if ep > 1 else ''} at ZeRO-1/2 on "
        f"{world} GPU(s); a cell whose memory estimate exceeds the device is marked 'does not fit' and not run",
        "base": dict(GPU_LARGE_BASE, model="qwen3-30b-a3b", vocab_size=151936, batch_size=world, lr=3e-4),
        "world_size": world,
        "gpu_only": True,
        "timeout_s": 3600,
        "device_memory": "auto",
        "cells": [
            {"method": "fsdp", "precision": "bf16-mixed"},
            *([{"method": "fsdp", "precision": "bf16-mixed", "options": {"ep": ep}, "label": f"fsdp{tag}"}]
              if ep > 1 else []),  # fmt: skip
            {"method": "deepspeed", "precision": "bf16-mixed", "options": ds, "label": f"deepspeed-moe{tag}-z{{zero_stage}}"},
        ],
    }


LLM_LONG_BASE: dict[str, Any] = {
    "model": "gpt-tiny-long",
    "data": "text",
    "max_steps": 3,
    "optimizer": "adamw",
    "lr": 1e-3,
    "eval_samples": 2,
    "timing_warmup_steps": 1,
    "measure_flops": False,
}
"""gpt-tiny's widths with a 4096-token context, 3 steps of AdamW (--measure-alloc samples step 2)."""

LLM_LONG_SEQS = (4096, 1024)
"""The sequences of llm-long: the long one first (its rows keep the methods' names, single's is the baseline),
then a short one (each row's label ends in -1k)."""


def preset_llm_long() -> dict[str, Any]:
    """Long sequences on a CPU: gpt-tiny-long at 4096 and 1024 tokens under single, fsdp, fsdp with selective
    and with full activation checkpointing, and fsdp --cp 2 (one sequence over the 2 ranks), one sequence per
    data-parallel rank, so that each row's memory is one rank's for one sequence (cp's: half of one)."""
    sac = {"activation_checkpointing": True, "ac_mode": "selective"}
    rows = [("single", 1, {}, {}, "single"), ("fsdp", 2, {}, {}, "fsdp"),
            ("fsdp", 2, {}, sac, "fsdp+sac"), ("fsdp", 2, {}, {"activation_checkpointing": True}, "fsdp+ac"),
            ("fsdp", 1, {"cp": 2}, {}, "fsdp-cp2")]  # fmt: skip
    cells = []
    for seq in LLM_LONG_SEQS:
        suffix = "" if seq == LLM_LONG_SEQS[0] else f"-{seq // 1024}k"
        for method, batch, options, config, name in rows:
            label = name + suffix
            entry = {"method": method, "precision": "fp32", "batch_size": batch, "options": options,
                     "config": {"seq_len": seq, **config}}  # fmt: skip
            cells.append(entry | ({"label": label} if label != method else {}))
    return {
        "name": "llm-long",
        "description": "gpt-tiny-long (gpt-tiny's 1.87M parameters, a 4096-token context) on byte-level text of "
        "the Python standard library at sequence 4096 and 1024 (-1k rows), 3 steps of AdamW in fp32, one sequence "
        "per data-parallel rank: single (1 process), fsdp, fsdp with selective (+sac) and full (+ac) activation "
        "checkpointing on 2 processes (global batch 2), and fsdp --cp 2 (Ulysses: 1 sequence split over the 2 "
        "processes, global batch 1); each row's memory is one rank's",
        "base": dict(LLM_LONG_BASE),
        "world_size": 2,
        "timeout_s": 600,
        "cells": cells,
    }


def preset_moe_quick(world_size: int | None = None) -> dict[str, Any]:
    """The mixture of experts on a CPU: gpt-moe-tiny (its experts, top-k, dropless) under single, ddp, fsdp, and
    expert parallelism over every rank (each rank holds experts / world whole experts, tokens sent to them by
    all-to-all) by fsdp and by DeepSpeed-MoE at ZeRO-2; the report adds active / total parameters and the load."""
    world = world_size or 2
    moe = SIZES["gpt-moe-tiny"]
    return {
        "name": "moe-quick",
        "description": f"gpt-moe-tiny ({moe.n_experts} experts, top-{moe.moe_top_k}, dropless) on byte-level text "
        "of the Python standard library, sequence 128, global batch 16, 40 steps of AdamW, fp32; the methods that "
        f"train a mixture of experts with {world} processes, and expert parallelism by fsdp and DeepSpeed-MoE",
        "base": dict(LLM_QUICK_BASE, model="gpt-moe-tiny"),
        "world_size": world,
        "timeout_s": 300,
        "cells": [
            {"method": ["single", "ddp", "fsdp"], "precision": "fp32"},
            {"method": "fsdp", "precision": "fp32", "options": {"ep": world}, "label": f"fsdp-ep{world}"},
            # DeepSpeed-MoE: DeepSpeed's own expert layer (its gate, dropless; padded all-to-all buffers) at ZeRO-2
            {
                "method": "deepspeed",
                "precision": "fp32",
                "options": {"zero_stage": 2, "ep": world, "reduce_bucket_size": SMALL_DS_BUCKET},
                "label": f"deepspeed-moe-ep{world}",
            },
        ],
    }


PRESETS = {
    "quick": preset_quick,
    "seed": preset_seed,
    "gpu-precision": preset_gpu_precision,
    "gpu-fast": preset_gpu_fast,
    "llm-quick": preset_llm_quick,
    "llm-fit": preset_llm_fit,
    "llm-tp": preset_llm_tp,
    "llm-nodes": preset_llm_nodes,
    "llm": preset_llm,
    "ft-quick": preset_ft_quick,
    "llm-ft": preset_llm_ft,
    "llm-long": preset_llm_long,
    "moe-quick": preset_moe_quick,
    "llm-moe": preset_llm_moe,
}
PRESET_HELP = {
    "quick": "default; every CPU method, tinynet on digits, minutes on 2 cores",
    "seed": "the source experiment, ResNet-50 on CIFAR-10, GPUs",
    "gpu-precision": "every precision on one GPU",
    "gpu-fast": "seed with the fast recipe",
    "llm-quick": "every CPU method on gpt-tiny and real text, minutes",
    "llm-fit": "where each method stops fitting a memory budget, CPU",
    "llm-tp": "tensor parallelism against data parallelism on 2 and 4 CPU processes",
    "llm-nodes": "HSDP and ZeRO++ against DDP and FSDP over 2 loopback nodes of 2 processes",
    "llm": "a 1B Llama at sequence 2048 on the GPUs here",
    "ft-quick": "fine-tuning on CPU: full, LoRA, LoRA + 8-bit AdamW",
    "llm-ft": "Llama-3-8B fine-tuning on GPUs: full, LoRA, QLoRA",
    "llm-long": "long sequences on CPU: activation checkpointing and context parallelism at 1k and 4k tokens",
    "moe-quick": "mixture of experts on CPU: single, ddp, fsdp, expert parallelism by fsdp and DeepSpeed-MoE",
    "llm-moe": "Qwen3-30B-A3B's shapes on the GPUs here: fsdp, fsdp --ep, DeepSpeed-MoE (a node of 8 GPUs)",
}
"""One line per preset for ``compare --help`` (every preset listed; a test keeps the two in step)."""
WORLD_PRESETS = ("quick", "seed", "gpu-fast", "llm-quick", "llm-fit", "ft-quick", "moe-quick")
"""Presets built for the world size (``--world-size``; seed and gpu-fast default to the GPUs here)."""


# ------------------------------------------------------------------------------------------------
# building


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _default_world(method: str, default: int) -> int:
    """Multi-process methods get the matrix's world size; one-process methods one process."""

    cls = all_strategies().get(method)
    if cls is None:  # not installed: assume it is one of the distributed methods (they are the optional ones)
        return default
    return default if cls.needs_process_group else 1


CELL_DEFAULTS: dict[str, Any] = {"breakdown": True, "comm_volume": True, "measure_alloc": True}
"""What every compare cell measures unless its matrix says otherwise: the step's phases, the collectives of
step 3 against the method's formula, and (CPU) the allocator's bytes against the memory estimate. The last two
record a warm-up step only (3 warm-up steps by default), so they cost the measured steps nothing."""


def build_matrix(
    spec: dict[str, Any], overrides: dict[str, Any] | None = None, world_size: int | None = None,
    nodes: int | None = None, precision: str | None = None, pretrain_steps: int | None = None,
    method_options: dict[str, dict[str, Any]] | None = None,
) -> Matrix:
    """Expand a matrix mapping into cells; ``overrides`` (train options from the command line) replace base values;
    ``nodes`` (``--nodes``): the nodes of every multi-process cell whose entry gives none; ``precision``
    (``--precision``): every cell's precision (cells that then coincide run once); ``pretrain_steps``
    (``--pretrain-steps``): the steps of the matrix's pretraining run; ``method_options``
    (``--method-option``): strategy options added to every cell of their method."""
    if precision is not None:
        precision = canonical_precision(precision)
        spec_of(precision)
    base = _matrix_base(spec, overrides)
    default_world = int(world_size or spec.get("world_size") or 2)
    entries = spec.get("cells")
    if entries is None:
        entries = [{"method": spec.get("methods", ["single"]), "precision": spec.get("precisions", ["fp32"]),
                    **({"world_size": spec["world_sizes"]} if "world_sizes" in spec else {}),
                    **({"batch_size": spec["batch_sizes"]} if "batch_sizes" in spec else {})}]  # fmt: skip
    if not isinstance(entries, list) or not entries:
        raise ConfigError("matrix: 'cells' must be a non-empty list of entries (method, precision, ...)")
    pretrain = _pretrain_of(spec.get("pretrain"), pretrain_steps)
    start = hashlib.sha1(json.dumps(pretrain, sort_keys=True, default=str).encode()).hexdigest()[:8] if pretrain else ""
    cells: list[Cell] = []
    seen: set[str] = set()
    for n, entry in enumerate(entries):
        for cell in _expand_entry(n + 1, entry, base, overrides, default_world, nodes, precision, method_options):
            cell = dataclasses.replace(cell, start=start)
            if cell.id not in seen:  # overrides can make two entries the same run: keep one
                seen.add(cell.id)
                cells.append(cell)
    return Matrix(
        name=str(spec.get("name") or "matrix"),
        description=str(spec.get("description") or ""),
        cells=cells,
        base=base,
        gpu_only=bool(spec.get("gpu_only", False)),
        timeout_s=float(spec.get("timeout_s") or 900),
        device_memory=bytes_of(spec.get("device_memory")),
        pretrain=pretrain,
        title=str(spec.get("title") or ""),
    )


PRETRAIN = "pretrain"
"""The folder of a sweep's pretraining run, in its output folder."""
PRETRAIN_OWNED = ("output", "strategy", "nproc", "nnodes", "strategy_options", "resume", "resume_from",
                  "init_from", "progress")  # fmt: skip
"""What the sweep sets on its pretraining run itself (one process of ``single`` into ``OUTPUT/pretrain``)."""


def _pretrain_of(value: Any, steps: int | None = None) -> dict[str, Any] | None:
    """The matrix's ``pretrain`` mapping, checked as TrainConfig options (one line naming a bad key), with
    ``steps`` (``--pretrain-steps``) as its ``max_steps`` where given."""
    if value is None:
        if steps is not None:
            raise ConfigError("--pretrain-steps: this matrix has no pretraining run (its 'pretrain' entry)")
        return None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"matrix: 'pretrain' must be a mapping of training options, got {value!r}")
    owned = sorted(set(value) & set(PRETRAIN_OWNED))
    if owned:
        raise ConfigError(f"matrix pretrain: {', '.join(map(repr, owned))} is set by compare (one `single` process "
                          "into OUTPUT/pretrain); leave it out")  # fmt: skip
    value = {**value, **({"max_steps": steps} if steps is not None else {})}
    from_dict(TrainConfig, value, where="matrix pretrain")
    return value


def pretrain_config(matrix: Matrix, out: Path) -> dict[str, Any]:
    """The YAML mapping of the sweep's pretraining run (``matrix.pretrain`` into ``out/pretrain``)."""
    return {**(matrix.pretrain or {}), "strategy": "single", "output": str(Path(out) / PRETRAIN), "progress": False}


def pretrained_checkpoint(out: Path) -> Path:
    """The checkpoint the cells of a sweep with a ``pretrain`` run start from: its last one."""
    return last_checkpoint(Path(out) / PRETRAIN)


def bytes_of(value: Any) -> int | None:
    """A device memory budget: bytes, a size such as ``24GiB``, or ``auto``: the memory of this machine's GPU
    (no budget without one). Anything else: one line naming it."""
    if value is None:
        return None
    if str(value).strip().lower() == "auto":
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return parse_bytes(str(value))


MATRIX_KEYS = ("name", "title", "description", "base", "world_size", "gpu_only", "timeout_s", "device_memory", "cells",
               "methods", "precisions", "world_sizes", "batch_sizes", "pretrain")  # fmt: skip


def _matrix_base(spec: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The options every cell shares (the cell defaults, the matrix's base, the command line's overrides),
    checked: a matrix with unknown keys, or a base that sets what compare sets per cell, is refused."""
    if not isinstance(spec, dict):
        raise ConfigError(f"a comparison matrix must be a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(MATRIX_KEYS))
    if unknown:
        raise ConfigError(
            f"matrix: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(MATRIX_KEYS))}"
        )
    base = CELL_DEFAULTS | dict(spec.get("base") or {})
    base.update(overrides or {})
    for key in SWEEP_OWNED:
        if key in base:
            raise ConfigError(
                f"matrix base: {key!r} is set per cell by compare; give it in a cell entry instead"
            )
    from_dict(TrainConfig, base, where="matrix base")  # unknown keys / bad types fail here, naming the key
    return base


def _expand_entry(
    n: int, entry: Any, base: dict[str, Any], overrides: dict[str, Any] | None, default_world: int,
    default_nodes: int | None = None, every_precision: str | None = None,
    method_options: dict[str, dict[str, Any]] | None = None,
) -> list[Cell]:
    """The cells of cell entry ``n`` (from 1): the product of its list values (``every_precision``:
    the precision of each, whatever the entry says; ``method_options``: added to each cell of their method)."""
    if not isinstance(entry, dict) or "method" not in entry:
        raise ConfigError(f"matrix cell entry {n} must be a mapping with at least 'method', got {entry!r}")
    bad = sorted(set(entry) - set(ENTRY_KEYS))
    if bad:
        raise ConfigError(
            f"matrix cell entry {n}: unknown key(s) {', '.join(bad)}; known: {', '.join(ENTRY_KEYS)}"
        )
    extra = dict(entry.get("config") or {})
    for key in SWEEP_OWNED:
        if key in extra:
            raise ConfigError(f"matrix cell entry {n}: 'config' cannot set {key!r}; use the entry's own keys")
    cells = []
    for method, precision, world, batch, options in itertools.product(
        _as_list(entry["method"]),
        [every_precision] if every_precision else _as_list(entry.get("precision", "fp32")),
        _as_list(entry.get("world_size")),
        _as_list(entry.get("batch_size")),
        _as_list(entry.get("options") or {}),
    ):
        config = {**base, **extra}
        # Command-line overrides win over cell entries too: the user asked for them for every cell.
        config.update(overrides or {})
        if batch is not None and not (overrides and "batch_size" in overrides):
            config["batch_size"] = int(batch)
        label = str(entry.get("label") or "")
        if label:
            try:
                label = label.format(**options)
            except (KeyError, IndexError):
                raise ConfigError(
                    f"matrix cell entry {n}: label {label!r} names an option not in {options}"
                ) from None
        options = {**options, **(method_options or {}).get(str(method), {})}
        world = int(world) if world is not None else _default_world(str(method), default_world)
        nodes = _nodes_of(n, entry.get("nodes"), default_nodes, world)
        cells.append(
            Cell(str(method), canonical_precision(str(precision)), world, config, dict(options), label, nodes)
        )
    return cells


def _nodes_of(n: int, given: Any, default: int | None, world: int) -> int:
    """Nodes of a cell of ``world`` processes: the entry's ``nodes``, else ``--nodes`` for a cell of several
    processes (a one-process cell runs on one node); they must divide the processes evenly."""
    if given is None:
        if not default or world == 1:
            return 1
        nodes, where = default, "--nodes"
    else:
        nodes, where = given, f"matrix cell entry {n}: nodes"
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or world % nodes:
        raise ConfigError(f"{where} {nodes!r} must be a whole number of nodes that divides the cell's {world} "
                          f"processes (1{''.join(f', {d}' for d in range(2, world + 1) if world % d == 0)})")  # fmt: skip
    return nodes


def load_matrix(preset: str | None, path: str | None, overrides: dict[str, Any] | None = None,
                world_size: int | None = None, nodes: int | None = None, precision: str | None = None,
                pretrain_steps: int | None = None, methods: list[str] | None = None,
                precisions: list[str] | None = None,
                method_options: dict[str, dict[str, Any]] | None = None) -> Matrix:  # fmt: skip
    """A preset by name, a YAML matrix file, or ``methods`` (``compare --methods``: no preset; exactly one of
    them). ``method_options``: strategy options for every cell of a method (``--method-option``)."""
    if methods:
        spec = methods_spec(methods, [precision] if precision else precisions, overrides)
        matrix = build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
        matrix.description = f"{describe_base(matrix.base)}; {spec['description']}"
        return matrix
    if precisions:
        raise ConfigError("--precisions lists the precisions of --methods; with a preset or a matrix use "
                          "--precision (every cell) or --only")  # fmt: skip
    if path:
        spec = load_yaml(path)
        try:
            return build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
        except ConfigError as exc:
            raise ConfigError(f"{path}{_line_of(Path(path), str(exc))}: {exc}") from None
    else:
        name = preset or "quick"
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; choose one of: "
                              f"{', '.join(PRESETS)} (or --matrix FILE.yaml, or --methods a,b,c)")  # fmt: skip
        if name == "seed":
            spec = preset_seed(world_size, bool((overrides or {}).get("download")))
        elif name in WORLD_PRESETS:
            spec = PRESETS[name](world_size)
        else:
            spec = PRESETS[name]()
    matrix = build_matrix(spec, overrides, world_size, nodes, precision, pretrain_steps, method_options)
    return _titled(matrix, spec, name, overrides)


def _line_of(path: Path, message: str) -> str:
    """" line N" of the YAML matrix file ``path`` where ``message`` points: the cell entry it numbers, else the
    first key it quotes ('' where neither is found)."""
    try:
        root = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return ""
    keys: dict[str, int] = {}
    entries: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                keys.setdefault(str(key.value), key.start_mark.line + 1)
                if key.value == "cells" and isinstance(value, yaml.SequenceNode):
                    entries.extend(item.start_mark.line + 1 for item in value.value)
                walk(value)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item)

    walk(root)
    entry = re.search(r"cell entry (\d+)", message)
    if entry and 0 < int(entry.group(1)) <= len(entries):
        return f" line {entries[int(entry.group(1)) - 1]}"
    found = [keys[q] for q in re.findall(r"'([^']+)'", message) if q in keys]
    return f" line {found[0]}" if found else ""


QUICK_KNOBS = ("epochs", "batch_size", "measure_flops", "timing_warmup_steps")
"""The quick preset's training settings a ``--methods`` sweep starts from (its model and data are the user's)."""


def check_methods(methods: list[str]) -> list[str]:
    """The method names, each known (one line with "did you mean" otherwise), in order, once each."""
    known = all_strategies()
    if not methods:
        raise ConfigError(f"--methods needs at least one method; choose from: {', '.join(sorted(known))}")
    for m in methods:
        if m not in known:
            raise ConfigError(f"unknown method {m!r}{did_you_mean(m, known)}; choose from: {', '.join(sorted(known))}")
    return list(dict.fromkeys(methods))


def methods_spec(methods: list[str], precisions: list[str] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The matrix of ``compare --methods a,b,c [--precisions p,q]``: each method at each precision, on the
    model and data the command line gives (the quick preset's tinynet on digits where it gives none), with the
    quick preset's epochs, batch and warm-up."""
    methods = check_methods(methods)
    precisions = [canonical_precision(p) for p in (precisions or ["fp32"])]
    for p in precisions:
        spec_of(p)
    quick = preset_quick()["base"]
    given = overrides or {}
    base = {k: quick[k] for k in QUICK_KNOBS}
    if "model" not in given:
        base.update(model=quick["model"], width=quick["width"])
    if "data" not in given:
        base.update(data=quick["data"], image_size=quick["image_size"])
    model = str(given.get("model", base.get("model")))
    named = f"{model} on {given['data']}" if "data" in given else model  # two data sets: two default folders
    return {
        "name": slug(named) or "methods",
        "title": model,
        "description": f"{', '.join(methods)} at {', '.join(precisions)}",
        "base": base,
        "timeout_s": 600,
        "cells": [{"method": m, "precision": precisions} for m in methods],
    }


def describe_base(base: dict[str, Any]) -> str:
    """What every cell trains, in words: "mynet:build on mydata:build, 2 epochs, global batch 64"."""
    steps = base.get("max_steps")
    epochs = int(base.get("epochs", TrainConfig.epochs))
    length = f"{steps} steps" if steps else f"{epochs} epoch{'s' if epochs != 1 else ''}"
    model, data = base.get("model", TrainConfig.model), base.get("data", TrainConfig.data)
    return f"{model} on {data}, {length}, global batch {base.get('batch_size', TrainConfig.batch_size)}"


def _titled(matrix: Matrix, spec: dict[str, Any], preset: str | None, overrides: dict[str, Any] | None) -> Matrix:
    """The report's title and Setup line as the cells run: a preset whose model or data the command line
    replaced says so instead of describing its own."""
    given = overrides or {}
    base = spec.get("base") or {}
    if preset and any(k in given and given[k] != base.get(k) for k in ("model", "data")):
        matrix.title = f"{preset} on {matrix.base.get('model', TrainConfig.model)}"
        matrix.description = f"{describe_base(matrix.base)}; the {preset} preset's cells"
    return matrix


METHOD_OPTION = re.compile(r"^([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)=(.*)$")


def parse_method_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--method-option METHOD.KEY=VALUE`` (repeatable) as {method: {key: value}} (VALUE read as YAML), each
    checked as ``check_method_option`` checks it."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        found = METHOD_OPTION.match(item.strip())
        if not found:
            raise ConfigError(f"--method-option {item!r} is not METHOD.KEY=VALUE (e.g. fsdp.wrap=size)")
        method, key, raw = found.group(1), found.group(2).replace("-", "_"), found.group(3)
        value = yaml.safe_load(raw) if raw.strip() else raw
        check_method_option(method, key, value, f"--method-option {item!r}")
        out.setdefault(method, {})[key] = value
    return out


def check_method_option(method: str, key: str, value: Any, where: str) -> None:
    """One of a method's options, against the method's ``Options``: an unknown method or key, or a bad value,
    is one line naming ``where``, with "did you mean"."""
    known = all_strategies()
    if method not in known:
        raise ConfigError(f"{where}: unknown method {method!r}{did_you_mean(method, known)}")
    fields = [f.name for f in dataclasses.fields(known[method].Options)]
    if key not in fields:
        raise ConfigError(f"{where}: {method} has no option {key!r}{did_you_mean(key, fields)}; its options: "
                          f"{', '.join(fields)}")  # fmt: skip
    from_dict(known[method].Options, {key: value}, where=where)


# ------------------------------------------------------------------------------------------------
# filters


def _matches(cell: Cell, token: str) -> bool:
    token = token.strip()
    names = (cell.method, cell.name, cell.precision, cell.id, f"w{cell.world_size}")
    return any(token == n or fnmatch.fnmatchcase(n, token) for n in names)


def select(cells: list[Cell], only: list[str] | None, skip: list[str] | None) -> list[Cell]:
    """``only``: each flag is a comma list; a cell must match one name of every flag. ``skip``: drop any match.

    A name matches a cell's method (ddp), label (deepspeed-z2), precision (bf16-mixed), id, or ``wN``
    (world size); shell wildcards work (``deepspeed*``)."""
    groups = [[t for t in g.split(",") if t.strip()] for g in (only or [])]
    dropped = [t for g in (skip or []) for t in g.split(",") if t.strip()]
    out = [c for c in cells if all(any(_matches(c, t) for t in g) for g in groups)]
    out = [c for c in out if not any(_matches(c, t) for t in dropped)]
    if not out:
        raise ConfigError(
            f"--only/--skip left no cells; cells are: {', '.join(sorted({c.name for c in cells}))} "
            f"x {', '.join(sorted({c.precision for c in cells}))}"
        )
    return out


# ------------------------------------------------------------------------------------------------
# what can run here


@dataclass(frozen=True)
class Plan:
    """What the sweep will do with a cell before running it: run it, or record it as skipped/failed with a reason."""

    cell: Cell
    status: str | None
    """None: run it; 'skipped': cannot run on this machine; 'failed': its configuration is invalid."""
    reason: str = ""


def plan_cell(cell: Cell, matrix: Matrix, allow_slow: bool = False) -> Plan:
    """Decide, without starting any work, whether ``cell`` can run on this machine (and why not)."""

    cls = all_strategies().get(cell.method)
    if cls is None:
        return Plan(cell, "skipped", f"strategy {cell.method} is not available in this install")
    try:
        cfg = from_dict(TrainConfig, cell.train_config("unused"), where=f"cell {cell.id}")
        try:
            device = resolve_device(cfg.device)
        except UnsupportedError as exc:
            return Plan(cell, "skipped", str(exc))
        if matrix.gpu_only and device.type != "cuda" and not allow_slow:
            return Plan(cell, "skipped", f"preset {matrix.name!r} measures GPUs and this machine has none "
                        "(--allow-slow runs it on the CPU anyway)")  # fmt: skip
        spec = SPECS.get(cell.precision)
        slow = slow_on(spec, device) if spec is not None else None
        if slow and not allow_slow:
            return Plan(cell, "skipped", f"{slow} (--allow-slow runs it anyway)")
        gpus = _gpu_count()
        if device.type == "cuda" and cls.needs_process_group and cell.procs_per_node > gpus:
            return Plan(
                cell, "skipped", f"needs {cell.procs_per_node} GPUs (one per process); this machine has {gpus}"
            )
        engine.preflight(cfg, world_size=cell.world_size)
        check_one_batch(cfg)
        configure_tf32(cfg.tf32, device)  # --tf32 needs an Ampere GPU; only flips flags in this idle process
        if matrix.device_memory is not None:
            unfit = does_not_fit(cfg, cell.world_size, device.type, matrix.device_memory)
            if unfit:
                return Plan(cell, "skipped", unfit)
    except UnsupportedError as exc:
        return Plan(cell, "skipped", str(exc))
    except ConfigError as exc:
        return Plan(cell, "failed", f"invalid cell configuration: {exc}")
    except StratbenchError as exc:  # missing data set, unreadable weights file, ...
        return Plan(cell, "failed", str(exc))
    return Plan(cell, None)


def does_not_fit(cfg: TrainConfig, world_size: int, device_type: str, device_memory: int) -> str | None:
    """'does not fit (estimate X of Y)' when the memory estimate's device total for the busiest rank exceeds
    ``device_memory``; None when it fits, or when the estimate cannot be made (the run then shows what happens)."""
    try:
        total = estimate(cfg, world_size, device_type).total_bytes
    except Exception:  # noqa: BLE001 - a model the estimate cannot trace still runs; its row shows what happened
        return None
    if total <= device_memory:
        return None
    return f"does not fit (estimate {fmt_bytes(total)} of {fmt_bytes(device_memory)} per device)"


def plan(matrix: Matrix, cells: list[Cell] | None = None, allow_slow: bool = False) -> list[Plan]:
    return [plan_cell(c, matrix, allow_slow) for c in (matrix.cells if cells is None else cells)]


def check_runnable(plans: list[Plan]) -> None:
    """A sweep in which no cell would run and some cell's configuration is refused (``--lr nan``, an unknown
    model, a missing token file) is bad input: one line naming the first such cell, before anything is written
    (a rerun into a finished sweep leaves it as it was), not a sweep of failed rows."""
    if any(p.status is None for p in plans):
        return
    refused = next((p for p in plans if p.status == "failed"), None)
    if refused is not None:
        raise ConfigError(f"no cell can run: {refused.cell.name} {refused.cell.precision}: {refused.reason}")
