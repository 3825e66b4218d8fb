"""Run configuration: one dataclass with a docstring per field, loadable from YAML, overridable from the CLI.

Strategy-specific options live in each strategy's own ``Options`` dataclass (see ``strategies/base.py``);
the run config carries them as a plain ``strategy_options`` mapping that the strategy validates.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from stratbench.core.errors import ConfigError, did_you_mean
from stratbench.core.files import atomic_write
from stratbench.models.hf import canonical_name, check_vocab, default_seq_len, is_hf_name
from stratbench.models.hf_llama import canonical_init, check_init, folder_vocab, is_hf_init
from stratbench.models.zoo import is_weights_name, moe_overrides, resolve_weights


def field_docs(cls: type) -> dict[str, str]:
    """Return the attribute docstrings (a string literal right after a field) of a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs. ``--batch-size`` is the global batch across all devices."""

    # --- what to train -------------------------------------------------------------------------
    model: str = "tinynet"
    """Model: tinynet (small BatchNorm-free CNN), resnet18, resnet34, resnet50, or a builder
    'package.module:function' (called with num_classes=N), found from the working directory; text data: gpt-tiny,
    gpt-tiny-long (a 4096-token context), gpt2-small, llama-1b, llama-8b, llama-8b-long (a 262,144-token context), the mixtures
    of experts gpt-moe-tiny, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-style (docs/usage.md), or a Hugging Face causal LM
    'hf:FOLDER' (a config.json, optionally safetensors weights) or 'hf:OWNER/NAME' from the Hugging Face cache (the
    hf extra)."""
    weights: str | None = None
    """Pretrained weights loaded before training: a local state-dict file, or torchvision's by name ('imagenet' =
    the model's DEFAULT, or an enum name such as IMAGENET1K_V2) from the torch hub cache ($TORCH_HOME/hub/
    checkpoints; downloaded there only with --download). Tensors that do not fit (the 1000-class head) are
    skipped."""
    cifar_stem: bool = False
    """ResNet only: 3x3 stride-1 first convolution and no max-pool (for 32x32 inputs)."""
    norm: str = "group"
    """tinynet only: normalisation layer, 'group' (GroupNorm) or 'none'."""
    width: int = 16
    """tinynet only: channels of the first stage (doubles per stage)."""
    moe_top_k: int | None = None
    """Mixtures of experts only (gpt-moe-tiny, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-style): the experts each token
    is routed to, from 1 to the model's experts; default: the model's own (gpt-moe-tiny: 2 of 4)."""
    capacity_factor: float | None = None
    """Mixtures of experts only: each expert takes at most ceil(C x tokens x top-k / experts) of a micro-batch's
    assignments, the rest are dropped (result.json's moe counts them); default: dropless (every token reaches its
    experts)."""
    data: str = "digits"
    """Data set. Images: synthetic (random), digits (scikit-learn's 8x8 digits at 32x32), cifar10, imagefolder (class
    subfolders of --data-dir). Text for a language model: text (the .txt/.md/.py files of --data-dir, default the
    Python standard library's sources), tokens:PATH (nanoGPT's .bin token files), synthetic-tokens. Fine-tuning
    examples: jsonl:PATH, hf-dataset:PATH_OR_NAME (a Hugging Face data set: a file, a folder or a cached hub
    name), instruct-stdlib (built in). A table: table:FILE (CSV, TSV, parquet or JSON lines; --target names the
    column to predict, the other columns are numeric features). Or a builder 'package.module:function' returning
    (train, val, class_names), found from the working directory."""
    target: str | None = None
    """table:FILE data: the column to predict (its distinct values are the classes)."""
    data_dir: str | None = None
    """Folder of the data set (cifar10: holds cifar-10-batches-py; imagefolder: class subfolders)."""
    download: bool = False
    """Download what is missing (needs internet): cifar10 into --data-dir, --weights by name into the torch hub
    cache, an hf:OWNER/NAME model into the Hugging Face cache (without it, Hugging Face models are read offline)."""
    image_size: int | None = None
    """Input resolution; default 32 for synthetic/digits/cifar10, 224 for imagefolder."""
    num_classes: int = 10
    """synthetic only: number of classes (other data sets define their own)."""
    synthetic_samples: int = 2048
    """synthetic only: number of training samples (validation gets a quarter of that)."""
    val_fraction: float = 0.2
    """digits/imagefolder without a val folder, text data: fraction held out for validation (fixed split; of text,
    the stream's last part)."""
    seq_len: int = 256
    """Text data (text, tokens:PATH, synthetic-tokens): tokens per sample; each sample's targets are the same
    tokens shifted by one. Not given, a Hugging Face model with fewer positions (max_position_embeddings) gets
    as many."""
    tokenizer: str | None = None
    """Text data: a Hugging Face tokenizer.json to encode the text with (default: UTF-8 bytes, vocabulary 256)."""
    vocab_size: int | None = None
    """Text data: the model's vocabulary (default: the tokenizer's; of token files, their largest id + 1)."""
    token_dtype: str = "uint16"
    """tokens:PATH: the integer type of the .bin files, uint16 (nanoGPT's) or uint32."""
    data_format: str = "auto"
    """Fine-tuning data (jsonl:PATH, hf-dataset:PATH_OR_NAME, instruct-stdlib): auto (by each record's fields), text
    ('text'), instruction ('instruction'/'input'/'output' or 'prompt'/'response') or chat ('messages')."""
    train_on_prompt: bool = False
    """Fine-tuning data: train on the prompt's tokens too (default: the loss is on the response tokens only)."""
    pack: bool = False
    """Fine-tuning data: pack whole examples into full windows of --seq-len (default: pad each batch to its longest)."""
    eval_samples: int | None = None
    """Evaluate on the first this many validation samples (default: all of an image set, 256 samples of text
    data, as nanoGPT estimates its validation loss on a fixed number of batches)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (loader pipeline only)."""
    data_pipeline: str = "auto"
    """loader (DataLoader, per-image transforms on the host), device (the in-memory data set - synthetic, digits,
    cifar10 - lives on the device and each batch is indexed, cropped, flipped, resized and normalised there in
    one batched call) or auto (device on CUDA when the data set is in memory and fits, else loader)."""
    pin_memory: bool = True
    """Loader pipeline on CUDA: pinned host batches, so the copy to the device is non-blocking."""
    # --- how to train --------------------------------------------------------------------------
    strategy: str = "single"
    """Training method (see `stratbench list`)."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen strategy (e.g. sharding, zero_stage); validated by the strategy."""
    precision: str = "fp32"
    """fp32, fp64, fp16-true, bf16-true, fp16-mixed, bf16-mixed (Lightning's names 32-true, 64-true, 16-mixed,
    bf16-mixed, 16-true, bf16-true are accepted too)."""
    tf32: bool = False
    """Allow TF32 matmuls/convolutions (NVIDIA Ampere or newer)."""
    channels_last: bool = False
    """Use the channels-last memory format for the model and inputs."""
    compile: bool = False
    """Compile the model with torch.compile."""
    cudnn_benchmark: bool = False
    """Let cuDNN time its convolution algorithms on the first batch and keep the fastest (fixed input shapes)."""
    recipe: str | None = None
    """A named bundle of speed settings, each filled in only where not set explicitly, written out in full in the
    resolved config: fast = bf16-mixed (fp16-mixed without bf16), channels-last, device pipeline, fused
    optimizer, cudnn.benchmark, and torch.compile on CUDA only (not measurable on CPU)."""
    activation_checkpointing: bool = False
    """Recompute activations of each residual block in the backward pass (saves memory, costs time)."""
    ac_mode: str = "full"
    """With --activation-checkpointing, what is recomputed: full (every block's activations), selective
    (torchtitan's op policy: every block keeps its attention's output and every other matmul's, recomputes the
    rest), every:N (full recomputation of one block in N: blocks 0, N, 2N, ...), or budget:F with --compile
    (0 < F < 1: the compiler's activation memory budget; its min-cut partitioner keeps at most F of the bytes its
    default would keep and recomputes the rest, across the whole compiled graph)."""
    # --- LoRA adapters (models/transforms/lora.py, the lora extra: peft) ----------------------------
    lora_rank: int = 0
    """LoRA: rank of the low-rank adapters PEFT adds to the targeted Linear layers, the base weights frozen (no
    gradients, no optimizer state); 0 = off (full training)."""
    lora_alpha: float | None = None
    """LoRA: scaling numerator (the update is scaled by alpha / rank); default 2 x rank, so that the scale stays 2
    whatever the rank (torchtune's and most recipes' alpha = 2r)."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input, in [0, 1)."""
    lora_targets: str = "all-linear"
    """LoRA: the Linear layers to adapt, comma-separated module names (a name matches itself or a module path
    ending in .NAME: 'wq,wv'), or all-linear (every nn.Linear but the output head, the model's last Linear)."""
    # --- QLoRA's quantised base (models/transforms/quantize_base.py, the qlora extra: torchao, bitsandbytes) --
    quantize_base: str = "none"
    """QLoRA: none, nf4 (the frozen weights of the Linear layers LoRA adapts stored as torchao's 4-bit
    NormalFloat, dequantised one layer at a time to compute) or int8 (the same layers as bitsandbytes'
    Linear8bitLt: int8 weights with one fp32 scale per output row; single only); needs lora_rank > 0."""
    # --- float8 training (models/transforms/float8.py; torchao: the lean or qlora extra) ------------
    float8: str = "none"
    """none, tensorwise or rowwise: the Linear layers (all but the output head; in- and out-features multiples of
    16) multiply in float8 through torchao, with one scale per tensor (tensorwise) or per row (rowwise); weights,
    gradients and optimizer state stay in the run's precision (fp32, bf16-mixed or bf16-true). GPUs with float8
    units (compute capability 8.9+); on a CPU a correctness run, not a speed one."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    # --- optimisation --------------------------------------------------------------------------
    epochs: int = 3
    """Number of passes over the training set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (the LR schedule still spans all epochs)."""
    batch_size: int = 64
    """Global batch per optimizer step, summed over all devices and accumulation micro-steps."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; the per-device micro-batch is batch_size / (world * grad_accum)."""
    optimizer: str = "sgd"
    """sgd (with momentum), adamw, or a memory-lean one: adamw8bit / adamw4bit (torchao's block-quantised AdamW
    states, the ``lean`` extra) or adafactor (torch's, factored second moments, no first moment)."""
    optimizer_impl: str = "default"
    """Optimizer kernels: default (torch's choice: foreach on CUDA), foreach (one multi-tensor kernel per
    operation), fused (one kernel for the whole update), for-loop (one kernel per parameter)."""
    lr: float = 0.05
    """Peak learning rate (the same for every method, so every method trains the same problem)."""
    momentum: float = 0.9
    """SGD momentum (0 disables it)."""
    weight_decay: float = 5e-4
    """Weight decay (decoupled for AdamW)."""
    lr_schedule: str = "cosine"
    """cosine or constant, after the warm-up."""
    lr_warmup_steps: int = 0
    """Linear LR warm-up from 0 over this many optimizer steps."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value (after unscaling)."""
    loss: str = "cross-entropy"
    """Training loss: cross-entropy, or the user's own 'package.module:function' called as fn(logits, targets),
    found from the working directory. The validation loss is cross-entropy either way."""
    label_smoothing: float = 0.0
    """cross-entropy only: label smoothing (torch's CrossEntropyLoss label_smoothing), from 0 to 1."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    # --- measurement and output ---------------------------------------------------------------
    output: str = "runs/train"
    """Folder for result.json, checkpoints, configs and TensorBoard logs."""
    timing_warmup_steps: int = 3
    """Optimizer steps at the start excluded from step-time statistics."""
    eval_every_epoch: bool = True
    """Evaluate on the validation split after each epoch (always after the last)."""
    save_every_steps: int | None = None
    """Also save a checkpoint every N optimizer steps."""
    save_every_epoch: bool = True
    """Save a checkpoint at the end of each epoch (and always at the end of training)."""
    resume: bool | Literal["must"] = False
    """Resume from OUTPUT/checkpoints/last (or --resume-from) if it exists, else start fresh; `must`: refuse to start when there is nothing to resume."""
    resume_from: str | None = None
    """Checkpoint to resume from (file or folder)."""
    init_from: str | None = None
    """Checkpoint whose model weights start the run (optimizer and progress are not restored); hf:FOLDER: a Hugging Face Llama folder (config.json + safetensors) mapped onto the built-in transformer of --model (docs/finetuning.md)."""
    trust_checkpoint: bool = False
    """Load --resume-from/--init-from/OUTPUT checkpoints with full unpickling, which runs code a crafted file holds; by default every file is read weights-only and one that needs more is refused."""
    keep_last: int = 1
    """Checkpoints kept under OUTPUT/checkpoints as step-NNNNNNNN entries; `last` points at the newest."""
    tensorboard: bool = False
    """Write TensorBoard scalars under OUTPUT/tensorboard."""
    mlflow: bool = False
    """Log params, per-step metrics and the result to MLflow (the mlflow extra): a local store OUTPUT/mlflow.db unless --mlflow-tracking-uri."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (e.g. sqlite:///runs/mlflow.db, http://host:5000, file:./mlruns); default: sqlite:///OUTPUT/mlflow.db."""
    mlflow_experiment: str = "stratbench"
    """MLflow experiment the run is logged under."""
    wandb: bool = False
    """Log the config, environment, per-step and validation metrics and the result summary to Weights & Biases
    (the wandb extra), from the main rank; the run's files go under OUTPUT/wandb."""
    wandb_project: str = "stratbench"
    """W&B project the run is logged under."""
    wandb_entity: str | None = None
    """W&B entity (user or team) that owns the project; default: the login's default entity."""
    wandb_mode: str = "auto"
    """auto, online, offline or disabled. auto: WANDB_MODE if set, else online when a W&B login is present
    (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or `wandb login`'s netrc entry), else offline, with a note on how
    to `wandb sync` the run: a run never waits on a login prompt or the network."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    measure_flops: bool = True
    """Count FLOPs per sample once (on the meta device) to report achieved FLOP/s and MFU."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device to report MFU against (default: the GPU's figure in hardware.yaml; none
    for a CPU, which then reports MFU only with this set)."""
    breakdown: bool = False
    """Time each step's phases (data wait, forward, backward, optimizer, other; each its own synchronised spans)
    into metrics.breakdown, beside the step time; what no span covers is reported as unattributed."""
    profile: int = 0
    """Write a torch.profiler trace per rank of this many steps after the timing warm-up (and after the
    --comm-volume steps) to OUTPUT/traces/rank{r}.json, the phases as named ranges (Perfetto, TensorBoard)."""
    measure_alloc: bool = False
    """CPU: measure the bytes the allocator hands out during step 2 (glibc mallinfo2 after every op, above a
    baseline read before the model is built; stratbench.measuring.memprobe), the quantity the memory estimate predicts."""
    comm_volume: bool = False
    """Record every collective (calls, payload bytes, time per kind) from the third step to the end of the
    timing warm-up (torch.profiler; outside the timed steps when the warm-up is >= 3) and check it against the
    method's formula (metrics.comm)."""
    # --- launching -----------------------------------------------------------------------------
    nproc: int = 1
    """Processes per node; > 1 makes stratbench start them through torchrun."""
    nnodes: int = 1
    """Number of nodes (passed to torchrun)."""
    node_rank: int = 0
    """Rank of this node (passed to torchrun)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0 (passed to torchrun)."""
    master_port: int = 0
    """Port on node 0 (passed to torchrun); 0 picks a free port on one node and 29500 across nodes."""
    rdzv_endpoint: str | None = None
    """host:port of a c10d rendezvous (replaces master addr/port; needed for --max-restarts across nodes)."""
    max_restarts: int = 0
    """torchrun elastic restarts of the worker group; training resumes from the last checkpoint."""
    dist_timeout_s: int = 300
    """Timeout of collective operations; a rank that died makes the others fail after this long."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# ---- help topics: where each field's flag stands in `train --help`, and which the short --help shows ------
HELP_TOPICS: dict[str, tuple[str, ...]] = {
    "model & data": (
        "model", "weights", "cifar_stem", "norm", "width", "moe_top_k", "capacity_factor", "data", "target", "data_dir", "download", "image_size",
        "num_classes", "synthetic_samples", "val_fraction", "seq_len", "tokenizer", "vocab_size", "token_dtype",
        "data_format", "train_on_prompt", "pack", "eval_samples", "num_workers", "data_pipeline", "pin_memory",
    ),
    "method & its options": ("strategy",),
    "precision, memory & speed": (
        "precision", "tf32", "channels_last", "compile", "cudnn_benchmark", "recipe", "activation_checkpointing",
        "ac_mode", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "quantize_base", "float8",
    ),
    "optimisation & schedule": (
        "epochs", "max_steps", "batch_size", "grad_accum", "optimizer", "optimizer_impl", "lr", "momentum",
        "weight_decay", "lr_schedule", "lr_warmup_steps", "clip_grad_norm", "loss", "label_smoothing", "seed",
    ),
    "run, output & checkpoints": (
        "output", "eval_every_epoch", "save_every_steps", "save_every_epoch", "resume", "resume_from",
        "init_from", "trust_checkpoint", "keep_last", "progress",
    ),
    "logging & measuring": (
        "timing_warmup_steps", "tensorboard", "mlflow", "mlflow_tracking_uri", "mlflow_experiment", "wandb",
        "wandb_project", "wandb_entity", "wandb_mode", "measure_flops", "peak_tflops", "breakdown", "profile",
        "measure_alloc", "comm_volume",
    ),
    "launch & processes": (
        "device", "nproc", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "max_restarts",
        "dist_timeout_s",
    ),
}  # fmt: skip
"""Each TrainConfig field's help topic, in the order `train --help` shows them (a field in none is shown under
"other options"; a test asks that every field has one)."""
SHORT_HELP_FIELDS = frozenset({
    "model", "data", "data_dir", "seq_len", "strategy", "precision", "recipe", "activation_checkpointing",
    "lora_rank", "epochs", "max_steps", "batch_size", "grad_accum", "optimizer", "lr", "output", "resume",
    "tensorboard", "wandb", "nproc", "nnodes", "device",
})  # fmt: skip
"""The fields whose flags the short `train --help` shows (`--help-all` shows every one)."""


def help_topic(name: str) -> str:
    """The help topic of field ``name`` (``HELP_TOPICS``)."""
    return next((topic for topic, names in HELP_TOPICS.items() if name in names), "other options")


CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("group", "none"),
    "device": ("auto", "cpu", "cuda"),
    "optimizer": ("sgd", "adamw", "adamw8bit", "adamw4bit", "adafactor"),
    "optimizer_impl": ("default", "foreach", "fused", "for-loop"),
    "lr_schedule": ("cosine", "constant"),
    "data_pipeline": ("auto", "loader", "device"),
    "wandb_mode": ("auto", "online", "offline", "disabled"),
    "float8": ("none", "tensorwise", "rowwise"),
}
RECIPES = ("fast",)
IN_MEMORY_DATA = ("synthetic", "digits", "cifar10")
"""Data sets held in memory as tensors: the ones the device pipeline can serve."""


FUSED_UNSUPPORTED = {
    ("fsdp", "sgd"): "torch's fused SGD kernel has no DTensor sharding rule (FSDP2 parameters)"
}
"""(strategy, optimizer) pairs whose fused kernel fails, measured with torch 2.13 (fused AdamW works under fsdp)."""


def recipe_settings(
    name: str, cuda: bool, bf16: bool, strategy: str = "single", optimizer: str = "sgd"
) -> dict[str, Any]:
    """The TrainConfig values a recipe stands for on a machine with (``cuda``) or without a CUDA device and with
    or without bf16 support. torch.compile is part of ``fast`` on CUDA only: its gain cannot be measured on a
    CPU-only machine, and on CPU it costs compile time for no measured benefit. The optimizer is fused, or
    foreach where the fused kernel does not work with the strategy (``FUSED_UNSUPPORTED``)."""
    if name != "fast":
        raise ConfigError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return {
        "precision": "bf16-mixed" if bf16 else "fp16-mixed",
        "channels_last": True,
        "data_pipeline": "device",
        "optimizer_impl": recipe_optimizer_impl(strategy, optimizer),
        "cudnn_benchmark": True,
        "pin_memory": True,
        "compile": cuda,
    }


# ---- the memory-lean optimizers (--optimizer adamw8bit | adamw4bit | adafactor) ----------------
TORCHAO_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
"""--optimizer names -> torchao.optim classes (an optional dependency: ``pip install 'stratbench[lean]'``)."""
OPTIMIZER_IMPLS = {
    "adamw8bit": ("default",),
    "adamw4bit": ("default",),
    "adafactor": ("default", "foreach", "for-loop"),
}
"""The optimizer_impl values a lean optimizer takes: torchao's step is one compiled function per parameter (no
foreach or fused variant); torch's Adafactor has foreach but no fused kernel."""


