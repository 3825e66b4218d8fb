"""Hugging Face ``transformers`` causal language models as ``--model hf:PATH_OR_NAME`` (the optional ``hf`` extra).

``PATH_OR_NAME`` is a local folder holding a ``config.json`` (and, optionally, ``*.safetensors`` weights), or a
Hugging Face model name (``owner/name``) already in the local Hugging Face cache; the hub is asked only with
``--download``. Everything else is offline (``local_files_only``), and a model that needs remote code (its
config.json has ``auto_map``, or its ``model_type`` is not one transformers ships) is refused: stratbench never
sets ``trust_remote_code``.

Before anything is built, stratbench refuses in one line: a model whose attention sees later tokens (an encoder
family without ``"is_decoder": true``; and, on the built model, earlier logits that change when a later token
changes), a model whose fp32 weights alone exceed the memory this host has available (parameters counted on the
meta device), and weights that would not load whole (a missing, unexpected or mis-shaped key, a pickle, a shard
missing). Safetensors weights are read in every layout ``save_pretrained`` writes: ``model.safetensors``, shards
with their ``model.safetensors.index.json``, and ``model-NNNNN-of-NNNNN.safetensors`` shards without an index.

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
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.core.tables import fmt_bytes
from stratbench.core.torchvision_compat import guard_torchvision_import
from stratbench.core.user_code import one_line
from stratbench.models.hf_moe import HFRouting, config_experts, use_stratbench_experts
from stratbench.models.moe import has_data
from stratbench.models.transformer import TransformerConfig

PREFIX = "hf:"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_SHARD = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")
"""What save_pretrained names the shards of a sharded save (their index beside them, unless it was lost)."""
PICKLED_WEIGHTS = "pytorch_model*.bin"
SHOWN_KEYS = 3
"""Keys a refusal names of each kind (missing, unexpected, mis-shaped), after their count."""
CAUSAL_PROBE_TOKENS = 8
"""Tokens of the causality check: the last one changes, the logits of the others must not."""
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
"""What ``--download`` fetches of a hub model: config, safetensors weights, tokenizer files (no pickles, no code)."""


def is_hf_name(name: str) -> bool:
    """Whether ``--model name`` is a Hugging Face model (``hf:PATH_OR_NAME``)."""
    return name.startswith(PREFIX)


def import_transformers() -> Any:
    """The transformers package (an optional extra); torchvision guarded first, since transformers imports it
    when installed and PyPI's CUDA torchvision fails to import on a CPU torch (core.torchvision_compat)."""
    guard_torchvision_import()
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


def default_seq_len(name: str, default: int) -> int:
    """The window a run of ``name`` gets when ``--seq-len`` is not given: ``default``, or the model's positions
    where it has fewer (a default follows the model; only an explicit --seq-len too long is refused). A model
    that does not resolve keeps ``default``: ``check_hf_model`` says why, before any work."""
    try:
        limit = max_positions(load_config(name))
    except ConfigError:
        return default
    return min(default, limit) if limit else default


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings, load report and progress bars off for a while: stratbench says what matters in
    one line (an encoder's "add is_decoder=True" warning, a MISSING-keys table and a "Loading weights" bar
    would otherwise be printed around it)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class MetaFacts:
    """What a build on the meta device tells of a config, at no memory cost: its parameters (tied ones once)
    and the attention it builds (``bidirectional``: the reason it sees later tokens, else None)."""

    parameters: int
    bidirectional: str | None


_META_FACTS: dict[str, MetaFacts] = {}
"""Per config (its JSON): one meta build per process, though a run checks its model several times."""


def meta_facts(name: str, config: Any) -> MetaFacts:
    """Build ``config``'s causal LM on the meta device (a second or two for trillions of parameters) and read
    its parameter count and whether it is a decoder; one line where transformers cannot build it."""
    key = config.to_json_string(use_diff=False)
    if key not in _META_FACTS:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"), quiet_transformers():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except Exception as exc:
            raise ConfigError(f"model {name!r}: transformers could not build it: {one_line(exc)}") from None
        parameters = sum(p.numel() for p in model.parameters())
        _META_FACTS[key] = MetaFacts(parameters, _bidirectional(config.model_type, model.config))
    return _META_FACTS[key]


