"""A trained gpt-tiny exported to ONNX (``input_ids`` with dynamic batch and sequence axes) runs in onnxruntime
on any (batch, seq) up to its context with PyTorch's logits, says in its metadata what to feed it, and
`bench-infer` measures it (eager and onnxruntime) in tokens/s."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from conftest import cli, fails, train
from stratbench.cli import main
from stratbench.inference.onnx_export import OrtModel, read_metadata
from stratbench.inference.predictor import load_model

SEQ = 32
LM = [
    "--model", "gpt-tiny", "--data", "text", "--seq-len", str(SEQ), "--batch-size", "8", "--epochs", "1",
    "--max-steps", "3", "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "16", "--progress", "false",
    "--measure-flops", "false", "--timing-warmup-steps", "1",
]  # fmt: skip
ATOL = 1e-4
"""The export command's fp32 bound per unit of the largest |logit|; measured: 1.7e-6 at |logit| ~4."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lm-export")


@pytest.fixture(scope="module")
def last(root):
    res = train(root / "run", "--strategy", "single", *LM)
    assert res["status"] == "ok", res.get("reason")
    return root / "run" / "checkpoints" / "last"


@pytest.fixture(scope="module")
def exported(root, last) -> tuple:
    """`stratbench export` of the checkpoint to ONNX, and what it printed."""
    out = root / "gpt.onnx"
    return out, cli("export", "--checkpoint", last, "--output", out, "--real-samples", "8")


def test_export_checks_both_dynamic_axes_and_records_the_input(exported):
    out, printed = exported
    assert "onnx.checker: ok" in printed and "dynamo exporter" in printed
    assert "inputs: input_ids int64 [batch, seq <= 256] -> logits float32 [batch, seq, 256]" in printed
    # the parity check ran two batch sizes and several lengths, and validation windows of the text
    for shape in ("1x5", "3x32", "2x256", "8x32"):
        assert f" {shape} " in printed, shape
    worst = float(printed.split("max abs diff ")[-1].split()[0])
    assert worst < ATOL * 10, printed
    meta = read_metadata(out)
    signature = meta["onnx_io"]
    assert signature["inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "seq_max": 256}
    ]
    assert signature["outputs"][0]["shape"] == ["batch", "seq", 256]
    assert "UTF-8 bytes" in signature["tokens"] and meta["codec"] == "bytes" and meta["seq_len"] == SEQ


@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (4, SEQ), (1, 256)])
def test_onnxruntime_gives_torch_logits_at_any_batch_and_length(exported, last, shape):
    """Shapes the export's own check did not use: the causal mask and the rotary angles follow the length."""
    out, _ = exported
    model = load_model(last).model
    session = OrtModel(out)
    tokens = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(sum(shape)))
    with torch.inference_mode():
        ref = model(tokens).numpy()
    got = session.run(tokens.numpy())
    assert got.shape == (*shape, 256) and session.input_dtype is np.int64
    assert np.abs(got - ref).max() <= ATOL * max(1.0, np.abs(ref).max())
    # causal: the first position's logits do not depend on what follows it
    if shape[1] > 1:
        assert np.allclose(session.run(tokens[:, :1].numpy()), got[:, :1], atol=1e-5)


