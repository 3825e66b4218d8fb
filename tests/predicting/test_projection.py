"""The step-time projection (stratbench.predicting.projection) and the hardware profiles it reads: the alpha-beta
arithmetic, profile loading and validation, device-name matching, calibration, and a projection (or "no model")
for every registered strategy. No GPU, no processes: all of it is arithmetic on fake-tensor shapes."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

import conftest
from stratbench.core.config import TrainConfig
from stratbench.measuring import hardware
from stratbench.measuring.hardware import HardwareError
from stratbench.measuring.records import RunRecord
from stratbench.predicting import projection

TINY = {
    "model": "tinynet",
    "width": 8,
    "image_size": 16,
    "num_classes": 10,
    "data": "synthetic",
    "batch_size": 32,
}


def tiny_cfg(**kw) -> TrainConfig:
    return TrainConfig(**(TINY | kw))


# ------------------------------------------------------------------------------------------------
# The unit arithmetic.


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_costs(n):
    B, bw, alpha = 100e6, 10e9, 5e-6
    assert projection.ring_time("all_reduce", B, n, bw, alpha) == pytest.approx(
        2 * (n - 1) / n * B / bw + 2 * (n - 1) * alpha
    )
    for kind in ("all_gather", "reduce_scatter", "broadcast"):
        assert projection.ring_time(kind, B, n, bw, alpha) == pytest.approx(
            (n - 1) / n * B / bw + (n - 1) * alpha
        )
    assert projection.ring_time("send_recv", B, n, bw, alpha) == pytest.approx(B / bw + alpha)
    assert projection.ring_time("all_reduce", B, 1, bw, alpha) == 0.0


def test_collective_time_one_node_and_hierarchical():
    s = hardware.builtin().system("h100-sxm")
    nvl, ib = s.intra_node, s.inter_node
    bw, a, c = nvl.bandwidth * nvl.efficiency, nvl.latency, s.call_latency
    B = 2e8
    # one node, 8 ranks, 4 calls of B/4: each call pays the call latency and the ring's steps
    got = projection.collective_time("all_reduce", B, 4, 8, s)
    assert got == pytest.approx(4 * c + 4 * (2 * 7 * a + 2 * 7 / 8 * (B / 4) / bw))
    # two nodes: reduce-scatter in the node, all-reduce of 1/8 across nodes over the node's 8 NICs shared by
    # 8 GPUs (one NIC each), all-gather in the node
    nic = ib.bandwidth * ib.efficiency * s.nics_per_node / s.gpus_per_node
    want = (
        c
        + (7 * a + 7 / 8 * B / bw)
        + (2 * 1 * ib.latency + 2 * 1 / 2 * (B / 8) / nic)
        + (7 * a + 7 / 8 * B / bw)
    )
    assert projection.collective_time("all_reduce", B, 1, 16, s) == pytest.approx(want)
    gather = projection.collective_time("all_gather", B, 1, 16, s)
    assert gather == pytest.approx(c + 7 * a + 7 / 8 * B / bw + ib.latency + 1 / 2 * (B / 8) / nic)
    assert projection.collective_time("all_reduce", B, 1, 1, s) == 0.0


def test_measured_fit_replaces_the_ring_model():
    """A probe's per-kind fit reproduces its own measurement at the probed size and scales latency by steps."""
    link = hardware.Link("x", 1e9, 1e-5, 1.0, {"all_reduce": hardware.CollectiveFit(4e-4, 2e8, 2)})
    s = hardware.System("x", hardware.builtin().gpus["p40"], 2, link, None, link)
    # at 2 ranks: latency + wire (1 x payload) / bandwidth
    assert projection.collective_time("all_reduce", 1e6, 1, 2, s) == pytest.approx(4e-4 + 1e6 / 2e8)
    s4 = hardware.System("x", hardware.builtin().gpus["p40"], 4, link, None, link)
    assert projection.collective_time("all_reduce", 1e6, 1, 4, s4) == pytest.approx(
        4e-4 * 6 / 2 + 1.5e6 / 2e8
    )
    # a kind the probe did not fit falls back to the link's ring model
    assert projection.collective_time("all_gather", 1e6, 1, 2, s) == pytest.approx(1e-5 + 0.5e6 / 1e9)
    # where the probe measured a call's cost in training (after a compute burst), each call's latency is that
    loaded = hardware.Link("x", 1e9, 1e-5, 1.0, {"all_reduce": hardware.CollectiveFit(4e-4, 2e8, 2, 1.5e-3)})
    sl = hardware.System("x", hardware.builtin().gpus["p40"], 2, loaded, None, loaded)
    assert projection.collective_time("all_reduce", 1e6, 3, 2, sl) == pytest.approx(3 * 1.5e-3 + 1e6 / 2e8)


# ------------------------------------------------------------------------------------------------
# Profiles: load, validate, match device names.


def test_builtin_profiles_load_and_are_complete():
    cat = hardware.builtin()
    assert {"h100-sxm", "a100-sxm", "p40-pcie3", "cpu-gloo"} <= set(cat.systems)
    assert cat.systems["cpu-gloo"].gpu.kind == "cpu" and cat.gpu_for_device("cpu") is None
    assert {
        "pcie3-x16",
        "pcie4-x16",
        "pcie5-x16",
        "nvlink3",
        "nvlink4",
        "ib-hdr",
        "ib-ndr",
        "eth-25g",
        "eth-100g",
    } <= set(cat.links)
    for g in cat.gpus.values():
        assert g.peak("fp32") and g.memory_bytes > 1e9
        assert g.memory_bandwidth > (1e11 if g.kind == "cuda" else 1e9)
        assert set(g.efficiency) == set(hardware.PRECISION_KEYS)
    assert cat.links["pcie3-x16"].bandwidth == pytest.approx(15.75e9)
    assert cat.links["ib-ndr"].bandwidth == pytest.approx(50e9)  # 400 Gb/s
    assert cat.gpus["p40"].peak("fp32") == pytest.approx(11.76e12)


# Real torch.cuda.get_device_name() strings -> the one entry they must match (None: no entry).
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200-sxm",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA A100-SXM4-80GB": "a100-sxm",
    "NVIDIA A100 80GB PCIe": "a100-sxm",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A10": "a10",
    "Tesla V100-SXM2-16GB": "v100-sxm2",
    "Tesla V100-PCIE-32GB": "v100-pcie",
    "Tesla T4": "t4",
    "Tesla P40": "p40",
    "NVIDIA RTX A1000": None,
    "NVIDIA A10G": None,
    "NVIDIA GH200 480GB": None,
    "NVIDIA GeForce RTX 4090": None,
}