def recipe_optimizer_impl(strategy: str, optimizer: str) -> str:
    """The recipe's optimizer kernels: fused, foreach where fused fails with the strategy, torch's default for an
    optimizer with no fused kernel (``OPTIMIZER_IMPLS``)."""
    if optimizer in OPTIMIZER_IMPLS:
        return "default"
    return "foreach" if (strategy, optimizer) in FUSED_UNSUPPORTED else "fused"


def check_optimizer(cfg: TrainConfig) -> None:
    """Refuse, before any work, a lean optimizer with kernels it has not, or whose library is not installed."""
    impls = OPTIMIZER_IMPLS.get(cfg.optimizer)
    if impls is not None and cfg.optimizer_impl not in impls:
        raise ConfigError(
            f"optimizer_impl {cfg.optimizer_impl!r} does not exist for optimizer {cfg.optimizer!r}; "
            f"choose one of: {', '.join(impls)}"
        )
    if cfg.optimizer in TORCHAO_OPTIMIZERS and importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"optimizer {cfg.optimizer!r} needs torchao, which is not installed: pip install 'stratbench[lean]'"
        )


def expand_recipe(data: dict[str, Any]) -> dict[str, Any]:
    """Fill in the recipe's settings where ``data`` does not set them: every knob stays individually settable
    (``--recipe fast --compile false``), and the result names every value, so the resolved config (config.yaml,
    result.json) shows what the recipe did. Expanding twice changes nothing."""
    name = data.get("recipe")
    if name is None:
        return data
    import torch

    device = data.get("device", "auto")
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    bf16 = torch.cuda.is_bf16_supported() if cuda else True  # CPU autocast supports bf16
    strategy, optimizer = (
        data.get("strategy", TrainConfig.strategy),
        data.get("optimizer", TrainConfig.optimizer),
    )
    settings = recipe_settings(str(name), cuda, bf16, strategy, optimizer)
    return {**settings, **data}


