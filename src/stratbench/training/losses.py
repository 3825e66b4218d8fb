"""The training loss: cross-entropy (optionally with label smoothing) or the user's own function.

A user loss is given as ``package.module:function`` and found like ``--model``/``--data`` builders (sys.path,
then the working directory). It is called as ``fn(logits, targets)`` and returns a scalar tensor; an
``nn.Module`` class is instantiated without arguments first. The validation loss stays plain cross-entropy
whatever the training loss, so that runs with different losses report comparable validation numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.user_code import call_user, check_signature, import_builder
from stratbench.data.instruct import IGNORE
from stratbench.data.text import is_ft_data, is_text_data
from stratbench.models.moe import Routing

LOSSES = ("cross-entropy",)
"""Built-in losses (``--loss``); anything else must be a ``package.module:function``."""


def _resolve(spec: str) -> Callable:
    fn = import_builder(spec, "loss", noun="loss")
    if isinstance(fn, type):  # an nn.Module class (import_builder refuses other classes)
        check_signature(fn, spec, "loss", "loss class: it must build without arguments")
        fn = call_user(fn, spec, "loss")
    check_signature(fn, spec, "loss", "loss: it must take (logits, targets)", None, None)
    return fn


class UserLoss:
    """The user's ``fn(logits, targets)``, checked on every call: what it raises, and a result that is not a
    scalar floating-point tensor (a per-sample vector, a float, a tuple), become one line naming the loss."""

    def __init__(self, fn: Callable, spec: str) -> None:
        self.fn, self.spec = fn, spec

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = call_user(self.fn, self.spec, "loss", logits, targets)
        if not isinstance(out, torch.Tensor) or out.ndim != 0 or not out.is_floating_point():
            what = (
                f"a {out.dtype} tensor of shape {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else f"a {type(out).__name__}"
            )
            raise ConfigError(
                f"loss {self.spec!r} returned {what}; a loss returns one floating-point scalar tensor "
                "(reduce it, e.g. with .mean())"
            )
        return out


def check_loss(cfg: TrainConfig) -> None:
    """Before any work: a known loss name, or an importable user loss taking (logits, targets)."""
    if ":" in cfg.loss:
        if cfg.label_smoothing:
            raise ConfigError(
                f"--label-smoothing applies to cross-entropy only; the loss {cfg.loss!r} is the user's own"
            )
        _resolve(cfg.loss)
    elif cfg.loss not in LOSSES:
        raise ConfigError(
            f"unknown loss {cfg.loss!r}; choose one of: {', '.join(LOSSES)} (with --label-smoothing X), "
            "or a function as 'package.module:function'"
        )


class TokenCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy over every position of a language model's output: logits (batch, seq, vocab) and targets
    (batch, seq) flattened to (batch x seq) predictions, averaged over the tokens (each window has the same
    length, so the mean of micro-batch means is the global batch's mean, as for images)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(logits.flatten(0, -2), targets.flatten())


class MaskedTokenCrossEntropy(nn.Module):
    """Cross-entropy of fine-tuning data, over the tokens the loss trains on (targets other than ``IGNORE``: the
    response, not the prompt or padding): their summed loss divided by ``denominator``.

    Micro-batches of padded examples hold different numbers of such tokens, so the mean of each micro-batch's
    own token mean is not the step's token mean (the gradient-accumulation error transformers fixed in 4.46).
    The loop therefore sets ``denominator`` before each step (``step_denominator``): the step's token count over
    every micro-batch and rank, divided by how many loss calls the methods average (micro-batches x data
    shards), so that dividing by the micro-batches and averaging over the ranks, as every method does, gives
    the exact token mean of the whole step. Unset (a loss called outside the loop), it is this micro-batch's
    count; a step with no such token (every response cut away) gives 0 with a zero gradient, not 0/0."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.denominator: float | None = None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = targets.flatten()
        total = nn.functional.cross_entropy(
            logits.flatten(0, -2), flat, ignore_index=IGNORE, reduction="sum", label_smoothing=self.label_smoothing
        )
        if self.denominator is not None:
            return total / self.denominator
        return total / (flat != IGNORE).sum().clamp(min=1)


