"""The projection of a ``--float8`` run (issue 46 item 4): the converted Linears' products at the GPU's fp8 peak x
the fp8 efficiency, the rest at the run's precision; a GPU without fp8 units refused in one line. Arithmetic on
meta-device shapes: no training, no GPU."""

from __future__ import annotations

import json

import pytest
import yaml

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.measuring.hardware import resolve
from stratbench.measuring.records import RunRecord
from stratbench.predicting import projection

GPT = dict(model="gpt-tiny", data="synthetic-tokens", seq_len=64, batch_size=8, precision="bf16-mixed")
FP8_GPU = {
    "version": 1,
    "gpus": {"fp8-gpu": {"name": "Round FP8 GPU", "match": r"\bRound FP8\b", "memory": "80 GB",
                         "memory_bandwidth": "1 TB/s", "peak_flops": {"bf16": "100 TFLOP/s", "fp8": "400 TFLOP/s"},
                         "efficiency": {"bf16": 0.5, "fp8": 0.25}}},
    "systems": {"fp8-node": {"gpu": "fp8-gpu", "gpus_per_node": 1, "intra_node": "nvlink4", "host": "pcie5-x16"}},
}  # fmt: skip


def test_the_converted_linears_run_at_the_fp8_peak_and_the_rest_at_the_precisions(tmp_path):
    """gpt-tiny (4 blocks of dim 192, SwiGLU 512, vocab 256) at 64 tokens: every Linear of the blocks is converted
    (dimensions multiples of 16), the output head (192 x 256) is not. By hand: per token and block, forward
    2 x (4 x 192 x 192 + 3 x 192 x 512) FLOPs, x 3 with backward, x 4 blocks x 64 tokens. On a GPU of 100 TFLOP/s
    bf16 at 50% and 400 fp8 at 25%, those FLOPs take 1/1e14 s each, the rest 1/5e13 s each."""
    hand = 3 * 2 * (4 * 192 * 192 + 3 * 192 * 512) * 4 * 64
    cfg = TrainConfig(**GPT, float8="tensorwise")
    assert projection.float8_flops(cfg) == hand
    total = projection.model_flops(cfg)
    assert 0.5 < hand / total < 1  # the attention scores and the head are the rest
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(FP8_GPU))
    system = resolve(f"{path}:fp8-node")
    p = projection.project(cfg, system, memory=False)
    assert p.status == "ok", p.reason
    assert p.compute_s == pytest.approx(8 * (hand / 1e14 + (total - hand) / 5e13), rel=1e-12)
    assert p.float8 == {"recipe": "tensorwise", "flops_share": pytest.approx(hand / total), "fp8_peak": 4e14,
                        "efficiency": 0.25, "source": f"hardware file {path} (gpus.fp8-gpu.efficiency.fp8)"}  # fmt: skip
    plain = projection.project(cfg.replace(float8="none"), system, memory=False)
    assert plain.compute_s == pytest.approx(8 * total / 5e13, rel=1e-12) and plain.float8 == {}


def test_a_gpu_without_fp8_units_is_refused_in_one_line(capsys):
    """A100: no fp8 peak. The projection's row and `estimate --time` say so in one line, as train refuses the
    device; a --float8 run cannot calibrate (its products ran at two peaks), and its predicted step says how float8
    was priced."""
    from stratbench.cli import main

    cfg = TrainConfig(**GPT, float8="rowwise")
    p = projection.project(cfg, resolve("a100-sxm"), 1, 1, memory=False)
    assert p.status == "error" and p.step_s is None
    assert p.reason == (
        "--float8 rowwise needs a GPU with float8 units (compute capability 8.9 or later: Ada, Hopper, Blackwell); "
        "NVIDIA A100 SXM4 80GB (a100-sxm) has none: no fp8 peak in its hardware profile"
    )
    argv = ["estimate", "--model", "gpt-tiny", "--data", "synthetic-tokens", "--seq-len", "64", "--batch-size",
            "8", "--precision", "bf16-mixed", "--float8", "tensorwise", "--time", "--gpus-per-node", "1"]  # fmt: skip
    assert main([*argv, "--hardware", "a100-sxm"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "A100 SXM4 80GB (a100-sxm) has none" in err, err
    assert main([*argv, "--hardware", "h100-sxm"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "float8 (tensorwise): the converted Linears' " in out, out
    assert "fp8 peak 1,979 TFLOP/s x 30.2%" in out, out
    run = {"status": "ok", "world_size": 1, "config": cfg.to_dict(), "metrics": {"step_time_median_s": 0.1},
           "environment": {"device_type": "cuda", "gpus": ["NVIDIA H100 80GB HBM3"]}}  # fmt: skip
    record = RunRecord.from_dict(json.loads(json.dumps(run)))
    with pytest.raises(ConfigError, match="a --float8 run cannot calibrate"):
        projection.calibrate([record], resolve("h100-sxm"))
    pred = projection.predict_record(record, None)  # a compare report's predicted step: how float8 was priced
    assert pred.step_s and "float8 Linears" in pred.basis and "at the fp8 peak x 30.2%" in pred.basis, pred
