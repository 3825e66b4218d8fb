"""Models: torchvision ResNets (optionally with a CIFAR stem) and ``tinynet``, a small BatchNorm-free CNN.

BatchNorm statistics differ between one device and several, so the cross-method equivalence tests use
``tinynet`` (GroupNorm or no normalisation). Each model's blocks are found by one rule (``models.blocks``), so
that FSDP wrapping and activation checkpointing act per block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.core.torchvision_compat import import_torchvision
from stratbench.core.user_code import call_user, check_signature, import_builder, one_line
from stratbench.models.blocks import block_types, why_no_blocks
from stratbench.models.flops import example_input
from stratbench.models.hf import HFCausalLM, build_hf, check_hf_model, is_hf_moe, is_hf_name
from stratbench.models.hf import decoder_shape as hf_decoder_shape
from stratbench.models.moe import LayerRouting, Routing, moe_layers
from stratbench.models.transformer import SIZES, TransformerConfig, build_transformer, transformer_config

IMAGE_MODELS = ("tinynet", "resnet18", "resnet34", "resnet50")
MODELS = (*IMAGE_MODELS, *SIZES)
"""Built-in models: image classifiers, then the decoder-only transformers (``models.transformer.SIZES``)."""


class TinyBlock(nn.Module):
    """conv-norm-relu x2 with a residual connection (projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            return nn.GroupNorm(min(8, c), c) if norm == "group" else nn.Identity()

        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=norm == "none")
        self.norm1 = norm_layer(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=norm == "none")
        self.norm2 = norm_layer(cout)
        self.act = nn.ReLU(inplace=False)
        self.shortcut = (
            nn.Identity() if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class TinyNet(nn.Module):
    """stem conv + 3 residual stages (width, 2w, 4w) + 4x4 average pool + linear."""

    _stratbench_block_types = (TinyBlock,)
    """Read by ``models.blocks.find_blocks``: declared, since its head can outweigh the blocks (1000 classes)."""

    def __init__(self, num_classes: int = 10, width: int = 32, norm: str = "group") -> None:
        super().__init__()
        stem_norm = nn.GroupNorm(min(8, width), width) if norm == "group" else nn.Identity()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=norm == "none"), stem_norm, nn.ReLU())
        self.blocks = nn.Sequential(
            TinyBlock(width, width, 1, norm),
            TinyBlock(width, 2 * width, 2, norm),
            TinyBlock(2 * width, 4 * width, 2, norm),
        )
        # A 4x4 pooled map, not global pooling: on small digits the layout matters, and a global average
        # of a 3-stage net's features trains far slower.
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(4 * width * 16, num_classes)
        for m in self.modules():  # ResNet's initialisation: without it training stalls for an epoch or two
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def residual_block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The block classes to wrap (FSDP) or checkpoint: one unit per block, found by ``models.blocks``' rule."""
    return block_types(model)


def _resnet(name: str, num_classes: int, cifar_stem: bool) -> nn.Module:

    model = getattr(import_torchvision().models, name)(weights=None, num_classes=num_classes)
    if cifar_stem:
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def is_language_model(name: str) -> bool:
    """Whether ``name`` is a built-in or Hugging Face language model (it takes token ids; its output width is the
    vocabulary)."""
    return name in SIZES or is_hf_name(name)


def is_moe_model(name: str) -> bool:
    """Whether ``name`` is a built-in mixture of experts (``models.transformer.SIZES`` with experts); a Hugging
    Face one is ``hf.is_hf_moe``."""
    return name in SIZES and SIZES[name].is_moe


def model_routing(model: nn.Module) -> Routing | None:
    """The routing of a mixture of experts as the training loop sees it (its load-balancing loss, counts and
    active parameters): the built-in MoE layers', a Hugging Face MoE's (``models.hf_moe``); None for a dense model."""
    if isinstance(model, HFCausalLM):
        return model.routing
    layers = moe_layers(model)
    return LayerRouting(layers) if layers else None


