"""A Hugging Face Llama checkpoint folder as the start of a built-in transformer (``--init-from hf:FOLDER``), and
a built-in transformer as such a folder: the key mapping both ways.

The built-in transformers (``models.transformer``: gpt-tiny, gpt2-small, llama-1b, llama-8b) are Llama's
architecture, so a ``LlamaForCausalLM`` folder (config.json + safetensors, one file or shards) maps onto them
key for key: ``model.embed_tokens`` -> ``tok_embeddings``, ``model.layers.N.self_attn.q_proj`` ->
``layers.N.attention.wq``, ..., ``model.norm`` -> ``norm``, ``lm_head`` -> ``output`` (absent when
``tie_word_embeddings``: the head is the embedding). Every key is accounted for: a key that maps nowhere, or a
parameter no key fills, is one line, never a partial load.

Rotary positions: the built-in model rotates adjacent channel pairs (Meta's layout), Hugging Face's Llama rotates
the two halves of each head (``rotate_half``), and its conversion script permutes the rows of each head of q_proj
and k_proj to match (transformers' ``convert_llama_weights_to_hf.py``, ``permute``). Loading undoes that
permutation, exporting applies it, so the two models compute the same logits.

Loading reads one shard after another through safetensors' memory map: the tensors handed to
``load_state_dict`` are views of the files (q and k, permuted, are the only copies), so a large checkpoint is
not held twice in memory.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.core.files import atomic_output
from stratbench.core.user_code import one_line
from stratbench.models.hf import PREFIX, find_weights, is_hf_name, model_folder
from stratbench.models.transformer import SIZES, RopeScaling, Transformer, TransformerConfig

LAYOUT = "hf-llama"
"""The layout a Hugging Face Llama folder reads as (``checkpoints.checkpoint.read_meta``)."""
SINGLE_FILE, CONFIG_FILE = "model.safetensors", "config.json"
SHOWN = 4
"""Keys a refusal names of each kind, after their count."""

TOP_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
"""Hugging Face's names outside the decoder layers -> the built-in model's."""
LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
"""Hugging Face's names inside ``model.layers.N.`` -> the built-in model's inside ``layers.N.``."""
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OWN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
ROTARY = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads"}
"""The projections whose rows Hugging Face permutes for its rotary layout, and the config field of their heads."""

FIELDS = (
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"),
    ("intermediate_size", "ffn_hidden"),
    ("vocab_size", "vocab_size"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"),
    ("rms_norm_eps", "norm_eps"),
)
"""config.json's fields -> ``TransformerConfig``'s: the shapes, and what else changes the logits."""


# ------------------------------------------------------------------------------------------------
# the key mapping, both ways


def to_builtin_key(key: str) -> str | None:
    """The built-in parameter a Hugging Face Llama key fills; None where it maps nowhere."""
    if key in TOP_KEYS:
        return TOP_KEYS[key]
    match = _HF_LAYER.fullmatch(key)
    if match and match[2] in LAYER_KEYS:
        return f"layers.{match[1]}.{LAYER_KEYS[match[2]]}"
    return None


_TO_HF_TOP = {v: k for k, v in TOP_KEYS.items()}
_TO_HF_LAYER = {v: k for k, v in LAYER_KEYS.items()}


def to_hf_key(key: str) -> str:
    """The Hugging Face Llama key of a built-in parameter (``to_builtin_key``'s inverse)."""
    if key in _TO_HF_TOP:
        return _TO_HF_TOP[key]
    match = _OWN_LAYER.fullmatch(key)
    if match is None or match[2] not in _TO_HF_LAYER:
        raise ConfigError(
            f"{key!r} is not a parameter of the built-in transformer; it has no Hugging Face name"
        )
    return f"model.layers.{match[1]}.{_TO_HF_LAYER[match[2]]}"


def _rotary_heads(key: str, cfg: TransformerConfig) -> int | None:
    """The heads of ``key``'s rows where it is q or k (their rows are permuted between the layouts), else None."""
    match = _OWN_LAYER.fullmatch(key)
    field = ROTARY.get(match[2]) if match else None
    return getattr(cfg, field) if field else None


def to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from Meta's adjacent pairs to Hugging Face's halves per head (transformers' ``permute``)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from Hugging Face's halves per head back to Meta's adjacent pairs (``to_halves``' inverse)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ------------------------------------------------------------------------------------------------
# the folder and its config.json


def is_hf_init(value: str | None) -> bool:
    """Whether ``--init-from`` names a Hugging Face Llama folder (``hf:FOLDER``) rather than a checkpoint."""
    return bool(value) and is_hf_name(value)


def canonical_init(value: str, download: bool = False) -> str:
    """``hf:FOLDER`` with the folder made absolute (the config is read again from other working directories), or
    ``hf:OWNER/NAME`` as its snapshot folder in the local Hugging Face cache (fetched there first with
    ``download``, as ``--model hf:`` is); what does not resolve is returned as it is (``hf_folder`` says why)."""
    path = Path(value[len(PREFIX) :]).expanduser()
    if path.is_dir():
        return PREFIX + str(path.resolve())
    try:
        return PREFIX + str(model_folder(value, download))
    except ConfigError:
        return value


def hf_folder(value: str) -> Path:
    """The folder ``hf:FOLDER`` names, holding config.json, or one line."""
    path = Path(value[len(PREFIX) :]).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--init-from {value}: no folder {str(path)!r}, and no model of that name in the Hugging Face cache; "
            "give hf:FOLDER, a Hugging Face Llama checkpoint folder (config.json and safetensors weights), or "
            "hf:OWNER/NAME of the cache (--download fetches it)"
        )
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"--init-from {value}: folder {path} has no {CONFIG_FILE} (a Hugging Face folder holds one)"
        )
    return path


