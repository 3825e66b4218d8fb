"""Hugging Face ``transformers`` causal language models as ``--model hf:PATH_OR_NAME`` (the optional ``hf`` extra).

``PATH_OR_NAME`` is a local folder holding a ``config.json`` (and, optionally, ``*.safetensors`` weights), or a
Hugging Face model name (``owner/name``) already in the local Hugging Face cache; the hub is asked only with
``--download``. Everything else is offline (``local_files_only``), and a model that needs remote code (its
config.json has ``auto_map``, or its ``model_type`` is not one transformers ships) is refused: stratbench never
sets ``trust_remote_code``.

The model is wrapped to look like the built-in transformers: token ids (batch, seq) in, logits
(batch, seq, vocab) out, where vocab is the data's vocabulary (the head's extra rows are left out when the
model's vocabulary is larger, e.g. byte-level text on a 32k-token Llama); its decoder-layer classes
(``_no_split_modules``) are the unit of FSDP wrapping and activation checkpointing. It is built in fp32 (a
folder's weights are loaded in fp32 too); the precision layer converts it, as it does the built-ins.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.core.user_code import one_line
from stratbench.models._torchvision import import_torchvision
from stratbench.models.transformer import TransformerConfig

PREFIX = "hf:"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
"""What ``--download`` fetches of a hub model: config, safetensors weights, tokenizer files (no pickles, no code)."""


def is_hf_name(name: str) -> bool:
    """Whether ``--model name`` is a Hugging Face model (``hf:PATH_OR_NAME``)."""
    return name.startswith(PREFIX)


def import_transformers() -> Any:
    """The transformers package (an optional extra); torchvision first, through stratbench's import, since
    transformers imports it when installed and PyPI's CUDA torchvision fails to import on a CPU torch."""
    import_torchvision()
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--model hf:...: Hugging Face models need the transformers package: pip install 'stratbench[hf]'"
        ) from None
    return transformers


# ------------------------------------------------------------------------------------------------
# where the model is: a local folder, or the Hugging Face cache


def _cached_folder(repo_id: str) -> Path | None:
    """The snapshot folder of ``repo_id`` in the local Hugging Face cache (it holds config.json), else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id huggingface_hub rejects is simply not in the cache
        return None
    return Path(found).parent if isinstance(found, str) else None


def _download(name: str, repo_id: str) -> Path:
    """Fetch ``repo_id``'s config, safetensors weights and tokenizer into the Hugging Face cache (--download)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as exc:
        raise ConfigError(
            f"model {name!r}: downloading {repo_id} from the Hugging Face hub failed: {one_line(exc)}"
        ) from None


def model_folder(name: str, download: bool = False) -> Path:
    """The local folder holding ``name``'s config.json: the folder it names, or the model's snapshot in the
    Hugging Face cache (fetched there first with ``download``); one line naming the value otherwise."""
    import_transformers()  # the extra installed (huggingface_hub comes with it), or one line saying how
    value = name[len(PREFIX) :]
    path = Path(value).expanduser()
    if value and path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model {name!r}: folder {path} has no config.json (a Hugging Face model folder holds one)"
            )
        return path
    if not _REPO_ID.fullmatch(value):
        raise ConfigError(
            f"model {name!r}: {value!r} is neither a folder nor a Hugging Face model name; give hf:FOLDER (holding "
            "config.json) or hf:OWNER/NAME"
        )
    folder = _cached_folder(value)
    if folder is None and download:
        folder = _download(name, value)
    if folder is None:
        from huggingface_hub import constants

        raise ConfigError(
            f"model {name!r}: no folder {value!r} here and {value} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); pass --download to fetch it, or give a local folder with config.json"
        )
    return folder


def canonical_name(name: str, download: bool = False) -> str:
    """``hf:FOLDER`` with the folder made absolute (a checkpoint rebuilds the model from any working directory);
    a hub name is fetched into the cache now with ``download`` and kept as it is. Other names are returned
    unchanged, and so is what does not resolve (``check_model`` says why, before any work)."""
    if not is_hf_name(name):
        return name
    value = name[len(PREFIX) :]
    if value and Path(value).expanduser().is_dir():
        return PREFIX + str(Path(value).expanduser().resolve())
    if download:
        model_folder(name, download=True)
    return name


# ------------------------------------------------------------------------------------------------
# the config


def _config_dict(folder: Path, name: str) -> dict[str, Any]:
    """config.json as JSON, refused in one line when it needs remote code or is no causal LM transformers ships."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model {name!r}: {folder / 'config.json'} is not readable JSON ({one_line(exc)})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"model {name!r}: {folder / 'config.json'} holds a {type(data).__name__}, not a mapping"
        )
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if "auto_map" in data:
        raise ConfigError(
            f"model {name!r} needs remote code (config.json has auto_map: {', '.join(map(str, data['auto_map']))}), "
            "and stratbench never sets trust_remote_code; choose a model whose model_type transformers ships, "
            "e.g. llama, mistral, qwen2, gpt2"
        )
    model_type = data.get("model_type")
    if model_type not in CAUSAL:
        raise ConfigError(
            f"model {name!r}: model_type {model_type!r} is not a causal LM that transformers "
            f"{transformers.__version__} ships (remote code is never run); choose one of: {', '.join(sorted(CAUSAL))}"
        )
    return data


def load_config(name: str, download: bool = False) -> Any:
    """The model's ``PretrainedConfig``, read from its local folder only (no remote code, no network)."""
    folder = model_folder(name, download)
    _config_dict(folder, name)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise ConfigError(
            f"model {name!r}: transformers cannot read {folder / 'config.json'}: {one_line(exc)}"
        ) from None


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position scheme was built for (``max_position_embeddings``; GPT-2's
    ``n_positions`` is the same attribute), None where the config sets none."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def check_hf_model(name: str, text: bool | None = None, seq_len: int | None = None) -> Any:
    """``hf:PATH_OR_NAME`` resolves offline to a causal LM transformers ships, trained on text (``text``
    known), with windows no longer than its positions (``seq_len`` given): its config, or one line."""
    config = load_config(name)
    if text is False:
        raise ConfigError(
            f"model {name!r} is a language model: train it on text data (--data text, tokens:PATH or synthetic-tokens)"
        )
    limit = max_positions(config)
    if seq_len is not None and limit is not None and seq_len > limit:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {name}'s max_position_embeddings of {limit} tokens; choose "
            f"--seq-len at most {limit}"
        )
    return config