@pytest.mark.parametrize(("name", "key"), DEVICE_NAMES.items())
def test_device_names_match_exactly_one_entry(name, key):
    from stratbench.measuring.hardware import peak_flops_for_name

    cat = hardware.builtin()
    assert cat.ambiguous(name) == ([key] if key else [])
    want = cat.gpus[key].peak("fp32") if key else None
    assert peak_flops_for_name(name, "fp32") == want  # MFU reads the same table


def _write(tmp_path, data) -> str:
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


GOOD = {
    "gpus": {"mygpu": {"name": "My GPU", "match": r"\bMyGPU\b", "peak_flops": {"fp32": "10 TFLOP/s"},
                       "memory": "16 GB", "memory_bandwidth": "500 GB/s"}},
    "links": {"mylink": {"bandwidth": "10 GB/s", "latency": "5 us"}},
    "systems": {"mysys": {"gpu": "mygpu", "gpus_per_node": 4, "intra_node": "mylink", "inter_node": "ib-hdr",
                          "host": "pcie4-x16"}},
}  # fmt: skip


def test_user_file_extends_the_builtin_catalogue(tmp_path):
    s = hardware.resolve(_write(tmp_path, GOOD))
    assert s.key == "mysys" and s.gpu.peak("fp32") == 10e12 and s.inter_node.key == "ib-hdr"
    assert s.gpu.efficiency["fp32"] == hardware.builtin().default_efficiency["fp32"]
    assert hardware.resolve(f"{tmp_path / 'hw.yaml'}:h100-sxm").key == "h100-sxm"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("gpus", "mygpu", "memory"), None, "gpus.mygpu: missing 'memory'"),
        (("gpus", "mygpu", "memory_bandwidth"), "500 GX/s", "gpus.mygpu.memory_bandwidth: unknown unit"),
        (("gpus", "mygpu", "peak_flops"), {"fp32": "-3 TFLOP/s"}, "'-3 TFLOP/s' must be a positive, finite number"),
        (("links", "mylink", "bandwidth"), -10, "-10 must be a positive, finite number"),
        (("links", "mylink", "bandwidth"), float("inf"), "inf must be a positive, finite number"),
        (("links", "mylink", "latency"), float("nan"), "nan must be a non-negative, finite number"),
        (("gpus", "mygpu", "memory"), "inf GB", "'inf GB' must be a positive, finite number"),
        (("gpus", "mygpu", "peak_flops"), {"fp4": "3 TFLOP/s"}, "unknown precision 'fp4'"),
        (("gpus", "mygpu", "match"), "([", "is not a regular expression"),
        (("gpus", "mygpu", "memroy"), "16 GB", "unknown field 'memroy'"),
        (("links", "mylink", "bandwidth"), 10, "needs a unit"),
        (("links", "mylink", "efficiency"), 1.5, "between 0 and 1"),
        (("systems", "mysys", "intra_node"), "nvlink9", "intra_node: unknown link 'nvlink9'"),
        (("systems", "mysys", "gpus_per_node"), 0, "must be a positive integer"),
    ],
)
def test_bad_profiles_are_refused_in_one_line(tmp_path, path, value, message):
    data = json.loads(json.dumps(GOOD))
    entry = data
    for k in path[:-1]:
        entry = entry[k]
    if value is None:
        del entry[path[-1]]
    else:
        entry[path[-1]] = value
    with pytest.raises(HardwareError) as err:
        hardware.resolve(_write(tmp_path, data))
    text = str(err.value)
    assert message in text and "\n" not in text and "hw.yaml" in text


def test_unknown_system_and_missing_file():
    with pytest.raises(HardwareError, match="unknown hardware 'h900'; choose one of: h100-sxm"):
        hardware.resolve("h900")
    with pytest.raises(HardwareError, match="does not exist"):
        hardware.resolve("no/such/file.yaml")


# ------------------------------------------------------------------------------------------------
# Projections: every strategy, overlap, calibration.


def test_every_registered_strategy_is_projected_or_says_no_model():
    from stratbench.strategies.base import REGISTRY, CostModel, Strategy, all_strategies, register

    class MemoryOnly(CostModel):  # a new strategy's cost model without comm_model
        @classmethod
        def memory_model(cls, ctx, rank):
            return ctx.replicated(buckets=False)

    class NoCostModel(Strategy):
        name = "test-no-cost-model"
        cost = MemoryOnly

    register(NoCostModel)
    try:
        s = hardware.builtin().system("h100-sxm")
        rows = projection.project_all(tiny_cfg(), s, nodes=1, gpus_per_node=2)
        assert {r.method for r in rows} == set(all_strategies())
        for r in rows:
            if r.status == "ok":
                assert r.step_s > 0 and r.throughput > 0 and r.compute_s > 0 and r.dominant
                assert 0 < r.scaling_efficiency <= 1.0 + 1e-9
                assert r.memory_bytes and r.fits is True
            else:  # never silently 0
                assert r.status == "no model" and r.step_s is None and "comm_model" in r.reason
        byname = {r.method: r for r in rows}
        assert byname["test-no-cost-model"].status == "no model"
        assert byname["dp"].status == "no model"  # DataParallel's copies are not c10d collectives
        assert byname["ddp"].comm_s > 0 and byname["single"].comm_s == 0
        # FSDP full shard moves 1.5x DDP's bytes
        assert byname["fsdp"].comm_s > byname["ddp"].comm_s
    finally:
        REGISTRY.pop("test-no-cost-model", None)


def test_overlap_hides_what_the_bucket_schedule_allows_times_the_stated_fraction():
    import dataclasses

    s = hardware.builtin().system("p40-pcie3")
    cfg = tiny_cfg(strategy="ddp", batch_size=8)
    none = projection.project(cfg, dataclasses.replace(s, overlap=0.0), memory=False)
    half = projection.project(cfg, dataclasses.replace(s, overlap=0.5), memory=False)
    full = projection.project(cfg, dataclasses.replace(s, overlap=1.0), memory=False)
    assert none.comm_exposed_s == pytest.approx(none.comm_s)
    # tinynet's gradients fit DDP's first 1 MiB bucket: reduced after backward, nothing to hide whatever overlap
    assert full.comm_exposed_s == pytest.approx(full.comm_s) == pytest.approx(half.comm_exposed_s)
    # DeepSpeed ZeRO-1/2 without overlap_comm reduce inside backward's hooks: nothing hides
    ds = projection.project(
        tiny_cfg(strategy="deepspeed", strategy_options={"zero_stage": 2}), s, memory=False
    )
    assert ds.overlap == 0.0


