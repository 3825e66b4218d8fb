"""What `stratbench export` does besides the ONNX export itself (stratbench.inference.onnx_export): the real
inputs its parity check adds, plain weight files (safetensors, a torch.save state dict) that any PyTorch
user loads into the bare model without stratbench, and a LoRA run's merged weights or adapters in Hugging Face's
formats (stratbench.inference.peft_format), each read back the way such a user would."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from stratbench.core.errors import StratbenchError
from stratbench.core.files import atomic_output
from stratbench.inference.onnx_export import (
    OrtModel,
    ParityRow,
    context_length,
    is_language,
    parity,
    random_inputs,
    random_tokens,
)
from stratbench.inference.peft_format import (
    ADAPTER,
    ADAPTER_WEIGHTS,
    MERGED,
    SIDECAR,
    adapter_config,
    adapter_state,
    copy_tokenizer,
    lora_layers,
    merge_adapters,
    sidecar,
)
from stratbench.inference.predictor import (
    ImageProblem,
    LoadedModel,
    build_from_meta,
    collect_images,
    load_image,
)
from stratbench.inference.quality import validation_batches
from stratbench.models.hf import PREFIX as HF_PREFIX
from stratbench.models.hf import is_hf_name, model_folder, quiet_transformers
from stratbench.models.hf_llama import save_hf_folder

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
            batches = validation_batches(loaded, 1, batch_size=n)
            if batches:
                xs = batches[0][0]
                inputs.append((f"{bundle_name(loaded)} validation x{len(xs)}", xs))
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


# ---- a LoRA run: merged weights, or the adapters alone ----------------------------------------------

Logits = list[tuple[torch.Tensor, torch.Tensor]]
"""(input, the checkpoint's logits on it) pairs: what an export's read-back is compared with."""


def reference_logits(loaded: LoadedModel) -> Logits:
    """The checkpoint's model's logits on the random samples (``_random_samples``), taken before a merge changes
    it: what the merged or adapter export must give back."""
    with torch.no_grad():
        return [(x, loaded.model(x).float()) for x in _random_samples(loaded.meta)]


def difference(run: Any, reference: Logits, vocab: int) -> tuple[float, float]:
    """(largest absolute difference of ``run(x)``'s first ``vocab`` logits from the reference's, largest
    |logit|, at least 1), over the reference's inputs."""
    worst, scale = 0.0, 1.0
    with torch.no_grad():
        for x, ref in reference:
            got = run(x).float()[..., :vocab]
            worst, scale = max(worst, (got - ref).abs().max().item()), max(scale, ref.abs().max().item())
    return worst, scale


def merged(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with its LoRA adapters folded into the base weights (in place) and its meta without them: the
    bare model that ``build_from_meta`` builds and every exporter writes."""
    merge_adapters(loaded.model)
    meta = {k: v for k, v in loaded.meta.items() if k != "lora"}
    return dataclasses.replace(loaded, meta=meta)


def _sidecar_text(loaded: LoadedModel, kind: str) -> str:
    return sidecar(kind, loaded.meta, loaded.config, loaded.source, loaded.strategy, loaded.progress)


def write_hf_folder(loaded: LoadedModel, out: Path, dtype: torch.dtype) -> list[str]:
    """A Hugging Face model folder at ``out`` (replaced whole): transformers' ``save_pretrained`` of the wrapped
    model (config.json, model.safetensors under its own key names) in ``dtype``, the source folder's tokenizer
    files and stratbench.json; a built-in transformer as a Hugging Face Llama (``models.hf_llama``: keys mapped,
    q/k rows permuted to its rotary layout). Returns the names written. The model must have no adapters left
    (``merged``)."""
    if not is_hf_name(loaded.meta["model"]):
        save_hf_folder(loaded.model, out, dtype, {SIDECAR: _sidecar_text(loaded, MERGED)})
        return sorted(p.name for p in out.iterdir())
    hf_model = loaded.model.hf
    source = model_folder(loaded.meta["model"])
    with atomic_output(out) as tmp:
        tmp.mkdir()
        with quiet_transformers():
            hf_model.to(dtype).save_pretrained(tmp)
        hf_model.float()
        copy_tokenizer(source, tmp, loaded.meta.get("tokenizer"))
        (tmp / SIDECAR).write_text(_sidecar_text(loaded, MERGED))
    return sorted(p.name for p in out.iterdir())


def hf_difference(loaded: LoadedModel, out: Path, reference: Logits) -> tuple[float, float]:
    """Load ``out`` with transformers' ``AutoModelForCausalLM.from_pretrained`` (fp32, local, safetensors) as a
    user would, and compare its logits with the checkpoint's (``difference``)."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True,
                                                     use_safetensors=True).eval()  # fmt: skip
    return difference(lambda x: model(input_ids=x).logits, reference, int(loaded.meta["num_classes"]))


def write_adapter_folder(loaded: LoadedModel, out: Path, dtype: torch.dtype) -> list[str]:
    """The LoRA adapters of ``loaded`` (an ``hf:`` model) in PEFT's format at ``out`` (replaced whole):
    adapter_config.json (rank, alpha, dropout, the adapted modules' paths, ``base_model_name_or_path`` the
    model's folder or hub name) and adapter_model.safetensors in ``dtype``, with stratbench.json."""
    from safetensors.torch import save_file

    hf_model = loaded.model.hf
    targets = [name for name, _ in lora_layers(hf_model)]
    config = adapter_config(loaded.meta["lora"], targets, loaded.meta["model"][len(HF_PREFIX) :])
    with atomic_output(out) as tmp:
        tmp.mkdir()
        config.save_pretrained(str(tmp))
        save_file(adapter_state(hf_model, dtype), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / SIDECAR).write_text(_sidecar_text(loaded, ADAPTER))
    return sorted(p.name for p in out.iterdir())


def adapter_difference(loaded: LoadedModel, out: Path, reference: Logits) -> tuple[float, float]:
    """Load the base with transformers and ``out`` onto it with ``peft.PeftModel.from_pretrained`` as a user
    would, and compare its logits with the checkpoint's (``difference``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft 0.21 calls a transformers 5 name deprecated for v6
        base = AutoModelForCausalLM.from_pretrained(model_folder(loaded.meta["model"]), dtype=torch.float32,
                                                    local_files_only=True, use_safetensors=True)  # fmt: skip
        model = PeftModel.from_pretrained(base, out).eval()
    return difference(lambda x: model(input_ids=x).logits, reference, int(loaded.meta["num_classes"]))
