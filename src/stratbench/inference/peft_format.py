"""A LoRA run's model in the formats the Hugging Face tools read (``stratbench export --merge-lora`` and
``--format peft``), and those folders read back for ``evaluate`` / ``predict``.

- **merged** (``--format hf``): the adapters folded into the base weights (W + alpha / r x B A, by PEFT's own
  ``merge``), written by transformers' ``save_pretrained``: ``config.json`` + ``model.safetensors`` under the
  model's own key names, which ``AutoModelForCausalLM.from_pretrained(FOLDER)`` loads; the source folder's
  tokenizer files beside them.
- **adapter** (``--format peft``): the adapters alone as PEFT writes them, ``adapter_config.json`` +
  ``adapter_model.safetensors`` (keys ``base_model.model.<path>.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, FOLDER)`` loads onto the base its config names.

Each folder also holds ``stratbench.json`` (plain JSON): the run's model meta and config, so that ``evaluate``
knows the data and ``predict`` the tokenizer and window. Reading is safetensors and JSON only (no pickle), and
an adapter file whose keys are not exactly the adapters its config makes is refused naming them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import CheckpointError
from stratbench.core.torchvision_compat import guard_torchvision_import
from stratbench.models.transforms.quantize_base import dequantize

SIDECAR = "stratbench.json"
HF_CONFIG = "config.json"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MERGED, ADAPTER = "merged", "adapter"
"""The two kinds of export folder, as ``stratbench.json`` records them."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the base model's module paths in an adapter file."""
ADAPTER_NAME = "default"
"""The adapter name PEFT's ``inject_adapter_in_model`` gives (in the live keys; not in the saved ones)."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja",
)  # fmt: skip
"""The tokenizer files of a Hugging Face model folder, copied into a merged export when the source has them."""
SHOWN = 4


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _an(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each PEFT LoRA layer in ``model`` (none in a model without adapters)."""
    guard_torchvision_import()  # peft imports transformers, which imports torchvision (core.torchvision_compat)
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def merge_adapters(model: nn.Module) -> nn.Module:
    """``model`` with each LoRA layer's update folded into its base Linear (PEFT's ``merge``: W + scale x B A)
    and the layer replaced by that Linear (in place): the bare model's modules and state-dict keys again. A QLoRA
    run's NF4 or int8 base is dequantised first (an int8 layer becomes a plain Linear): the merged weight is the
    dequantised one plus the update, in full precision (what the QLoRA model computes with)."""
    for name, layer in lora_layers(model):
        layer.base_layer = dequantize(layer.get_base_layer())
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    return model


# ---- the adapters in PEFT's key naming -------------------------------------------------------------


def to_peft_key(key: str) -> str | None:
    """``X.lora_A.default.weight`` (a live key, ``X`` the path in the Hugging Face model) as PEFT saves it,
    ``base_model.model.X.lora_A.weight``; None for a key that is no adapter's."""
    marker = f".{ADAPTER_NAME}."
    if ".lora_" not in key or marker not in key:
        return None
    return PEFT_PREFIX + key.replace(marker, ".", 1)