def _check_vocab(name: str, config: Any, vocab_size: int) -> None:
    if vocab_size > config.vocab_size:
        raise ConfigError(
            f"the data's vocabulary of {vocab_size} tokens is larger than {name}'s vocab_size "
            f"{config.vocab_size}; use a tokenizer (or --vocab-size) of at most {config.vocab_size} tokens"
        )


def check_vocab(name: str, vocab_size: int) -> None:
    """A vocabulary the model's head covers (``--vocab-size``, before any work; the data's is checked again
    when the model is built, for a tokenizer's or a token file's)."""
    _check_vocab(name, load_config(name), vocab_size)


# ------------------------------------------------------------------------------------------------
# the model


class HFCausalLM(nn.Module):
    """A transformers causal LM as stratbench's language models are: ``forward(tokens)`` with token ids
    (batch, seq) returns logits (batch, seq, vocab_size), vocab_size being the data's (at most the model's)."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.hf = model
        self.vocab_size = vocab_size
        names = set(getattr(model, "_no_split_modules", None) or ())
        # Read by zoo.residual_block_types: the unit of FSDP wrapping and activation checkpointing.
        self._stratbench_block_types = tuple({type(m) for m in model.modules() if type(m).__name__ in names})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ConfigError(
                f"the model takes token ids of shape (batch, seq), not shape {tuple(tokens.shape)}"
            )
        mask = None
        if tokens.is_meta:
            # transformers decides on its causal mask by reading the positions' values (packed sequences?),
            # which the meta device (FLOP counting) has not: the same causal mask, given ready-made.
            t = tokens.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None, None]
        logits = self.hf(input_ids=tokens, attention_mask=mask, use_cache=False).logits
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]


def has_weights(folder: Path) -> bool:
    """Whether the folder holds safetensors weights (one file, or shards with their index)."""
    return any((folder / f).is_file() for f in WEIGHT_FILES)


def build_hf(name: str, vocab_size: int, seq_len: int | None = None) -> HFCausalLM:
    """The model ``name`` for data of ``vocab_size`` tokens: its folder's safetensors weights loaded by
    transformers when there are some, else a random init from its config (seeded by the caller's generator,
    the same on every rank); on the meta device (FLOP counting) always from the config."""
    config = check_hf_model(name, True, seq_len)
    folder = model_folder(name)
    _check_vocab(name, config, vocab_size)
    if (folder / "pytorch_model.bin").is_file() and not has_weights(folder):
        raise ConfigError(
            f"model {name!r}: {folder} holds pytorch_model.bin, a pickle, and no model.safetensors; stratbench "
            "loads safetensors weights only (save them with save_pretrained(..., safe_serialization=True))"
        )
    from transformers import AutoModelForCausalLM

    meta = torch.get_default_device().type == "meta"
    try:
        if has_weights(folder) and not meta:
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                dtype=torch.float32,
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=False,
            )
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except Exception as exc:
        raise ConfigError(f"model {name!r}: transformers could not build it: {one_line(exc)}") from None
    return HFCausalLM(model, vocab_size)


def flops_per_token(model: HFCausalLM, seq_len: int) -> float:
    """Training FLOPs per token, ``6 N + 12 n_layers n_heads head_dim seq_len`` as
    ``transformer.flops_per_token`` counts the built-ins: N the weights that take part in a matmul (every
    linear, the head included; not the embedding lookup), and the attention scores and values over the full
    seq_len x seq_len square."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear

    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear | Conv1D))
    cfg = model.hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len


# ------------------------------------------------------------------------------------------------
# the shape the published activation formula takes (the estimate's cross-check)


@functools.cache
def decoder_shape(name: str, vocab_size: int) -> TransformerConfig | None:
    """``name``'s shape as the built-in transformers' (``TransformerConfig``), for the estimate's activation
    formula: width, heads, layers and MLP width from the config, checked against a decoder layer built on the
    meta device (a gated MLP: two matrices from the width to ``intermediate_size``; heads that split the width).
    None where the layers are not of that kind (GPT-2's plain MLP, a head size apart from width / heads)."""
    config = load_config(name)
    with torch.device("meta"):
        model = build_hf(name, vocab_size)
    types_ = model._stratbench_block_types
    layer = next((m for m in model.modules() if types_ and isinstance(m, types_)), None)
    h, a = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    f = getattr(config, "intermediate_size", None)
    if layer is None or not all(isinstance(v, int) for v in (h, a, f)):
        return None
    to_mlp = [
        m for m in layer.modules() if isinstance(m, nn.Linear) and (m.in_features, m.out_features) == (h, f)
    ]
    if len(to_mlp) != 2 or (getattr(config, "head_dim", None) or h // a) * a != h:
        return None
    try:
        return TransformerConfig(
            vocab_size=vocab_size, dim=h, n_layers=config.num_hidden_layers, n_heads=a,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or a, ffn_hidden=f,
            max_seq_len=max_positions(config) or 1 << 20,
        ).check()  # fmt: skip
    except ConfigError:  # e.g. an odd head size (the built-ins' rotary needs an even one): no formula
        return None