PLAIN_ATTENTION_KWARGS = frozenset(
    {"dropout", "scaling", "position_ids", "use_cache", "cache", "cache_position", "output_attentions"}
)
"""What a plain causal attention hands transformers' attention interface besides q, k, v and the mask (None or
False values of other names too: a feature switched off)."""


@dataclass(frozen=True)
class AttentionCalls:
    """What a model's attentions hand transformers' attention interface (``AttentionInterface``) in one forward,
    recorded on the meta device: one (heads, key/value heads, head size) per call, whether every calling module
    is causal, its sliding windows, the keyword arguments beyond a plain causal attention's (name=value), whether
    the model takes ``position_ids``, and why the forward failed (None when it ran)."""

    shapes: tuple[tuple[int, int, int], ...] = ()
    causal: bool = True
    windows: tuple[int, ...] = ()
    extras: tuple[str, ...] = ()
    takes_positions: bool = True
    error: str | None = None


_ATTENTION_CALLS: dict[str, AttentionCalls] = {}
"""Per config (its JSON): one meta build and forward per process."""


def attention_calls(name: str) -> AttentionCalls:
    """``name``'s attentions as one forward of 4 tokens on the meta device shows them, through a recording
    implementation registered in transformers' ``AttentionInterface`` (what context parallelism replaces);
    a model whose attention does not go through it records no call."""
    config = load_config(name)
    key = config.to_json_string(use_diff=False)
    if key not in _ATTENTION_CALLS:
        _ATTENTION_CALLS[key] = _record_attention(config)
    return _ATTENTION_CALLS[key]


def _record_attention(config: Any) -> AttentionCalls:
    import inspect

    from transformers import AttentionInterface, AutoModelForCausalLM

    calls: list[tuple[tuple[int, int, int], bool, dict[str, Any]]] = []

    def record(module, query, key, value, mask, **kwargs):
        shape = (query.shape[1], key.shape[1], query.shape[3])
        calls.append((shape, getattr(module, "is_causal", False), kwargs))
        b, h, t, _ = query.shape
        return query.new_empty(b, t, h, value.shape[3]), None

    AttentionInterface.register("stratbench_probe", record)
    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
            model.set_attn_implementation("stratbench_probe")
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    except Exception as exc:
        return AttentionCalls(error=one_line(exc))
    plain = PLAIN_ATTENTION_KWARGS | {"sliding_window"}
    extras = {f"{k}={'a tensor' if torch.is_tensor(v) else repr(v)}" for _, _, kw in calls for k, v in kw.items()
              if k not in plain and v is not None and v is not False}  # fmt: skip
    return AttentionCalls(
        shapes=tuple(shape for shape, _, _ in calls),
        causal=all(causal is True for _, causal, _ in calls),
        windows=tuple(sorted({kw["sliding_window"] for _, _, kw in calls if kw.get("sliding_window")})),
        extras=tuple(sorted(extras)),
        takes_positions="position_ids" in inspect.signature(model.forward).parameters,
    )


def parameter_count(name: str) -> int:
    """Parameters of the model ``hf:...`` (tied weights once), counted on the meta device from its config alone:
    what the memory check, and an estimate, need without building it."""
    return meta_facts(name, load_config(name)).parameters


