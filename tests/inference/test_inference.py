"""After training: predict / evaluate / export / bench-infer from sharded (fsdp, deepspeed) checkpoints.

The sharded checkpoints come from real 2-process gloo runs; the same checkpoint consolidated to one file
(`stratbench consolidate`) and loaded on one device must give the same predictions and accuracy, the ONNX
export must match PyTorch, and onnxruntime `evaluate` must equal PyTorch `evaluate`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli as run_in_process
from conftest import train
from stratbench.cli import main
from stratbench.core.errors import DataError
from stratbench.strategies.base import all_strategies

# A few steps are enough: the point is that every path gives the same numbers, not a good model.
FEW = [
    "--model", "tinynet", "--width", "8", "--data", "digits", "--batch-size", "32", "--epochs", "1",
    "--max-steps", "12", "--lr", "0.05", "--progress", "false", "--measure-flops", "false",
    "--timing-warmup-steps", "1",
]  # fmt: skip
SHARDED = {"fsdp": ["--checkpoint-format", "sharded"], "deepspeed": ["--zero-stage", "3"]}


def _need(strategy: str) -> None:
    # A renamed or missing strategy is a failure here, not a silent skip.
    assert strategy in all_strategies(), f"strategy {strategy!r} is not registered"


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Eight real digits as 8x8 grayscale PNGs (the model resizes them as it was trained)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    folder = tmp_path_factory.mktemp("digits_png")
    digits = load_digits()
    for i in range(8):
        Image.fromarray((digits.images[i] / 16 * 255).astype(np.uint8), "L").save(
            folder / f"{i}_label{digits.target[i]}.png"
        )
    return folder


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, dict]:
    """strategy -> {"folder": sharded checkpoint, "file": consolidated file, "result": result.json} (lazily)."""
    return {"_root": tmp_path_factory.mktemp("sharded")}


def sharded_run(runs: dict, strategy: str) -> dict:
    _need(strategy)
    if strategy not in runs:
        out = runs["_root"] / strategy
        result = train(out, "--strategy", strategy, *SHARDED[strategy], *FEW, nproc=2, timeout=400)
        folder = out / "checkpoints" / "last"
        assert folder.is_dir(), f"{strategy} wrote {folder} as a file, not a sharded folder"
        file = out / "consolidated.pt"
        run_in_process("consolidate", folder, file)
        runs[strategy] = {"folder": folder, "file": file, "result": result}
    return runs[strategy]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_checkpoint_predicts_like_consolidated_single(strategy, sharded_runs, images, capsys):
    run = sharded_run(sharded_runs, strategy)
    from stratbench.inference.predictor import load_model

    sharded, single = load_model(run["folder"]), load_model(run["file"])
    assert sharded.layout != "full" and single.layout == "full"
    for key, value in single.model.state_dict().items():
        torch.testing.assert_close(sharded.model.state_dict()[key], value, rtol=0, atol=0, msg=key)

    preds = {}
    for name, ckpt in (("sharded", run["folder"]), ("single", run["file"])):
        rc, out, err = cli(capsys, "predict", "--checkpoint", ckpt, images, "--top-k", "3", "--json")
        assert rc == 0, err
        preds[name] = json.loads(out)["predictions"]
    assert len(preds["sharded"]) == 8
    assert [[t["class"] for t in p["top"]] for p in preds["sharded"]] == [
        [t["class"] for t in p["top"]] for p in preds["single"]
    ]
    for a, b in zip(preds["sharded"], preds["single"], strict=True):
        assert [t["probability"] for t in a["top"]] == pytest.approx(
            [t["probability"] for t in b["top"]], abs=1e-6
        )

    evals = {}
    for name, ckpt in (("sharded", run["folder"]), ("single", run["file"])):
        rc, out, err = cli(capsys, "evaluate", "--checkpoint", ckpt, "--json")
        assert rc == 0, err
        evals[name] = json.loads(out)
    assert evals["sharded"]["val_accuracy"] == evals["single"]["val_accuracy"]
    assert evals["sharded"]["val_loss"] == pytest.approx(evals["single"]["val_loss"], rel=1e-6)
    # ... and both equal what the 2-process run measured on its sharded model at the end of training.
    metrics = run["result"]["metrics"]
    assert evals["single"]["val_samples"] == metrics["evaluations"][-1]["val_samples"]
    assert evals["single"]["val_accuracy"] == pytest.approx(metrics["val_accuracy"], abs=1e-9)
    assert evals["single"]["val_loss"] == pytest.approx(metrics["val_loss"], rel=1e-4)


@pytest.mark.distributed
def test_export_parity_tolerance_scales_with_the_logits(sharded_runs, tmp_path, capsys):
    """fp32 rounds relative to a value's size: a model whose logits reach ~1e4 (an fsdp resnet18 after 3 steps
    of the README's tour reached 2.5e4) differs from onnxruntime by ~1e-2 absolute, 5e-7 relative. --atol is the
    bound per unit of the largest |logit| (it failed such a model before); a difference past it still fails."""
    from stratbench.checkpoints import checkpoint as ckpt

    state = ckpt.load_any(Path(sharded_run(sharded_runs, "fsdp")["folder"]))
    for key in ("fc.weight", "fc.bias"):
        state["model"][key] = state["model"][key] * 1e4
    big = tmp_path / "big.pt"
    ckpt.save_full(big, {k: v for k, v in state.items() if k not in ("format", "version", "layout")})
    rc, out, err = cli(capsys, "export", "--checkpoint", big, "--output", tmp_path / "big.onnx")
    assert rc == 0, err
    scale = float(out.split("|logit| ")[-1].split(")")[0])
    assert scale > 1e3
    rc, out, err = cli(capsys, "export", "--checkpoint", big, "--output", tmp_path / "b2.onnx", "--atol", "1e-12")
    assert rc != 0 and "parity check failed" in err and "largest |logit|" in err


def test_onnx_export_matches_pytorch_and_onnxruntime_evaluate_equals_torch(
    sharded_runs, images, tmp_path, capsys
):
    run = sharded_run(sharded_runs, "fsdp")
    onnx_file = tmp_path / "model.onnx"
    rc, out, err = cli(
        capsys, "export", "--checkpoint", run["folder"], "--output", onnx_file, "--images", images
    )
    assert rc == 0, err
    assert "onnx.checker: ok" in out and "max abs diff" in out
    assert onnx_file.is_file() and not list(tmp_path.glob("*.data"))  # one self-contained file

    from stratbench.inference.onnx_export import OrtModel, parity, random_inputs, read_metadata
    from stratbench.inference.predictor import load_image, load_model

    loaded = load_model(run["folder"])
    assert read_metadata(onnx_file)["class_names"] == loaded.class_names
    session = OrtModel(onnx_file)
    real = torch.stack([load_image(p, loaded.meta) for p in sorted(images.glob("*.png"))])
    rows = parity(loaded.model, session, [*random_inputs(32, (1, 5, 33)), ("digits", real)])
    assert {r.shape[0] for r in rows} == {1, 5, 33, 8}  # the batch axis is dynamic
    for r in rows:
        assert r.max_abs_diff <= 1e-4, r
        assert r.same_argmax == 1.0, r

    results = {}
    for backend in ("torch", "onnxruntime"):
        extra = ["--onnx", onnx_file] if backend == "onnxruntime" else []
        rc, out, err = cli(
            capsys,
            "evaluate",
            "--checkpoint",
            run["folder"],
            "--backend",
            backend,
            *extra,
            "--json",
            "--batch-size",
            "100",
        )
        assert rc == 0, err
        results[backend] = json.loads(out)
    assert results["onnxruntime"]["val_samples"] == results["torch"]["val_samples"] == 359
    assert results["onnxruntime"]["val_accuracy"] == results["torch"]["val_accuracy"]
    assert results["onnxruntime"]["val_loss"] == pytest.approx(results["torch"]["val_loss"], abs=1e-5)

    # predict through onnxruntime from the exported file alone (meta stored in it) gives the torch answers
    rc, out_ort, err = cli(
        capsys, "predict", "--backend", "onnxruntime", "--onnx", onnx_file, images, "--json"
    )
    assert rc == 0, err
    rc, out_pt, err = cli(capsys, "predict", "--checkpoint", run["file"], images, "--json")
    assert rc == 0, err
    top = lambda doc: [p["top"][0]["class"] for p in json.loads(doc)["predictions"]]  # noqa: E731
    assert top(out_ort) == top(out_pt)


@pytest.mark.distributed
def test_bad_input_one_clear_line_each(sharded_runs, images, tmp_path, capsys):
    run = sharded_run(sharded_runs, "fsdp")
    good = run["file"]

    rc, out, err = cli(capsys, "predict", "--checkpoint", tmp_path / "nope.pt", images)
    assert rc != 0 and out == ""
    assert err.strip().splitlines() == [
        f"stratbench predict: error: checkpoint not found: {tmp_path / 'nope.pt'}"
    ]

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good.read_bytes()[:2000])
    rc, out, err = cli(capsys, "evaluate", "--checkpoint", corrupt)
    assert rc != 0 and len(err.strip().splitlines()) == 1
    assert "corrupt" in err and str(corrupt) in err

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in sorted(images.glob("*.png"))[:3]:
        (mixed / p.name).write_bytes(p.read_bytes())
    (mixed / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    rc, out, err = cli(capsys, "predict", "--checkpoint", good, mixed, "--json")
    assert rc != 0
    doc = json.loads(out)
    assert len(doc["predictions"]) == 3  # the good images of the batch still get predictions
    assert [e["path"] for e in doc["errors"]] == [str(mixed / "broken.jpg")]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "broken.jpg: cannot decode image" in errors[0]

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    rc, out, err = cli(capsys, "predict", "--checkpoint", good, empty)
    assert rc != 0 and out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{empty}: directory holds no images" in errors[0]

    not_ckpt = tmp_path / "some_folder"
    not_ckpt.mkdir()
    rc, out, err = cli(capsys, "export", "--checkpoint", not_ckpt, "--output", tmp_path / "x.onnx")
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "not a stratbench checkpoint" in err


@pytest.mark.distributed
def test_bench_infer_table_and_csv(sharded_runs, tmp_path, capsys):
    run = sharded_run(sharded_runs, "fsdp")
    out_csv = tmp_path / "bench.csv"
    rc, out, err = cli(
        capsys, "bench-infer", "--checkpoint", run["folder"], "--batch-sizes", "1,4",
        "--backends", "eager-fp32,eager-fp16,onnxruntime-cpu", "--warmup", "1", "--iters", "4", "--min-iters", "2",
        "--output", out_csv,
    )  # fmt: skip
    assert rc == 0, err
    rows = list(csv.DictReader(out_csv.open()))
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["backend"], r["batch_size"]) for r in ok} >= {
        ("eager-fp32", "1"),
        ("eager-fp32", "4"),
        ("onnxruntime-cpu", "1"),
        ("onnxruntime-cpu", "4"),
    }
    for r in ok:
        p50, p95, p99 = float(r["p50_ms"]), float(r["p95_ms"]), float(r["p99_ms"])
        assert 0 < p50 <= p95 <= p99
        assert 2 <= int(r["iterations"]) <= 4
        # throughput is samples over the timed seconds = batch / mean latency
        expected = int(r["batch_size"]) / (float(r["mean_ms"]) / 1e3)
        assert float(r["throughput_samples_per_s"]) == pytest.approx(expected, rel=1e-3)
    fp16 = [r for r in rows if r["backend"] == "eager-fp16"]
    if not torch.cuda.is_available() and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert fp16 and fp16[0]["status"] == "skipped" and "fp16" in fp16[0]["reason"]
    assert "p99 ms" in out


def test_percentile_nearest_rank():
    from stratbench.inference.predictor import percentile

    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 95) == 95 and percentile(values, 99) == 99
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0  # with few samples p99 is the slowest one
    assert percentile([5.0], 50) == 5.0


def test_quantized_export_is_checked_and_reports_parity(sharded_runs, tmp_path, capsys):
    """export --quantize int8-static on tinynet: a checked file whose metadata names the mode and its calibration,
    parity reported (not required), and top-1 on the digits within 1 point of PyTorch's. The 0.3x size bound is
    tested on gpt-tiny (test_lm_export.py), where weights are 94% of the fp32 file; tinynet's 24k parameters are
    half of its 194 KiB file, the rest graph and the exporter's debug metadata (its int8-static file measured 0.27x)."""
    run = sharded_run(sharded_runs, "fsdp")
    out = tmp_path / "int8.onnx"
    rc, printed, err = cli(capsys, "export", "--checkpoint", run["file"], "--output", out, "--quantize",
                           "int8-static", "--calibration-batches", "2", "--real-samples", "16")  # fmt: skip
    assert rc == 0, err
    assert "int8-static: " in printed and "calibrated on 64 validation samples" in printed
    assert "onnx.checker: ok" in printed and "parity (reported, not required): max abs diff" in printed
    from stratbench.inference.onnx_export import OrtModel, read_metadata
    from stratbench.inference.predictor import load_model
    from stratbench.inference.quality import Reference, validation_batches

    meta = read_metadata(out)
    assert meta["onnx_quantization"] == "int8-static" and meta["onnx_calibration_samples"] == 64
    loaded = load_model(run["file"])
    session = OrtModel(out)
    quality = Reference(loaded.model, validation_batches(loaded, 12), language=False).score(
        lambda x: torch.from_numpy(session.run(x.numpy()))
    )
    assert quality.samples == 359 and abs(quality.top1_delta_pts) <= 1.0, quality