def optimizer_impl_kwargs(impl: str) -> dict[str, Any]:
    """Keyword arguments of torch.optim.SGD/AdamW for ``optimizer_impl`` (empty: torch's own choice)."""
    return {
        "default": {},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[impl]


POSITIVE = (
    "epochs",
    "batch_size",
    "grad_accum",
    "nproc",
    "nnodes",
    "width",
    "num_classes",
    "synthetic_samples",
)


def base_type(annotation: Any) -> type:
    """The non-None type of a field annotation such as ``int | None``."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, vars(typing), {"Any": Any})  # noqa: S307 - annotations of our own dataclasses
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    origin = typing.get_origin(hint)
    return origin or hint


def _literal_words(annotation: Any) -> tuple[str, ...]:
    """The words a ``bool | Literal[...]`` field takes besides true/false (``resume: must``)."""
    hint = eval(annotation, vars(typing), {"Any": Any}) if isinstance(annotation, str) else annotation  # noqa: S307
    return tuple(
        w for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)
    )


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML/CLI value to the field's type, with an error naming the field."""
    typ = base_type(annotation)
    if value is None:
        return None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            words = _literal_words(annotation)
            if text in words:
                return text
            if words:
                raise ConfigError(f"{name}: cannot read {value!r}; use true, false or {', '.join(words)}")
            raise ValueError
        if typ in (int, float, str):
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return typ(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {typ.__name__}") from None


def from_dict(cls: type, data: dict[str, Any], where: str = "config") -> Any:
    """Build a dataclass from a mapping, rejecting unknown keys with the list of known ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {', '.join(map(repr, unknown))}"
                          f"{did_you_mean(unknown[0], fields)}; known: {', '.join(sorted(fields))}")  # fmt: skip
    values = {
        k: coerce(k, v, fields[k].type) if k != "strategy_options" else dict(v or {}) for k, v in data.items()
    }
    if cls is TrainConfig:
        values = _resolve_train_values(values)
        values = expand_recipe(values)
    return cls(**values)


PRECISION_ALIASES = {
    "32-true": "fp32",
    "32": "fp32",
    "64-true": "fp64",
    "64": "fp64",
    "16-mixed": "fp16-mixed",
    "16": "fp16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-true": "fp16-true",
    "bf16-true": "bf16-true",
}
"""Lightning's precision names (``Trainer(precision=...)``, including its short legacy forms) -> stratbench's."""


def canonical_precision(name: str) -> str:
    """stratbench's name for a precision given in stratbench's or Lightning's spelling (``16-mixed`` -> ``fp16-mixed``)."""
    return PRECISION_ALIASES.get(str(name).strip().lower(), name) if name is not None else name


def _resolve_train_values(values: dict[str, Any]) -> dict[str, Any]:
    """Names a user may give that stratbench resolves once, here: precision aliases, pretrained weights by
    name (a torch hub cache file; downloaded only with ``download``) and a Hugging Face model (``hf:FOLDER``
    made absolute; a hub name fetched into its cache only with ``download``; its positions the default
    ``seq_len`` where fewer than 256) and a Llama folder to start from (``--init-from hf:FOLDER`` made absolute;
    its ``vocab_size`` the run's where none is given)."""
    if isinstance(values.get("model"), str):
        values["model"] = canonical_name(values["model"], bool(values.get("download", False)))
        if "seq_len" not in values and is_hf_name(values["model"]):  # the default follows the model's positions
            values["seq_len"] = default_seq_len(values["model"], TrainConfig.seq_len)
    if "precision" in values:
        values["precision"] = canonical_precision(values["precision"])
    if is_hf_init(values.get("init_from")):  # a Llama folder's vocabulary is the run's unless one is given
        values["init_from"] = canonical_init(values["init_from"], bool(values.get("download", False)))
        if values.get("vocab_size") is None:
            values["vocab_size"] = folder_vocab(values["init_from"])
    weights = values.get("weights")
    if weights:
        if is_weights_name(weights):
            model = values.get("model", TrainConfig.model)
            values["weights"] = resolve_weights(model, weights, bool(values.get("download", False)))
    return values


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of option: value, got {type(data).__name__}")
    return data


def dump_yaml(cfg: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML, written atomically (a kill or a full disk leaves the earlier file whole)."""

    atomic_write(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def validate(cfg: TrainConfig) -> None:
    """Checks that need no registry: choices, positive numbers, combinations."""
    for name, allowed in CHOICES.items():
        value = getattr(cfg, name)
        if value not in allowed:
            raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
    for name in POSITIVE:
        value = getattr(cfg, name)
        if value is None or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    for name, value in vars(cfg).items():  # nan/inf would pass every comparison below or none of them
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    for name, (low, high) in RANGES.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(f"{name} must be {_range_text(low, high)}, got {value!r}")
    if not 0 < cfg.lr <= 10:
        raise ConfigError(f"lr must be positive and at most 10, got {cfg.lr!r}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction must be between 0 and 1, got {cfg.val_fraction!r}")
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        raise ConfigError(f"clip_grad_norm must be positive, got {cfg.clip_grad_norm!r}")
    if cfg.peak_tflops is not None and cfg.peak_tflops <= 0:
        raise ConfigError(f"peak_tflops must be a positive number of TFLOP/s, got {cfg.peak_tflops!r}")
    if cfg.node_rank >= cfg.nnodes:
        raise ConfigError(
            f"node_rank must be below nnodes ({cfg.nnodes}): ranks are 0..{cfg.nnodes - 1}, got {cfg.node_rank}"
        )
    check_optimizer(cfg)
    why = FUSED_UNSUPPORTED.get((cfg.strategy, cfg.optimizer))
    if cfg.optimizer_impl == "fused" and why:
        raise ConfigError(
            f"optimizer_impl 'fused' does not work with strategy {cfg.strategy!r} and optimizer {cfg.optimizer!r}: "
            f"{why}; use foreach (or optimizer adamw)"
        )
    if cfg.vocab_size is not None and is_hf_name(cfg.model):
        check_vocab(cfg.model, cfg.vocab_size)  # the head's width is the model's, not the data's
    moe_overrides(cfg.model, cfg.moe_top_k, cfg.capacity_factor)  # an MoE model, a top-k within its experts, C > 0
    if cfg.recipe is not None and cfg.recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {cfg.recipe!r}; choose one of: {', '.join(RECIPES)}")
    check_ac_mode(cfg.ac_mode)
    if cfg.activation_checkpointing and ac_budget(cfg.ac_mode) is not None and not cfg.compile:
        raise ConfigError(
            f"ac_mode {cfg.ac_mode!r} is the compiler's activation memory budget and needs --compile; "
            f"without it choose one of: {', '.join(m for m in AC_MODES if not m.startswith('budget'))}"
        )
    check_lora(cfg)
    check_float8(cfg)
    if is_hf_init(cfg.init_from):
        check_init(cfg.init_from, cfg.model, cfg.vocab_size)  # --model's size, every key mapped
    if cfg.data_pipeline == "device" and cfg.data not in IN_MEMORY_DATA:
        raise ConfigError(
            f"data_pipeline 'device' needs an in-memory data set ({', '.join(IN_MEMORY_DATA)}), got data "
            f"{cfg.data!r}; use data_pipeline loader or auto"
        )


AC_MODES = ("full", "selective", "every:N", "budget:F")


def ac_budget(mode: str) -> float | None:
    """F of a budget:F ``ac_mode`` (checked by ``check_ac_mode``), None for the other modes."""
    return float(mode.removeprefix("budget:")) if mode.startswith("budget:") else None


def check_ac_mode(mode: str) -> None:
    """full, selective, every:N with N a positive integer, or budget:F with 0 < F < 1; one line naming the bad
    value otherwise."""
    if mode in ("full", "selective"):
        return
    n = mode.removeprefix("every:")
    if mode.startswith("every:") and n.isdigit() and int(n) >= 1:
        return
    f = mode.removeprefix("budget:")
    if mode.startswith("budget:"):
        try:
            value = float(f)
        except ValueError:
            value = math.nan
        if 0 < value < 1:
            return
        raise ConfigError(
            f"ac_mode {mode!r}: the activation memory budget F must be a number with 0 < F < 1 (0.5 keeps at most "
            f"half of what the compiler would keep), got {f!r}"
        )
    raise ConfigError(
        f"unknown ac_mode {mode!r}; choose one of: {', '.join(AC_MODES)} (N a positive integer, 0 < F < 1)"
    )


def check_lora(cfg: TrainConfig) -> None:
    """The LoRA options' values (the targets are matched against the model's Linear layers when it is built)."""
    if cfg.lora_rank < 0:
        raise ConfigError(f"lora_rank must be 0 (off) or a positive rank, got {cfg.lora_rank!r}")
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha must be positive, got {cfg.lora_alpha!r}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout!r}")
    if not [t for t in cfg.lora_targets.split(",") if t.strip()]:
        raise ConfigError(f"lora_targets must name modules or be all-linear, got {cfg.lora_targets!r}")
    check_quantize_base(cfg)


QUANTIZE_BASE = {"none": "", "nf4": "torchao", "int8": "bitsandbytes"}
"""--quantize-base values and the library each needs (the qlora extra): nf4 is torchao's NF4Tensor, int8
bitsandbytes' Linear8bitLt (LLM.int8 without outlier columns; docs/finetuning.md, QLoRA)."""


def check_quantize_base(cfg: TrainConfig) -> None:
    """--quantize-base: a known kind, LoRA on top, and its library installed."""
    if cfg.quantize_base not in QUANTIZE_BASE:
        raise ConfigError(f"quantize_base must be one of {', '.join(QUANTIZE_BASE)}, got {cfg.quantize_base!r}")
    if cfg.quantize_base != "none" and cfg.lora_rank <= 0:
        raise ConfigError(
            f"quantize_base {cfg.quantize_base!r} needs LoRA adapters on top (--lora-rank R > 0): a quantised "
            "base is frozen and cannot train by itself"
        )
    library = QUANTIZE_BASE[cfg.quantize_base]
    if library and importlib.util.find_spec(library) is None:
        raise ConfigError(
            f"quantize_base {cfg.quantize_base!r} needs {library}, which is not installed: "
            "pip install 'stratbench[qlora]'"
        )


FLOAT8_PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")
"""The precisions float8 training composes with: torchao's float8 products return fp32 or bf16."""


def check_float8(cfg: TrainConfig) -> None:
    """--float8 (a known recipe: CHOICES): a precision it composes with, no LoRA, and torchao installed."""
    if cfg.float8 == "none":
        return
    if cfg.precision not in FLOAT8_PRECISIONS:
        raise ConfigError(
            f"--float8 with --precision {cfg.precision} is not supported: float8 products return fp32 or bf16; "
            f"use one of {', '.join(FLOAT8_PRECISIONS)}"
        )
    if cfg.lora_rank > 0:
        raise ConfigError(
            "--float8 with --lora-rank is not supported: float8 training converts the Linear layers LoRA adapts "
            "(torchao's Float8Linear under PEFT's adapters is untested); use one or the other"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--float8 needs torchao, which is not installed: pip install 'stratbench[lean]'")


# Allowed ranges (inclusive; None: unbounded) of numeric options, checked by ``validate``.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "max_steps": (1, None),
    "image_size": (8, 4096),
    "width": (1, 4096),
    "num_classes": (1, 1_000_000),
    "synthetic_samples": (1, 100_000_000),
    "seq_len": (1, 1_048_576),
    "vocab_size": (2, 16_777_216),
    "eval_samples": (1, None),
    "num_workers": (0, 256),
    "momentum": (0, 1),
    "weight_decay": (0, 10),
    "lr_warmup_steps": (0, None),
    "label_smoothing": (0, 1),
    "seed": (0, 2**32 - 1),  # numpy's seed range
    "timing_warmup_steps": (0, None),
    "profile": (0, 1000),
    "save_every_steps": (1, None),
    "keep_last": (1, 1000),
    "nproc": (1, 4096),
    "nnodes": (1, 100_000),
    "node_rank": (0, None),
    "master_port": (0, 65535),
    "max_restarts": (0, 1000),
    "dist_timeout_s": (1, 7 * 24 * 3600),
}


def _range_text(low: float | None, high: float | None) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"between {low} and {high}"


# ------------------------------------------------------------------------------------------------
# argparse glue: every dataclass field becomes a --flag whose help is the field's docstring.


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, *, dest_prefix: str = "", group_of: Any = None
) -> None:
    """Add one optional flag per field; unset flags stay ``None`` so they do not override YAML values.
    ``group_of(name)``: the argument group a field's flag goes into (its help topic; default the parser)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name == "strategy_options":
            continue
        container = group_of(f.name) if group_of else parser
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = (docs.get(f.name, "") + f" (default: {default})").replace("%", "%%")
        typ = base_type(f.type)
        dest = dest_prefix + f.name
        if typ is bool:
            container.add_argument(
                flag, dest=dest, nargs="?", const="true", default=None, metavar="BOOL", help=help_text
            )
        else:
            container.add_argument(flag, dest=dest, default=None, metavar=f.name.upper(), help=help_text)


def collect_overrides(ns: argparse.Namespace, cls: type, *, dest_prefix: str = "") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(ns, dest_prefix + f.name, None)
        if value is not None:
            out[f.name] = value
    return out