def _result_json(
    cfg: TrainConfig, step_s: float, device: str = "Tesla P40", env: dict | None = None, **fields
) -> dict:
    """A calibration run's result.json; ``fields`` replace its own (e.g. world_size)."""
    return {
        "status": "ok", "world_size": 1, "config": cfg.to_dict(),
        "environment": env or {"device_type": "cuda", "gpus": [device]},
        "metrics": {"step_time_median_s": step_s},
    } | fields  # fmt: skip


def _result(
    cfg: TrainConfig, step_s: float, device: str = "Tesla P40", env: dict | None = None, **fields
) -> RunRecord:
    """A calibration run's record (its result.json parsed)."""
    return RunRecord.from_dict(_result_json(cfg, step_s, device, env, **fields))


def test_calibration_from_one_run_and_from_two_batch_sizes():
    s = hardware.builtin().system("p40-pcie3")
    cfg = tiny_cfg(batch_size=64)
    flops = projection.model_flops(cfg)
    t_opt = projection.optimizer_bytes(cfg, 1)[0] / s.gpu.memory_bandwidth
    eff = 0.3
    step = flops * 64 / (11.76e12 * eff) + t_opt
    cal = projection.calibrate([_result(cfg, step)], s)["fp32"]
    assert cal.efficiency == pytest.approx(eff) and cal.overhead_s == 0 and cal.device == "p40"
    # the projection of single on the same device gives back the measured step
    p = projection.project(cfg.replace(strategy="single"), s, calibration={"fp32": cal}, memory=False)
    assert p.step_s == pytest.approx(step) and "calibrated" in p.efficiency_source
    # two batch sizes: the fixed per-step overhead is recovered too
    runs = [
        _result(cfg.replace(batch_size=b), 0.004 + flops * b / (11.76e12 * eff) + t_opt) for b in (32, 128)
    ]
    cal2 = projection.calibrate(runs, s)["fp32"]
    assert cal2.efficiency == pytest.approx(eff, rel=1e-6) and cal2.overhead_s == pytest.approx(
        0.004, rel=1e-6
    )
    # a bf16 projection uses the default, and says so
    q = projection.project(
        cfg.replace(precision="bf16-mixed"), hardware.builtin().system("h100-sxm"), calibration={"fp32": cal}
    )
    assert q.efficiency_source.startswith("default")


def test_a_calibration_whose_step_does_not_grow_with_the_batch_falls_back_to_the_largest_batch_and_says_so():
    """A busy machine slowed the smaller batch's few timed steps: the line over the two batches falls, so the
    efficiency comes from the largest batch alone, with no fixed overhead, and the source names the steps."""
    s = hardware.builtin().system("p40-pcie3")
    cfg = tiny_cfg(batch_size=64)
    flops = projection.model_flops(cfg)
    t_opt = projection.optimizer_bytes(cfg, 1)[0] / s.gpu.memory_bandwidth
    eff, big = 0.3, flops * 128 / (11.76e12 * 0.3) + t_opt
    runs = [_result(cfg.replace(batch_size=32), big * 1.5), _result(cfg.replace(batch_size=128), big)]
    cal = projection.calibrate(runs, s)["fp32"]
    assert cal.efficiency == pytest.approx(eff, rel=1e-6) and cal.overhead_s == 0
    assert "did not grow with the batch" in cal.source and "batch 128" in cal.source
    p = projection.project(cfg.replace(batch_size=128), s, calibration={"fp32": cal}, memory=False)
    assert p.step_s == pytest.approx(big) and "did not grow" in p.efficiency_source


def test_cpu_calibration_counts_the_threads_of_the_run_against_the_all_core_peak():
    """A CPU profile's peak is a matmul on every core; a 1-thread run on 2 cores had half of it, so the same
    step time means twice the efficiency, and a 2-process projection (compute_share of the profile) of that
    run's per-process batch gives back the 1-thread step."""
    import dataclasses

    s = hardware.builtin().system("cpu-gloo")
    s = dataclasses.replace(s, compute_share=0.5)
    cfg = tiny_cfg(batch_size=32)

    def run(threads: int) -> RunRecord:
        return _result(cfg, 0.02, env={"device_type": "cpu", "torch_threads": threads, "cpu_count": 2})

    all_cores = projection.calibrate([run(2)], s)["fp32"]
    one = projection.calibrate([run(1)], s)["fp32"]
    assert "share of all cores" in one.source and "share of all cores" not in all_cores.source
    t_opt = projection.optimizer_bytes(cfg, 1, 0, "cpu")[0] / s.gpu.memory_bandwidth
    flops = projection.model_flops(cfg) * 32
    assert all_cores.efficiency == pytest.approx(flops / ((0.02 - t_opt) * s.gpu.peak("fp32")))
    assert one.efficiency == pytest.approx(2 * all_cores.efficiency)
    # ddp on 2 processes, 32 samples each: each process computes as the 1-thread calibration run did
    p = projection.project(cfg.replace(strategy="ddp", batch_size=64), s, 1, 2, {"fp32": one}, memory=False)
    assert p.compute_s == pytest.approx(0.02 - t_opt)


