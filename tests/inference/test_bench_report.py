"""bench-infer's answer (inference.bench_report): the fastest, the highest-throughput and the smallest backend
within --max-quality-loss, picked from rows made up here so that each pick is known; the refusal of an
out-of-range limit; and one small real run (tinynet, 16 px) for the per-cell columns and the report's order."""

from __future__ import annotations

import csv

import pytest
import torch

from conftest import cli, fails
from stratbench.inference.bench import Row, random_model
from stratbench.inference.bench_report import DEFAULT_MAX_LOSS, answer, chart, markdown
from stratbench.inference.quality import Reference


def row(
    backend: str, bs: int, p50: float, size: int, loss: float | None, language: bool = False, **kw
) -> Row:
    """A completed row: p50 ms at batch ``bs`` (throughput bs / p50), a file of ``size`` bytes, and ``loss``
    (top-1 points lost, or perplexity percent gained; None: not scored)."""
    r = Row("m", 32, backend, "float32", "cpu", bs, p50_ms=p50, p90_ms=p50, p99_ms=p50, size_bytes=size, **kw)
    r.throughput_samples_per_s = bs / p50 * 1e3
    if loss is not None and language:
        r.perplexity, r.perplexity_delta_pct = 20 * (1 + loss / 100), loss
    elif loss is not None:
        r.top1, r.top1_delta_pts = 0.9 - loss / 100, -loss
    return r


def matrix(language: bool = False, scored: bool = True) -> list[Row]:
    """eager-fp32 (the reference), onnxruntime fp32 (no loss), int8-static (0.8 lost, small), int8-dynamic (the
    fastest and smallest of all; 2.5 top-1 points lost, or 1.5% perplexity), at batch 1 and 8; a skipped row."""
    spec = [("eager-fp32", 10.0, 400, 0.0), ("onnxruntime-cpu", 6.0, 410, 0.0),
            ("onnxruntime-int8-static", 5.0, 110, 0.8), ("onnxruntime-int8-dynamic", 3.0, 100, 1.5 if language else 2.5)]  # fmt: skip
    rows = [row(b, bs, p50 * bs / (2 if bs > 1 else 1), size, loss if scored else None, language)
            for bs in (1, 8) for b, p50, size, loss in spec]  # fmt: skip
    return rows + [
        Row("m", 32, "onnxruntime-cuda", "float32", "cuda", "-", status="skipped", reason="needs a CUDA GPU")
    ]


def test_answer_picks_within_the_quality_loss():
    ans = answer(matrix(), DEFAULT_MAX_LOSS[False], language=False)
    picks = {k: (r.backend, r.batch_size) for k, r in ans.picks.items()}
    assert picks == {"fastest": ("onnxruntime-int8-static", 1), "throughput": ("onnxruntime-int8-static", 8),
                     "smallest": ("onnxruntime-int8-static", 1)}  # fmt: skip
    labels = [label for label, _ in ans.lines]
    assert labels[0] == "Fastest within 1 pts top-1 of eager fp32", labels
    text = dict(ans.lines)
    assert "2.00x as fast as eager-fp32" in text[labels[0]] and "0.28x eager-fp32's" in text[labels[2]]
    assert "Runner-up" not in text[labels[0]]  # onnxruntime-cpu is 20% slower
    close = matrix()
    close[1].p50_ms = 5.4
    assert "Runner-up: onnxruntime-cpu, 8% slower" in answer(close, 1.0, language=False).lines[0][1]
    assert "onnxruntime-int8-dynamic (+2.50 pts top-1)" in text["Quality"]
    # a looser limit lets int8-dynamic in; a language model's loss is its perplexity increase (default 2%)
    assert answer(matrix(), 3.0, language=False).picks["fastest"].backend == "onnxruntime-int8-dynamic"
    lm = answer(matrix(language=True), DEFAULT_MAX_LOSS[True], language=True)
    assert lm.picks["fastest"].backend == "onnxruntime-int8-dynamic" and "2% perplexity" in lm.lines[0][0]
    strict = answer(matrix(language=True), 0.5, language=True).picks
    assert (strict["fastest"].backend, strict["smallest"].backend) == ("onnxruntime-cpu", "eager-fp32")
    # unscored rows (random weights): picked by speed and size, and the answer says why
    unscored = answer(matrix(scored=False), 1.0, language=False, unscored_reason="random weights")
    assert unscored.picks["fastest"].backend == "onnxruntime-int8-dynamic"
    assert "not measured (random weights)" in dict(unscored.lines)["Quality"]
    assert answer(matrix()[-1:], 1.0, False).lines[0][0] == "Nothing to compare"


