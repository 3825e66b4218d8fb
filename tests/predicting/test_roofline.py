"""The roofline basis of the step-time projection (stratbench.predicting.roofline): the per-op formula on
hand-computed cases (a bandwidth-bound add, a compute-bound GEMM of exactly one full wave, a one-wave GEMM that
leaves SMs idle, a tiny op that costs its launch), the traced ops of real models against the FLOP counter, and the
basis in the projection's JSON. No GPU: fake tensors and arithmetic."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from stratbench.measuring import hardware
from stratbench.measuring.hardware import HardwareError, Roofline
from stratbench.measuring.model_trace import ModelSpec, trace_ops
from stratbench.models import flops
from stratbench.models.flops import OP_CLASSES, flop_counter, flops_by_op, op_cost
from stratbench.predicting import projection, roofline

# A GPU of round numbers: H100 SXM's peaks and 132 SMs, 3 TB/s, every class at 0.5 of the peak and 0.8 of the
# bandwidth, 128 x 128 tiles, 5 us per launch.
LAUNCH = 5e-6
ROOF = Roofline("test", {c: (0.5, 0.8) for c in OP_CLASSES}, (128, 128), LAUNCH)
GPU = dataclasses.replace(hardware.builtin().gpus["h100-sxm"], memory_bandwidth=3e12, sms=132, roofline=ROOF)
BF16_PEAK = 989.4e12


def _cost(func, *shapes, dtype=torch.bfloat16, rest=()):
    """``op_cost`` of one aten op on fake tensors of ``shapes`` (None: no tensor), then the ``rest`` arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = (*(None if s is None else torch.empty(s, dtype=dtype) for s in shapes), *rest)
        return op_cost(func, args, {}, func(*args))


def test_a_large_add_is_bandwidth_bound():
    n = 2**28  # fp32: read two, write one
    op = _cost(torch.ops.aten.add.Tensor, (n,), (n,), dtype=torch.float32)
    assert (op.op_class, op.bytes) == ("elementwise", 3 * 4 * n)
    assert roofline.op_seconds(op, GPU, "fp32") == pytest.approx(3 * 4 * n / (3e12 * 0.8) + LAUNCH, rel=1e-12)


def test_a_full_wave_gemm_is_compute_bound_at_the_peak_times_its_fraction():
    m, n, k = 128 * 12, 128 * 11, 16384  # 12 x 11 = 132 tiles: one full wave on 132 SMs
    op = _cost(torch.ops.aten.mm.default, (m, k), (k, n))
    assert (op.op_class, op.flops, op.output_tiles) == ("large_gemm", 2 * m * n * k, (1, m, n))
    assert op.dtype == "bfloat16"
    assert op.bytes == 2 * (m * k + k * n + m * n)
    assert roofline.wave_efficiency(op, GPU) == 1.0
    compute = 2 * m * n * k / (BF16_PEAK * 0.5)
    assert compute > op.bytes / (3e12 * 0.8)  # compute-bound
    assert roofline.op_seconds(op, GPU, "bf16") == pytest.approx(compute + LAUNCH, rel=1e-12)


def test_a_one_wave_gemm_of_fewer_tiles_than_sms_does_not_reach_the_peak():
    m = n = 1024  # 8 x 8 = 64 tiles on 132 SMs: one wave, 68 SMs idle
    k = 65536
    op = _cost(torch.ops.aten.mm.default, (m, k), (k, n))
    assert roofline.wave_efficiency(op, GPU) == pytest.approx(64 / 132)
    expect = 2 * m * n * k / (BF16_PEAK * 0.5 * 64 / 132) + LAUNCH
    assert roofline.op_seconds(op, GPU, "bf16") == pytest.approx(expect, rel=1e-12)
    # 133 tiles take two waves: 133 / 264 of the SMs busy over them
    wide = dataclasses.replace(op, output_tiles=(1, 128 * 7, 128 * 19))
    assert roofline.wave_efficiency(wide, GPU) == pytest.approx(133 / 264)


