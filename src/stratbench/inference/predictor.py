"""After training: load a model from any method's checkpoint, preprocess images the way it was trained, and
run predictions or a validation pass through PyTorch or onnxruntime.

Everything inference needs is in the checkpoint: the model (name, classes, width, ...), the class names
and the preprocessing (image size, mean/std) are in its ``meta``; the training config names the data set.
Sharded checkpoints (fsdp, ddp-zero, deepspeed folders) are consolidated in memory by ``checkpoint.load_any``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratbench.checkpoints import checkpoint as ckpt
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.dist import resolve_device
from stratbench.core.errors import CheckpointError, ConfigError, DataError
from stratbench.data.datasets import build_data
from stratbench.inference.onnx_export import OrtModel, export_onnx, read_metadata
from stratbench.inference.peft_format import (
    ADAPTER,
    export_kind,
    load_adapter_weights,
    read_adapter_config,
    read_sidecar,
)
from stratbench.models.hf import PREFIX as HF_PREFIX
from stratbench.models.transforms.lora import apply_meta as apply_lora_meta
from stratbench.models.transforms.quantize_base import apply_meta as apply_quantize_meta
from stratbench.models.zoo import build_model
from stratbench.training.losses import per_sample_eval

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
META_KEYS = ("model", "num_classes", "class_names", "image_size", "mean", "std")
# Prefixes a wrapper may leave on parameter names (torch.compile, DataParallel/DDP, activation checkpointing).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
BACKENDS = ("torch", "onnxruntime")


@dataclass
class LoadedModel:
    """A model ready for inference plus what the checkpoint says about it."""

    model: nn.Module
    meta: dict[str, Any]
    config: dict[str, Any]
    source: Path
    layout: str
    strategy: str | None
    progress: dict[str, Any] = field(default_factory=dict)

    @property
    def class_names(self) -> list[str]:
        return list(self.meta["class_names"])

    def describe(self) -> str:
        """One line naming what was loaded (printed by the commands so the user sees what they got)."""
        step = self.progress.get("step")
        shape = (
            f"vocabulary {self.meta['num_classes']}, {self.meta['seq_len']}-token windows"
            if self.meta.get("seq_len")
            else f"{self.meta['num_classes']} classes, {self.meta['image_size']}px"
        )
        return (
            f"{self.meta['model']} ({shape}) from "
            f"{self.source} [{self.layout} checkpoint of strategy {self.strategy or '?'}"
            + (f", step {step}" if step is not None else "")
            + "]"
        )


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for prefix in _WRAPPER_PREFIXES:
            key = key.replace(prefix, "")
        out[key] = value
    return out


def build_from_meta(meta: dict[str, Any]) -> nn.Module:
    """The untrained model that the checkpoint's ``meta`` describes (same constructor the training loop used),
    with the LoRA adapters of a LoRA run (``meta["lora"]``), whose keys its checkpoint holds."""
    model = build_model(
        meta["model"],
        int(meta["num_classes"]),
        cifar_stem=bool(meta.get("cifar_stem", False)),
        norm=meta.get("norm", "group"),
        width=int(meta.get("width", 16)),
        sample_shape=_sample_shape(meta),
        seq_len=int(meta["seq_len"]) if meta.get("seq_len") else None,
        moe_top_k=meta.get("moe_top_k"),
        capacity_factor=meta.get("capacity_factor"),
    )
    return apply_lora_meta(model, meta.get("lora"))


def _sample_shape(meta: dict[str, Any]) -> tuple[int, ...] | None:
    """One input sample's shape as the model was trained on it: (seq_len,) token ids or (3, H, W) pixels."""
    if meta.get("seq_len"):
        return (int(meta["seq_len"]),)
    return (3, int(meta["image_size"]), int(meta["image_size"])) if meta.get("image_size") else None


def check_meta(meta: Any, source: Path | str) -> dict[str, Any]:
    """The model meta, or one clear error naming what is missing."""
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint {source} has no model meta (it was not written by `stratbench train`)"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(
            f"checkpoint {source}: model meta lacks {', '.join(missing)} (found {', '.join(sorted(meta))})"
        )
    return meta