def adapter_state(hf_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapters of ``hf_model`` (a Hugging Face model with PEFT's layers in it) under PEFT's saved names."""
    out = {}
    for key, value in hf_model.state_dict().items():
        saved = to_peft_key(key)
        if saved is not None:
            out[saved] = value.detach().to(dtype).contiguous().clone()
    return out


def adapter_config(lora: dict[str, Any], targets: list[str], base: str) -> Any:
    """PEFT's ``LoraConfig`` of a run's adapters (``lora``: the checkpoint meta's rank / alpha / dropout), on the
    modules ``targets`` (paths in the Hugging Face model), for the base ``base`` (a folder or a hub name)."""
    guard_torchvision_import()
    from peft import LoraConfig

    return LoraConfig(
        r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
        target_modules=targets, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base,
    )  # fmt: skip


def read_adapter_config(folder: Path) -> tuple[str, dict[str, Any]]:
    """(base model: ``base_model_name_or_path``, the adapters as a checkpoint's ``lora`` meta) of an adapter
    folder; one line for a config stratbench cannot rebuild (no base, not LoRA, per-layer ranks, DoRA, ...)."""
    path = folder / ADAPTER_CONFIG
    data = _read_json(path)
    base = data.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise CheckpointError(
            f"{path} names no base model (base_model_name_or_path is {base!r}); set it to the Hugging Face model "
            "folder the adapters were trained on"
        )
    if data.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(
            f"{path}: peft_type {data.get('peft_type')!r}; stratbench reads LORA adapters only"
        )
    unsupported = [
        k
        for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save")
        if data.get(k)
    ]
    if data.get("bias", "none") != "none":
        unsupported.append(f"bias {data['bias']!r}")
    if unsupported:
        raise CheckpointError(
            f"{path} sets {', '.join(unsupported)}; stratbench rebuilds plain LoRA adapters (one rank and alpha, "
            "no DoRA/rsLoRA, bias none, no modules_to_save)"
        )
    targets = data.get("target_modules")
    targets = ",".join(sorted(targets)) if isinstance(targets, list) else targets
    if not isinstance(targets, str) or not targets:
        raise CheckpointError(f"{path} names no target_modules")
    lora = {"rank": data.get("r"), "alpha": data.get("lora_alpha"), "dropout": data.get("lora_dropout", 0.0)}
    if not isinstance(lora["rank"], int) or not isinstance(lora["alpha"], int | float):
        raise CheckpointError(
            f"{path}: r and lora_alpha must be numbers, got {lora['rank']!r}, {lora['alpha']!r}"
        )
    return base, lora | {"targets": targets}


def load_adapter_weights(hf_model: nn.Module, folder: Path) -> None:
    """Load ``folder``'s adapter_model.safetensors into the adapters of ``hf_model`` (PEFT's layers already in
    it): every adapter of the model from the file and every tensor of the file into an adapter, of its shape,
    or one line naming the keys that are missing, unexpected or of another shape."""
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(
            f"adapter folder {folder} has no {ADAPTER_WEIGHTS} (stratbench reads safetensors only)"
        )
    saved = load_file(str(path))
    live = {k: v for k, v in hf_model.state_dict().items() if to_peft_key(k) is not None}
    wanted = {to_peft_key(k): k for k in live}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(live[wanted[k]].shape)}"
              for k in sorted(set(saved) & set(wanted)) if saved[k].shape != live[wanted[k]].shape]  # fmt: skip
    problems = [f"{len(v)} {kind} ({_some(v)})" for kind, v in
                (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if v]  # fmt: skip
    if problems:
        raise CheckpointError(
            f"{path} does not fit the adapters {ADAPTER_CONFIG} describes on its base: keys {'; '.join(problems)}"
        )
    hf_model.load_state_dict({wanted[k]: v.float() for k, v in saved.items()}, strict=False)


# ---- the folders ------------------------------------------------------------------------------------


def export_kind(path: Path) -> str | None:
    """What a folder given as a checkpoint is: an adapter folder (``adapter_config.json``), a Hugging Face model
    folder (``config.json``: a merged export), or None (a checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / ADAPTER_CONFIG).is_file():
        return ADAPTER
    if (path / HF_CONFIG).is_file():
        return MERGED
    return None


def read_sidecar(folder: Path) -> dict[str, Any]:
    """``stratbench.json`` of an export folder (the run's meta and config), or one line saying it is missing."""
    path = folder / SIDECAR
    if not path.is_file():
        raise CheckpointError(
            f"{folder} has no {SIDECAR}, so it was not written by `stratbench export`: stratbench does not know the "
            "data, window and tokenizer its model was trained with (give the run's checkpoint instead)"
        )
    data = _read_json(path)
    if not isinstance(data.get("meta"), dict):
        raise CheckpointError(f"{path} holds no model meta")
    return data


def sidecar(kind: str, meta: dict[str, Any], config: dict[str, Any], source: Path, strategy: str | None,
            progress: dict[str, Any]) -> str:  # fmt: skip
    """The text of ``stratbench.json``: the export's kind and the run's meta, config, checkpoint and progress."""
    doc = {"export": kind, "meta": meta, "config": config, "checkpoint": str(source), "strategy": strategy,
           "progress": progress}  # fmt: skip
    return json.dumps(doc, indent=2, default=str) + "\n"


def check_output_folder(out: Path, kind: str) -> None:
    """An export folder's destination: new, empty, or a stratbench export of the same kind (replaced whole,
    as export replaces a file); anything else is refused naming what it holds, before any work."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"--output {out} is a file; a {kind} export is a folder: name a new or empty folder"
        )
    if not out.is_dir() or not any(out.iterdir()):
        return
    held = None
    if (out / SIDECAR).is_file():
        try:
            held = json.loads((out / SIDECAR).read_text()).get("export")
        except (OSError, ValueError, AttributeError):
            held = None
    if held != kind:
        what = (
            f"{_an(held)} export" if held else f"other files ({_some(sorted(p.name for p in out.iterdir()))})"
        )
        raise CheckpointError(
            f"--output {out} holds {what}; {_an(kind)} export replaces only an earlier one: name a new or empty folder"
        )


def copy_tokenizer(source: Path, out: Path, tokenizer: str | None) -> list[str]:
    """Copy the tokenizer files of the model folder ``source`` into ``out``; the run's own ``tokenizer`` file
    (``--tokenizer``), when it was another, becomes ``out``'s tokenizer.json. Returns the names written."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    if (
        tokenizer
        and Path(tokenizer).is_file()
        and Path(tokenizer).resolve() != (source / "tokenizer.json").resolve()
    ):
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        copied = sorted({*copied, "tokenizer.json"})
    return copied


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a mapping")
    return data