def test_cpu_contention_from_the_probe_slows_flops_and_fixed_overhead_alike():
    """With the probe's measured share of a 1-thread process alone (thread_share) and with every process running
    (compute_share), a 2-process projection of a 1-thread calibration is the calibrated step (FLOPs and the
    fixed overhead alike) stretched by thread_share / compute_share."""
    import dataclasses

    s = dataclasses.replace(
        hardware.builtin().system("cpu-gloo"), compute_share=0.3, thread_share=0.6, threads_per_process=1
    )
    cfg = tiny_cfg()

    def run(batch: int, step: float, threads: int = 1, cores: int = 2) -> RunRecord:
        env = {"device_type": "cpu", "torch_threads": threads, "cpu_count": cores}
        return _result(cfg.replace(batch_size=batch), step, env=env)

    cal = projection.calibrate([run(32, 0.030), run(64, 0.050)], s)["fp32"]
    assert cal.thread_share == 0.6 and cal.overhead_s > 0
    p = projection.project(cfg.replace(strategy="ddp", batch_size=64), s, 1, 2, {"fp32": cal}, memory=False)
    t_opt = projection.optimizer_bytes(cfg.replace(batch_size=32), 1, 0, "cpu")[0] / s.gpu.memory_bandwidth
    assert p.compute_s == pytest.approx((0.030 - t_opt) * 0.6 / 0.3, rel=1e-6)
    assert p.overhead_s == pytest.approx(cal.overhead_s * 2)
    # a 1-thread calibration counted with a thread count the probe did not measure: threads / cores
    other = projection.calibrate([run(32, 0.030, threads=2, cores=4)], s)["fp32"]
    assert other.thread_share == 0.5


def test_a_methods_one_device_run_calibrates_its_own_overhead_on_any_world_size():
    """fsdp on one device took 6 ms per step more than the `single` calibration predicts at that batch (its hooks
    and flat-parameter copies): a projection of fsdp on 2 processes carries those 6 ms, stretched by the CPU
    contention like the fixed overhead; a method without such a run (ddp) is projected as before."""
    import dataclasses

    from stratbench.core.errors import ConfigError

    s = dataclasses.replace(
        hardware.builtin().system("cpu-gloo"), compute_share=0.3, thread_share=0.6, threads_per_process=1
    )
    cfg = tiny_cfg()

    def run(batch: int, step: float, world_size: int = 1, **kw) -> RunRecord:
        env = {"device_type": "cpu", "torch_threads": 1, "cpu_count": 2}
        return _result(cfg.replace(batch_size=batch, **kw), step, env=env, world_size=world_size)

    singles = [run(32, 0.030), run(64, 0.050)]
    base = projection.calibrate(singles, s)["fp32"]
    cal = projection.calibrate([*singles, run(32, 0.036, strategy="fsdp"), run(32, 0.0364, strategy="fsdp")], s)
    cal = cal["fp32"]
    assert cal.method_overhead_s == {"fsdp": pytest.approx(0.0062, rel=1e-6)}
    assert (cal.efficiency, cal.overhead_s) == (base.efficiency, base.overhead_s)
    two = cfg.replace(batch_size=64, strategy="fsdp")
    with_it = projection.project(two, s, 1, 2, {"fp32": cal}, memory=False)
    without = projection.project(two, s, 1, 2, {"fp32": base}, memory=False)
    assert with_it.overhead_s - without.overhead_s == pytest.approx(0.0062 * 0.6 / 0.3, rel=1e-6)
    # the step: that overhead, and the stragglers' share of it (they scale with the compute, overhead included)
    stragglers = with_it.straggler_s - without.straggler_s
    assert stragglers == pytest.approx(projection.expected_max_normal(2) * s.step_time_cv * 0.0062 * 0.6 / 0.3)
    assert with_it.step_s - without.step_s == pytest.approx(0.0062 * 0.6 / 0.3 + stragglers, rel=1e-6)
    assert "fsdp: +6.2 ms per step beyond `single`" in with_it.efficiency_source
    ddp = cfg.replace(batch_size=64, strategy="ddp")
    assert projection.project(ddp, s, 1, 2, {"fp32": cal}, memory=False).step_s == pytest.approx(
        projection.project(ddp, s, 1, 2, {"fp32": base}, memory=False).step_s
    )
    # a method's options name it (each ZeRO stage is its own method); paths do not
    z3 = cfg.replace(strategy="deepspeed", strategy_options={"zero_stage": 3, "nvme_path": "/x"})
    assert projection.method_key(z3) == "deepspeed[zero_stage=3]"
    # refused: a multi-device run of the method; a method run with no `single` run of its precision
    with pytest.raises(ConfigError, match="world size 2 .*--nproc 1"):
        projection.calibrate([*singles, run(32, 0.036, 2, strategy="fsdp")], s)
    with pytest.raises(ConfigError, match="`single` calibration run in bf16; give one .*: fp32"):
        projection.calibrate([*singles, run(32, 0.036, strategy="fsdp", precision="bf16-mixed")], s)
    with pytest.raises(ConfigError, match="a pipeline on one device is one stage"):
        projection.calibrate([*singles, run(32, 0.036, strategy="pipeline")], s)
    # with gradient accumulation the batch's FLOPs are counted once and the fixed overhead once per micro-step
    accum = run(32, 0.030 + base.overhead_s + 2 * 0.005, strategy="fsdp", grad_accum=2)
    assert projection.calibrate([*singles, accum], s)["fp32"].method_overhead_s["fsdp"] == pytest.approx(0.005)


def test_probe_loaded_latency_reaches_the_profile_and_reads_back(tmp_path):
    """The probe's loaded measurement (a small call right after a compute burst) becomes each kind's
    loaded_latency, less the bytes' share and never below the idle fit's latency; the file reads back."""
    from stratbench.commands.probe import build_profile
    from stratbench.measuring.hardware import dump, load

    rows = [{"payload_bytes": b, "seconds": 1e-4 + b / 1e9} for b in (4096, 1 << 20)]
    data = {"ranks": 2, "device": "cpu", "cpu": "x", "cpu_count": 2, "threads_per_process": 1, "overlap": 0.5,
            "memory_bandwidth": 1e10, "collectives": {k: rows for k in ("all_reduce", "all_gather")},
            "matmul_alone": {"fp32": 40e9}, "matmul_together": {"fp32": 16e9},
            "loaded": {"payload_bytes": 4096, "burst_s": 2e-3, "all_reduce": 1e-3 + 4096 / 1e9, "all_gather": 5e-5}}  # fmt: skip
    profile, fits = build_profile(data, "t")
    assert fits["all_reduce"]["loaded_latency_s"] == pytest.approx(1e-3, rel=1e-3)
    assert fits["all_gather"]["loaded_latency_s"] == pytest.approx(fits["all_gather"]["latency_s"])  # never below
    path = tmp_path / "p.yaml"
    path.write_text(dump(profile))
    link = load(path).systems["t"].intra_node
    assert link.collectives["all_reduce"].loaded_latency == pytest.approx(1e-3, rel=1e-3)
    assert link.collectives["all_reduce"].call_latency == link.collectives["all_reduce"].loaded_latency
    # a profile without it (older probes, hand-written files) prices calls at the idle latency
    del data["loaded"]
    plain, _ = build_profile(data, "t")
    assert "loaded_latency" not in plain["links"]["t-link"]["collectives"]["all_reduce"]


