"""LoRA adapters through PEFT (``--lora-rank R``): a low-rank update ``B @ A`` (A: rank x in, B: out x rank,
scaled by alpha / rank) beside each targeted nn.Linear, the base frozen.

PEFT's ``inject_adapter_in_model`` puts the adapters into the model in place and returns the same module (no
``PeftModel`` wrapper, so no ``base_model.model.`` prefix): a targeted ``wq.weight`` becomes
``wq.base_layer.weight`` beside ``wq.lora_A.default.weight`` / ``wq.lora_B.default.weight``. Every method then
wraps, shards and checkpoints it like any model (DDP and FSDP2 see plain parameters, some with
``requires_grad=False``); a LoRA checkpoint's keys are these names, and inference re-applies the same adapters
from the checkpoint's model meta (``lora_meta``) before it loads them.

The targets are resolved here, not by PEFT, so that the estimate (from the Linear names alone,
``adapter_shapes``) and the run adapt the same layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from stratbench.core.config import TrainConfig
from stratbench.core.errors import CheckpointError, ConfigError
from stratbench.core.optim import import_torchao
from stratbench.core.precision import Precision
from stratbench.core.torchvision_compat import guard_torchvision_import
from stratbench.models.transforms.base import FORWARD_SHARE, Cost, Phase, Transform

ALL_LINEAR = "all-linear"

# A frozen Linear's backward computes the input's gradient only, not the weight's: one product per forward one
# instead of two. With (nearly) every matrix product in Linear layers, a step is forward + 1 x forward:
# (1 + 1) / (1 + 2) of the full step's FLOPs (the adapters' own products, 2 x rank x (in + out) per token, and
# attention's score products are left out: a few percent at the ranks used).
FROZEN_FLOPS_FACTOR = 2 * FORWARD_SHARE


def resolve_targets(linear_names: list[str] | tuple[str, ...], targets: str) -> list[str]:
    """The qualified names of the Linear layers ``targets`` adapts: ``all-linear`` = every one but the output
    head (the last in module order), else each comma-separated name matching a path or its ending ``.NAME``; a
    name that matches none is one line listing the Linear layers there are."""
    names = list(linear_names)
    if targets.strip() == ALL_LINEAR:
        chosen = names[:-1] if len(names) > 1 else names
    else:
        wanted = [t.strip() for t in targets.split(",") if t.strip()]
        chosen = []
        for t in wanted:
            hits = [n for n in names if n == t or n.endswith("." + t)]
            if not hits:
                raise ConfigError(
                    f"lora_targets {t!r} matches no nn.Linear of the model; its Linear layers: "
                    f"{', '.join(_short_names(names)) or 'none'} (or all-linear)"
                )
            chosen += [n for n in hits if n not in chosen]
    if not chosen:
        raise ConfigError(f"lora_targets {targets!r}: the model has no nn.Linear layer to adapt")
    return [n for n in names if n in chosen]


def _short_names(names: list[str]) -> list[str]:
    """Each distinct last component of the Linear paths, in order (what a user types: wq, w1, output)."""
    out: list[str] = []
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        if leaf not in out:
            out.append(leaf)
    return out


def alpha_of(cfg: TrainConfig) -> float:
    """LoRA's alpha: the flag, else 2 x rank."""
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank


def adapter_shapes(
    linear_names: tuple[str, ...], linear_features: tuple[tuple[int, int], ...], cfg: TrainConfig
) -> list[tuple[int, int]]:
    """(numel, dim 0) of each adapter parameter a LoRA run adds, A (rank x in) then B (out x rank) per adapted
    Linear: rank x (in + out) elements per layer; none without LoRA."""
    if cfg.lora_rank <= 0:
        return []
    features = dict(zip(linear_names, linear_features, strict=True))
    r = cfg.lora_rank
    out: list[tuple[int, int]] = []
    for name in resolve_targets(linear_names, cfg.lora_targets):
        fan_in, fan_out = features[name]
        out += [(r * fan_in, r), (fan_out * r, fan_out)]
    return out


def linear_layers(model: nn.Module) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """The qualified names of ``model``'s nn.Linear modules and their (in, out) features, in module order: what
    LoRA's targets are matched against and its adapters sized from (``ModelInfo`` records the same)."""
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return tuple(n for n, _ in linear), tuple((m.in_features, m.out_features) for _, m in linear)


def parameter_counts(model: nn.Module, cfg: TrainConfig) -> tuple[int, int]:
    """(trainable, total) parameters of ``model`` (unwrapped, before the transforms) once a run of ``cfg`` has
    set it up: with LoRA the adapters (``adapter_shapes``) train and add to the total; without, the parameters
    that require gradients train."""
    base = sum(p.numel() for p in model.parameters())
    if cfg.lora_rank <= 0:
        return sum(p.numel() for p in model.parameters() if p.requires_grad), base
    adapters = sum(n for n, _ in adapter_shapes(*linear_layers(model), cfg))
    return adapters, base + adapters