def _bidirectional(model_type: str, config: Any) -> str | None:
    """Why a model transformers ships as a causal LM attends to later tokens, read from its built config (the
    causal-LM class may set ``is_decoder`` itself, as BART's does): an encoder family (one transformers also
    ships as a masked LM) that is no decoder, or bidirectional attention switched on; None for a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    if getattr(config, "use_bidirectional_attention", False):
        return "config.json sets use_bidirectional_attention"
    decoder = getattr(config, "is_decoder", False) or getattr(config, "causal", False)
    if model_type in MASKED and not decoder:
        return 'an encoder unless config.json sets "is_decoder": true'
    return None


def check_decoder(name: str, config: Any) -> None:
    """A causal LM only: a model whose attention sees later tokens would learn to copy the next token (its loss
    falls, and it predicts nothing), so it is refused before any work."""
    why = meta_facts(name, config).bidirectional
    if why:
        raise ConfigError(
            f"model {name!r}: model_type {config.model_type!r} is not a decoder ({why}), so each token sees the "
            "ones after it; stratbench trains causal LMs: a decoder model_type (llama, mistral, qwen2, gpt2, ...) "
            'or an encoder family with "is_decoder": true'
        )


def check_hf_model(name: str, text: bool | None = None, seq_len: int | None = None) -> Any:
    """``hf:PATH_OR_NAME`` resolves offline to a causal LM transformers ships, a decoder, trained on text
    (``text`` known), with windows no longer than its positions (``seq_len`` given): its config, or one line."""
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
    check_decoder(name, config)
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


def is_hf_moe(name: str) -> bool:
    """Whether ``name`` is a Hugging Face mixture of experts (``models.hf_moe``: a config with routed experts and
    a router auxiliary loss); False for a dense one and for a name that does not resolve (``check_model`` says why)."""
    if not is_hf_name(name):
        return False
    try:
        return config_experts(load_config(name)) > 0
    except ConfigError:
        return False


def vocab_size_of(name: str) -> int:
    """The model's vocabulary (its config's ``vocab_size``): the token ids its embedding takes, 0..vocab_size-1."""
    return int(load_config(name).vocab_size)


def check_memory(
    name: str, parameters: int, available: int | None = None, bytes_per_parameter: int = 4
) -> None:
    """Refuse a model whose weights (fp32: ``bytes_per_parameter`` 4, as stratbench builds every model) exceed
    ``available`` bytes (default: this host's available memory), naming both, before it is built: a build that
    does not fit climbs until the kernel kills it."""
    need = parameters * bytes_per_parameter
    free = psutil.virtual_memory().available if available is None else available
    if need > free:
        raise ConfigError(
            f"model {name!r} has {parameters:,} parameters: building it in fp32 takes {fmt_bytes(need)}, more than "
            f"the {fmt_bytes(free)} of memory available on this host; choose a smaller config"
        )


# ------------------------------------------------------------------------------------------------
# the weights: every safetensors layout save_pretrained writes, loaded whole or refused


@dataclass(frozen=True)
class Weights:
    """A folder's safetensors weights: ``index`` (model.safetensors.index.json: transformers reads it), or
    ``files`` (model.safetensors, or shards whose index is missing: stratbench writes their index)."""

    folder: Path
    index: Path | None = None
    files: tuple[Path, ...] = ()


def find_weights(name: str, folder: Path) -> Weights | None:
    """The folder's safetensors weights in one of save_pretrained's layouts, None where it holds none (a config
    alone: a random init); one line for weights stratbench would not load whole (a pickle, a shard missing,
    safetensors files under other names)."""
    if (folder / INDEX_FILE).is_file():
        return _indexed(name, folder)
    if (folder / SINGLE_FILE).is_file():
        return Weights(folder, files=(folder / SINGLE_FILE,))
    shards = sorted(p for p in folder.glob("*.safetensors") if _SHARD.fullmatch(p.name))
    if shards:
        return Weights(folder, files=_complete(name, folder, shards))
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        raise ConfigError(
            f"model {name!r}: {folder} holds {_some(others)}, which is not a layout of a model's weights "
            f"({SINGLE_FILE}, {INDEX_FILE} with its shards, or model-NNNNN-of-NNNNN.safetensors shards); rename "
            "it, or save the model with save_pretrained"
        )
    pickles = sorted(p.name for p in folder.glob(PICKLED_WEIGHTS))
    if pickles:
        raise ConfigError(
            f"model {name!r}: {folder} holds {_some(pickles)}, a pickle, and no safetensors weights; stratbench loads "
            "safetensors weights only (save them with save_pretrained(..., safe_serialization=True))"
        )
    return None


def _indexed(name: str, folder: Path) -> Weights:
    """The index's shards, all there, or one line naming the missing ones."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"model {name!r}: {index} is not a safetensors index with a weight_map ({one_line(exc)})"
        ) from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ConfigError(
            f"model {name!r}: {index} names {len(missing)} shard(s) that are not in {folder}: {_some(missing)}"
        )
    return Weights(folder, index=index)


