"""What `stratbench export` does besides the ONNX export itself (stratbench.inference.onnx_export): the real
inputs its parity check adds, and plain weight files (safetensors, a torch.save state dict) that any PyTorch
user loads into the bare model without stratbench, read back the way such a user would."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from stratbench.core.errors import StratbenchError
from stratbench.inference.onnx_export import (
    OrtModel,
    ParityRow,
    context_length,
    is_language,
    parity,
    random_inputs,
    random_tokens,
)
from stratbench.inference.predictor import (
    ImageProblem,
    LoadedModel,
    build_from_meta,
    collect_images,
    load_image,
    train_config_for,
    validation_set,
)

WEIGHT_META = (
    "model",
    "num_classes",
    "image_size",
    "class_names",
    "mean",
    "std",
    "width",
    "norm",
    "cifar_stem",
)
"""The checkpoint metadata a safetensors file carries (under "stratbench"): what rebuilds the bare model."""


def format_for(output: str) -> str:
    """The export format an output file name implies: .safetensors, .pt/.pth/.bin (state dict), else ONNX."""
    suffix = output.lower().rsplit(".", 1)[-1] if "." in output else ""
    formats = {"safetensors": "safetensors", "pt": "state-dict", "pth": "state-dict", "bin": "state-dict"}
    return formats.get(suffix, "onnx")


def bundle_name(loaded: LoadedModel) -> str:
    return str(loaded.config.get("data") or loaded.meta.get("data") or "data")


def real_inputs(
    loaded: LoadedModel, n: int, image_paths: list[str]
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(name, batch) pairs of real inputs: up to ``n`` validation samples of the training data, plus the given
    images; and a note for each that was skipped (no data here, an unreadable image)."""
    inputs, notes = [], []
    if n > 0:
        try:
            bundle = validation_set(train_config_for(loaded.config, loaded.meta), loaded.meta)
            count = min(n, len(bundle.val))
            xs = torch.stack([bundle.val[i][0] for i in range(count)])
            inputs.append((f"{bundle_name(loaded)} validation x{count}", xs))
        except StratbenchError as exc:
            notes.append(f"validation samples skipped ({exc})")
    if image_paths:
        files, problems = collect_images(image_paths)
        tensors = []
        for f in files:
            try:
                tensors.append(load_image(f, loaded.meta))
            except StratbenchError as exc:
                problems.append(ImageProblem(f, str(exc)))
        for p in problems:
            notes.append(f"image input skipped: {p.line()}")
        if tensors:
            inputs.append((f"images x{len(tensors)}", torch.stack(tensors)))
    return inputs, notes


def onnx_parity(loaded: LoadedModel, session: OrtModel, real_samples: int,
                images: list[str]) -> tuple[list[ParityRow], list[str]]:  # fmt: skip
    """The ONNX model's logits against PyTorch's on random inputs (a language model's: token ids of the shapes
    ``token_shapes``) and the real ones (``real_inputs``: a language model's validation windows); and the notes on
    real inputs that were skipped."""
    real, notes = real_inputs(loaded, real_samples, images)
    meta = loaded.meta
    if is_language(meta):
        shapes = token_shapes(int(meta["seq_len"]), context_length(loaded.model, meta))
        random = random_tokens(int(meta["num_classes"]), shapes)
    else:
        random = random_inputs(int(meta["image_size"]))
    return parity(loaded.model, session, random + real), notes


def token_shapes(seq_len: int, context: int) -> list[tuple[int, int]]:
    """(batch, seq) of a language model's random parity inputs: one sequence of 5 tokens, 3 of the training
    window, 2 of the whole context: two batch sizes and up to three lengths, so both dynamic axes are exercised."""
    return list(dict.fromkeys([(1, min(5, context)), (3, seq_len), (2, context)]))


def write_weights(loaded: LoadedModel, out: Path, fmt: str, dtype: torch.dtype) -> int:
    """The bare model's state dict (no wrapper prefixes; floating tensors in ``dtype``) as ``fmt`` (safetensors or
    state-dict) at ``out``, written through a temporary file then renamed; returns the number of tensors."""
    # safetensors refuses tensors that share memory; clone so each tensor owns its storage
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().clone()
             for k, v in loaded.model.state_dict().items()}  # fmt: skip
    meta = {k: loaded.meta[k] for k in WEIGHT_META if k in loaded.meta}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"format": "pt", "stratbench": json.dumps(meta, default=str)})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(state)


def _random_samples(meta: dict[str, Any]) -> list[torch.Tensor]:
    """Random batches of 1 and 7 samples the model takes: token ids of its window for a language model (a
    seeded draw from its vocabulary), else images (``random_inputs``)."""
    if not meta.get("seq_len"):
        return [x for _, x in random_inputs(int(meta["image_size"]))]
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, int(meta["num_classes"]), (b, int(meta["seq_len"])), generator=g) for b in (1, 7)
    ]


def reload_difference(loaded: LoadedModel, out: Path, fmt: str) -> tuple[float, float]:
    """Read ``out`` back with plain torch / safetensors into a freshly built model of the same architecture:
    (largest absolute difference of its logits from the checkpoint's on random inputs, largest |logit|, at least
    1)."""
    reread: dict[str, Any]
    if fmt == "safetensors":
        from safetensors.torch import load_file

        reread = load_file(str(out))
    else:
        reread = torch.load(out, map_location="cpu", weights_only=True)
    fresh = build_from_meta(loaded.meta).eval()
    fresh.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in reread.items()}, strict=True
    )
    worst, scale = 0.0, 1.0
    with torch.no_grad():
        for x in _random_samples(loaded.meta):
            ref = loaded.model(x)
            worst, scale = max(worst, (fresh(x) - ref).abs().max().item()), max(scale, ref.abs().max().item())
    return worst, scale