@pytest.mark.slow
def test_probe_profile_records_the_per_process_share():
    from stratbench.commands.probe import build_profile

    rows = [{"payload_bytes": b, "seconds": 1e-4 + b / 1e9} for b in (4096, 1 << 20)]
    data = {"ranks": 2, "device": "cpu", "cpu": "x", "cpu_count": 2, "threads_per_process": 1, "overlap": 0.5,
            "memory_bandwidth": 1e10, "collectives": {k: rows for k in ("all_reduce", "all_gather")},
            "matmul_alone": {"fp32": 40e9}, "matmul_alone_per_process": {"fp32": 22e9},
            "matmul_together": {"fp32": 16e9}}  # fmt: skip
    profile, _ = build_profile(data, "t")
    system = profile["systems"]["t"]
    assert system["compute_share"] == 0.4 and system["thread_share"] == 0.55
    assert system["threads_per_process"] == 1


def test_calibration_refuses_what_it_cannot_use():
    from stratbench.core.errors import ConfigError

    s = hardware.builtin().system("p40-pcie3")
    with pytest.raises(ConfigError, match="one device"):
        projection.calibrate([_result(tiny_cfg(), 0.1, world_size=2)], s)
    with pytest.raises(ConfigError, match="not in the hardware profiles"):
        projection.calibrate([_result(tiny_cfg(), 0.1, device="NVIDIA RTX A1000")], s)
    cpu = _result(tiny_cfg(), 0.1, env={"device_type": "cpu"})
    with pytest.raises(ConfigError, match="CPU run calibrates a CPU profile"):
        projection.calibrate([cpu], s)


def test_calibrate_files_are_parsed_once_and_refused_with_one_line(tmp_path):
    """`--calibrate FILE`: each result.json is read and parsed into a record once; a file that cannot be read,
    is not JSON, is no result.json (no 'config'/'metrics', or not an object) or did not finish is refused with
    one line naming it, and so is one whose field has the wrong type (naming the field)."""
    from stratbench.core.errors import ConfigError

    s = hardware.builtin().system("p40-pcie3")
    cfg = tiny_cfg(batch_size=64)
    good = {"status": "ok", "world_size": 1, "config": cfg.to_dict(),
            "environment": {"device_type": "cuda", "gpus": ["Tesla P40"]},
            "metrics": {"step_time_median_s": 0.01}}  # fmt: skip
    files = {"good": good, "list": [good], "nocfg": {"status": "ok", "metrics": {}},
             "failed": {**good, "status": "failed"}, "strcfg": {**good, "config": "tinynet"},
             "strstep": {**good, "metrics": {"step_time_median_s": "10 ms"}}}  # fmt: skip
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    (tmp_path / "torn.json").write_text('{"status": ')
    loaded = projection.load_calibration([str(tmp_path / "good.json")], s)["fp32"]
    direct = projection.calibrate([_result(cfg, 0.01)], s)["fp32"]
    assert loaded.efficiency == pytest.approx(direct.efficiency)
    for name, why in [("missing", "cannot read it"), ("torn", "not JSON"),
                      ("list", "not a stratbench result.json (no 'config'/'metrics')"),
                      ("nocfg", "not a stratbench result.json"), ("strcfg", "config is 'tinynet', not an object"),
                      ("failed", "the run's status is 'failed'; calibrate on a run that finished"),
                      ("strstep", "metrics.step_time_median_s is '10 ms', not a number")]:  # fmt: skip
        with pytest.raises(ConfigError, match="^(--calibrate )?" + re.escape(str(tmp_path / name))) as exc:
            projection.load_calibration([str(tmp_path / f"{name}.json")], s)
        assert why in str(exc.value) and "\n" not in str(exc.value), (name, exc.value)


def test_more_devices_less_compute_per_device_and_memory_from_the_estimator():
    import dataclasses

    s = hardware.builtin().system("a100-sxm")
    cfg = tiny_cfg(strategy="fsdp", batch_size=64)
    two = projection.project(cfg, s, gpus_per_node=2)
    eight = projection.project(cfg, s, gpus_per_node=8)
    assert eight.compute_s == pytest.approx(two.compute_s / 4)
    assert eight.memory_bytes < two.memory_bytes
    across = projection.project(cfg, s, nodes=2, gpus_per_node=4)
    assert across.nodes == 2 and across.step_s > 0 and not math.isnan(across.step_s)
    # large payloads: the same 8 ranks over InfiniBand cost more than over NVLink; tiny ones are latency-bound,
    # where the hierarchy's fewer steps win
    one, two_nodes = (dataclasses.replace(s, gpus_per_node=g) for g in (8, 4))
    assert projection.collective_time("all_reduce", 1e9, 1, 8, two_nodes) > projection.collective_time(
        "all_reduce", 1e9, 1, 8, one
    )
    assert projection.collective_time("all_reduce", 1e3, 1, 8, two_nodes) < projection.collective_time(
        "all_reduce", 1e3, 1, 8, one
    )