def moe_overrides(name: str, top_k: int | None, capacity_factor: float | None) -> dict[str, int | float]:
    """The MoE routing a run asks of model ``name`` (``--moe-top-k``, ``--capacity-factor``), checked: an MoE size,
    a top-k from 1 to its experts, a capacity factor > 0; one line naming the value otherwise. Empty: the size's."""
    given = {"moe_top_k": top_k, "capacity_factor": capacity_factor}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return {}
    flag = "--moe-top-k" if top_k is not None else "--capacity-factor"
    value = top_k if top_k is not None else capacity_factor
    if is_hf_moe(name):
        how = "its top-k is config.json's num_experts_per_tok" if top_k is not None else "its routing is dropless"
        raise ConfigError(
            f"{flag} {value}: model {name!r} is a Hugging Face mixture of experts, routed as transformers routes it "
            f"({how}); the flag takes a built-in MoE ({', '.join(n for n, c in SIZES.items() if c.is_moe)})"
        )
    if not is_moe_model(name):
        moes = ", ".join(n for n, c in SIZES.items() if c.is_moe)
        raise ConfigError(f"{flag} {value} applies to a mixture of experts ({moes}); model {name!r} has none")
    experts = SIZES[name].n_experts
    if top_k is not None and (isinstance(top_k, bool) or not 1 <= top_k <= experts):
        raise ConfigError(f"--moe-top-k {top_k} must be from 1 to {name}'s {experts} experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(f"--capacity-factor {capacity_factor} must be > 0 (omit it for dropless routing)")
    return given


def decoder_shape(name: str, vocab_size: int) -> TransformerConfig | None:
    """A language model's shape as ``TransformerConfig`` (a built-in size, or a Hugging Face config whose layers
    are of that kind: ``hf.decoder_shape``), for the published activation formula; None for other models and for
    a mixture of experts (the formula's MLP is one dense SwiGLU; the trace sees the routed experts' copies)."""
    if is_moe_model(name) or is_hf_moe(name):
        return None
    if name in SIZES:
        return transformer_config(name, vocab_size=vocab_size)
    return hf_decoder_shape(name, vocab_size) if is_hf_name(name) else None


def _output_keyword(text: bool) -> str:
    """What a user's builder is called with: ``vocab_size=`` for text data, ``num_classes=`` for images."""
    return "vocab_size" if text else "num_classes"


def user_builder(spec: str, text: bool = False) -> Callable[..., nn.Module]:
    """A user's model builder ('pkg.module:function'), imported and checked to take ``num_classes=`` (text data:
    ``vocab_size=``) before any work (``--model os:system`` is refused here, not called)."""
    builder = import_builder(spec, "model", prefixes=("hf",))
    key = _output_keyword(text)
    check_signature(builder, spec, "model", f"model builder: it does not take {key}=", **{key: 10})
    return builder


def _load_user_builder(spec: str, num_classes: int, text: bool = False) -> nn.Module:
    """``my_pkg.my_module:build`` -> ``build(num_classes=...)`` (text: ``build(vocab_size=...)``): any user
    nn.Module; what it raises is one line."""
    key = _output_keyword(text)
    model = call_user(user_builder(spec, text), spec, "model", **{key: num_classes})
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec!r}: the builder returned {type(model).__name__}, not an nn.Module")
    return model


def has_lazy_parameters(model: nn.Module) -> bool:
    """Whether ``model`` holds lazy modules whose parameters exist only after a first forward (nn.LazyLinear)."""
    from torch.nn.parameter import is_lazy

    return any(is_lazy(t) for t in (*model.parameters(), *model.buffers()))


def materialize_lazy(
    model: nn.Module, sample_shape: tuple[int, ...] | None, name: str, tokens: bool | None = None
) -> nn.Module:
    """Give lazy modules their parameters with a dry forward on one zero sample (in eval mode, no gradients),
    as torch documents, so that counting, sharding and saving see real parameters. Seeded like the build: every
    rank and every method gets the same initial weights."""
    if sample_shape is None or not has_lazy_parameters(model):
        return model  # no input shape known: the caller's first forward creates them
    x = example_input(1, sample_shape, tokens)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:
        raise ConfigError(
            f"model {name!r} has lazy modules, and the dry forward on one sample of shape {tuple(x.shape)} that "
            f"creates their parameters raised {one_line(exc)}"
        ) from None
    finally:
        model.train(training)
    if has_lazy_parameters(model):
        raise ConfigError(f"model {name!r}: lazy modules still lack parameters after a forward on one sample")
    return model


