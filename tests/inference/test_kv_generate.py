"""Decoding with a key/value cache (stratbench.models.kv_cache) and ``stratbench bench-generate``: the cached greedy
tokens are the no-cache forward's (the built-in transformer, with grouped-query heads too, and a Hugging Face Llama
folder, where they are also transformers' own ``generate``'s); a prompt fed in chunks gives the full forward's
logits; the command measures every case it is asked for and refuses bad input in one line."""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch

from conftest import fails
from stratbench.cli import main
from stratbench.core.errors import ConfigError
from stratbench.inference.generate import Sampling, decode, generate
from stratbench.models.hf import import_transformers
from stratbench.models.kv_cache import compile_step, decoder_for
from stratbench.models.transformer import Transformer, TransformerConfig, build_transformer
from stratbench.models.zoo import build_model

GQA = TransformerConfig(
    vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64, init="llama"
)


def _greedy_both_ways(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> tuple[list[int], list[int]]:
    greedy = Sampling(max_new_tokens=new, top_k=1)
    cached = decode(decoder_for(model), prompt, greedy).ids
    return cached, generate(model, prompt[0].tolist(), 10**6, greedy)


def test_cached_greedy_tokens_are_the_full_forwards():
    """gpt-tiny (grouped-query heads: the chunked test below, whose tiny random model repeats one token greedily)."""
    torch.manual_seed(0)
    model = build_transformer("gpt-tiny").eval()
    prompt = torch.randint(0, model.vocab_size, (1, 24))
    cached, full = _greedy_both_ways(model, prompt, 24)
    assert cached == full
    assert len(set(cached)) > 1  # a decoder stuck on one token would match trivially
    no_cache = decode(decoder_for(model, cache=False), prompt, Sampling(24, top_k=1)).ids
    assert no_cache == full


def test_a_prompt_fed_in_chunks_gives_the_full_forwards_logits():
    """Prefill, a chunk after cached tokens (the masked path), single tokens: each the full forward's last logits;
    a sequence past the max length is refused in one line."""
    torch.manual_seed(0)
    model = Transformer(GQA).eval()
    tokens = torch.randint(0, GQA.vocab_size, (2, 40))
    decoder = decoder_for(model)
    with torch.inference_mode():
        full = model(tokens)
        decoder.start(2)
        for lo, hi in ((0, 16), (16, 30), (30, 31), (31, 40)):
            torch.testing.assert_close(decoder.feed(tokens[:, lo:hi]), full[:, hi - 1], rtol=1e-4, atol=1e-5)
        with pytest.raises(ConfigError, match="longer than the model's max length of 64"):
            decoder.feed(torch.zeros(1, 25, dtype=torch.long))


def test_the_cached_step_compiles_as_one_graph():
    """The step bench-generate compiles (dynamic shapes, fullgraph=True: a graph break is an error, not a silent
    fallback to eager), traced by dynamo with its eager backend (inductor's build takes 20-100 s on 2 shared cores):
    the same greedy tokens as the eager cache, over a prompt and single tokens at moving positions."""
    torch.manual_seed(0)
    model = build_transformer("gpt-tiny").eval()
    prompt = torch.randint(0, model.vocab_size, (1, 16))
    decoder = decoder_for(model)
    decoder.step = compile_step(decoder.forward_at, backend="eager")
    greedy = Sampling(max_new_tokens=12, top_k=1)
    assert decode(decoder, prompt, greedy).ids == decode(decoder_for(model), prompt, greedy).ids


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_llama_folder_decodes_with_dynamic_cache(tmp_path):
    transformers = import_transformers()  # torchvision guarded first, as stratbench imports it
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config.save_pretrained(tmp_path / "llama")  # config.json alone: stratbench builds it with random weights
    model = build_model(f"hf:{tmp_path / 'llama'}", 96, seq_len=32).eval()
    prompt = torch.randint(0, 96, (1, 12))
    cached, full = _greedy_both_ways(model, prompt, 16)
    assert cached == full and len(set(cached)) > 1
    hf_ids = model.hf.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16, pad_token_id=0)
    assert hf_ids[0, 12:].tolist() == cached


def _run(capsys, *args: str) -> tuple[int, str]:
    code = main(["bench-generate", *map(str, args)])
    return code, capsys.readouterr().err


def test_bench_generate_measures_each_case(tmp_path, capsys):
    out = tmp_path / "gen.csv"
    code, err = _run(capsys, "--model", "gpt-tiny", "--prompt-lengths", "8,20", "--max-new-tokens", "6",
                     "--backends", "eager,eager-no-cache", "--warmup", "0", "--repeats", "2", "--threads", "1",
                     "--output", out)  # fmt: skip
    assert code == 0, err
    rows = list(csv.DictReader(out.open()))
    assert [(r["backend"], r["decoding"], r["prompt_len"]) for r in rows] == [
        (b, d, n) for b in ("eager", "eager-no-cache") for n in ("8", "20") for d in ("greedy", "sampled")
    ]
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 and float(r["ttft_ms"]) > 0 for r in rows)
    assert all(float(r["p50_ms"]) <= float(r["p90_ms"]) for r in rows)
    assert [r["same_as_reference"] for r in rows if r["backend"] == "eager-no-cache" and r["decoding"] == "greedy"] == [
        "True", "True",
    ]  # fmt: skip
    assert {r["cache"] for r in rows} == {"kv", "none"} and {r["threads"] for r in rows} == {"1"}


def test_default_prompt_lengths_are_capped_and_said(capsys):
    code, err = _run(capsys, "--model", "gpt-tiny", "--max-new-tokens", "220", "--backends", "eager", "--decodings",
                     "greedy", "--warmup", "0", "--repeats", "1", "--threads", "1")  # fmt: skip
    assert code == 0, err
    assert "prompt lengths 128, 512, 2048 capped at 36: gpt-tiny's max length is 256 tokens" in err
    assert "prompt 36 " in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "gpt-tiny", "--prompt-lengths", "250"], "--prompt-lengths 250: with --max-new-tokens 64, gpt-tiny's max length of 256 tokens leaves room for prompts of at most 192"),
        (["--model", "gpt-huge"], "unknown model 'gpt-huge'"),
        (["--model", "resnet18"], "bench-generate needs a language model"),
        (["--model", "gpt-tiny", "--backends", "eager,onnx"], "--backends: unknown value 'onnx'"),
        (["--model", "gpt-tiny", "--max-new-tokens", "256"], "leaves no room for a prompt"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(capsys, args, says):
    assert says in fails(capsys, "bench-generate", *args)
