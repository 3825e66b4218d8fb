"""Text from a prompt with a trained language model (``stratbench predict --prompt``): greedy decoding or top-k
sampling, one token at a time over the last ``seq_len`` tokens (the window the model was trained on; no KV cache:
clear, and fast enough for the built-in sizes on a CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.data.text import ByteCodec, Codec, IdCodec, load_tokenizer


def codec_for(meta: dict[str, Any]) -> Codec:
    """How the checkpoint's training data turned text into ids: its tokenizer.json (which must still be where it
    was), UTF-8 bytes, or ids written as numbers (token files without a tokenizer)."""
    if meta.get("tokenizer"):
        return load_tokenizer(meta["tokenizer"])
    if meta.get("codec", "bytes") == "bytes" and int(meta["num_classes"]) == 256:
        return ByteCodec()
    return IdCodec(int(meta["num_classes"]))


@dataclass(frozen=True)
class Sampling:
    """``top_k`` 1 is greedy decoding; otherwise a token is drawn from the ``top_k`` most likely (0: all), their
    probabilities sharpened or flattened by ``temperature``, from a generator seeded with ``seed``."""

    max_new_tokens: int = 64
    top_k: int = 1
    temperature: float = 1.0
    seed: int = 0

    def check(self) -> Sampling:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (all tokens), 1 (greedy) or more, got {self.top_k}")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be above 0, got {self.temperature}")
        return self


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], context: int, sampling: Sampling) -> list[int]:
    """The ids ``model`` continues ``prompt`` with (``sampling.max_new_tokens`` of them), each predicted from at
    most the last ``context`` tokens."""
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one character (or token)")
    sampling.check()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    for _ in range(sampling.max_new_tokens):
        logits = model(ids[:, -context:])[0, -1].float().cpu()
        ids = torch.cat([ids, torch.tensor([[_pick(logits, sampling, gen)]], device=device)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    if sampling.top_k == 1:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