def lora_meta(cfg: TrainConfig) -> dict[str, Any] | None:
    """What a checkpoint's model meta records so that inference re-applies the same adapters (None: no LoRA)."""
    if cfg.lora_rank <= 0:
        return None
    meta = {"rank": cfg.lora_rank, "alpha": alpha_of(cfg), "dropout": cfg.lora_dropout, "targets": cfg.lora_targets}
    if cfg.quantize_base != "none":  # QLoRA: inference quantises the base again (quantize_base.apply_meta)
        meta["quantize_base"] = cfg.quantize_base
    return meta


def inject(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> nn.Module:
    """``model`` with PEFT's LoRA adapters in its targeted Linear layers and everything else frozen (in place)."""
    chosen = resolve_targets(linear_layers(model)[0], targets)
    guard_torchvision_import()  # peft imports transformers, which imports torchvision (core.torchvision_compat)
    import_torchao()  # and torchao, whose import logs a warning per CUDA library a CPU cannot load
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("--lora-rank needs the peft package: pip install 'stratbench[lora]'") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=chosen, bias="none")
    # The estimate's trace builds the model on fake tensors, and PEFT's move of each new adapter to the base's
    # device and dtype (module.to) cannot convert a fake parameter (torch 2.13 swaps it and fails): there the
    # adapters are made as real tensors (rank x (in + out) per layer: small) and then replaced by fake ones.
    fake = any(is_fake(p) for p in model.parameters())
    with unset_fake_temporarily() if fake else contextlib.nullcontext():
        model = inject_adapter_in_model(config, model)
    if fake:
        _real_to_fake(model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)  # PEFT freezes the base too; said here so that it holds for any model
    return model


def _real_to_fake(model: nn.Module) -> None:
    """Each real parameter of ``model`` (LoRA's adapters in the trace) replaced by an empty one of its shape and
    dtype, made inside the caller's FakeTensorMode (so: fake, no memory)."""
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and not is_fake(p):
                module._parameters[key] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                )


def apply_meta(model: nn.Module, meta: dict[str, Any] | None) -> nn.Module:
    """``model`` with the adapters a checkpoint's ``lora_meta`` describes (inference; unchanged without). A
    header that is not ``lora_meta``'s shape (a hand-edited or foreign checkpoint) is one line, not a KeyError."""
    if not meta:
        return model
    try:
        rank, alpha, dropout, targets = (meta[k] for k in ("rank", "alpha", "dropout", "targets"))
        rank, alpha, dropout = int(rank), float(alpha), float(dropout)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"the checkpoint's model meta 'lora' is {meta!r}; it must hold rank (an integer > 0), alpha, dropout "
            "and targets, as a LoRA run writes it"
        ) from None
    if rank <= 0 or not isinstance(targets, str):
        raise CheckpointError(f"the checkpoint's model meta 'lora' is {meta!r}; rank must be > 0 and targets a string")
    return inject(model, rank, alpha, dropout, targets)


@dataclass(frozen=True)
class Lora(Transform):
    """``--lora-rank``: PEFT's LoRA adapters in the targeted Linear layers, the base frozen. Configured per run
    (``configured``): the instance in ``ORDER`` has rank 0 and only answers ``applies_to``."""

    rank: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    targets: str = ALL_LINEAR

    name = "lora"
    phase = Phase.BEFORE_WRAP
    traced = True
    cost = Cost(
        parameters="the base's plus the adapters': rank x (in + out) per adapted Linear (MemoryContext.numels)",
        gradients="the adapters' only (MemoryContext.trainable)",
        optimizer_state="the adapters' only (MemoryContext.trainable)",
        activations="the adapters' (traced: the model is traced with them; a frozen Linear keeps no input)",
        flops="no weight-gradient product for a frozen Linear: backward ~1 x forward instead of 2 x",
        flops_factor=FROZEN_FLOPS_FACTOR,
        note="the adapters' own FLOPs (2 x rank x (in + out) per token per layer) are left out of the projection",
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return cfg.lora_rank > 0

    def label(self, cfg: TrainConfig) -> str:
        return f"{self.name}:r{cfg.lora_rank}"

    def configured(self, cfg: TrainConfig) -> Lora:
        return Lora(cfg.lora_rank, alpha_of(cfg), cfg.lora_dropout, cfg.lora_targets)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        if self.rank <= 0:
            raise ValueError("the LoRA transform needs a rank: apply Lora().configured(cfg)")
        return inject(model, self.rank, self.alpha, self.dropout, self.targets)