def _rope(data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """rope_theta and the rope parameters (their ``rope_type``), from transformers 5's ``rope_parameters`` or
    the older top-level ``rope_theta`` / ``rope_scaling``."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    return theta, params | {"rope_type": params.get("rope_type") or params.get("type") or "default"}


def _scaling(params: dict[str, Any]) -> RopeScaling | None:
    """The built-in ``RopeScaling`` of Llama 3.1's ``llama3`` rope parameters; None for plain ones."""
    if params["rope_type"] == "default":
        return None
    default = RopeScaling()
    return RopeScaling(
        factor=float(params.get("factor", default.factor)),
        low_freq_factor=float(params.get("low_freq_factor", default.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", default.high_freq_factor)),
        original_max_seq_len=int(
            params.get("original_max_position_embeddings", default.original_max_seq_len)
        ),
    )


@functools.cache
def read_config(value: str) -> dict[str, Any]:
    """config.json's fields of ``FIELDS`` (transformers' defaults where absent), or one line where the folder is
    no plain Llama: another model_type, an activation other than SiLU, biases, a head size apart from
    hidden / heads, or rotary scaling the built-in transformers do not implement."""
    path = hf_folder(value) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--init-from {value}: {path} is not readable JSON ({one_line(exc)})") from None
    if not isinstance(data, dict) or data.get("model_type") != "llama":
        kind = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            f"--init-from {value}: {path} has model_type {kind!r}; the built-in transformers start from a Llama "
            "folder (model_type 'llama'); train another model as --model hf:FOLDER"
        )
    theta, rope = _rope(data)
    kind = rope["rope_type"]
    heads, hidden = data.get("num_attention_heads", 32), data.get("hidden_size", 4096)
    head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    checks = (
        (data.get("hidden_act", "silu") != "silu", f"hidden_act {data.get('hidden_act')!r} (the built-ins use 'silu')"),
        (bool(data.get("attention_bias")), "attention_bias true (the built-ins have no biases)"),
        (bool(data.get("mlp_bias")), "mlp_bias true (the built-ins have no biases)"),
        (kind not in ("default", "llama3"), f"rope type {kind!r} (the built-ins implement 'default' and 'llama3')"),
        (data.get("head_dim") not in (None, head_dim),
         f"head_dim {data.get('head_dim')} (the built-ins' is hidden_size / num_attention_heads)"),
    )  # fmt: skip
    why = [text for bad, text in checks if bad]
    if why:
        raise ConfigError(f"--init-from {value}: {path} has {'; '.join(why)}")
    defaults = {  # LlamaConfig's, for a field config.json leaves out
        "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    fields = {k: data.get(k, defaults.get(k)) for k, _ in FIELDS}
    fields.update(num_attention_heads=heads, num_key_value_heads=data.get("num_key_value_heads") or heads,
                  rope_theta=float(theta), rope_scaling=_scaling(rope))  # fmt: skip
    return fields


def shape_of(fields: dict[str, Any], max_seq_len: int = 1 << 20) -> TransformerConfig:
    """The built-in ``TransformerConfig`` of a Llama config.json's fields (``read_config``)."""
    try:
        return TransformerConfig(
            **{own: fields[hf] for hf, own in FIELDS}, max_seq_len=max_seq_len, init="llama"
        ).check()
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"config.json describes no built-in transformer: {one_line(exc)}") from None


# ------------------------------------------------------------------------------------------------
# the checks, before any work


def _describe(name: str, cfg: TransformerConfig) -> str:
    rope = f"rope_theta {cfg.rope_theta:g}" + (", llama3 rope scaling" if cfg.rope_scaling else "")
    return (
        f"{name} (hidden {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, "
        f"intermediate {cfg.ffn_hidden}, {'tied' if cfg.tie_embeddings else 'untied'}, {rope}, eps {cfg.norm_eps:g})"
    )


def check_size(value: str, model: str, vocab_size: int | None) -> None:
    """config.json of ``hf:FOLDER`` matches the built-in size ``model`` field for field, its vocabulary the
    run's ``vocab_size`` (where known); else one line naming the mismatched fields and the sizes there are."""
    if model not in SIZES or SIZES[model].is_moe:  # a Llama folder has no experts
        dense = ", ".join(n for n, c in SIZES.items() if not c.is_moe)
        raise ConfigError(
            f"--init-from {value} maps a Hugging Face Llama folder onto a dense built-in transformer "
            f"({dense}), not --model {model}; train a Hugging Face model as --model hf:FOLDER"
        )
    fields = read_config(value)
    own = SIZES[model] if vocab_size is None else replace(SIZES[model], vocab_size=vocab_size)
    shape = [(hf, attr) for hf, attr in FIELDS if hf != "vocab_size" and fields[hf] != getattr(own, attr)]
    differ = [f"{hf} {fields[hf]} ({model}: {getattr(own, attr)})" for hf, attr in shape]
    if fields["vocab_size"] != own.vocab_size:
        differ.append(
            f"vocab_size {fields['vocab_size']} (the run's vocabulary: {own.vocab_size}; --vocab-size and the "
            "tokenizer decide it)"
        )
    if not differ:
        return
    fits = [
        n
        for n, c in SIZES.items()
        if all(fields[hf] == getattr(c, a) for hf, a in FIELDS if hf != "vocab_size")
    ]
    sizes = ", ".join(_describe(n, c) for n, c in SIZES.items())
    where = (
        f"; it is {fits[0]}'s shape: --model {fits[0]} (the built-in sizes: {', '.join(SIZES)})"
        if fits
        else f"; the built-in sizes are {sizes}"
    )
    raise ConfigError(
        f"--init-from {value}: config.json does not match --model {model}: {', '.join(differ)}"
        + (where if shape else "")
    )


def weight_files(value: str) -> tuple[Path, ...]:
    """The folder's safetensors files in one of save_pretrained's layouts (``hf.find_weights``), or one line."""
    folder = hf_folder(value)
    weights = find_weights(value, folder)
    if weights is None:
        raise ConfigError(
            f"--init-from {value}: {folder} holds no safetensors weights (model.safetensors, or shards with "
            "model.safetensors.index.json); stratbench reads safetensors only"
        )
    if weights.index is None:
        return weights.files
    shards = sorted(set(json.loads(weights.index.read_text())["weight_map"].values()))
    return tuple(folder / s for s in shards)


def _some(items: list[str]) -> str:
    head = ", ".join(items[:SHOWN])
    return head if len(items) <= SHOWN else f"{head} and {len(items) - SHOWN} more"


@functools.cache
def check_keys(value: str) -> None:
    """Every tensor of the folder maps onto a parameter of the built-in model its config.json describes, each
    parameter gets one, shapes equal (read from the safetensors headers alone); else one line naming them."""
    from safetensors import safe_open

    with torch.device("meta"):
        own = Transformer(shape_of(read_config(value))).state_dict()
    shapes: dict[str, tuple[int, ...]] = {}
    unmapped, mis_shaped = [], []
    for path in weight_files(value):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                target = to_builtin_key(key)
                if target is None or target not in own:
                    unmapped.append(key)
                    continue
                shapes[target] = tuple(f.get_slice(key).get_shape())
                if shapes[target] != tuple(own[target].shape):
                    mis_shaped.append(f"{key} {list(shapes[target])} (expected {list(own[target].shape)})")
    tied = read_config(value)["tie_word_embeddings"]  # no lm_head.weight: the head is the embedding
    missing = [to_hf_key(k) for k in own if k not in shapes and not (tied and k == "output.weight")]
    problems = [
        f"{len(unmapped)} key(s) that map to no parameter of the built-in transformer: {_some(unmapped)}" * bool(unmapped),
        f"no tensor for {len(missing)} parameter(s): {_some(missing)}" * bool(missing),
        f"{len(mis_shaped)} tensor(s) of another shape: {_some(mis_shaped)}" * bool(mis_shaped),
    ]  # fmt: skip
    if any(problems):
        raise ConfigError(
            f"--init-from {value}: the folder's weights do not map onto the built-in transformer: "
            f"{'; '.join(p for p in problems if p)}"
        )


def check_init(value: str, model: str, vocab_size: int | None) -> None:
    """``--init-from hf:FOLDER`` before any work: a Llama folder whose config.json is ``model``'s size and
    whose every key maps (one line otherwise)."""
    check_size(value, model, vocab_size)
    check_keys(value)


def folder_vocab(value: str) -> int | None:
    """config.json's ``vocab_size`` (the run's vocabulary where none is given); None where unreadable (the
    checks say why)."""
    try:
        return int(read_config(value)["vocab_size"])
    except (ConfigError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------
# loading and writing


def builtin_state(value: str) -> dict[str, torch.Tensor]:
    """The folder's weights under the built-in names, q/k in the built-in rotary layout, read shard by shard
    through safetensors' memory map (views of the files, not copies), in the files' dtype; a tied head is the
    embedding. ``check_keys`` has accounted for every key."""
    from safetensors import safe_open

    check_keys(value)
    cfg = shape_of(read_config(value))
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(value):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = to_builtin_key(key)
                tensor = f.get_tensor(key)
                heads = _rotary_heads(name, cfg)
                state[name] = tensor if heads is None else to_pairs(tensor, heads)
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def hf_config(cfg: TransformerConfig) -> dict[str, Any]:
    """The Hugging Face config.json a built-in transformer's weights imply (``LlamaForCausalLM``)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_hidden,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "rope_scaling": None if cfg.rope_scaling is None else {
            "rope_type": "llama3", "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len,
        },
    }  # fmt: skip


def hf_state(state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """A built-in transformer's state dict under Hugging Face's names, q/k in its rotary layout; a tied head is
    left out (transformers ties it to the embedding on load)."""
    out = {}
    for key, tensor in state.items():
        if cfg.tie_embeddings and key == "output.weight":
            continue
        heads = _rotary_heads(key, cfg)
        out[to_hf_key(key)] = (tensor if heads is None else to_halves(tensor, heads)).contiguous()
    return out


def save_hf_folder(
    model: nn.Module, folder: Path, dtype: torch.dtype | None = None, extra: dict[str, str] | None = None
) -> Path:
    """Write a built-in transformer as a Hugging Face Llama folder (config.json + model.safetensors, in ``dtype``
    or the weights' own) that ``LlamaForCausalLM.from_pretrained`` loads, with ``extra`` text files (name ->
    text) beside them, atomically (a folder replaced whole)."""
    from safetensors.torch import save_file

    if not isinstance(model, Transformer):
        raise ConfigError(
            f"only a built-in transformer maps onto a Hugging Face Llama, not {type(model).__name__}"
        )
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    state = hf_state(state, model.config)
    config = hf_config(model.config) | {
        "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch.")
    }
    with atomic_output(Path(folder)) as tmp:
        tmp.mkdir()
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file(state, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
    return Path(folder)
