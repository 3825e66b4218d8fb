"""What an inference backend or precision costs in quality, against eager fp32 on the checkpoint's own
validation set: a classifier's top-1 accuracy and its change in points; a language model's perplexity and its
change in percent; for both, how often the top class (a language model: the next token) agrees with eager fp32's
and the largest |logit| difference. bench-infer scores each of its rows with it."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stratbench.inference.onnx_export import is_language
from stratbench.inference.predictor import LoadedModel, train_config_for, validation_set

Batches = list[tuple[torch.Tensor, torch.Tensor]]
"""(inputs, targets) pairs on the CPU: images and labels, or token windows and their next tokens."""


IMAGE_BATCH = 32
TOKEN_BATCH = 8
"""Samples per validation batch: images, or a language model's windows (of its training length)."""


def validation_batches(loaded: LoadedModel, batches: int, batch_size: int | None = None) -> Batches:
    """The first ``batches`` x ``batch_size`` samples of the checkpoint's validation set (fewer where it is
    smaller) in batches of ``batch_size`` (default: ``TOKEN_BATCH`` windows or ``IMAGE_BATCH`` images); raises the
    data set's one-line error where it cannot be built here."""
    batch_size = batch_size or (TOKEN_BATCH if is_language(loaded.meta) else IMAGE_BATCH)
    bundle = validation_set(train_config_for(loaded.config, loaded.meta), loaded.meta)
    count = min(batches * batch_size, len(bundle.val))
    if count == 0:
        return []
    items = [bundle.val[i] for i in range(count)]
    xs = torch.stack([x for x, _ in items])
    ys = torch.stack([torch.as_tensor(y) for _, y in items])
    return [(xs[i : i + batch_size], ys[i : i + batch_size]) for i in range(0, count, batch_size)]


@dataclass
class Quality:
    """One backend's scores on the validation batches, and its change against eager fp32's."""

    samples: int
    top1: float | None = None
    """A classifier's top-1 accuracy (a fraction)."""
    top1_delta_pts: float | None = None
    """Its change against eager fp32, in percentage points (negative: worse)."""
    perplexity: float | None = None
    """A language model's exp(mean cross-entropy per token)."""
    perplexity_delta_pct: float | None = None
    """Its change against eager fp32, in percent (positive: worse)."""
    argmax_agreement: float = 1.0
    """The fraction of samples (a language model: of positions) whose top class is eager fp32's."""
    max_abs_delta_logit: float = 0.0


def cpu_fp32_eval(model: nn.Module) -> nn.Module:
    """``model`` itself where it is already on the CPU, in float32 and in eval mode; else a copy made so (the
    caller's model is left as it was: its device, dtype and training mode)."""
    tensors = [*model.parameters(), *model.buffers()]
    fp32_cpu = all(t.device.type == "cpu" and (t.dtype == torch.float32 or not t.is_floating_point())
                   for t in tensors)  # fmt: skip
    ready = fp32_cpu and not any(m.training for m in model.modules())
    return model if ready else copy.deepcopy(model).cpu().float().eval()


class Reference:
    """Eager fp32's logits on the validation batches, against which ``score`` measures a backend. The model is
    not changed: where it is not on the CPU in float32 and eval mode, a copy is (``cpu_fp32_eval``)."""

    def __init__(self, model: nn.Module, batches: Batches, language: bool) -> None:
        self.batches, self.language = batches, language
        model = cpu_fp32_eval(model)
        with torch.inference_mode():
            self.logits = [model(x).float() for x, _ in batches]
        self.base = self._summary(self.logits)

    def _summary(self, logits: list[torch.Tensor]) -> float:
        """Top-1 accuracy (a classifier) or perplexity (a language model) of ``logits`` on the targets."""
        if not self.language:
            right = sum(
                (lg.argmax(-1) == y).sum().item() for lg, (_, y) in zip(logits, self.batches, strict=True)
            )
            return right / sum(len(y) for _, y in self.batches)
        total = sum(
            F.cross_entropy(lg.double().reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="sum").item()
            for lg, (_, y) in zip(logits, self.batches, strict=True)
        )
        return math.exp(total / sum(y.numel() for _, y in self.batches))

    def score(self, run: Callable[[torch.Tensor], torch.Tensor]) -> Quality:
        """``run`` (a CPU batch -> float32 CPU logits) on every validation batch, against eager fp32."""
        got = [
            run(x).float()[..., : ref.shape[-1]]
            for (x, _), ref in zip(self.batches, self.logits, strict=True)
        ]
        agree = sum(
            (g.argmax(-1) == r.argmax(-1)).sum().item() for g, r in zip(got, self.logits, strict=True)
        )
        q = Quality(
            samples=sum(len(x) for x, _ in self.batches),
            argmax_agreement=agree / sum(r[..., 0].numel() for r in self.logits),
            max_abs_delta_logit=max(
                (g - r).abs().max().item() for g, r in zip(got, self.logits, strict=True)
            ),
        )
        value = self._summary(got)
        if self.language:
            q.perplexity, q.perplexity_delta_pct = value, 100 * (value / self.base - 1)
        else:
            q.top1, q.top1_delta_pts = value, 100 * (value - self.base)
        return q