def test_a_tiny_op_costs_its_launch():
    op = _cost(torch.ops.aten.mul.Tensor, (4,), (4,), dtype=torch.float32)
    assert op.bytes == 48
    t = roofline.op_seconds(op, GPU, "fp32")
    assert LAUNCH < t < LAUNCH * 1.0001


def test_depthwise_and_dense_convolutions_are_classed_apart():
    conv = torch.ops.aten.convolution.default
    rest = ([1, 1], [1, 1], [1, 1], False, [0, 0])  # stride, padding, dilation, transposed, output padding
    dense = _cost(conv, (8, 64, 32, 32), (128, 64, 3, 3), None, rest=(*rest, 1))
    depthwise = _cost(conv, (8, 64, 32, 32), (64, 1, 3, 3), None, rest=(*rest, 64))
    assert (dense.op_class, dense.output_tiles) == ("convolution", (1, 8 * 32 * 32, 128))
    assert depthwise.op_class == "depthwise_convolution"
    assert dense.flops == 2 * 8 * 128 * 32 * 32 * 64 * 9


def test_a_depthwise_convolutions_backward_is_twice_its_forward():
    # torch's counter prices a grouped convolution's weight gradient as an ungrouped one (groups x too many)
    x = torch.randn(2, 16, 8, 8)
    w = torch.randn(16, 1, 3, 3)
    grad = torch.randn(2, 16, 8, 8)
    args = (grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 16, [True, True, False])
    out = torch.ops.aten.convolution_backward.default(*args)
    cost = op_cost(torch.ops.aten.convolution_backward.default, args, {}, out)
    forward = 2 * 2 * 16 * 8 * 8 * 9
    assert cost.op_class == "depthwise_convolution" and cost.flops == 2 * forward
    only_input = (*args[:10], [True, False, False])
    assert op_cost(torch.ops.aten.convolution_backward.default, only_input, {}, out).flops == forward
    # and so does the whole-model counter (MFU, the efficiency basis' FLOPs), the input's gradient included
    conv, x = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), x.requires_grad_()
    with flop_counter() as counter:
        conv(x).sum().backward()
    assert counter.get_total_flops() == 3 * forward


def test_a_traced_step_has_the_flop_counters_total_per_class():
    tinynet = ModelSpec("tinynet", 10, 16, width=8)
    ops = trace_ops(tinynet, 2, "fp32")
    counted = flops_by_op(tinynet.build, tinynet.sample_shape, 10)[0]
    assert sum(o.flops for o in ops) / 2 == pytest.approx(sum(counted.values()), rel=1e-12)
    classes = {o.op_class for o in ops}
    assert {"convolution", "small_gemm", "elementwise", "reduction"} <= classes <= set(OP_CLASSES)
    assert all(o.bytes > 0 for o in ops)
    # gpt-tiny: its products as the counter's; its fused attention by torch's flash rule, whose backward
    # recomputes the scores (2.5 x the forward where the meta device's unfused path counts 2 x: 3.5 / 3 of it)
    gpt = ModelSpec("gpt-tiny", 256, 0, seq_len=32)
    ops = trace_ops(gpt, 2, "bf16-mixed")
    counted = flops_by_op(gpt.build, gpt.sample_shape, 256)[0]
    attention = sum(o.flops for o in ops if o.op_class == "attention") / 2
    assert sum(o.flops for o in ops if "gemm" in o.op_class) / 2 == counted["aten.mm"]
    assert attention == pytest.approx(counted["aten.bmm"] * 3.5 / 3, rel=1e-12)


def test_the_projection_says_its_basis_and_the_roofline_prices_the_compute():
    cfg = projection.TrainConfig(model="tinynet", width=8, image_size=16, num_classes=10, data="synthetic",
                                 batch_size=32, precision="bf16-mixed")  # fmt: skip
    system = hardware.builtin().system("h100-sxm")
    default = projection.project(cfg, system, 1, 1, memory=False)
    roof = projection.project(cfg, system, 1, 1, memory=False, basis="roofline")
    assert (default.basis, roof.basis) == ("family fallback", roofline.BASIS) and not default.roofline
    assert roof.compute_s == pytest.approx(roof.roofline["seconds"], rel=1e-9)
    assert json.loads(json.dumps(roof.to_dict()))["basis"] == roofline.BASIS
    with pytest.raises(projection.ConfigError, match="basis 'flops'; allowed: auto, efficiency, roofline"):
        projection.project(cfg, system, basis="flops")


