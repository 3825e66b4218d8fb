"""The decoder-only transformer family (stratbench.models.transformer): published parameter counts, causal
attention, dtypes, grouped-query attention, the two initialisations, bad configs, the FLOPs formula against
torch's FLOP counter, and a few optimiser steps that learn."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from stratbench.core.errors import ConfigError
from stratbench.models.flops import flop_counter
from stratbench.models.transformer import (
    SIZES,
    RopeScaling,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    build_transformer,
    flops_per_token,
    parameter_count,
    transformer_config,
)
from stratbench.models.zoo import check_model, count_parameters, residual_block_types

# Published counts: GPT-2 small (HF gpt2, learned positions and biases), Llama 3.2 1B, Llama 3 8B (and 3.1 8B).
# The MoE shapes' totals as published (tests/models/test_moe_layer.py checks their active counts): Mixtral-8x7B 46.7B
# (mistral.ai/news/mixtral-of-experts), Qwen3-30B-A3B 30.5B (its Hugging Face model card), DeepSeek-V3 671B (the
# DeepSeek-V3 technical report, arXiv 2412.19437, abstract; without its multi-token-prediction module).
PUBLISHED = {"gpt2-small": 124_439_808, "llama-1b": 1_235_814_400, "llama-8b": 8_030_261_248,
             "llama-8b-long": 8_030_261_248, "mixtral-8x7b": 46.7e9, "qwen3-30b-a3b": 30.5e9,
             "deepseek-v3-style": 671e9}  # fmt: skip


def small(**overrides) -> TransformerConfig:
    """A transformer small enough for exact CPU checks in milliseconds."""
    base = TransformerConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=24)
    return replace(base, **overrides)


def seeded(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def tokens(cfg: TransformerConfig, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_have_their_published_parameter_counts_on_meta(name):
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_transformer(name)
    # nothing is allocated, so llama-8b builds in well under a second (gpt-tiny, first, pays for warm-up)
    assert time.perf_counter() - start < 10 or name == "gpt-tiny"
    n = count_parameters(model)
    assert n == parameter_count(model.config)
    if name.startswith("gpt-"):  # gpt-tiny, gpt-tiny-long (its widths, a longer context), gpt-moe-tiny
        assert 1_000_000 <= n <= 3_100_000
    else:
        assert abs(n / PUBLISHED[name] - 1) < 0.01, (name, n)
    assert residual_block_types(model) == (TransformerBlock,)
    assert len(model.layers) == model.config.n_layers and list(model.buffers()) == []
    assert (model.output.weight is model.tok_embeddings.weight) == model.config.tie_embeddings


def test_exact_llama_counts_and_overrides():
    with torch.device("meta"):
        assert count_parameters(build_transformer("llama-8b")) == 8_030_261_248
        assert count_parameters(build_transformer("llama-1b")) == 1_235_814_400
        byte_gpt2 = build_transformer("gpt2-small", vocab_size=256, max_seq_len=512)
    assert (byte_gpt2.vocab_size, byte_gpt2.max_seq_len) == (256, 512)
    assert transformer_config("llama-1b").n_kv_heads == 8 and SIZES["gpt-tiny"].n_kv_heads == 4


def test_forward_shape_and_causality():
    cfg = small()
    model = seeded(cfg).eval()
    x = tokens(cfg)
    logits = model(x)
    assert logits.shape == (2, 16, cfg.vocab_size)
    changed = x.clone()
    changed[:, 9:] = (changed[:, 9:] + 7) % cfg.vocab_size  # tokens 9.. differ
    other = model(changed)
    torch.testing.assert_close(other[:, :9], logits[:, :9], rtol=0, atol=1e-6)
    assert (other[:, 9:] - logits[:, 9:]).abs().max() > 1e-3


def test_fp64_matches_fp32_and_bf16_runs():
    cfg = small()
    model = seeded(cfg)
    x = tokens(cfg)
    model64 = seeded(cfg).double()
    out64 = model64(x)
    out64.sum().backward()
    assert out64.dtype == torch.float64 and all(p.grad is not None for p in model64.parameters())
    torch.testing.assert_close(model(x).double(), out64, rtol=1e-4, atol=1e-4)
    out16 = seeded(cfg).to(torch.bfloat16)(x)
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    torch.testing.assert_close(out16.double(), out64, rtol=0.1, atol=0.1)


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads():
    """GQA with 2 kv heads for 4 query heads computes what plain attention does when each kv head's weights are
    copied to the 2 query heads it serves (consecutive heads share, as Llama's repeat_kv)."""
    gqa_cfg = small(n_kv_heads=2)
    gqa, mha = seeded(gqa_cfg), seeded(small())
    with torch.no_grad():
        for name, p in mha.named_parameters():
            own = gqa.get_parameter(name)
            if own.shape == p.shape:
                p.copy_(own)
            else:  # wk / wv: (kv_heads * head_dim, dim) -> (heads * head_dim, dim)
                per_head = own.unflatten(0, (2, -1))
                p.copy_(per_head.repeat_interleave(2, dim=0).flatten(0, 1))
    assert count_parameters(gqa) == parameter_count(gqa_cfg) < count_parameters(mha)
    x = tokens(gqa_cfg)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_tied_head_is_the_embedding_and_survives_materialisation():
    cfg = small()
    model = seeded(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_parameters(model) == parameter_count(cfg)
    assert set(model.state_dict()) >= {"tok_embeddings.weight", "output.weight"}  # one tensor, two names
    with torch.device("meta"):
        lazy = Transformer(cfg)
    torch.manual_seed(0)
    lazy.materialize("cpu")
    assert lazy.output.weight is lazy.tok_embeddings.weight
    for (name, a), b in zip(model.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # meta build + materialize = direct build, same seed
    untied = seeded(small(tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight


def _std(t: torch.Tensor) -> float:
    return t.detach().double().std().item()


def test_gpt2_init_stds():
    model = seeded(transformer_config("gpt-tiny"))
    residual = 0.02 / math.sqrt(2 * 4)
    for block in model.layers:
        assert _std(block.attention.wo.weight) == pytest.approx(residual, rel=0.1)
        assert _std(block.feed_forward.w2.weight) == pytest.approx(residual, rel=0.1)
        assert _std(block.attention.wq.weight) == pytest.approx(0.02, rel=0.1)
        assert _std(block.feed_forward.w1.weight) == pytest.approx(0.02, rel=0.1)
        assert torch.equal(block.attention_norm.weight, torch.ones(192))
    assert _std(model.tok_embeddings.weight) == pytest.approx(0.02, rel=0.1)


def test_llama_init_stds_scale_with_depth():
    cfg = replace(transformer_config("gpt-tiny"), init="llama", tie_embeddings=False)
    model = seeded(cfg)
    for i, block in enumerate(model.layers):
        depth = 0.02 / math.sqrt(2 * (i + 1))
        for linear in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
            assert _std(linear.weight) == pytest.approx(depth, rel=0.1)
        assert _std(block.attention.wk.weight) == pytest.approx(0.02, rel=0.1)
    assert _std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.1)
    head = 192**-0.5
    assert _std(model.output.weight) == pytest.approx(head, rel=0.1)
    assert model.output.weight.abs().max() <= 3 * head  # truncated at 3 std
    tied = seeded(replace(cfg, tie_embeddings=True))
    assert _std(tied.tok_embeddings.weight) == pytest.approx(head, rel=0.1)


def test_same_seed_same_weights():
    a, b, c = seeded(small(), 3), seeded(small(), 3), seeded(small(), 4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"n_heads": 5}, ("n_heads 5", "dim 32", "choose one of: 1, 2, 4, 8, 16")),
        ({"n_kv_heads": 3}, ("n_kv_heads 3", "n_heads 4", "1, 2, 4")),
        ({"dim": 24, "n_heads": 8}, ("head dim 3", "odd", "1, 2, 3, 4, 6, 12")),
        ({"dim": 0}, ("dim", "positive integer", "0")),
        ({"ffn_hidden": -4}, ("ffn_hidden", "-4")),
        ({"max_seq_len": 2.5}, ("max_seq_len", "2.5")),
        ({"norm_eps": 0.0}, ("norm_eps", "0.0")),
        ({"init": "xavier"}, ("'xavier'", "gpt2, llama")),
    ],
)
def test_bad_configs_are_one_line_errors_naming_the_value(overrides, words):
    with pytest.raises(ConfigError) as err:
        Transformer(small(**overrides))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_unknown_size_and_too_long_sequence():
    with pytest.raises(ConfigError, match=r"unknown transformer size 'gpt5'; choose one of: gpt-tiny, "):
        transformer_config("gpt5")
    with pytest.raises(ConfigError, match="n_heads 7 does not divide dim 192"):
        TransformerConfig(n_heads=7).check()
    model = seeded(small())
    with pytest.raises(ConfigError, match="sequence of 25 tokens is longer than the model's max_seq_len 24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"shape \(batch, seq\), not shape \(25,\)"):
        model(torch.zeros(25, dtype=torch.long))


def test_the_long_context_8b_is_llama_8b_with_llama_31_rotary_and_a_262k_context():
    """llama-8b-long (issue 46's long-context picture): llama-8b's shapes, Llama 3.1's rope scaling (factor 8),
    262,144 positions: the estimate takes --seq-len up to that and refuses one more, naming the context."""
    long, base = SIZES["llama-8b-long"], SIZES["llama-8b"]
    assert replace(long, max_seq_len=base.max_seq_len, rope_scaling=None) == base
    assert long.rope_scaling == RopeScaling(factor=8.0) and long.max_seq_len == 262_144
    check_model("llama-8b-long", True, 262_144)
    too_long = "--seq-len 262145 is longer than llama-8b-long's context of 262144"
    with pytest.raises(ConfigError, match=too_long):
        check_model("llama-8b-long", True, 262_145)
    with pytest.raises(ConfigError, match="--seq-len 8193 is longer than llama-8b's context of 8192"):
        check_model("llama-8b", True, 8193)


def counted_flops_per_token(name: str, seq_len: int) -> float:
    """Forward + backward with a cross-entropy over the flattened logits, counted on the meta device."""
    with torch.device("meta"):
        model = build_transformer(name)
        x = torch.zeros(2, seq_len, dtype=torch.long)
    counter = flop_counter()
    with counter:
        logits = model(x)
        nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    return counter.get_total_flops() / x.numel()


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-small"])
@pytest.mark.parametrize("seq_len", [64, 256])
def test_flops_formula_matches_the_counter(name, seq_len):
    formula = flops_per_token(transformer_config(name), seq_len)
    assert counted_flops_per_token(name, seq_len) == pytest.approx(formula, rel=0.01)


def test_a_few_steps_learn_a_repeated_sequence():
    cfg = transformer_config("gpt-tiny")
    model = seeded(cfg)
    x = tokens(cfg, batch=2, seq=17, seed=5)
    inputs, targets = x[:, :-1], x[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.1)  # a uniform start
    assert losses[-1] < 0.5 * losses[0], losses


def test_activation_checkpointing_wraps_each_block_and_keeps_the_gradients():
    from stratbench.models.zoo import apply_activation_checkpointing

    cfg = small()
    plain, wrapped = seeded(cfg), seeded(cfg)
    assert apply_activation_checkpointing(wrapped) == cfg.n_layers
    x = tokens(cfg)
    for model in (plain, wrapped):
        model(x).square().mean().backward()
    grads = [p.grad for p in wrapped.parameters()]
    for (name, p), g in zip(plain.named_parameters(), grads, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)