def check_model(name: str, text: bool | None = None, seq_len: int | None = None) -> None:
    """A known model name, or a user builder that imports and takes ``num_classes=`` (``vocab_size=`` for text);
    with ``text`` known, a built-in model that fits the data (a transformer on text, a classifier on images, no
    window longer than the transformer's context)."""
    if is_hf_name(name):  # before the builder test: 'hf:NAME' holds a colon too
        check_hf_model(name, text, seq_len)
        return
    if ":" in name:
        user_builder(name, bool(text))
        return
    if name not in MODELS:
        raise ConfigError(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)} (or a builder as 'package.module:function')"
        )
    if text is None:
        return
    if is_language_model(name) and not text:
        raise ConfigError(
            f"model {name!r} is a language model: give it text data (--data text, tokens:PATH or "
            "synthetic-tokens, with --seq-len)"
        )
    if text and not is_language_model(name):
        raise ConfigError(
            f"model {name!r} classifies images; text data needs a language model: {', '.join(SIZES)} (or a "
            "builder taking vocab_size=)"
        )
    if seq_len is not None and seq_len > SIZES[name].max_seq_len:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {name}'s context of {SIZES[name].max_seq_len} tokens; choose "
            f"--seq-len at most {SIZES[name].max_seq_len}"
        )


def build_model(
    name: str,
    num_classes: int,
    *,
    cifar_stem: bool = False,
    norm: str = "group",
    width: int = 32,
    sample_shape: tuple[int, ...] | None = None,
    seq_len: int | None = None,
    moe_top_k: int | None = None,
    capacity_factor: float | None = None,
) -> nn.Module:
    """The model ``name`` with ``num_classes`` outputs (text data, ``seq_len`` given: a vocabulary of
    ``num_classes``; an MoE size's routing overridden by ``moe_top_k`` / ``capacity_factor`` where given); a user
    model with lazy modules gets its parameters from a dry forward on one sample of ``sample_shape`` ((C, H, W) or
    (seq_len,))."""
    text = seq_len is not None
    check_model(name, text, seq_len)
    if name == "tinynet":
        return TinyNet(num_classes, width=width, norm=norm)
    if is_hf_name(name):
        return build_hf(name, num_classes, seq_len)
    if is_language_model(name):
        return build_transformer(
            name, vocab_size=num_classes, **moe_overrides(name, moe_top_k, capacity_factor)
        )
    if ":" in name:
        return materialize_lazy(_load_user_builder(name, num_classes, text), sample_shape, name, text)
    return _resnet(name, num_classes, cifar_stem)


# ``--weights`` names resolved through torchvision's weights API (``imagenet`` = the model's DEFAULT enum).
PRETRAINED_ALIASES = {"imagenet": "DEFAULT"}


def is_weights_name(value: str | None) -> bool:
    """True for ``imagenet`` or a torchvision enum name (``IMAGENET1K_V2``) that is not an existing file."""
    if not value or Path(value).exists():
        return False
    return value.lower() in PRETRAINED_ALIASES or value == value.upper() and value.replace("_", "").isalnum()


def torchvision_weights(model: str, name: str):
    """The torchvision ``WeightsEnum`` member for ``model`` and ``name`` (``imagenet``, ``DEFAULT``, ``IMAGENET1K_V1``)."""
    if model not in IMAGE_MODELS or model == "tinynet":
        tv_models = ", ".join(m for m in IMAGE_MODELS if m != "tinynet")
        raise ConfigError(
            f"--weights {name}: pretrained weights exist only for torchvision models ({tv_models}), not {model!r}"
        )

    enum = import_torchvision().models.get_model_weights(model)
    key = PRETRAINED_ALIASES.get(name.lower(), name)
    try:
        return enum[key]
    except KeyError:
        allowed = ", ".join(["imagenet", "DEFAULT", *(w.name for w in enum)])
        raise ConfigError(
            f"unknown weights {name!r} for {model}; choose one of: {allowed} (or a local file)"
        ) from None


