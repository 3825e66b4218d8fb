"""A model's family (convnet / transformer) is decided from what it computes, not from its name
(stratbench.models.family): the projection's default efficiency depends on it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.models.family import family_from_counts, model_family
from stratbench.models.zoo import build_model


class TinyAttention(nn.Module):
    """Tokens from an image (patch-embedding convolution, as a ViT), two attention layers, a head."""

    def __init__(self, num_classes: int, module: bool) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 4, 4)
        self.module = module
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True) if module else None
        self.qkv = nn.Linear(32, 96)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)  # (batch, tokens, 32)
        for _ in range(2):
            if self.attn is not None:
                t = t + self.attn(t, t, t, need_weights=False)[0]
            else:  # attention written out, as nanoGPT or a user's model does
                q, k, v = self.qkv(t).chunk(3, dim=-1)
                t = t + F.scaled_dot_product_attention(q, k, v)
            t = t + self.mlp(t)
        return self.head(t.mean(1))


def test_convnets_are_convnets_whatever_their_name():
    for name in ("tinynet", "resnet18"):
        assert model_family(lambda n=name: build_model(n, 10), (3, 32, 32), 10) == "convnet", name


def test_attention_models_are_transformers_with_or_without_the_module():
    for module in (True, False):
        assert model_family(lambda m=module: TinyAttention(10, m), (3, 32, 32), 10) == "transformer", module


def test_an_mlp_has_no_family_and_the_rule_reads_the_counted_ops():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))
    assert model_family(lambda: mlp, (3, 8, 8), 10) is None
    assert family_from_counts({"aten.convolution": 6.0, "aten.mm": 4.0}) == "convnet"
    assert family_from_counts({"aten.convolution": 4.0, "aten.mm": 5.0, "aten.bmm": 1.0}) == "transformer"
    assert family_from_counts({"aten.mm": 1.0}, has_attention_module=True) == "transformer"
    assert family_from_counts({"aten.mm": 1.0}) is None
