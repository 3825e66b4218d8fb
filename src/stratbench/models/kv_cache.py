"""Decoding a language model one token at a time: with a key/value cache (the prompt is read once, then each new
token attends to the keys and values the earlier tokens left), or without one (the whole sequence run again for
every token, the reference a cache is checked against).

A decoder is started for a batch (``start``), then fed token ids at the next positions (``feed``: the prompt, then
one token at a time), and returns the logits of the last position fed. Three kinds:

- ``TransformerCache``: the built-in transformer (``models.transformer``). Its blocks' own modules (projections,
  norms, MLP or experts, head) are run here, with the attention reading and writing a cache preallocated at the
  model's ``max_seq_len``; the model's ``forward`` (the training one) is untouched, and so is its speed. Rotary
  angles are computed at the fed tokens' positions, so a cached key is the one the full forward computes.
- ``HFCache``: a Hugging Face decoder (``hf:FOLDER``, ``models.hf.HFCausalLM``) with transformers' own
  ``DynamicCache``, as its ``generate`` uses it.
- ``NoCache``: any language model's ``forward`` over the whole sequence so far, for each token.

``compiled=True`` runs a cached decoder's step through ``torch.compile`` with dynamic shapes (one graph for the
prompt and one for the single-token steps, whatever the position).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.core.errors import ConfigError
from stratbench.models.hf import HFCausalLM, max_positions
from stratbench.models.transformer import Attention, Transformer, repeat_kv


class Decoder(Protocol):
    max_len: int
    """The most positions a sequence may take (prompt and generated tokens together)."""

    def start(self, batch: int) -> None: ...

    def feed(self, tokens: torch.Tensor) -> torch.Tensor: ...


def max_length(model: nn.Module) -> int | None:
    """The longest sequence a language model takes: a built-in transformer's ``max_seq_len``, a Hugging Face
    decoder's ``max_position_embeddings``; None where nothing says."""
    if isinstance(model, Transformer):
        return model.max_seq_len
    if isinstance(model, HFCausalLM):
        return max_positions(model.hf.config)
    return None


CACHED_KINDS = "the built-in transformers (gpt-tiny, ..., llama-8b) and Hugging Face decoders (hf:FOLDER)"


def decoder_for(model: nn.Module, cache: bool = True, compiled: bool = False) -> Decoder:
    """A decoder for ``model`` (in eval mode): cached (``cache``, optionally ``compiled``) or the full forward
    each token; one line for a model no cache is written for."""
    if not cache:
        return NoCache(model, max_length(model))
    if isinstance(model, Transformer):
        return TransformerCache(model, compiled)
    if isinstance(model, HFCausalLM):
        return HFCache(model, compiled)
    raise ConfigError(
        f"a key/value cache is written for {CACHED_KINDS}; this model is a {type(model).__name__}"
    )