def test_bench_infer_quality_of_quantized_rows(sharded_runs, tmp_path, capsys):
    """bench-infer's onnxruntime int8 / fp16 and torchao rows on tinynet: each scored against eager fp32 on the
    validation set (top-1 within 1 point), with its file size and start-up; a row that cannot run says why."""
    run = sharded_run(sharded_runs, "fsdp")
    out_csv = tmp_path / "bench.csv"
    backends = "eager-fp32,onnxruntime-int8-dynamic,onnxruntime-int8-static,onnxruntime-fp16,torchao-int8-dynamic"
    rc, printed, err = cli(capsys, "bench-infer", "--checkpoint", run["file"], "--batch-sizes", "2",
                           "--backends", backends + ",onnxruntime-cuda", "--warmup", "0", "--iters", "2",
                           "--min-iters", "1", "--threads", "1", "--calibration-batches", "2",
                           "--output", out_csv)  # fmt: skip
    assert rc == 0, err
    assert "top-1 %" in printed and "Δ pts" in printed and "max |Δlogit|" in printed
    rows = {r["backend"]: r for r in csv.DictReader(out_csv.open())}
    assert rows["onnxruntime-cuda"]["status"] == "skipped" and rows["onnxruntime-cuda"]["reason"]
    fp32 = rows["eager-fp32"]
    assert float(fp32["top1_delta_pts"]) == 0 and fp32["quality_samples"] == "256"
    for name in backends.split(",")[1:]:
        r = rows[name]
        assert r["status"] == "ok", (name, r["reason"])
        assert abs(float(r["top1_delta_pts"])) <= 1.0 and float(r["argmax_agreement"]) >= 0.95, (name, r)
        assert float(r["top1"]) == pytest.approx(float(fp32["top1"]) + float(r["top1_delta_pts"]) / 100, abs=2e-4)
        assert int(r["size_bytes"]) > 0 and float(r["startup_s"]) > 0
    assert int(rows["onnxruntime-int8-dynamic"]["size_bytes"]) < int(rows["onnxruntime-fp16"]["size_bytes"])