def test_auto_is_the_roofline_where_the_gpu_has_fractions_else_the_fallback_says_why(monkeypatch):
    """The default basis (auto): a calibration or the hardware file's efficiency where given; else the roofline
    where the GPU has fractions; the family efficiency only where it has none or the model cannot be traced op by
    op, with why in the efficiency's source."""
    cfg = projection.TrainConfig(model="tinynet", width=8, image_size=16, num_classes=10, data="synthetic",
                                 batch_size=32, precision="bf16-mixed")  # fmt: skip
    h100 = hardware.builtin().system("h100-sxm")
    assert projection.project(cfg, h100, 1, 1, memory=False, basis="auto").basis == roofline.BASIS
    bare = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, roofline=None))
    p = projection.project(cfg, bare, 1, 1, memory=False, basis="auto")
    assert p.basis == "family fallback" and p.efficiency_source.endswith(
        "[not the roofline basis: NVIDIA H100 SXM5 80GB has no roofline fractions]"
    )
    own = dataclasses.replace(h100.gpu, efficiency={**h100.gpu.efficiency, "bf16": 0.3},
                              efficiency_source={"bf16": "hardware file mine.yaml"})  # fmt: skip
    p = projection.project(cfg, dataclasses.replace(h100, gpu=own), 1, 1, memory=False, basis="auto")
    assert (p.basis, p.efficiency) == ("hardware file", 0.3)

    def untraceable(*args, **kwargs):
        raise RuntimeError("a data-dependent op")

    monkeypatch.setattr(projection, "trace_ops", untraceable)
    p = projection.project(cfg, h100, 1, 1, memory=False, basis="auto")
    assert p.basis == "family fallback" and "not the roofline basis: model 'tinynet' cannot be traced op by op" in (
        p.efficiency_note
    )
    with pytest.raises(projection.ConfigError, match="cannot be traced op by op"):
        projection.project(cfg, h100, 1, 1, memory=False, basis="roofline")  # asked for: refused, not replaced


def test_roofline_entries_are_checked():
    base = {"gpus": {"x": {"name": "X", "match": "X", "peak_flops": {"fp32": "1 TFLOP/s"}, "memory": "1 GB",
                           "memory_bandwidth": "1 TB/s", "generation": "hopperr"}}}  # fmt: skip
    with pytest.raises(HardwareError, match="generation: 'hopperr'; allowed: hopper"):
        hardware.parse(base, "f.yaml", hardware.builtin())
    bad = {"roofline": {"new": {"fractions": {"large_gemm": {"compute": 0.8, "bandwidth": 0.8}}}}}
    with pytest.raises(HardwareError, match="fractions: missing 'small_gemm'; the classes are: large_gemm"):
        hardware.parse(bad, "f.yaml", hardware.builtin())


def test_estimate_basis_flag(capsys):
    from stratbench.cli import main

    rc = main(["estimate", "--model", "tinynet", "--basis", "roofline"])
    assert rc != 0 and "--basis roofline prices the step time: it needs --time" in capsys.readouterr().err
    rc = main(["estimate", "--model", "tinynet", "--time", "--basis", "roofline", "--calibrate", "run.json"])
    assert rc != 0 and "--calibrate gives the calibrated efficiency basis" in capsys.readouterr().err
    rc = main(["estimate", "--model", "tinynet", "--time", "--hardware", "cpu-gloo", "--basis", "roofline"])
    assert rc != 0 and "(cpu) has no roofline fractions" in capsys.readouterr().err
    rc = main(["estimate", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
               "--strategy", "single", "--time", "--hardware", "h100-sxm", "--basis", "roofline", "--json"])  # fmt: skip
    assert rc == 0
    row = json.loads(capsys.readouterr().out)["results"][0]["projection"]
    assert row["basis"] == roofline.BASIS and row["roofline"]["by_class"]["convolution"]["ops"] > 0