def test_evaluate_through_onnxruntime_matches_torch(exported, last):
    """The exported file is usable on its own: `evaluate --backend onnxruntime --onnx` gives PyTorch's loss."""
    out, _ = exported
    args = ("evaluate", "--checkpoint", last, "--eval-samples", "16", "--json")
    ref = json.loads(cli(*args))
    got = json.loads(cli(*args, "--backend", "onnxruntime", "--onnx", out))
    assert got["backend"] == "onnxruntime" and got["val_samples"] == ref["val_samples"] == 16
    assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def test_a_failed_export_leaves_the_earlier_file(exported, last, capsys):
    """TorchScript cannot export the transformer (no aten::rms_norm): one error line, the earlier file intact."""
    out, _ = exported
    before = out.read_bytes()
    assert main(["export", "--checkpoint", str(last), "--output", str(out), "--exporter", "torchscript"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "ONNX export of gpt-tiny failed (torchscript:" in err[-1] and "Traceback" not in "".join(err)
    assert out.read_bytes() == before
    err = fails(
        capsys, "export", "--checkpoint", last, "--output", out.with_name("x.onnx"), "--images", "a.png"
    )
    assert "--images: gpt-tiny is a language model" in err and not out.with_name("x.onnx").exists()


def test_bench_infer_measures_tokens_per_second(last, root, capsys):
    out_csv = root / "bench.csv"
    code = main([
        "bench-infer", "--checkpoint", str(last), "--seq-len", "16", "--batch-sizes", "1,2",
        "--backends", "eager-fp32,onnxruntime-cpu", "--warmup", "1", "--iters", "3", "--min-iters", "2",
        "--threads", "1", "--output", str(out_csv),
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "gpt-tiny, 16-token sequences" in printed.err and "tokens/s" in printed.out
    assert "note: a language model's iteration is one forward over batch x seq-len tokens" in printed.err
    rows = list(csv.DictReader(out_csv.open()))
    assert {(r["backend"], r["batch_size"]) for r in rows if r["status"] == "ok"} == {
        ("eager-fp32", "1"), ("eager-fp32", "2"), ("onnxruntime-cpu", "1"), ("onnxruntime-cpu", "2"),
    }  # fmt: skip
    for r in rows:
        assert r["seq_len"] == "16"
        tokens = float(r["throughput_tokens_per_s"])
        assert tokens == pytest.approx(16 * float(r["throughput_samples_per_s"]), rel=1e-3) and tokens > 0


def test_bench_infer_random_language_model_and_bad_lengths(last, capsys):
    """--model gpt-tiny (random weights) runs at its default length; a length beyond the context, or --seq-len on
    an image model, is one line before any work."""
    printed = cli(
        "bench-infer", "--model", "gpt-tiny", "--batch-sizes", "1", "--backends", "eager-fp32",
        "--warmup", "0", "--iters", "2", "--min-iters", "1", "--threads", "1",
    )  # fmt: skip
    assert "gpt-tiny, 128-token sequences" in printed
    err = fails(
        capsys, "bench-infer", "--model", "gpt-tiny", "--seq-len", "300", "--backends", "onnxruntime-cpu"
    )
    assert (
        "--seq-len 300 is longer than gpt-tiny's context of 256 tokens; choose --seq-len at most 256" in err
    )
    err = fails(capsys, "bench-infer", "--checkpoint", last, "--seq-len", "257")
    assert "--seq-len 257 is longer than gpt-tiny's context of 256 tokens" in err
    err = fails(capsys, "bench-infer", "--model", "tinynet", "--seq-len", "16")
    assert "--seq-len is for language models" in err and "tinynet takes images" in err


def test_quantized_exports_shrink_and_keep_the_next_token(exported, last, root):
    """export --quantize's rewrite of gpt-tiny's fp32 export (1.9M parameters: weights are 94% of the 7.6 MiB
    file): checked files whose metadata names the mode; both int8 files at most 0.3x the fp32 one (measured: 0.25x
    each), fp16 0.53x; each keeps eager fp32's next token on >= 95% of the validation positions (measured 100%)."""
    from stratbench.inference.quality import Reference, validation_batches
    from stratbench.inference.quantize import quantize_onnx

    fp32, _ = exported
    loaded = load_model(last)
    batches = validation_batches(loaded, 4)
    reference = Reference(loaded.model, batches, language=True)
    calibration = [x.numpy() for x, _ in batches[:2]]
    for mode, most in (("int8-dynamic", 0.3), ("int8-static", 0.3), ("fp16", 0.6)):
        result = quantize_onnx(fp32, root / f"gpt-{mode}.onnx", mode, calibration)
        assert result.size_bytes / fp32.stat().st_size <= most, (mode, result.size_bytes)
        meta = read_metadata(result.path)
        assert meta["onnx_quantization"] == mode and meta["seq_len"] == SEQ
        assert meta.get("onnx_calibration_samples") == (16 if mode == "int8-static" else None)
        session = OrtModel(result.path)
        q = reference.score(lambda x, s=session: torch.from_numpy(s.run(x.numpy())))
        assert q.argmax_agreement >= 0.95 and q.samples == 32, (mode, q)
        assert abs(q.perplexity_delta_pct) < 2.0 and 0 < q.max_abs_delta_logit < 1.0, (mode, q)


def test_bench_infer_scores_quantized_rows_against_eager(last, root, capsys):
    """bench-infer's quality columns for a language model: perplexity and its change, argmax agreement and max
    |delta logit| against eager fp32 on the validation windows, the file size and start-up of each backend (torchao's
    int8 rows here; onnxruntime's quantised files are scored above and in tests/inference/test_inference.py)."""
    out_csv = root / "bench-q.csv"
    code = main([
        "bench-infer", "--checkpoint", str(last), "--seq-len", "16", "--batch-sizes", "1",
        "--backends", "eager-fp32,torchao-int8-weight,torchao-int8-dynamic", "--warmup", "0", "--iters", "2",
        "--min-iters", "1", "--threads", "1", "--quality-batches", "2", "--output", str(out_csv),
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "ppl" in printed.out and "agree %" in printed.out
    assert "quality against eager fp32 on the first 16 validation token windows (2 batches)" in printed.err
    rows = {r["backend"]: r for r in csv.DictReader(out_csv.open())}
    assert set(rows) == {"eager-fp32", "torchao-int8-weight", "torchao-int8-dynamic"}
    eager = rows["eager-fp32"]
    assert float(eager["perplexity_delta_pct"]) == 0 and float(eager["argmax_agreement"]) == 1
    for name in ("torchao-int8-weight", "torchao-int8-dynamic"):
        r = rows[name]
        assert r["status"] == "ok" and r["dtype"] == "int8" and r["quality_samples"] == "16"
        assert float(r["perplexity"]) == pytest.approx(float(eager["perplexity"]), rel=0.02)
        assert float(r["argmax_agreement"]) >= 0.95 and float(r["max_abs_delta_logit"]) > 0
        # int8 weights (and their scales): the state dict at most 0.3x eager fp32's (measured 0.28x)
        assert int(r["size_bytes"]) <= 0.3 * int(eager["size_bytes"]), name
        assert float(r["startup_s"]) > 0
