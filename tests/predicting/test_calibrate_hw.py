"""`stratbench calibrate-hw` (stratbench.predicting.calibrate_hw): on this CPU at tiny sizes it writes measured
fractions into the profile, the roofline basis picks them up ("roofline with measured fractions") and an op's time
is the formula's with them; a fraction measured in one precision is used for that precision's ops; bad input is
one line before anything is measured or written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from stratbench.cli import main
from stratbench.core.errors import ConfigError
from stratbench.measuring import hardware
from stratbench.measuring.hardware import HardwareError, Roofline
from stratbench.models.flops import OP_CLASSES, OpCost
from stratbench.predicting import calibrate_hw, projection, roofline

# A CPU profile as `stratbench probe` writes one, with round figures above what a 2-core VM does (1 TFLOP/s fp32,
# 1 TB/s): every measured fraction well inside (0, 1.5].
PROFILE = {
    "version": 1, "default_system": "t",
    "gpus": {"t-cpu": {"name": "test cpu", "kind": "cpu", "match": "(?!)", "peak_flops": {"fp32": "1 TFLOP/s"},
                       "memory": "8 GB", "memory_bandwidth": "1 TB/s"}},
    "links": {"t-link": {"bandwidth": "1 GB/s", "latency": "10 us"}},
    "systems": {"t": {"gpu": "t-cpu", "gpus_per_node": 2, "intra_node": "t-link", "host": "t-link"}},
}  # fmt: skip
TINYNET = projection.TrainConfig(model="tinynet", width=8, image_size=16, num_classes=10, data="synthetic",
                                 batch_size=8, device="cpu")  # fmt: skip


def test_calibrate_hw_writes_measured_fractions_the_roofline_uses(tmp_path, capsys):
    path = tmp_path / "probe.yaml"
    path.write_text("# written by stratbench probe\n" + yaml.safe_dump(PROFILE))
    with pytest.raises(
        ConfigError, match=r"\(t-cpu\) has no roofline fractions"
    ):  # before: nothing to price with
        projection.project(TINYNET, hardware.resolve(str(path)), 1, 1, memory=False, basis="roofline")
    argv = ["calibrate-hw", "--hardware", str(path), "--sizes", "tiny", "--repeats", "3", "--json"]
    assert main(argv) == 0
    entry = json.loads(capsys.readouterr().out)["measured_roofline"]
    assert path.read_text().startswith("# written by stratbench probe\n# measured_roofline.t-cpu: written by")
    gpu = hardware.resolve(str(path)).gpu
    roof = gpu.roofline
    assert roof.measured and "calibrate-hw" in roof.source and entry["device"] == "test cpu"
    assert all(0 < f <= 1.5 for pair in roof.fractions.values() for f in pair)
    assert {t.split(".")[0] for t in entry["measured"]} == set(OP_CLASSES)  # every class has a measured term
    cases = {c["case"]: c for c in entry["cases"] if c["precision"] == "fp32"}
    # hand-checked: the add is the elementwise class's one case, bandwidth-bound: the roofline gives its time back
    add = cases["add"]
    op = OpCost("add", "elementwise", 0.0, add["bytes"], "float32")
    busy = max(add["seconds"] - roof.launch, add["seconds"] / 4)
    assert roof.fractions["elementwise"][1] == pytest.approx(add["bytes"] / (busy * 1e12), rel=1e-3)
    assert roofline.op_seconds(op, gpu, "fp32") == pytest.approx(add["seconds"], rel=2e-3)
    # the large matmul at the measured compute fraction: FLOPs / (1 TFLOP/s x fraction) + launch
    mm = cases["mm_large"]
    op = OpCost("mm", "large_gemm", mm["flops"], mm["bytes"], "float32", (1, 128, 128))
    compute = mm["flops"] / (1e12 * roof.fractions["large_gemm"][0])
    memory = mm["bytes"] / (1e12 * roof.fractions["large_gemm"][1])
    assert roofline.op_seconds(op, gpu, "fp32") == pytest.approx(
        max(compute, memory) + roof.launch, rel=1e-12
    )
    assert roof.fractions["large_gemm"][0] >= mm["compute"] * (1 - 1e-3)
    p = projection.project(TINYNET, hardware.resolve(str(path)), 1, 1, memory=False, basis="roofline")
    assert p.basis == roofline.MEASURED_BASIS == "roofline with measured fractions"
    assert p.efficiency_source.startswith(roofline.MEASURED_BASIS)


def test_a_fraction_measured_in_a_precision_prices_that_precisions_ops():
    base = hardware.builtin().gpus["h100-sxm"]
    roof = Roofline("m", {c: (0.5, 0.8) for c in OP_CLASSES}, (128, 128), 0.0, measured=True,
                    by_precision={"bf16": {"large_gemm": 0.25}})  # fmt: skip
    gpu = dataclasses.replace(base, roofline=roof, sms=None)
    flops = 2.0 * 8192**3
    bf16 = OpCost("mm", "large_gemm", flops, 1.0, "bfloat16", (1, 8192, 8192))
    fp32 = dataclasses.replace(bf16, dtype="float32")
    assert roofline.op_seconds(bf16, gpu, "bf16") == pytest.approx(flops / (base.peak("bf16") * 0.25))
    assert roofline.op_seconds(fp32, gpu, "fp32") == pytest.approx(flops / (base.peak("fp32") * 0.5))
    assert roofline.basis_of(gpu) == roofline.MEASURED_BASIS
    assert roofline.basis_of(base) == roofline.BASIS


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "2"], "--repeats must be at least 3, got 2"),
        (["--device", "cpu", "--sizes", "gpu"], "--sizes gpu on a CPU would take far too long"),
        (["--device", "cpu"], "calibrate-hw on a CPU needs --hardware FILE"),
        (["--device", "cpu", "--hardware", "h100-sxm"], "its device NVIDIA H100 SXM5 80GB is a cuda one"),
        (["--device", "cpu", "--hardware", "nope"], "unknown hardware 'nope'; choose one of: h100-sxm"),
    ],
)
def test_bad_arguments_are_one_line(capsys, tmp_path, argv, message):
    assert main(["calibrate-hw", "--output", str(tmp_path / "o.yaml"), *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o.yaml").exists()


def test_bad_measured_entries_and_fractions_beyond_the_profile_are_refused():
    fractions = {c: {"compute": 0.5, "bandwidth": 0.5} for c in OP_CLASSES}
    data = dict(PROFILE, measured_roofline={"t-cpu": {"fractions": fractions}})
    assert hardware.parse(data, "f.yaml", hardware.builtin()).gpus["t-cpu"].roofline.measured
    for key, entry, message in [
        ("nope", {"fractions": fractions}, "'nope' is not a gpu; choose one of"),
        (
            "t-cpu",
            {"fractions": fractions | {"other": {"compute": 2.0, "bandwidth": 0.5}}},
            "between 0 and 1.5",
        ),
        ("t-cpu", {"fractions": fractions | {"other": {"compute": 0, "bandwidth": 0.5}}}, "must be above 0"),
        ("t-cpu", {"fractions": fractions, "by_precision": {"fp9": {}}}, "unknown precision 'fp9'"),
    ]:
        with pytest.raises(HardwareError, match=message):
            hardware.parse(dict(PROFILE, measured_roofline={key: entry}), "f.yaml", hardware.builtin())
    gpu = hardware.parse(PROFILE, "f.yaml", hardware.builtin()).gpus["t-cpu"]
    case = calibrate_hw.CaseResult("add", "fp32", (4,), 1e-3, [], compute=0.0, bandwidth=2.0)
    cal = calibrate_hw.Calibration("test cpu", ["fp32"], 1e-6, [case])
    with pytest.raises(ConfigError, match=r"case add \(fp32\) reached 2.00 x the profile's memory bandwidth"):
        calibrate_hw.section(cal, gpu, "test")


def test_a_gpu_without_a_built_in_system_gets_its_like_gpus_node_and_keeps_unmeasured_published_terms(
    tmp_path,
):
    cat = hardware.builtin()
    gpu = cat.gpus["h200-sxm"]
    system = calibrate_hw.system_for(gpu, cat)
    assert (system.key, system.gpu.key) == ("h200-sxm-calibrated", "h200-sxm")
    assert system.intra_node.key == cat.systems["h100-sxm"].intra_node.key
    op = OpCost("mm", "large_gemm", 2.0 * 8192**3, 3 * 2.0 * 8192**2, "bfloat16", (1, 8192, 8192))
    case = calibrate_hw.CaseResult("mm_large", "bf16", (8192,) * 3, 2e-3, [op], compute=0.7, bandwidth=0.01)
    entry = calibrate_hw.section(calibrate_hw.Calibration("NVIDIA H200", ["bf16"], 4e-6, [case]), gpu, "test")
    text = calibrate_hw.profile_text(None, system.key, gpu.key, entry, "# x\n",
                                     {system.key: calibrate_hw.system_mapping(system)})  # fmt: skip
    (tmp_path / "h200.yaml").write_text(text)
    got = hardware.resolve(str(tmp_path / "h200.yaml"))
    assert got.key == "h200-sxm-calibrated" and got.gpu.roofline.measured and got.gpu.roofline.launch == 4e-6
    assert got.gpu.roofline.fractions["large_gemm"] == (0.7, 0.8)  # bandwidth: hopper's published 0.8
    assert got.gpu.roofline.fractions["elementwise"] == cat.roofline["hopper"].fractions["elementwise"]
    assert entry["measured"] == ["large_gemm.compute"]


def test_a_small_product_tiled_finer_than_the_roofline_is_capped_not_refused():
    # 256 x 256 output: 4 tiles of 128 x 128 on 132 SMs (wave efficiency 4/132). At 0.1 of the peak it reaches
    # 3.3x the wave-corrected rate: the library tiled it finer; the fraction is capped at 1.5, not refused.
    # Above 1.5 x the peak itself, the profile's peak is wrong: refused in one line.
    gpu = hardware.builtin().gpus["h200-sxm"]
    flops = 2.0 * 256 * 1024 * 256
    op = OpCost("mm", "small_gemm", flops, 1.2e6, "bfloat16", (1, 256, 256))
    peak = gpu.peak("bf16")
    fine = calibrate_hw.CaseResult("mm_small", "bf16", (256, 1024, 256), flops / (0.1 * peak), [op])
    calibrate_hw.fractions_of(fine, gpu, 0.0)
    assert fine.peak_share == pytest.approx(0.1) and fine.compute == 1.5
    entry = calibrate_hw.section(calibrate_hw.Calibration("NVIDIA H200", ["bf16"], 0.0, [fine]), gpu, "test")
    assert entry["fractions"]["small_gemm"]["compute"] == 1.5
    wrong = calibrate_hw.CaseResult("mm_small", "bf16", (256, 1024, 256), flops / (2.0 * peak), [op])
    calibrate_hw.fractions_of(wrong, gpu, 0.0)
    with pytest.raises(ConfigError, match=r"case mm_small \(bf16\) reached 2.00 x the profile's peak"):
        calibrate_hw.section(calibrate_hw.Calibration("NVIDIA H200", ["bf16"], 0.0, [wrong]), gpu, "test")


def test_training_cases_time_the_backward_and_batch_norm_is_its_own_class():
    import torch

    for name, shape in (("batch_norm", (2, 4, 8, 8)), ("depthwise", (1, 4, 8, 8)), ("conv1x1", (1, 4, 8, 8))):
        ops = calibrate_hw.recorded(calibrate_hw.build(name, shape, torch.device("cpu"), torch.float32))
        assert len(ops) == 2 and ops[1].op.endswith("_backward"), (name, [o.op for o in ops])
    bn = calibrate_hw.recorded(calibrate_hw.build("batch_norm", (2, 4, 8, 8), torch.device("cpu"), torch.float32))
    assert {o.op_class for o in bn} == {"batch_norm"}
    # a profile written before the class existed prices batch norm as it priced it then: as a reduction
    old = {c: {"compute": 0.5, "bandwidth": 0.5} for c in OP_CLASSES if c != "batch_norm"}
    old["reduction"] = {"compute": 0.5, "bandwidth": 0.3}
    roof = hardware.parse(dict(PROFILE, measured_roofline={"t-cpu": {"fractions": old}}), "f.yaml",
                          hardware.builtin()).gpus["t-cpu"].roofline  # fmt: skip
    assert roof.fractions["batch_norm"] == roof.fractions["reduction"] == (0.5, 0.3)