def compile_step(step: Callable[..., torch.Tensor], backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``step`` under ``torch.compile``: dynamic shapes (positions and prompt lengths symbolic, so no recompile per
    token) and the full graph (a graph break is an error, where dynamo would otherwise skip the step and run it
    eagerly without a word)."""
    return torch.compile(step, dynamic=True, fullgraph=True, backend=backend)


class _Positions:
    """The position the next token takes, and the refusal of a sequence past ``max_len``."""

    max_len: int
    pos: int = 0

    def _advance(self, t: int) -> int:
        if self.pos + t > self.max_len:
            raise ConfigError(
                f"a sequence of {self.pos + t} tokens is longer than the model's max length of {self.max_len}"
            )
        pos, self.pos = self.pos, self.pos + t
        return pos


class NoCache(_Positions):
    """The model's forward over every token so far, for each new one (what decoding without a cache costs)."""

    def __init__(self, model: nn.Module, max_len: int | None) -> None:
        self.model, self.max_len = model, max_len or 2**31
        self.ids: torch.Tensor | None = None

    def start(self, batch: int) -> None:
        self.ids, self.pos = None, 0

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        self._advance(tokens.shape[1])
        self.ids = tokens if self.ids is None else torch.cat([self.ids, tokens], dim=1)
        return self.model(self.ids)[:, -1]


class TransformerCache(_Positions):
    """The built-in transformer with a key/value cache per block, (batch, max_seq_len, kv heads, head size)."""

    def __init__(self, model: Transformer, compiled: bool = False) -> None:
        self.model, self.max_len = model, model.max_seq_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.step = compile_step(self.forward_at) if compiled else self.forward_at

    def start(self, batch: int) -> None:
        weight = self.model.tok_embeddings.weight
        self.keys, self.values = [], []
        for layer in self.model.layers:
            attn = layer.attention
            shape = (batch, self.max_len, attn.wk.weight.shape[0] // attn.head_dim, attn.head_dim)
            self.keys.append(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
            self.values.append(torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.pos = 0

    def cache_bytes(self) -> int:
        """The cache's memory (keys and values of every block at the full length)."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.keys:
            raise ConfigError("the decoder was not started: call start(batch) before feed")
        return self.step(tokens, self._advance(tokens.shape[1]))

    def forward_at(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """The logits (batch, vocab) of the last of ``tokens``, which sit at positions ``pos`` onwards; the
        blocks as ``TransformerBlock.forward`` runs them, their attention through the cache."""
        model = self.model
        h = model.tok_embeddings(tokens)
        for i, layer in enumerate(model.layers):
            h = h + self._attend(layer.attention, layer.attention_norm(h), i, pos)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        return model.output(model.norm(h[:, -1]))

    def _attend(self, attn: Attention, x: torch.Tensor, i: int, pos: int) -> torch.Tensor:
        """``Attention.forward`` at positions ``pos`` to ``pos + t``: this step's keys and values written into block
        ``i``'s cache, the queries attending to every cached position up to theirs."""
        b, t, _ = x.shape
        q, k, v = attn.rotated_qkv(x, pos)
        self.keys[i][:, pos : pos + t] = k
        self.values[i][:, pos : pos + t] = v
        keys, values = self.keys[i][:, : pos + t], self.values[i][:, : pos + t]
        n_rep = q.shape[2] // keys.shape[2]
        keys, values = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        # Branches in Python, not a bool computed into is_causal: under torch.compile a position is symbolic, and
        # each branch is a guard (one graph for the prompt, one for a single token), where a computed flag breaks it.
        if t == 1:  # one new token: it sees every cached position
            out = F.scaled_dot_product_attention(q, keys, values)
        elif pos == 0:  # the prompt: causal, as the full forward computes it
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:  # a chunk after cached tokens: a query sees the cache, and its chunk up to itself
            seen = torch.arange(pos + t, device=x.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[None, :] <= seen[pos:, None])
        return attn.wo(out.transpose(1, 2).reshape(b, t, -1))


class HFCache(_Positions):
    """A Hugging Face decoder with transformers' ``DynamicCache`` (the cache its ``generate`` builds)."""

    def __init__(self, model: HFCausalLM, compiled: bool = False) -> None:
        self.model, self.max_len = model, max_positions(model.hf.config) or 2**31
        self.cache: Any = None
        # transformers 5 calls the argument `cache` and warns on the older `past_key_values`, which it still reads
        takes = inspect.signature(model.hf.forward).parameters
        self.cache_arg = "cache" if "cache" in takes else "past_key_values"
        self.step = compile_step(self._forward) if compiled else self._forward

    def start(self, batch: int) -> None:
        from transformers import DynamicCache

        self.cache, self.pos = DynamicCache(config=self.model.hf.config), 0

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            raise ConfigError("the decoder was not started: call start(batch) before feed")
        self._advance(tokens.shape[1])
        return self.step(tokens)[:, -1, : self.model.vocab_size]

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model.hf(input_ids=tokens, use_cache=True, **{self.cache_arg: self.cache})
        return out.logits