def test_quantize_bad_input_one_line_nothing_written(sharded_runs, tmp_path, capsys, monkeypatch):
    from conftest import fails

    good = sharded_run(sharded_runs, "fsdp")["file"]
    out = tmp_path / "q.onnx"
    base = ("export", "--checkpoint", good, "--output", out)
    err = fails(capsys, *base, "--quantize", "int8-statc")
    assert "unknown --quantize mode 'int8-statc' (did you mean 'int8-static'" in err and "int8-dynamic, int8-static, fp16" in err
    err = fails(capsys, "export", "--checkpoint", good, "--output", tmp_path / "q.pt", "--quantize", "int8-dynamic")
    assert "--quantize int8-dynamic rewrites an ONNX export; --format state-dict is not ONNX" in err
    err = fails(capsys, *base, "--quantize", "fp16", "--fp16")
    assert "choose one" in err
    err = fails(capsys, *base, "--quantize", "int8-dynamic", "--atol", "0.1")
    assert "--atol bounds an export's parity check" in err
    err = fails(capsys, *base, "--quantize", "int8-static", "--calibration-batches", "0")
    assert "--quantize int8-static needs calibration data" in err

    def no_data(*a, **k):
        raise DataError("data set 'digits' cannot be read here")

    monkeypatch.setattr("stratbench.commands.export.validation_batches", no_data)
    err = fails(capsys, *base, "--quantize", "int8-static")
    assert "int8-static calibrates on the checkpoint's validation data, which is not available here" in err
    assert not out.exists() and not list(tmp_path.iterdir())
    err = fails(capsys, "bench-infer", "--checkpoint", good, "--backends", "onnxruntime-int8-statc")
    assert "unknown backend(s) onnxruntime-int8-statc (did you mean 'onnxruntime-int8-static'" in err