def _complete(name: str, folder: Path, shards: list[Path]) -> tuple[Path, ...]:
    """Shards of one save, numbered 1..N of N, or one line naming what is missing or mixed."""
    totals = {int(_SHARD.fullmatch(p.name)[2]) for p in shards}
    if len(totals) != 1:
        raise ConfigError(
            f"model {name!r}: {folder} holds shards of different saves ({_some([p.name for p in shards])}: "
            f"of {', '.join(map(str, sorted(totals)))}); keep one save's shards"
        )
    total = totals.pop()
    numbers = {int(_SHARD.fullmatch(p.name)[1]) for p in shards}
    missing = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1) if i not in numbers]
    if missing:
        raise ConfigError(
            f"model {name!r}: {folder} has {len(numbers)} of the {total} shards of its weights; missing: "
            f"{_some(missing)}"
        )
    return tuple(shards)


def _some(items: Iterable[str], shown: int = SHOWN_KEYS) -> str:
    """``a, b, c and 4 more``: the first few of a list, and how many more."""
    items = list(items)
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head} and {len(items) - shown} more"


@contextmanager
def _readable_folder(weights: Weights) -> Iterator[Path]:
    """A folder transformers loads the weights from: the model's own, or, for shards without their index, a
    temporary one holding links to them and the index stratbench writes from their headers (their keys only;
    the user's folder is not written to)."""
    if weights.index is not None or weights.files == (weights.folder / SINGLE_FILE,):
        yield weights.folder
        return
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="stratbench-hf-") as tmp:
        for path in [
            *weights.folder.glob("*.json"),
            *weights.files,
        ]:  # config.json, generation_config.json, ...
            (Path(tmp) / path.name).symlink_to(path.resolve())
        for path in weights.files:
            with safe_open(str(path), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), path.name))
        (Path(tmp) / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        yield Path(tmp)


def _check_loaded(name: str, folder: Path, info: dict[str, Any]) -> None:
    """Every key of the model came from the weights and every key of the weights went into the model, each of
    its shape; else one line naming how many of each kind and the first few (a model half trained from the
    weights and half from a random init measures nothing a user meant)."""
    problems = []
    for kind, keys in (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"])):
        if keys:
            problems.append(f"{len(keys)} {kind} ({_some(sorted(keys))})")
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        shapes = [f"{k} {tuple(saved)} vs {tuple(model)}" for k, saved, model in mismatched]
        problems.append(f"{len(mismatched)} of another shape ({_some(shapes)})")
    if problems:
        raise ConfigError(
            f"model {name!r}: the weights in {folder} do not fit its config.json: keys {'; '.join(problems)}; "
            "stratbench trains from a folder's weights only when every key loads (save them with save_pretrained)"
        )


def _load(name: str, config: Any, weights: Weights) -> nn.Module:
    """The model with ``weights`` loaded by transformers (its key renames and conversions applied), in fp32."""
    from transformers import AutoModelForCausalLM

    with _readable_folder(weights) as folder, quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            config=config,
            dtype=torch.float32,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=False,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below with the other keys, in one line
        )
    _check_loaded(name, weights.folder, info)
    return model


# ------------------------------------------------------------------------------------------------
# the model


class HFCausalLM(nn.Module):
    """A transformers causal LM as stratbench's language models are: ``forward(tokens)`` with token ids
    (batch, seq) returns logits (batch, seq, vocab_size), vocab_size being the data's (at most the model's).
    A mixture of experts (``models.hf_moe``) runs its experts by stratbench's loop and keeps each training
    forward's routing in ``routing``."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.hf = model
        self.vocab_size = vocab_size
        self.routing = HFRouting.of(model)
        """The routing of a mixture of experts (its aux loss and counts, ``models.hf_moe``); None when dense."""
        if self.routing is not None:
            use_stratbench_experts(model)
        names = set(getattr(model, "_no_split_modules", None) or ())
        # Read by zoo.residual_block_types: the unit of FSDP wrapping and activation checkpointing.
        self._stratbench_block_types = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
        self.chunk = 0
        """Which chunk of its sequences a forward's tokens are: positions start at ``chunk`` x their length (a
        context-parallel rank feeds chunk r of T / C positions, rotated or embedded at their global positions)."""

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
        positions = None
        if self.chunk:
            t = tokens.shape[1]
            positions = torch.arange(self.chunk * t, (self.chunk + 1) * t, device=tokens.device)[None]
        # a training forward of a mixture of experts returns its router logits and aux loss, for the training loss;
        # no other does (an evaluation, or a meta-device one, whose causal mask the aux loss would take for padding)
        routed = self.routing is not None and torch.is_grad_enabled() and has_data(tokens)
        moe = {"output_router_logits": routed} if self.routing is not None else {}
        out = self.hf(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False, **moe)
        if routed:
            self.routing.keep(out.aux_loss, out.router_logits)
        logits = out.logits
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]


def check_routing(name: str, model: HFCausalLM) -> None:
    """A config with routed experts builds a model whose routers and stacked experts ``models.hf_moe`` finds, or is
    refused in one line: trained without them, it would miss its aux loss, its counts and its active parameters."""
    config = model.hf.config
    if model.routing is None and config_experts(config):
        raise ConfigError(
            f"model {name!r}: model_type {config.model_type!r} is a mixture of experts whose routers (recorded as "
            "router_logits) or stacked (E, ...) experts stratbench does not find; it trains mixtures of experts of "
            "that kind, e.g. mixtral, qwen2_moe, qwen3_moe"
        )


def check_causal(name: str, model: HFCausalLM, positions: int | None) -> None:
    """The logits of a token must not depend on the tokens after it: one forward (eval mode, no grad) of a few
    random tokens and of the same tokens with their second half changed; the first half's logits must agree
    (a causal model gives them bit for bit on CPU; an encoder at init moves them by ~1e-3 of their size).
    Catches what the config does not say (custom attention, a mask that looks both ways)."""
    t = min(CAUSAL_PROBE_TOKENS, positions or CAUSAL_PROBE_TOKENS)
    if t < 2:
        return
    half = t // 2
    generator = torch.Generator().manual_seed(0)  # its own: the global RNG (dropout, the data) is untouched
    tokens = torch.randint(0, model.vocab_size, (1, t), generator=generator).repeat(2, 1)
    tokens[1, half:] = (tokens[0, half:] + 1) % model.vocab_size
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(tokens.to(next(model.parameters()).device)).float()[:, :half]
    finally:
        model.train(training)
    change = (logits[0] - logits[1]).abs().max().item()
    if not change <= 1e-5 * logits.abs().max().item():
        raise ConfigError(
            f"model {name!r} is not causal: changing tokens {half}..{t - 1} of {t} changed the logits of tokens "
            f"0..{half - 1} (by up to {change:.3g}); model_type {model.hf.config.model_type!r} attends to later "
            "tokens here, and stratbench trains causal LMs (a decoder model_type such as llama, mistral, qwen2, gpt2)"
        )


def build_hf(name: str, vocab_size: int, seq_len: int | None = None) -> HFCausalLM:
    """The model ``name`` for data of ``vocab_size`` tokens: its folder's safetensors weights loaded whole by
    transformers when there are some, else a random init from its config (seeded by the caller's generator,
    the same on every rank), checked to fit this host's memory first and to be causal after; on the meta
    device (FLOP counting) always from the config, unchecked."""
    config = check_hf_model(name, True, seq_len)
    folder = model_folder(name)
    _check_vocab(name, config, vocab_size)
    weights = find_weights(name, folder)
    from transformers import AutoModelForCausalLM

    if torch.get_default_device().type == "meta":
        with quiet_transformers():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        wrapped = HFCausalLM(model, vocab_size)
        check_routing(name, wrapped)
        return wrapped
    check_memory(name, meta_facts(name, config).parameters)
    try:
        if weights is not None:
            model = _load(name, config, weights)
        else:
            with quiet_transformers():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"model {name!r}: transformers could not build it: {one_line(exc)}") from None
    wrapped = HFCausalLM(model, vocab_size)
    check_routing(name, wrapped)
    check_causal(name, wrapped, max_positions(config))
    return wrapped


def flops_per_token(model: HFCausalLM, seq_len: int) -> float:
    """Training FLOPs per token, ``6 N + 12 n_layers n_heads head_dim seq_len`` as
    ``transformer.flops_per_token`` counts the built-ins: N the weights that take part in a matmul (every
    linear, the head included; not the embedding lookup; of a mixture of experts, its routers and k of each routed
    layer's E experts), and the attention scores and values over the full
    seq_len x seq_len square."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear

    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear | Conv1D))
    if model.routing is not None:  # a mixture of experts: its routers, and k of each layer's E experts
        n += model.routing.active_matmul_weights()
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
