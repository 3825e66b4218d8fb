"""Text from a prompt with a trained language model: greedy decoding or top-k sampling, one token at a time.

``generate`` (``stratbench predict --prompt``) runs the model's forward over the last ``seq_len`` tokens (the window
the model was trained on) for each token: no cache, so a prompt of any length slides through the window. ``decode``
(``stratbench bench-generate``) runs a decoder of ``models.kv_cache`` (a key/value cache, or none), timing the
first token (the prompt read, then the token picked) and each later one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.data.text import ByteCodec, Codec, IdCodec, load_tokenizer
from stratbench.models.kv_cache import Decoder


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
        ids = torch.cat([ids, torch.tensor([[pick(logits, sampling, gen)]], device=device)], dim=1)
    return ids[0, len(prompt) :].tolist()


def pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """The next token from one position's logits (on the CPU): the most likely (``top_k`` 1), or a draw."""
    if sampling.top_k == 1:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@dataclass
class Decoded:
    """What ``decode`` generated and how long it took: ``first_s`` from the prompt given to the first token
    picked (time to first token), ``step_s`` each later token's (its step through the model and its pick)."""

    ids: list[int]
    first_s: float
    step_s: list[float] = field(default_factory=list)


@torch.inference_mode()
def decode(decoder: Decoder, prompt: torch.Tensor, sampling: Sampling) -> Decoded:
    """``sampling.max_new_tokens`` ids continuing ``prompt`` (1, t) (on the model's device): the prompt fed once,
    then each picked token fed back. Every pick reads the logits on the CPU, so each time includes the device's
    work (no asynchronous step is left running)."""
    if prompt.numel() == 0:
        raise ConfigError("the prompt is empty: give at least one token")
    sampling.check()
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    decoder.start(prompt.shape[0])
    begin = time.perf_counter()
    token = pick(decoder.feed(prompt)[0].float().cpu(), sampling, gen)
    out = Decoded([token], time.perf_counter() - begin)
    for _ in range(sampling.max_new_tokens - 1):
        begin = time.perf_counter()
        fed = torch.tensor([[token]], dtype=torch.long, device=prompt.device)
        token = pick(decoder.feed(fed)[0].float().cpu(), sampling, gen)
        out.step_s.append(time.perf_counter() - begin)
        out.ids.append(token)
    return out