def weights_cache_file(weights) -> Path:
    """Where torch.hub keeps a torchvision weights file: ``$TORCH_HOME/hub/checkpoints/<name from the URL>``."""
    from urllib.parse import urlparse

    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def resolve_weights(model: str, weights: str | None, download: bool = False) -> str | None:
    """Turn a weights name into the local file to load: the torch hub cache file when it is there, a
    download into that cache with ``download`` (torchvision checks the file's hash), else a one-line error
    naming the file and the folder. Local paths and ``None`` are returned unchanged."""
    if not is_weights_name(weights):
        return weights
    member = torchvision_weights(model, weights)
    path = weights_cache_file(member)
    if not path.is_file():
        if not download:
            raise CheckpointError(
                f"pretrained weights {model} {member.name} are not in the torch hub cache: put {path.name} "
                f"({member.url}) into {path.parent}, or add --download when online"
            )
        try:
            member.get_state_dict(
                progress=False, check_hash=True
            )  # load_state_dict_from_url: fills the cache
        except Exception as exc:
            raise CheckpointError(f"downloading {member.url} into {path.parent} failed: {exc}") from None
    return str(path)


def pretrained_available(model: str, weights: str = "imagenet") -> bool:
    """Whether the weights file of ``model``/``weights`` is already in the torch hub cache (no download)."""
    try:
        return weights_cache_file(torchvision_weights(model, weights)).is_file()
    except ConfigError:
        return False


def describe_init(weights: str | None) -> str:
    """How a run's model started, for the report: random, imagenet (a torchvision ImageNet file), or the file name."""
    if not weights:
        return "random"
    name = Path(weights).name
    if name.lower() in PRETRAINED_ALIASES or name == "DEFAULT" or name.startswith("IMAGENET"):
        return "imagenet"
    if re.fullmatch(r"(resnet\d+|wide_resnet\d+_\d+|resnext\d+_\w+)-[0-9a-f]{8,}\.pth", name):
        return "imagenet"
    return name


def load_weights(model: nn.Module, path: str) -> list[str]:
    """Load a local state dict (e.g. torchvision's ImageNet ResNet-50 file). Tensors whose shape does not
    match (the 1000-class head on a 10-class model) are skipped and returned, so the caller can say so."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"weights file not found: {p}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"weights file {p} is not a readable PyTorch state dict: {exc}") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a stratbench checkpoint
    if not isinstance(state, dict):
        raise CheckpointError(f"weights file {p} holds a {type(state).__name__}, not a state dict")
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise CheckpointError(
            f"weights file {p} has no tensor that fits this model (keys like {next(iter(state), '-')!r})"
        )
    skipped = sorted(k for k in state if k not in usable)
    model.load_state_dict(usable, strict=False)
    return skipped


def ac_every(mode: str) -> int:
    """One block in how many an ``ac_mode`` (checked by ``core.config.check_ac_mode``) checkpoints: N for every:N,
    1 for full and selective."""
    return int(mode.removeprefix("every:")) if mode.startswith("every:") else 1


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> int:
    """Recompute residual blocks' activations in the backward pass (``mode``: full, selective or every:N, as
    ``TrainConfig.ac_mode`` says); returns the number of blocks wrapped."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as _apply,
    )

    types_ = residual_block_types(model)
    if not types_:
        raise ConfigError(f"activation checkpointing: no blocks to recompute: {why_no_blocks(model)}")
    blocks = [m for m in model.modules() if isinstance(m, types_)]
    chosen = {id(b) for b in blocks[:: ac_every(mode)]}
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if mode == "selective":
        kwargs |= {"context_fn": selective_context, "preserve_rng_state": False}
    _apply(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, **kwargs),
           check_fn=lambda m: id(m) in chosen)  # fmt: skip
    return len(chosen)


def selective_context():
    """torchtitan's op-level selective checkpointing policy (``_apply_op_sac``): a block keeps the outputs of its
    attention, its reduce-scatters and every other matmul, and recomputes the rest (norms, activations, rotary,
    the other matmuls) in backward. One context per checkpointed call: the matmul count starts at 0 for the
    forward and again for the recomputation."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    save = {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention.default, ops._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, ops.max.default}  # fmt: skip
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == ops.mm.default:
            counts[key] += 1
        keep = func in save and not (func == ops.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