def load_model(path: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    """Build the model recorded in any stratbench checkpoint (file or sharded folder; a run folder: its last
    checkpoint) or export folder (``export_kind``) and load its weights, in fp32 and eval mode, on ``device``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir() and ckpt.last_checkpoint(path).exists():
        path = ckpt.last_checkpoint(path)
    kind = export_kind(path)
    if kind is not None:
        return _load_export(path, kind, device)
    # Some layout readers print progress (DeepSpeed's zero_to_fp32); stdout belongs to the command's output.
    with contextlib.redirect_stdout(sys.stderr):
        state = ckpt.load_any(path)
    meta = check_meta(state.get("meta"), path)
    weights = state.get("model")
    if not isinstance(weights, dict) or not weights:
        raise CheckpointError(f"checkpoint {path} holds no model weights (keys: {', '.join(sorted(state))})")
    model = build_from_meta(meta)
    weights = _strip_prefixes(weights)
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit a {meta['model']} model: "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}"
        )
    bad_shape = [k for k in own if tuple(own[k].shape) != tuple(weights[k].shape)]
    if bad_shape:
        k = bad_shape[0]
        raise CheckpointError(
            f"checkpoint {path}: tensor {k} has shape {tuple(weights[k].shape)}, the model expects {tuple(own[k].shape)}"
        )
    # A bf16-true/fp16-true checkpoint holds low-precision weights; load_state_dict copies them into fp32.
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    # QLoRA: the loaded base quantised as it trained, on the device (bitsandbytes' int8 state stays where made)
    model = apply_quantize_meta(model.to(device), meta.get("lora"))
    model.eval()
    return LoadedModel(
        model=model,
        meta=meta,
        config=dict(state.get("config") or {}),
        source=path,
        layout=str(state.get("layout", "full")),
        strategy=state.get("strategy"),
        progress=dict(state.get("progress") or {}),
    )


def _load_export(path: Path, kind: str, device: str | torch.device) -> LoadedModel:
    """A merged export (a Hugging Face model folder, its weights loaded whole by transformers) or an adapter
    folder (the base its adapter_config.json names, with the adapters of adapter_model.safetensors on it), with
    the run's meta and config from its stratbench.json."""
    base, lora = read_adapter_config(path) if kind == ADAPTER else (str(path.resolve()), None)
    doc = read_sidecar(path)
    meta = {k: v for k, v in doc["meta"].items() if k != "lora"} | {"model": HF_PREFIX + base}
    if lora is not None:
        meta["lora"] = lora
    elif meta.get("tokenizer") and (path / "tokenizer.json").is_file():
        meta["tokenizer"] = str(path.resolve() / "tokenizer.json")  # the copy export wrote beside the weights
    meta = check_meta(meta, path)
    model = build_from_meta(meta)  # hf: the folder's safetensors weights, every key loaded or one line
    if lora is not None:
        load_adapter_weights(model.hf, path)
    model.eval().to(device)
    return LoadedModel(
        model=model, meta=meta, config=dict(doc.get("config") or {}), source=path, layout=f"{kind} export",
        strategy=doc.get("strategy"), progress=dict(doc.get("progress") or {}),
    )  # fmt: skip


# ---- images -----------------------------------------------------------------------------------------
@dataclass
class ImageProblem:
    """An input that produced no prediction, and why (reported, then the command exits non-zero)."""

    path: Path
    reason: str

    def line(self) -> str:
        return f"{self.path}: {self.reason}"


def collect_images(inputs: Sequence[str | Path]) -> tuple[list[Path], list[ImageProblem]]:
    """Image files named directly, plus the image files under each folder (recursively, sorted).
    Missing paths and folders without images are returned as problems, not raised: the rest still runs."""
    files: list[Path] = []
    problems: list[ImageProblem] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                problems.append(
                    ImageProblem(p, f"directory holds no images (looked for {', '.join(IMAGE_EXTENSIONS)})")
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            problems.append(ImageProblem(p, "image not found"))
    return files, problems


def preprocess(image: Any, meta: dict[str, Any]) -> torch.Tensor:
    """A PIL image -> the (3, H, W) float tensor the model was trained on (size, colour mode, mean/std).

    digits: grayscale, bilinear resize (8x8 digits were upsampled the same way), ink bright on dark as in
    scikit-learn's data. imagefolder: resize the short side to size*256/224 then centre-crop (ImageNet
    evaluation). Otherwise (cifar10, synthetic): resize to size x size.
    """
    from PIL import Image

    size = int(meta["image_size"])
    data = meta.get("data")
    if data == "digits":
        img = image.convert("L").resize((size, size), Image.BILINEAR)
        arr = np.asarray(img, dtype=np.float32)[None].repeat(3, axis=0) / 255.0
    else:
        img = image.convert("RGB")
        if data == "imagefolder":
            short = int(size * 256 / 224)
            w, h = img.size
            scale = short / min(w, h)
            img = img.resize((max(short, round(w * scale)), max(short, round(h * scale))), Image.BILINEAR)
            w, h = img.size
            left, top = (w - size) // 2, (h - size) // 2
            img = img.crop((left, top, left + size, top + size))
        else:
            img = img.resize((size, size), Image.BILINEAR)
        arr = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
    mean = np.asarray(meta["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(meta["std"], dtype=np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray((arr - mean) / std))


def load_image(path: Path, meta: dict[str, Any]) -> torch.Tensor:
    """Decode one image with PIL (torchvision's decode_jpeg is broken on a CPU torch) and preprocess it.
    Raises DataError with the decoder's reason when the file is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            return preprocess(img, meta)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"cannot decode image ({reason[:160]})") from None


# ---- backends ---------------------------------------------------------------------------------------
Runner = Callable[[torch.Tensor], torch.Tensor]


def torch_runner(model: nn.Module, device: torch.device | str = "cpu") -> Runner:
    """Batch -> fp32 logits on CPU, through the PyTorch model."""
    device = torch.device(device)

    @torch.inference_mode()
    def run(x: torch.Tensor) -> torch.Tensor:
        return model(x.to(device)).float().cpu()

    return run


def onnx_runner(onnx_path: str | Path, device: str = "cpu", threads: int | None = None) -> Runner:
    """Batch -> fp32 logits, through an onnxruntime session of an exported model."""

    session = OrtModel(onnx_path, device=device, threads=threads)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(x.numpy())).float()

    return run


@dataclass
class Prediction:
    path: Path
    top: list[tuple[str, float]]  # (class name, probability), best first

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "top": [{"class": c, "probability": p} for c, p in self.top]}


def predict_files(
    files: Sequence[Path], meta: dict[str, Any], runner: Runner, top_k: int = 5, batch_size: int = 32
) -> tuple[list[Prediction], list[ImageProblem]]:
    """Top-k classes for each file; undecodable files become problems and the others are still predicted."""
    names = list(meta["class_names"])
    k = max(1, min(top_k, len(names)))
    predictions: list[Prediction] = []
    problems: list[ImageProblem] = []
    for start in range(0, len(files), batch_size):
        chunk, tensors = [], []
        for f in files[start : start + batch_size]:
            try:
                tensors.append(load_image(f, meta))
                chunk.append(f)
            except DataError as exc:
                problems.append(ImageProblem(f, str(exc)))
        if not tensors:
            continue
        probs = torch.softmax(runner(torch.stack(tensors)).double(), dim=1)
        values, indices = probs.topk(k, dim=1)
        for f, vals, idx in zip(chunk, values.tolist(), indices.tolist(), strict=True):
            predictions.append(Prediction(f, [(names[i], v) for i, v in zip(idx, vals, strict=True)]))
    return predictions, problems


# ---- evaluation -------------------------------------------------------------------------------------
def train_config_for(
    loaded_config: dict[str, Any], meta: dict[str, Any], data: str | None = None, data_dir: str | None = None
):
    """A TrainConfig for the data set the checkpoint was trained on, or for ``data``/``data_dir`` when given.
    Unknown keys (a checkpoint from a newer stratbench) are dropped rather than refused: only the data
    fields matter here. The image size is always the one the model was trained at."""

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in loaded_config.items() if k in known}
    values.setdefault("data", meta.get("data", "digits"))
    if data is not None and data != values["data"]:
        values["data"] = data
        values["data_dir"] = None  # the training data's folder does not belong to another data set
    if data_dir is not None:
        values["data_dir"] = data_dir
    if meta.get("image_size"):
        values["image_size"] = int(meta["image_size"])
    return from_dict(TrainConfig, values, where="checkpoint config")


def validation_set(cfg, meta: dict[str, Any]):
    """The validation split of ``cfg``'s data set, checked against the model's number of classes."""

    bundle = build_data(cfg)
    if bundle.num_classes != int(meta["num_classes"]):
        raise DataError(
            f"data set {cfg.data!r} has {bundle.num_classes} classes but the model predicts {meta['num_classes']}"
        )
    return bundle


def evaluate(runner: Runner, dataset: Iterable, batch_size: int = 256) -> dict[str, float]:
    """Validation loss (mean cross-entropy) and accuracy over every sample of ``dataset`` exactly once."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    loss_sum, correct, count = 0.0, 0.0, 0
    for x, y in loader:
        losses, right = per_sample_eval(runner(x).double(), y)  # a language model: means over each window
        loss_sum += losses.sum().item()
        correct += right.sum().item()
        count += len(y)
    if count == 0:
        raise DataError("the validation split is empty")
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count, "val_samples": count}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples p99 is the slowest one, as it should be)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def resolve_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return name


@dataclass
class OpenedModel:
    """What predict/evaluate need, whichever backend runs the model."""

    meta: dict[str, Any]
    config: dict[str, Any]
    runner: Runner
    description: str


@contextlib.contextmanager
def open_model(
    checkpoint: str | None,
    backend: str = "torch",
    onnx: str | None = None,
    device: str = "auto",
    threads: int | None = None,
) -> Iterator[OpenedModel]:
    """Load a checkpoint (any layout) and/or an ONNX file and yield a runner for ``backend``.

    torch needs the checkpoint. onnxruntime uses ``onnx`` when given (its stored meta replaces the checkpoint's
    if there is no checkpoint), otherwise exports the checkpoint to a temporary file first.
    """

    resolve_backend(backend)
    dev = resolve_device(device)
    if backend == "torch" and onnx:
        raise ConfigError("--onnx applies to --backend onnxruntime only")
    if checkpoint is None and not (backend == "onnxruntime" and onnx):
        raise ConfigError(
            "--checkpoint is required (or --backend onnxruntime --onnx FILE for an exported model)"
        )
    loaded = load_model(checkpoint, dev) if checkpoint is not None else None
    if backend == "torch":
        assert loaded is not None
        yield OpenedModel(
            loaded.meta, loaded.config, torch_runner(loaded.model, dev), f"torch ({dev}): {loaded.describe()}"
        )
        return

    ort_device = "cuda" if dev.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="stratbench-onnx-") as tmp:
        if onnx:
            if not Path(onnx).is_file():
                raise CheckpointError(f"ONNX file not found: {onnx}")
            stored = read_metadata(onnx)
            if loaded is None:
                if not stored:
                    raise CheckpointError(
                        f"ONNX file {onnx} has no stratbench metadata; pass --checkpoint too"
                    )
                meta = check_meta({k: v for k, v in stored.items() if k != "config"}, onnx)
                config = dict(stored.get("config") or {})
                what = f"{meta['model']} from {onnx}"
            else:
                meta, config, what = loaded.meta, loaded.config, f"{onnx} ({loaded.describe()})"
                if stored and int(stored.get("num_classes", -1)) != int(meta["num_classes"]):
                    raise CheckpointError(
                        f"ONNX file {onnx} predicts {stored.get('num_classes')} classes, checkpoint {checkpoint} {meta['num_classes']}"
                    )
            path = Path(onnx)
        else:
            assert loaded is not None
            path = Path(tmp) / "model.onnx"
            export_onnx(loaded.model, loaded.meta, path, extra_metadata={"config": loaded.config})
            meta, config, what = (
                loaded.meta,
                loaded.config,
                f"{loaded.describe()}, exported to ONNX on the fly",
            )
        yield OpenedModel(
            meta, config, onnx_runner(path, ort_device, threads), f"onnxruntime ({ort_device}): {what}"
        )


def add_backend_arguments(parser) -> None:
    """--backend/--onnx/--device: what runs the model, shared by predict and evaluate."""
    parser.add_argument(
        "--backend", default="torch", choices=("torch", "onnxruntime"), help="what runs the model"
    )
    parser.add_argument(
        "--onnx", help="exported model for --backend onnxruntime (default: export the checkpoint on the fly)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="device (default: cuda when present)",
    )