def test_report_opens_with_the_answer_and_draws_the_chart(tmp_path):
    rows = matrix()
    ans = answer(rows, 1.0, language=False)
    assert chart(rows, ans, False, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 5000
    text = markdown(rows, ans, "Inference: m", ["how"], "c.png")
    order = [text.index(s) for s in ("## What to use", "**Fastest", "| backend |", "![", "needs a CUDA GPU")]
    assert order == sorted(order), text
    assert not chart(matrix(scored=False), ans, False, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("bad", ["150", "-1", "nan"])
def test_quality_loss_out_of_range_refused_before_work(bad, tmp_path, capsys):
    out, report = tmp_path / "b.csv", tmp_path / "b.md"
    err = fails(capsys, "bench-infer", "--model", "tinynet", "--max-quality-loss", bad, "--output", out,
                "--report", report)  # fmt: skip
    assert "--max-quality-loss must be between 0 and 100" in err and f"got {float(bad):g}" in err
    assert not list(tmp_path.iterdir())


def test_bench_infer_cells_and_report(tmp_path):
    """A real run: p90 and the cell's peak memory (the RSS high-water mark on a CPU), the compile row's start-up
    including its compile, a GPU-only row that says why here, and the report in its order."""
    out, report = tmp_path / "b.csv", tmp_path / "b.md"
    printed = cli("bench-infer", "--model", "tinynet", "--image-size", "16", "--width", "4", "--batch-sizes", "1",
                  "--backends", "eager-fp32,torch-tensorrt,onnxruntime-tensorrt", "--warmup", "0", "--iters", "2",
                  "--min-iters", "1", "--threads", "1", "--output", out, "--report", report)  # fmt: skip
    assert printed.startswith("Fastest (quality not measured): eager-fp32: p50 "), printed
    rows = {r["backend"]: r for r in csv.DictReader(out.open())}
    fp32 = rows["eager-fp32"]
    assert float(fp32["p50_ms"]) <= float(fp32["p90_ms"]) <= float(fp32["p99_ms"])
    assert fp32["memory_kind"] == "rss-hwm" and int(fp32["peak_memory_bytes"]) > 10 * 2**20
    assert 0 < int(fp32["memory_start_bytes"]) <= int(fp32["peak_memory_bytes"])
    if not torch.cuda.is_available():
        assert (
            rows["torch-tensorrt"]["reason"] == rows["onnxruntime-tensorrt"]["reason"] == "needs a CUDA GPU"
        )
    text = report.read_text()
    assert text.index("## What to use") < text.index("| backend |") < text.index("## Rows that did not run")


def test_reference_leaves_the_model_as_it_was():
    """quality.Reference scores on a CPU fp32 eval copy where the model is not one already: the caller's model
    keeps its dtype and training mode (it used to be cast and switched to eval in place)."""
    model, _ = random_model("tinynet", 10, 16, 4)
    model.to(torch.bfloat16).train()
    x = torch.randn(4, 3, 16, 16)
    ref = Reference(model, [(x, torch.zeros(4, dtype=torch.long))], language=False)
    assert model.training and next(model.parameters()).dtype == torch.bfloat16
    assert (
        ref.logits[0].dtype == torch.float32 and ref.score(lambda b: ref.logits[0]).max_abs_delta_logit == 0
    )
