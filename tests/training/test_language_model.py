"""The built-in transformer (gpt-tiny) on real text (the Python standard library's source, byte-level) under every
method that runs on CPU: each trains exactly the model `single` trains (fp64 within conftest.RTOL; DeepSpeed, which
has no fp64, in fp32 against one process with the same micro-batches: ZeRO-1, ZeRO-2 and ZeRO-2 with the optimizer
offloaded to the host bit for bit, ZeRO-3 within fp32 rounding), and a run reports what
language models are compared by: tokens/s, FLOPs per token (the 6N + attention formula), validation perplexity."""

from __future__ import annotations

import json
import math

import pytest

from conftest import RTOL, RTOL_FP32_SAME_MICRO_BATCHES, assert_curves_match, cli, fails, train
from stratbench.models.transformer import SIZES, flops_per_token

SEQ = 32
LM = [
    "--model", "gpt-tiny", "--data", "text", "--seq-len", str(SEQ), "--batch-size", "8", "--epochs", "1",
    "--max-steps", "8", "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "16", "--progress", "false",
    "--timing-warmup-steps", "1",
]  # fmt: skip
LM64 = [*LM, "--precision", "fp64", "--measure-flops", "false"]
LM32 = [*LM, "--measure-flops", "false"]

METHODS = {
    "ddp": ["--strategy", "ddp"],
    "ddp-zero": ["--strategy", "ddp-zero"],
    "fsdp-full+ac": ["--strategy", "fsdp", "--sharding", "full", "--activation-checkpointing"],
    "fsdp1": ["--strategy", "fsdp1"],
    "accelerate-ddp": ["--strategy", "accelerate-ddp"],
}
ZERO3_RTOL = 1e-5
"""ZeRO-3 on this transformer is fp32 rounding apart from one process on the same micro-batches, not bit for bit
as ZeRO-2 is (and as ZeRO-3 is on tinynet): 1.0e-7 after 8 steps, the first step's loss identical, measured on
an AMD EPYC (AVX2) with deepspeed 0.19.8, with and without ZeRO-3's own linear (memory_efficient_linear). A
wrong average or a missed gradient moves the loss by >= 1e-3."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lm")


@pytest.fixture(scope="module")
def single(root) -> dict:
    """`single` fp32 with the metrics a language-model row reports (FLOPs counted)."""
    return train(root / "single", "--strategy", "single", *LM)


@pytest.fixture(scope="module")
def single64(root) -> dict:
    return train(root / "single64", "--strategy", "single", *LM64)


@pytest.fixture(scope="module")
def single_accum2(root) -> dict:
    """fp32, one process, 2 micro-batches per step: the samples 2 ranks take (data.virtual_rank_order)."""
    return train(root / "single-accum2", "--strategy", "single", *LM32, "--grad-accum", "2")


def test_a_run_reports_tokens_per_second_flops_per_token_and_perplexity(single):
    m = single["metrics"]
    assert single["status"] == "ok" and single["model_meta"]["seq_len"] == SEQ
    assert single["model_meta"]["vocab_size"] == 256 and m["tokens_per_sample"] == SEQ
    assert m["throughput_tokens_per_s"] == pytest.approx(m["throughput_samples_per_s"] * SEQ)
    assert m["flops_per_token"] == pytest.approx(flops_per_token(SIZES["gpt-tiny"], SEQ), rel=0.01)
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["evaluations"][-1]["val_samples"] == 16 and m["evaluations"][-1]["val_tokens"] == 16 * SEQ
    assert m["val_perplexity"] < 256, "a byte model that learned nothing has perplexity ~256"
    curve = m["loss_curve"]
    assert curve[-1] < 0.85 * curve[0], curve


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_the_transformer_single_trains(root, single64, method):
    res = train(root / method, *METHODS[method], *LM64, nproc=2)
    assert res["status"] == "ok" and res["world_size"] == 2
    ref = single64["metrics"]["loss_curve"]
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(single64["metrics"]["val_loss"], rel=RTOL)


ZERO_BIT_FOR_BIT = {
    "zero1": ["--zero-stage", "1"],
    "zero2": ["--zero-stage", "2"],
    "zero2-offload": ["--zero-stage", "2", "--offload-optimizer", "cpu"],
}


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("case", list(ZERO_BIT_FOR_BIT))
def test_deepspeed_zero1_2_and_offload_train_the_transformer_one_process_trains_on_the_same_micro_batches(
    root, single_accum2, case
):
    res = train(root / case, "--strategy", "deepspeed", *ZERO_BIT_FOR_BIT[case], *LM32, nproc=2, timeout=240)
    assert res["status"] == "ok", res.get("reason")
    ref = single_accum2["metrics"]["loss_curve"]
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL_FP32_SAME_MICRO_BATCHES)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_deepspeed_zero3_trains_the_transformer_within_fp32_rounding(root, single_accum2):
    res = train(root / "zero3", "--strategy", "deepspeed", "--zero-stage", "3", *LM32, nproc=2, timeout=240)
    assert res["status"] == "ok", res.get("reason")
    assert_curves_match(res["metrics"]["loss_curve"], single_accum2["metrics"]["loss_curve"], ZERO3_RTOL)


def test_text_and_model_must_fit_in_one_line(capsys):
    """A classifier on text, a transformer on images, a window longer than the context: one line each, before
    any work."""
    err = fails(capsys, "train", "--model", "resnet18", "--data", "text")
    assert "classifies images; text data needs a language model: gpt-tiny" in err
    err = fails(capsys, "train", "--model", "gpt-tiny", "--data", "digits")
    assert "is a language model" in err
    err = fails(capsys, "train", "--model", "gpt-tiny", "--data", "text", "--seq-len", "512")
    assert "--seq-len 512 is longer than gpt-tiny's context of 256 tokens" in err
    err = fails(capsys, "train", "--model", "gpt-tiny", "--data", "tokens:/nonexistent/folder")
    assert "token data '/nonexistent/folder' does not exist" in err


def test_after_training_evaluate_generate_and_export_safetensors(single, root, capsys):
    """The single run's checkpoint: `evaluate` gives the perplexity of its validation windows, `predict --prompt`
    continues text (greedy: the same twice; top-k sampling: other text with another seed), `export` writes
    safetensors that a fresh gpt-tiny loads to the same logits (ONNX: tests/inference/test_lm_export.py)."""
    last = root / "single" / "checkpoints" / "last"
    out = json.loads(cli("evaluate", "--checkpoint", last, "--eval-samples", "16", "--json"))
    assert out["val_samples"] == 16 and out["val_perplexity"] == pytest.approx(math.exp(out["val_loss"]))
    assert out["val_loss"] == pytest.approx(single["metrics"]["val_loss"], rel=1e-6)  # the same 16 windows
    greedy = [json.loads(cli("predict", "--checkpoint", last, "--prompt", "def ", "--json")) for _ in range(2)]
    assert greedy[0] == greedy[1] and len(greedy[0]["ids"]) == 64 and all(0 <= i < 256 for i in greedy[0]["ids"])
    sampled = {
        json.loads(cli("predict", "--checkpoint", last, "--prompt", "def ", "--top-k", "20", "--seed", str(s),
                       "--max-new-tokens", "16", "--json"))["generated"]
        for s in range(3)
    }  # fmt: skip
    assert len(sampled) > 1
    assert "reloaded with plain safetensors" in cli("export", "--checkpoint", last, "--output", root / "m.safetensors")
    err = fails(capsys, "predict", "--checkpoint", last, "some.png")
    assert "this checkpoint is a language model: give --prompt TEXT" in err