def step_denominator(local_tokens: float, world: int, shards: int, chunks: int) -> float:
    """``MaskedTokenCrossEntropy.denominator`` for one step: the tokens scored in it, from ``local_tokens``
    summed over all ``world`` ranks (ranks that share a data shard, e.g. a pipeline's stages, each counted it:
    x shards / world), divided by the ``chunks`` micro-batches each rank's loss is averaged over and the
    ``shards`` data-parallel ranks gradients are averaged over. At least 1 token (0/0 guard)."""
    tokens = local_tokens * shards / world
    return max(tokens, 1.0) / (chunks * shards)


def build_loss(cfg: TrainConfig) -> Callable:
    """The loss function the loop calls as ``loss_fn(logits, targets)``: cross-entropy per sample, or per token
    of text data; a user's loss gets the model's output as it is."""
    check_loss(cfg)
    if ":" in cfg.loss:
        return UserLoss(_resolve(cfg.loss), cfg.loss)
    if is_ft_data(cfg.data):
        return MaskedTokenCrossEntropy(label_smoothing=cfg.label_smoothing)
    if is_text_data(cfg.data):
        return TokenCrossEntropy(label_smoothing=cfg.label_smoothing)
    return ClassCrossEntropy(label_smoothing=cfg.label_smoothing)


class ClassCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy of a classifier's logits; one line where the model's output is no tensor of logits."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                f"the model's forward returned {type(logits).__name__} in training, not a tensor of logits: build "
                "it to return the logits alone (torchvision's googlenet and inception_v3: aux_logits=False), or "
                "give --loss package.module:function taking that output"
            )
        return super().forward(logits, targets)


class WithRouterLoss:
    """The training loss plus the mixture of experts' load-balancing loss (``routing.loss()``: coef x the loss of
    the micro-batch the model just ran, ``models.moe.LayerRouting`` or ``models.hf_moe.HFRouting``), so that the loss
    the loop backpropagates and reports holds both; the routing counts are committed there, once per trained
    micro-batch. The validation loss stays plain cross-entropy."""

    def __init__(self, loss_fn: Callable, routing: Routing) -> None:
        self.loss_fn, self.routing = loss_fn, routing

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        return loss + self.routing.loss().to(loss.dtype)


def with_router_loss(loss_fn: Callable, routing: Routing | None) -> Callable:
    """``loss_fn`` with the load-balancing loss of a mixture of experts added (``WithRouterLoss``); itself for a
    dense model."""
    return loss_fn if routing is None else WithRouterLoss(loss_fn, routing)


def per_sample_eval(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, share of correct predictions) per sample, in fp32 or wider: of a classifier, the sample's
    loss and 0/1; of a language model, the means over the sample's tokens (next-token accuracy), of fine-tuning
    data over the tokens it is scored on (targets other than ``IGNORE``: the response, not prompt or padding)."""
    losses = nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    correct = (logits.argmax(-1) == targets).to(losses.dtype).flatten()
    n = targets.shape[0]
    scored = targets != IGNORE
    if bool(scored.all()):  # every token scored (images, text windows): the plain means
        return losses.view(n, -1).mean(1), correct.view(n, -1).mean(1)
    weight = scored.to(losses.dtype).view(n, -1)
    count = weight.sum(1).clamp(min=1)
    return (losses.view(n, -1) * weight).sum(1) / count, (correct.view(n, -1) * weight).sum(1) / count


def perplexity(mean_loss: float) -> float:
    """exp(mean cross-entropy per token), capped where exp overflows a float (a diverged model)."""
    return math.exp(min(mean_loss, 700.0))


def describe_loss(cfg: TrainConfig) -> dict[str, Any]:
    """What result.json records about the loss."""
    out: dict[str, Any] = {"name": cfg.loss, "validation_loss": "cross-entropy"}
    if is_ft_data(cfg.data):
        out["tokens"] = "prompt and response" if cfg.train_on_prompt else "response only (prompt masked)"
    if ":" not in cfg.loss:
        out["label_smoothing"] = cfg.label_smoothing
    return out