def test_models_that_initialise_with_a_truncated_normal_trace_on_fake_tensors():
    # torch's trunc_normal_ samples until in bounds, reading values (ViT, ConvNeXt): under plain FakeTensorMode
    # the build fails; under model_trace.fake_mode it builds (the values are never read)
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from stratbench.measuring.model_trace import fake_mode

    def build():
        layer = torch.nn.Linear(64, 64)
        torch.nn.init.trunc_normal_(layer.weight, std=0.02)
        return layer

    with pytest.raises(DataDependentOutputException), FakeTensorMode(allow_non_fake_inputs=True):
        build()
    with fake_mode():
        assert build().weight.shape == (64, 64)


def test_a_compiled_steps_fused_region_moves_only_its_boundary():
    # x (4 MB) + y (4 MB) -> a; relu(a) -> b; sum(b) -> s (4 B); then a matmul reads b. Eager: every op reads and
    # writes its tensors. Compiled: one region (add, relu, sum) reads x and y, writes b (read after it) and s (read
    # nowhere: an output); a stays in registers. The matmul stays a library kernel, priced as eager.
    from stratbench.predicting.roofline import Region, fused_regions, region_bytes

    mb = 4 * 2**20
    add = flops.OpCost("add", "elementwise", 0.0, 3 * mb, "float32", reads=((1, mb), (2, mb)), writes=((3, mb),))
    relu = flops.OpCost("relu", "elementwise", 0.0, 2 * mb, "float32", reads=((3, mb),), writes=((4, mb),))
    total = flops.OpCost("sum", "reduction", 0.0, mb + 4, "float32", reads=((4, mb),), writes=((5, 4),))
    mm = flops.OpCost("mm", "large_gemm", 2.0 * 1024**3, 3 * mb, "float32", (1, 1024, 1024), reads=((4, mb), (6, mb)),
                writes=((7, mb),))  # fmt: skip
    units = fused_regions([add, relu, total, mm])
    assert isinstance(units[0], Region) and units[0].ops == [add, relu, total] and units[1] is mm
    assert region_bytes(units[0]) == 2 * mb + mb + 4  # x, y in; b, s out
    eager = roofline.step_seconds([add, relu, total, mm], GPU, "fp32")
    fused = roofline.step_seconds([add, relu, total, mm], GPU, "fp32", fused=True)
    # the region: its bytes at the lowest bandwidth fraction of its classes (all 0.8 here), two kernels (one
    # reduction), so two launches
    region_s = (3 * mb + 4) / (GPU.memory_bandwidth * 0.8) + 2 * LAUNCH
    mm_s = roofline.op_seconds(mm, GPU, "fp32")
    assert fused.seconds == pytest.approx(region_s + mm_s) and fused.launches == 3
    assert eager.seconds == pytest.approx(sum(roofline.op_seconds(o, GPU, "fp32") for o in (add, relu, total, mm)))
    assert fused.seconds < eager.seconds and "compiled step" in fused.source


def test_a_compiled_configs_projection_prices_fused_regions():
    from stratbench.measuring.hardware import resolve
    from stratbench.predicting.projection import project

    cfg = projection.TrainConfig(model="gpt-tiny", data="synthetic-tokens", vocab_size=256, seq_len=64, batch_size=8,
                      precision="bf16-mixed", device="cuda")  # fmt: skip
    eager = project(cfg, resolve("h100-sxm"), 1, 1, memory=False, basis="roofline")
    compiled = project(cfg.replace(compile=True), resolve("h100-sxm"), 1, 1, memory=False, basis="roofline")
    assert compiled.roofline["launches"] < eager.roofline["launches"]
    assert compiled.throughput > eager.throughput and "fused regions" in compiled.efficiency_source