def test_pipeline_compute_is_the_busiest_stage_stretched_by_the_bubble():
    """A pipeline step: the busiest stage's FLOPs / (1 - (P-1)/(M+P-1)), not the whole model per device;
    model-parallel (one process, the devices in turn) computes the whole model."""
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.strategies.base import get_strategy
    from stratbench.strategies.costs import MemoryContext
    from stratbench.strategies.parallel.pipeline_parallel import spec_split

    s = hardware.builtin().system("h100-sxm")
    single = projection.project(tiny_cfg(batch_size=32), s, memory=False)
    for mb in (1, 4, 8):
        cfg = tiny_cfg(strategy="pipeline", strategy_options={"microbatches": mb, "schedule": "gpipe"})
        p = projection.project(cfg, s, gpus_per_node=2, memory=False)
        cls = get_strategy("pipeline")
        opts = cls.parse_options(cfg.strategy_options)
        ctx = MemoryContext(cfg, 2, model_info(ModelSpec.from_config(cfg)), opts, "cuda")
        stages = spec_split(cfg, 2, opts).stages
        busiest = max(st.flops for st in stages) / sum(st.flops for st in stages)
        assert 0.5 <= busiest < 1.0
        bubble = 1 / (mb + 1)
        assert cls.cost.compute_scale(ctx) == pytest.approx(busiest / (1 - bubble))
        compute = p.compute_s - p.overhead_s
        assert compute == pytest.approx((single.compute_s - single.overhead_s) * busiest / (1 - bubble))
        assert p.overlap == 0.0 and p.comm_exposed_s == pytest.approx(p.comm_s)
    # more micro-batches, a smaller bubble, a faster step
    steps = [
        projection.project(
            tiny_cfg(strategy="pipeline", strategy_options={"microbatches": mb, "schedule": "gpipe"}),
            s, gpus_per_node=2, memory=False,
        ).compute_s
        for mb in (1, 2, 4)
    ]
    assert steps[0] > steps[1] > steps[2]


