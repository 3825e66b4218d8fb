"""The built-in compare presets: each a matrix (``matrix``'s shape: base, world size, cells) of the methods one
question compares - every CPU method on a small model (quick, llm-quick), the source experiment and its GPU
variants (seed, gpu-precision, gpu-fast), large language models on the GPUs here (llm, llm-ft, llm-moe), fine-tuning
(ft-quick), long sequences (llm-long), nodes (llm-nodes), tensor parallelism (llm-tp), memory budgets (llm-fit) and
mixtures of experts (moe-quick). ``PRESETS`` names them, ``PRESET_HELP`` says each in one line."""

from __future__ import annotations

from typing import Any

from stratbench.models.transformer import SIZES
from stratbench.models.zoo import pretrained_available
from stratbench.strategies.parallel.pipeline_parallel import pipeline_layout


def gpu_count() -> int:
    """The CUDA devices this machine has (0 without CUDA): what the GPU presets spread over."""
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

    world = world_size or max(2, gpu_count())
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
    world = world_size or max(1, gpu_count())
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
    world = max(1, gpu_count())
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
    world = max(1, gpu_count())
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
    world = max(1, gpu_count())
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