def test_estimate_time_cli_json(capsys):
    from stratbench.cli import main

    rc = main(["estimate", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
               "--batch-size", "32", "--strategy", "all", "--time", "--hardware", "a100-sxm", "--nodes", "2",
               "--gpus-per-node", "2", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["system"] == "a100-sxm" and out["hardware"]["nodes"] == 2
    rows = {r["strategy"]: r for r in out["results"]}
    assert rows["ddp"]["projection"]["world"] == 4 and rows["ddp"]["projection"]["step_s"] > 0
    assert rows["dp"]["projection"]["status"] == "no model"
    rc = main(["estimate", "--model", "tinynet", "--time", "--hardware", "h900"])
    assert rc != 0 and "unknown hardware 'h900'" in capsys.readouterr().err


def test_advise_goal_speed_ranks_the_plans_that_fit(capsys):
    from stratbench.cli import main
    from stratbench.predicting.advise import SPEED_TIE, advise
    from stratbench.predicting.estimate import estimate

    s = hardware.builtin().system("h100-sxm")
    base = tiny_cfg(model="tinynet", width=256, batch_size=64)
    roomy = advise(base, 8, 80 * 10**9, "speed", system=s)
    assert len(roomy.ranking) == len(roomy.tried) and all(r["fits"] for r in roomy.ranking)
    fastest = min(r["step_s"] for r in roomy.ranking)
    chosen = next(r for r in roomy.ranking if r["plan"] == roomy.plan.label)
    assert chosen["step_s"] <= fastest * (1 + SPEED_TIE)
    # a budget that only the sharded plans meet: DDP is ruled out whatever its speed
    ddp = estimate(base.replace(strategy="ddp"), 8, "cuda").total_bytes
    tight = advise(base, 8, int(ddp / 0.9) - (1 << 20), "speed", system=s)
    assert not next(r for r in tight.ranking if r["plan"] == "ddp")["fits"]
    assert tight.plan is not None and tight.plan.strategy != "ddp"
    assert next(r for r in tight.ranking if r["plan"] == tight.plan.label)["fits"]
    rc = main(["advise", "--model", "tinynet", "--width", "8", "--image-size", "16", "--devices", "2",
               "--hardware", "a100-sxm", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] and {r["plan"] for r in out["ranking"]} >= {"ddp", "fsdp --sharding full"}
    rc = main(["advise", "--devices", "2", "--device-memory", "8GiB", "--calibrate", "x.json"])
    assert rc != 0 and "--calibrate needs --hardware" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# compare reports: predicted step beside measured.


def _cell(method: str, precision: str, world: int, step_s: float, device: str = "cpu", **config) -> dict:
    env = {"device_type": device} | ({"gpus": ["NVIDIA H100 80GB HBM3"]} if device == "cuda" else {})
    return {
        "id": f"{method}_{precision}_w{world}", "method": method, "label": method, "precision": precision,
        "world_size": world, "batch_size": 32, "status": "ok", "reason": "",
        "machine": {"hostname": "box", "device": "CPU: test (2 cores)" if device == "cpu" else "NVIDIA H100"},
        "environment": env,
        "config": TINY | {"strategy": method, "precision": precision, "nproc": world} | config,
        "metrics": {"step_time_median_s": step_s, "throughput_samples_per_s": 32 / step_s, "train_time_s": 1.0},
    }  # fmt: skip


def test_compare_report_shows_predicted_step_and_error(tmp_path):
    """Without the sweep's own calibration (compare --calibrate: tests/compare/test_calibration.py), a GPU row is
    predicted on its device's profile, calibrated on the sweep's single run of its precision or at the default
    efficiency; a CPU row is n/a, uncalibrated (calibrated on the all-core single run with another machine's
    probe it was 35-80% off), never a number."""
    import csv

    from stratbench.compare import report as report_mod

    records = [
        _cell("single", "fp32", 1, 0.040),
        _cell("ddp", "fp32", 2, 0.030),
        _cell("single", "fp32", 1, 0.010, device="cuda"),
        _cell("ddp", "fp32", 2, 0.004, device="cuda"),
        _cell("ddp", "bf16-mixed", 2, 0.004, device="cuda"),  # no single bf16 run: the default efficiency
    ]
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), tmp_path)
    rows = {(r["method"], r["precision"], "gpu" if "H100" in r["machine"] else "box"): r
            for r in csv.DictReader(paths["csv"].open())}  # fmt: skip
    assert rows["single", "fp32", "box"]["predicted_step_s"] == rows["ddp", "fp32", "box"]["predicted_step_s"] == "n/a"
    md = paths["md"].read_text()
    assert "uncalibrated. On a CPU the projection needs this machine's probe" in md and "--calibrate" in md
    assert float(rows["single", "fp32", "gpu"]["predicted_step_s"]) == pytest.approx(0.010)  # gives itself back
    runs = [RunRecord.from_dict(r) for r in records]
    pred = projection.predict_record(runs[3], runs[2])
    assert pred.step_s and pred.calibrated and pred.system == "h100-sxm"
    ddp = rows["ddp", "fp32", "gpu"]
    assert float(ddp["predicted_step_s"]) == pytest.approx(pred.step_s)
    assert float(ddp["predicted_step_error_pct"]) == pytest.approx((pred.step_s / 0.004 - 1) * 100)
    bf16 = rows["ddp", "bf16-mixed", "gpu"]
    assert float(bf16["predicted_step_s"]) > 0 and bf16["predicted_dominant"] and bf16["predicted_step_basis"].startswith("default for convnet bf16")
    assert "predicted step (error)" in md and "(calibration)" in md
    assert f"{pred.step_s * 1e3:.1f} ms ({(pred.step_s / 0.004 - 1) * 100:+.0f}%)" in md
    assert "default efficiency" in md and "h100-sxm profile" in md
    assert "predicted step (error)" in paths["html"].read_text()
    # predict_record itself, on a CPU record: calibrated on the single run on cpu-gloo, or a probe file given
    cpu = projection.predict_record(runs[1], runs[0])
    assert cpu.step_s and cpu.system == "cpu-gloo"
    given = projection.predict_record(runs[1], runs[0], hardware="cpu-gloo")
    assert given.step_s == pytest.approx(cpu.step_s)
    assert projection.predict_record(runs[1], None).reason.startswith("no single run of this precision")
    assert projection.predict_record(runs[1], runs[0], hardware="h100-sxm").step_s is None


# ------------------------------------------------------------------------------------------------
# issue 33: --tf32 for estimate/advise, and where the efficiency comes from, from the CLI in process.

TIME_ARGS = ["estimate", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
             "--batch-size", "32", "--time", "--gpus-per-node", "1"]  # fmt: skip
MY_GPU = {
    "version": 1, "default_system": "my-node",
    "gpus": {"my-gpu": {"name": "NVIDIA H100 custom", "match": r"\bH100 custom\b", "memory": "80 GB",
                        "peak_flops": {"fp32": "67 TFLOP/s", "tf32": "494.7 TFLOP/s", "bf16": "989.4 TFLOP/s"},
                        "memory_bandwidth": "3350 GB/s", "efficiency": {"bf16": 0.3}}},
    "systems": {"my-node": {"gpu": "my-gpu", "gpus_per_node": 8, "intra_node": "nvlink4", "inter_node": "ib-ndr",
                            "nics_per_node": 8, "host": "pcie5-x16", "host_memory_bandwidth": "200 GB/s",
                            "call_latency": "8.4 us"}},
}  # fmt: skip


def _projection(capsys, *argv: str) -> dict:
    from stratbench.cli import main

    assert main([*TIME_ARGS, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]["projection"]


def test_efficiency_source_is_default_hardware_file_or_calibration(tmp_path, capsys):
    """The JSON's ``efficiency_from`` (and the text's line) names where the efficiency comes from: the built-in
    default, the user's --hardware file (which the JSON called "default"), or --calibrate runs."""
    from stratbench.cli import main

    hw = tmp_path / "my.yaml"
    hw.write_text(yaml.safe_dump(MY_GPU))
    p = _projection(capsys, "--precision", "bf16-mixed", "--hardware", "h100-sxm", "--basis", "efficiency")
    assert (p["efficiency_from"], p["efficiency"], p["uncalibrated"]) == ("default", 0.082, True), p
    assert p["efficiency_source"].startswith("default for convnet bf16 on NVIDIA H100 SXM5 80GB"), p
    p = _projection(capsys, "--precision", "bf16-mixed", "--hardware", str(hw))
    assert p["efficiency_from"] == "hardware file" and p["efficiency"] == 0.3 and not p["uncalibrated"], p
    assert p["efficiency_source"] == f"hardware file {hw} (gpus.my-gpu.efficiency.bf16)"
    p = _projection(capsys, "--precision", "fp32", "--hardware", str(hw), "--basis", "efficiency")  # bf16 only
    assert (p["efficiency_from"], p["efficiency"]) == ("default", 0.5), p  # no evidence, no like: the assumption
    assert "assumption" in p["efficiency_source"] and p["efficiency_note"] == "no evidence for convnet fp32", p
    run = tmp_path / "result.json"
    run.write_text(json.dumps(_result_json(tiny_cfg(precision="bf16-mixed"), 0.01, "NVIDIA H100 80GB HBM3")))
    p = _projection(capsys, "--precision", "bf16-mixed", "--hardware", str(hw), "--calibrate", str(run))
    assert p["efficiency_from"] == "calibration" and p["efficiency_source"].startswith("calibrated on"), p
    assert main([*TIME_ARGS, "--precision", "bf16-mixed", "--hardware", str(hw)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the text, unwrapped
    assert f"compute efficiency 30.0% of NVIDIA H100 custom's dense peak: hardware file {hw}" in out, out


def test_tf32_projects_fp32_at_the_tf32_peak_and_is_refused_where_train_refuses_it(capsys):
    """--tf32 (train's flag, TrainConfig.tf32) prices fp32 at the GPU's tf32 peak and default efficiency; a
    16-bit precision keeps its own peak (train accepts --tf32 with it too); a GPU without TF32 or a CPU is one
    line, as train refuses TF32 there."""
    from conftest import fails
    from stratbench.cli import main

    h100 = hardware.builtin().system("h100-sxm").gpu
    fp32 = _projection(capsys, "--precision", "fp32", "--hardware", "h100-sxm", "--basis", "efficiency")
    tf32 = _projection(capsys, "--precision", "fp32", "--hardware", "h100-sxm", "--tf32", "--basis", "efficiency")
    eff = {k: h100.default_efficiency(k, "convnet").value for k in ("fp32", "tf32")}  # tinynet is a convnet
    want = (h100.peak("fp32") * eff["fp32"]) / (h100.peak("tf32") * eff["tf32"])
    assert tf32["compute_s"] == pytest.approx(fp32["compute_s"] * want) and tf32["step_s"] < fp32["step_s"] / 2
    assert tf32["efficiency"] == eff["tf32"] and tf32 != fp32
    bf16 = {_projection(capsys, "--precision", "bf16-mixed", "--hardware", "h100-sxm", *f)["step_s"]
            for f in ([], ["--tf32", "true"])}  # fmt: skip
    assert len(bf16) == 1
    assert main(["advise", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
                 "--batch-size", "32", "--devices", "1", "--precision", "fp32", "--hardware", "h100-sxm",
                 "--tf32", "--json"]) == 0  # fmt: skip
    advice = json.loads(capsys.readouterr().out)
    assert "--tf32 true" in advice["train_command"], advice
    assert {r["efficiency_from"] for r in advice["ranking"]} == {"roofline"}, advice["ranking"]  # its default
    assert main(["advise", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
                 "--batch-size", "32", "--devices", "1", "--precision", "fp32", "--hardware", "h100-sxm",
                 "--tf32", "--basis", "efficiency", "--json"]) == 0  # fmt: skip
    advice = json.loads(capsys.readouterr().out)
    assert {r["efficiency_from"] for r in advice["ranking"]} == {"default"}, advice["ranking"]
    assert "Tesla P40 has no TF32" in fails(capsys, *TIME_ARGS, "--hardware", "p40-pcie3", "--tf32")
    assert "not a CPU" in fails(capsys, "estimate", "--model", "tinynet", "--device-type", "cpu", "--tf32")
    assert "'maybe'" in fails(capsys, *TIME_ARGS, "--hardware", "h100-sxm", "--tf32", "maybe")


# ------------------------------------------------------------------------------------------------
# Default efficiency from evidence, per (GPU, precision, model family) (issue 33 item 1).


def test_the_default_is_chosen_per_gpu_precision_and_family_with_its_source():
    gpus = hardware.builtin().gpus
    a100 = gpus["a100-sxm"]
    d = a100.default_efficiency("tf32", "transformer")
    assert (d.value, d.note) == (0.604, "") and "dle-bert-pretrain-s128-a100-tf32-1gpu" in d.evidence
    assert "median implied efficiency of 2 BERT-large pre-training figures" in d.source
    assert a100.default_efficiency("tf32", "convnet").value == 0.146  # a convnet reaches far less there
    bf16 = a100.default_efficiency("bf16", "convnet")  # no bf16 figure: fp16's, same tensor-core peak, said so
    assert bf16.value == a100.default_efficiency("fp16", "convnet").value and "fp16 default" in bf16.note
    h200 = gpus["h200-sxm"].default_efficiency("bf16", "convnet")  # no H200 evidence: the like GPU's, said so
    assert h200.value == gpus["h100-sxm"].default_efficiency("bf16", "convnet").value
    assert "h100-sxm's default" in h200.note and "result.json" in h200.source
    for family, why in (("transformer", "no evidence for transformer fp32"), (None, "model family unknown")):
        guess = a100.default_efficiency("fp32", family)  # no figure at all: the per-precision assumption, flagged
        assert guess.value == 0.5 and guess.evidence == () and why in guess.note, guess


def test_uncalibrated_flag_and_source_in_json_absent_when_calibrated(tmp_path, capsys):
    p = _projection(capsys, "--precision", "bf16-mixed", "--hardware", "h100-sxm", "--basis", "efficiency")
    assert (p["uncalibrated"], p["efficiency_from"], p["model_family"]) == (True, "default", "convnet"), p
    assert p["efficiency"] == 0.082 and p["efficiency_note"] == ""
    assert p["efficiency_source"].startswith("default for convnet bf16 on NVIDIA H100 SXM5 80GB: implied efficiency")
    run = tmp_path / "result.json"
    run.write_text(json.dumps(_result_json(tiny_cfg(precision="bf16-mixed"), 0.01, "NVIDIA H100 80GB HBM3")))
    p = _projection(capsys, "--precision", "bf16-mixed", "--hardware", "h100-sxm", "--calibrate", str(run))
    assert (p["uncalibrated"], p["efficiency_from"]) == (False, "calibration"), p


def test_every_default_in_the_data_names_its_evidence():
    data = yaml.safe_load(hardware.BUILTIN.read_text())["default_efficiency"]
    published = {e["id"]: e for e in yaml.safe_load(hardware.PUBLISHED.read_text())["entries"]}
    held = set(data["held_out"])
    assert held and held <= set(published)
    # 1-GPU figures, and the float8 figures the fp8 default (set from an 8-GPU figure: no 1-GPU float8 one) is
    # checked against
    assert all(published[h]["gpus"] == 1 or published[h]["precision"] == "fp8" for h in held)
    seen = set()
    for e in data["entries"]:
        evidence = [*e.get("published", []), *e.get("runs", [])]
        assert evidence and e["how"], e
        assert not held & set(e.get("published", [])), e
        assert all(pid in published for pid in e.get("published", [])), e
        assert all((conftest.REPO / r).is_file() for r in e.get("runs", [])), e
        seen.add((e["gpu"], e["precision"], e["family"]))
    assert len(seen) == len(data["entries"]) and {f for _, _, f in seen} == set(hardware.FAMILIES)
    bad = yaml.safe_load(hardware.BUILTIN.read_text())
    bad["default_efficiency"]["entries"].append({"gpu": "l4", "precision": "bf16", "family": "convnet",
                                                 "value": 0.3, "how": "a guess"})  # fmt: skip
    with pytest.raises(hardware.HardwareError, match="names no evidence"):
        hardware.parse(bad, "hardware.yaml")
    bad["default_efficiency"]["entries"][-1]["published"] = [sorted(held)[0]]
    with pytest.raises(hardware.HardwareError, match="is held out"):
        hardware.parse(bad, "hardware.yaml")


ATTENTION_NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.embed = nn.Linear(48, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        t = self.embed(x.flatten(2).transpose(1, 2).reshape(x.shape[0], -1, 48))
        return self.head((t + self.attn(t, t, t, need_weights=False)[0]).mean(1))


def build(num_classes):
    return Net(num_classes)


def mlp(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, num_classes))
'''


def test_a_transformer_gets_the_transformer_default_and_an_mlp_the_flagged_assumption(tmp_path, monkeypatch):
    (tmp_path / "sb_attention_net.py").write_text(ATTENTION_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    a100 = hardware.builtin().system("a100-sxm")
    cfg = TrainConfig(model="sb_attention_net:build", data="synthetic", num_classes=10, image_size=8, batch_size=8,
                      precision="bf16-mixed")  # fmt: skip
    p = projection.project(cfg, a100, gpus_per_node=1, memory=False)
    assert (p.model_family, p.efficiency, p.uncalibrated) == ("transformer", 0.567, True), p
    assert "BERT-large pre-training" in p.efficiency_source and "fp16 default" in p.efficiency_note
    q = projection.project(cfg.replace(model="sb_attention_net:mlp"), a100, gpus_per_node=1, memory=False)
    assert (q.model_family, q.efficiency) == (None, 0.4) and "model family unknown" in q.efficiency_source, q
