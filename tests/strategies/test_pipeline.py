"""pipeline and model-parallel: 2-process gloo pipelines (gpipe, 1f1b, interleaved-1f1b) and one 2 x 2 pipeline x
data-parallel run train exactly the model `single` trains (fp64, conftest.EQUIV/RTOL); each stage holds only its
own parameters; checkpoints are full and portable both ways (pipeline -> single/predict, ddp -> pipeline); bad
layouts are refused in one line before any work. The splitter and the model-parallel placement are unit-tested in
process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import (
    BIG_LOSS,
    COMM,
    EQUIV,
    RTOL,
    TINY,
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    fails,
    train,
)

PP = ["--strategy", "pipeline", "--dist-timeout-s", "60"]
FP64 = 8  # bytes per parameter of the fp64 test problem


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run) -> dict:
    """The shared `single` reference and the pipeline runs every test below reads (one run each)."""
    root = tmp_path_factory.mktemp("pipeline")
    out: dict = {"root": root, "single": reference_run}
    # gpipe, split balanced by FLOPs; saves only at the end (step 20)
    out["gpipe"] = train(root / "gpipe", *PP, *EQUIV, "--schedule", "gpipe", "--microbatches", "4",
                         "--balance", "flops", *COMM, nproc=2)  # fmt: skip
    # 1f1b with an explicit split, saving at step 10 too (single resumes from it)
    out["1f1b"] = train(root / "1f1b", *PP, *EQUIV, "--schedule", "1f1b", "--microbatches", "4",
                        "--split-points", "blocks.1", "--save-every-steps", "10", "--keep-last", "2", nproc=2)  # fmt: skip
    # naive: one micro-batch, plain model parallelism across the 2 processes
    out["naive"] = train(root / "naive", *PP, *EQUIV, "--schedule", "naive", nproc=2)
    return out


def _ok(res: dict, world: int = 2) -> None:
    assert res["status"] == "ok" and res["world_size"] == world, res.get("reason")


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(("schedule", "m"), [("gpipe", 4), ("1f1b", 4), ("naive", 1)])
def test_pipeline_matches_single(runs, schedule, m):
    """20 steps of a 2-stage pipeline over M micro-batches (naive: 1) = 20 full-batch steps of one process;
    the evaluation forward through the stages gives single's val loss and accuracy on the same samples."""
    res, ref = runs[schedule], runs["single"]
    _ok(res)
    assert res["data_parallel_size"] == 1 and res["per_device_batch_size"] == 32  # both stages see the batch
    curve = res["metrics"]["loss_curve"]
    assert len(curve) == 20 and ref["metrics"]["loss_curve"][-1] < 0.9 * ref["metrics"]["loss_curve"][0]
    assert_curves_match(curve, ref["metrics"]["loss_curve"], RTOL)
    assert (
        res["metrics"]["evaluations"][-1]["val_samples"] == ref["metrics"]["evaluations"][-1]["val_samples"]
    )
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    assert res["metrics"]["val_accuracy"] == ref["metrics"]["val_accuracy"]
    pipe = res["pipeline"]
    assert pipe["layout"] == {"pp": 2, "dp": 1, "stages": 2, "microbatches": m, "schedule": schedule,
                              "stages_per_rank": 1}  # fmt: skip
    assert pipe["bubble_theory"] == pytest.approx(1 / (m + 1))
    for rank in pipe["ranks"]:  # measured on every rank over the timed steps
        bubble = rank["bubble"]
        assert bubble["steps"] >= 15 and 0.0 <= bubble["min"] <= bubble["median"] <= bubble["max"] < 1.0


@pytest.mark.distributed
def test_measured_sends_match_the_formula(runs):
    """Each stage sends what comm_model says (4 micro-batches of activations or of their gradients, and the
    loss broadcast); receives are the other rank's sends and add no payload."""
    comm = runs["gpipe"]["metrics"]["comm"]
    assert set(comm["check"]) == {"send_recv", "broadcast"}, comm["check"]
    for kind, c in comm["check"].items():
        assert c["error_pct"] == pytest.approx(0.0, abs=5.0), (kind, c)
    for rank in comm["measured_per_rank"]:
        assert rank["per_step"]["send_recv"]["calls"] == 4


@pytest.mark.distributed
def test_phases_add_up_and_the_memory_estimate_holds(runs):
    """The gpipe run: the schedule (forwards, backwards, sends) is timed as backward, the loss broadcast as
    other, and they add up to the step time on both stages; the estimate of the busiest stage (all 4
    micro-batches in flight under gpipe, and the step's input batch) is within 10% of its measured peak."""
    assert_breakdown_adds_up(runs["gpipe"], schedule_as_backward=True)
    assert_estimate_within(runs["gpipe"])


@pytest.mark.distributed
def test_each_stage_holds_only_its_parameters(runs):
    """Per-rank parameter bytes are the split's stage sizes and add up to the model exactly."""
    for schedule in ("gpipe", "1f1b"):
        res = runs[schedule]
        total = res["model_meta"]["num_parameters"]
        stages = res["pipeline"]["split"]["stages"]
        assert res["pipeline"]["split"]["total_params"] == total
        assert res["sharding"]["param_bytes"] == [s["params"] * FP64 for s in stages]
        assert sum(res["sharding"]["param_bytes"]) == total * FP64 and min(res["sharding"]["param_bytes"]) > 0
        assert res["sharding"]["optimizer_state_bytes"] == res["sharding"]["param_bytes"]  # SGD momentum
        # the memory model (stratbench estimate) predicts exactly these per-rank bytes
        from stratbench.core.config import TrainConfig
        from stratbench.predicting.estimate import model_state_bytes

        predicted = model_state_bytes(TrainConfig(**res["config"]), 2)
        for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
            assert [p[key] for p in predicted] == res["sharding"][key], key
    # the explicit split point and the FLOP balance were applied
    assert runs["1f1b"]["pipeline"]["split"]["stages"][1]["pieces"] == ["blocks.1", "blocks.2", "head"]
    flops = [s["flops"] for s in runs["gpipe"]["pipeline"]["split"]["stages"]]
    assert runs["gpipe"]["pipeline"]["split"]["balance"] == "flops" and max(flops) < 0.65 * sum(flops)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_pipeline_checkpoint_is_full_and_single_resumes_it(runs, capsys):
    """The step-10 checkpoint of the 1f1b run is a full state dict with the original names; `single` resumes
    it and continues the reference run exactly; predict loads the final one like single's own, and export
    writes single's weights from it (safetensors) and an ONNX file that matches PyTorch."""
    from stratbench.checkpoints import checkpoint
    from stratbench.cli import main

    ckpts = runs["root"] / "1f1b" / "checkpoints"
    step10 = next(
        p for p in ckpts.iterdir() if p.name != "last" and checkpoint.read_meta(p)["progress"]["step"] == 10
    )
    state = checkpoint.load_file(step10)
    ref_names = list(
        checkpoint.load_file(Path(runs["single"]["config"]["output"]) / "checkpoints" / "last")["model"]
    )
    assert list(state["model"]) == ref_names
    assert state["optimizer"]["param_groups"][0]["params"] == ref_names
    assert sorted(state["optimizer"]["state"]) == sorted(ref_names)
    res = train(
        runs["root"] / "single-from-1f1b", "--strategy", "single", *EQUIV, "--resume-from", str(step10)
    )
    assert res["resumed_from"]["step"] == 10
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"][10:], RTOL)

    folder = runs["root"] / "digits_png"
    folder.mkdir(exist_ok=True)
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(6):
        Image.fromarray((digits.images[i] / 16 * 255).astype(np.uint8), "L").save(folder / f"{i}.png")
    preds = {}
    for name, path in (
        ("pipeline", ckpts / "last"),
        ("single", Path(runs["single"]["config"]["output"]) / "checkpoints" / "last"),
    ):
        capsys.readouterr()
        assert main(["predict", "--checkpoint", str(path), str(folder), "--json", "--top-k", "2"]) == 0
        preds[name] = json.loads(capsys.readouterr().out)["predictions"]
    top = lambda p: [(r["top"][0]["class"], round(r["top"][0]["probability"], 6)) for r in p]  # noqa: E731
    assert len(preds["pipeline"]) == 6 and top(preds["pipeline"]) == top(preds["single"])

    # export: the plain weights are single's (names, shapes, dtypes; values within the run's tolerance), and
    # the ONNX export of the pipeline checkpoint passes export's own check against PyTorch
    from safetensors.torch import load_file

    weights = {}
    single_last = Path(runs["single"]["config"]["output"]) / "checkpoints" / "last"
    for name, path in (("pipeline", ckpts / "last"), ("single", single_last)):
        out_file = runs["root"] / f"{name}.safetensors"
        assert main(["export", "--checkpoint", str(path), "--output", str(out_file)]) == 0
        weights[name] = load_file(out_file)
    assert list(weights["pipeline"]) == list(weights["single"]) and len(weights["single"]) > 0
    for key, value in weights["single"].items():
        # export writes fp32: fp64 weights 1e-12 apart may round to neighbouring fp32 values (6e-8 apart)
        assert weights["pipeline"][key].dtype == value.dtype == torch.float32
        torch.testing.assert_close(weights["pipeline"][key], value, rtol=1e-6, atol=1e-9, msg=key)
    capsys.readouterr()
    onnx_file = runs["root"] / "pipeline.onnx"
    args = ["export", "--checkpoint", str(ckpts / "last"), "--output", str(onnx_file), "--images", str(folder)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "onnx.checker: ok" in out and "max abs diff" in out and onnx_file.is_file()


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ddp_checkpoint_resumes_under_pipeline(runs):
    """ddp's full checkpoint at step 10, resumed by a 2-stage pipeline: steps 11-20 equal the reference's."""
    root = runs["root"]
    train(root / "ddp", "--strategy", "ddp", *EQUIV, "--max-steps", "10", nproc=2)
    res = train(root / "pp-from-ddp", *PP, *EQUIV, "--schedule", "1f1b",
                "--resume-from", str(root / "ddp" / "checkpoints" / "last"), nproc=2)  # fmt: skip
    _ok(res)
    assert res["resumed_from"]["step"] == 10
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"][10:], RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_interleaved_four_stages_on_two_processes(runs):
    res = train(runs["root"] / "interleaved", *PP, *EQUIV, "--schedule", "interleaved-1f1b", nproc=2)
    _ok(res)
    assert res["pipeline"]["layout"]["stages"] == 4 and res["pipeline"]["layout"]["stages_per_rank"] == 2
    assert [r["stages"] for r in res["pipeline"]["ranks"]] == [[0, 2], [1, 3]]
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"], RTOL)
    assert sum(res["sharding"]["param_bytes"]) == res["model_meta"]["num_parameters"] * FP64


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(("schedule", "stages", "bubble"), [
    ("zb-interleaved", [[0, 2], [1, 3]], 1 / (3 * 2 * 4 + 1)),  # ZB-H1, v = 2: (P-1) / (3vM + P-1)
    ("zbv", [[0, 3], [1, 2]], 0.0),  # M = 4 >= 2P
    ("dualpipev", [[0, 3], [1, 2]], 0.0),
])  # fmt: skip
def test_zero_bubble_schedules_train_the_model_single_trains(runs, schedule, stages, bubble):
    """The zero-bubble schedules (each backward split into its input- and weight-gradient halves) on 2
    processes x 2 stages, loop-placed or in a V: single's fp64 curve; the V's turn (stages 1 and 2 on one rank)
    sends nothing, so each rank sends one boundary each way per micro-batch, as the formula says."""
    res = train(runs["root"] / schedule, *PP, *EQUIV, "--schedule", schedule, "--microbatches", "4", *COMM,
                nproc=2)  # fmt: skip
    _ok(res)
    assert [r["stages"] for r in res["pipeline"]["ranks"]] == stages
    assert res["pipeline"]["bubble_theory"] == pytest.approx(bubble)
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"], RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)
    assert_comm_matches_formula(res, tol=0.0)
    assert_estimate_within(res)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_pipeline_x_data_parallel_2x2(runs):
    """4 processes = 2 replicas of a 2-stage pipeline on a (dp=2, pp=2) mesh: each replica reads half of the
    batch, each stage's gradients are averaged over its 2 replicas; the run equals `single` on the full batch."""
    res = train(
        runs["root"] / "pp2dp2",
        *PP,
        *EQUIV,
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "2",
        nproc=4,
    )
    _ok(res, world=4)
    assert res["data_parallel_size"] == 2 and res["per_device_batch_size"] == 16
    assert [(r["dp_rank"], r["pp_rank"]) for r in res["pipeline"]["ranks"]] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"], RTOL)
    assert res["metrics"]["val_accuracy"] == runs["single"]["metrics"]["val_accuracy"]
    p = res["sharding"]["param_bytes"]
    assert p[0] == p[2] and p[1] == p[3] and p[0] + p[1] == res["model_meta"]["num_parameters"] * FP64


RTOL_SAME_KERNELS = 1e-6
"""Mixed precision, a pipeline against `single --grad-accum M`: every kernel call has the same shapes and inputs
in both (each stage computes its pieces' slice of single's micro-step on the same micro-batch, the loss divided
by M and scaled by the same power of two), so the curves are expected bit-identical (measured: 0.0 in fp16-mixed
and bf16-mixed). 1e-6 leaves room for a kernel that chooses another algorithm for a stage run alone; a stage
stepping on a step another stage skipped moved the curve by 2.5e-2 (measured with a per-stage GradScaler)."""


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_mixed_precision_matches_single_and_stages_skip_together(precision, tmp_path):
    """fp16-mixed and bf16-mixed on a 2-stage 1f1b pipeline equal `single --grad-accum 4` (the same 4
    micro-batches). fp16-mixed trains with the loss x 2^10 (and the lr / 2^10): at the default initial scale
    2^16 the gradients overflow for the first steps, in some steps on one stage only (stage 0 skipped 5 steps,
    stage 1 7, when each stage had its own scaler); with the found-inf all-reduced, every rank skips the steps
    `single` skips and ends with its loss scale. Width 4 at 16 px: fp16 convolution backward is ~100x slower
    than fp32 on a CPU."""
    args = [*TINY, "--width", "4", "--image-size", "16", "--precision", precision, "--dist-timeout-s", "60"]
    if precision == "fp16-mixed":  # the user's loss module, found in the folder the run starts in
        (tmp_path / "bigloss.py").write_text(BIG_LOSS)
        args += ["--loss", "bigloss:loss", "--lr", str(0.02 / 2**10), "--weight-decay", "0"]
    ref = train(tmp_path / "single", *args, "--strategy", "single", "--grad-accum", "4", cwd=tmp_path)
    res = train(tmp_path / "pipeline", *args, "--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "4",
                "--comm-volume", "true", nproc=2, cwd=tmp_path)  # fmt: skip
    _ok(res)
    # what each stage sent in step 3: 16-bit activations (and their gradients), the loss, fp16's found-inf flag
    comm = assert_comm_matches_formula(res)
    assert ("all_reduce" in comm["check"]) == (precision == "fp16-mixed"), comm["check"]
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL_SAME_KERNELS)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL_SAME_KERNELS)
    skipped = ref["metrics"]["skipped_steps"]
    ranks = res["pipeline"]["ranks"]
    assert [r["skipped_steps"] for r in ranks] == [skipped, skipped] == [res["metrics"]["skipped_steps"]] * 2
    if precision == "fp16-mixed":
        assert 3 <= skipped <= 12, skipped  # overflowed at first, then trained
        assert [r["loss_scale"] for r in ranks] == [2.0**16 / 2**skipped] * 2  # halved per skip, never grown
        assert ref["metrics"]["loss_curve"][-1] < 0.98 * ref["metrics"]["loss_curve"][0]
    else:
        assert skipped == 0 and [r["loss_scale"] for r in ranks] == [None, None]


# ---- refusals: one clear line, before any work ---------------------------------------------------


def _preflight_error(world: int, *args: str) -> str:
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.errors import StratbenchError
    from stratbench.training.engine import preflight

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = resolve_config(parser.parse_args([*TINY, "--strategy", "pipeline", *args]))
    with pytest.raises(StratbenchError) as info:
        preflight(cfg, world_size=world)
    return str(info.value)


def test_bad_layouts_are_refused(tmp_path, monkeypatch):
    line = _preflight_error(2, "--schedule", "interleaved-1f1b", "--stages", "6")
    assert "6 stages need 5 split points" in line and "has only 4" in line and "stem, blocks.0" in line
    line = _preflight_error(2, "--microbatches", "3")
    assert "--microbatches 3 does not divide the per-replica batch 32" in line
    line = _preflight_error(4, "--pp", "2", "--microbatches", "32")
    assert "per-replica batch 16" in line
    assert "world size 3 is not divisible into pipelines of 2" in _preflight_error(3, "--pp", "2")
    assert "naive runs one micro-batch" in _preflight_error(2, "--schedule", "naive", "--microbatches", "4")
    assert "1f1b needs --microbatches >= the 2" in _preflight_error(2, "--microbatches", "1")
    assert "'layer2' is not a piece" in _preflight_error(2, "--split-points", "layer2")
    assert "unknown schedule 'zb'" in _preflight_error(2, "--schedule", "zb")
    line = _preflight_error(2, "--schedule", "zbv", "--stages", "6")
    assert "zbv runs exactly 2 stages per process in a V: --stages 4 with 2 pipeline processes; got 6" in line
    assert "zb-interleaved needs --stages a multiple of the 2" in _preflight_error(2, "--schedule", "zb-interleaved", "--stages", "3")
    assert "unknown balance 'time'" in _preflight_error(2, "--balance", "time")
    # a model that cannot be split
    (tmp_path / "unsplittable.py").write_text(
        "from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self, num_classes):\n"
        "        super().__init__()\n        self.a = nn.Conv2d(3, 4, 3)\n        self.b = nn.Linear(4, num_classes)\n"
        "    def forward(self, x):\n        return self.b(self.a(x).mean((2, 3)))\n\n"
        "def build(num_classes):\n    return Net(num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _preflight_error(2, "--model", "unsplittable:build")
    assert "cannot split a Net into pipeline stages" in line and "nn.Sequential" in line


def test_refusal_is_one_line_before_any_work(tmp_path, capsys):
    line = fails(capsys, "train", "--output", tmp_path, *PP, "--nproc", "2", *TINY, "--stages", "3")
    # a layout that does not fit the world is a configuration error, found with the batch split
    assert "not divisible into pipelines of 3" in line and "--stages 3" in line, line
    assert not (tmp_path / "result.json").exists()


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_preset_pipeline_cells_are_valid_for_any_gpu_count(gpus, monkeypatch):
    """The quick and seed presets expanded as on a machine with 1, 2, 4 or 8 GPUs (and quick at --world-size
    N): every pipeline cell passes the strategy's own check (layout, micro-batches, the split of the model), so
    no cell is refused for a layout the preset chose. At 8 GPUs the seed preset's ResNet-50 (6 pieces) runs 4
    stages x 2 replicas with 8 micro-batches, not 8 stages."""
    from stratbench.compare import matrix, presets
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.strategies.parallel.pipeline_parallel import resolve_layout
    from stratbench.strategies.pipeline import PipelineStrategy

    monkeypatch.setattr(presets, "gpu_count", lambda: gpus)
    expanded = [("seed", matrix.load_matrix("seed", None)), ("quick", matrix.load_matrix("quick", None)),
                ("quick", matrix.load_matrix("quick", None, world_size=gpus))]  # fmt: skip
    for preset, mat in expanded:
        cells = [c for c in mat.cells if c.method == "pipeline"]
        assert {c.options["schedule"] for c in cells} == {"gpipe", "1f1b"}, preset
        for cell in cells:
            cfg = from_dict(TrainConfig, cell.train_config("unused"), where=cell.id)
            reason = PipelineStrategy.check_supported(cfg, torch.device("cuda"), cell.world_size)
            assert reason is None, (preset, gpus, cell.world_size, cell.options, reason)
            lay = resolve_layout(PipelineStrategy.parse_options(cfg.strategy_options), cell.world_size)
            assert lay.pp * lay.dp == cell.world_size and lay.microbatches >= lay.pp
    seed = [c for c in expanded[0][1].cells if c.method == "pipeline"][0]
    lay = resolve_layout(PipelineStrategy.parse_options(seed.options), seed.world_size)
    assert (seed.world_size, lay.pp, lay.dp) == {1: (2, 2, 1), 2: (2, 2, 1), 4: (4, 4, 1), 8: (8, 4, 2)}[gpus]
    quick = [c for c in expanded[1][1].cells if c.method == "pipeline"][0]
    # no "pp" at world 2 (its default): the quick cells' ids, which resume matches on, are unchanged
    assert quick.world_size == 2 and set(quick.options) == {"schedule", "microbatches"}
    assert quick.options["microbatches"] == 4


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2+ GPUs: model-parallel can run")
def test_model_parallel_refused_without_two_gpus(tmp_path, capsys):
    line = fails(capsys, "train", "--output", tmp_path, "--strategy", "model-parallel", *TINY)
    assert "model-parallel/fp32 cannot run here: needs >= 2 CUDA GPUs, found" in line


# ---- in process: the splitter, the layouts, model-parallel placement --------------------------------


def test_balanced_cut_minimises_the_largest_stage():
    from stratbench.models.split import balanced_cut

    def parts(costs, starts):
        bounds = [*starts, len(costs)]
        return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]

    assert balanced_cut([1, 1, 1, 1, 10], 2) == [0, 4]
    assert max(parts([5, 1, 1, 1, 1, 1], balanced_cut([5, 1, 1, 1, 1, 1], 3))) == 5
    assert max(parts([2, 7, 1, 1, 6, 3], balanced_cut([2, 7, 1, 1, 6, 3], 3))) == 9  # 8 is impossible
    assert balanced_cut([3, 3, 3, 3], 4) == [0, 1, 2, 3]


def test_split_pieces_of_the_models_stratbench_builds():
    from stratbench.models.split import split_model
    from stratbench.models.zoo import build_model

    with torch.device("meta"):
        resnet = build_model("resnet18", 10, cifar_stem=True)
    split = split_model(resnet, 3, split_points=["layer2", "layer4"], sample_shape=(3, 32, 32))
    assert [s.pieces for s in split.stages] == [["stem", "layer1"], ["layer2", "layer3"], ["layer4", "head"]]
    assert sum(s.params for s in split.stages) == sum(p.numel() for p in resnet.parameters())
    assert split.stages[0].out_numel == 64 * 32 * 32 and split.stages[-1].out_numel == 10
    # the pieces are costed with the counter of metrics.flops_per_sample (MFU): their FLOPs add up to the model's
    from stratbench.models.flops import flops_per_sample

    whole = flops_per_sample(lambda: build_model("resnet18", 10, cifar_stem=True), (3, 32, 32), 10)
    assert whole and sum(s.flops for s in split.stages) == whole
    seq = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    by_params = split_model(seq, 2, sample_shape=(4,))
    # parameters 320 | 4160 | 195: the largest stage is smallest with the big layer alone-ish
    assert [s.pieces for s in by_params.stages] == [["0"], ["1", "2", "3", "4"]]


def test_stages_compose_to_the_model_and_model_parallel_places_them():
    """The stage modules run in order equal the model's forward (fp64, exact), and model-parallel's placement
    (here on two CPU 'devices') keeps the forward and backward and the state dict names."""
    from stratbench.models.split import split_model, stage_module
    from stratbench.models.zoo import build_model
    from stratbench.strategies.model_parallel import place_stages

    torch.manual_seed(0)
    model = build_model("tinynet", 10, norm="none", width=8).double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    split = split_model(model, 3, balance="flops", sample_shape=(3, 16, 16))
    out = x
    for stage in split.stages:
        out = stage_module(model, stage)(out)
    assert torch.equal(out, model(x))
    names = list(model.state_dict())
    handles = place_stages(model, split, [torch.device("cpu")] * 3)
    assert len(handles) == 4 and list(model.state_dict()) == names
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_memory_model_counts_the_micro_batches_in_flight():
    from stratbench.core.config import TrainConfig
    from stratbench.predicting.estimate import rank_states

    def acts(schedule: str, rank: int) -> int:
        cfg = TrainConfig(model="tinynet", image_size=32, data="synthetic", strategy="pipeline", batch_size=64,
                          strategy_options={"schedule": schedule, "microbatches": 8})  # fmt: skip
        return rank_states(cfg, 2, rank, device_type="cpu").activations

    # stage 0 under gpipe holds all 8 micro-batches, under 1f1b at most 2 (= the stages); stage 1 holds 1; each
    # stage also holds the step's 64 fp32 input images, whatever the schedule
    images = 64 * 3 * 32 * 32 * 4
    assert acts("gpipe", 0) - images == 4 * (acts("1f1b", 0) - images) > 0
    assert acts("gpipe", 1) - images == 8 * (acts("1f1b", 1) - images) > 0


def test_comm_model_sends_each_micro_batch_across_the_boundary():
    from stratbench.core.config import TrainConfig
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.strategies.costs import MemoryContext
    from stratbench.strategies.pipeline import PipelineStrategy

    opts = {"schedule": "1f1b", "pp": 2, "microbatches": 2}
    cfg = TrainConfig(model="tinynet", image_size=32, data="synthetic", strategy="pipeline", batch_size=32,
                      strategy_options=opts)  # fmt: skip
    ctx = MemoryContext(
        cfg, 4, model_info(ModelSpec.from_config(cfg)), PipelineStrategy.parse_options(opts), "cpu"
    )
    rows = {r.kind: r for r in PipelineStrategy.cost.comm_model(ctx)}
    # 2 replicas x 2 micro-batches of 8; tinynet (width 16) split by parameters after blocks.1: 32 x 16 x 16 floats
    assert rows["send_recv"].payload_bytes == 2 * 8 * 32 * 16 * 16 * 4 and rows["send_recv"].calls == 2
    assert rows["all_reduce"].group_size == 2 and rows["broadcast"].payload_bytes == 8


def test_model_parallel_trains_like_single_with_cpu_stand_ins(tmp_path, monkeypatch, reference_run):
    """The whole model-parallel path (split, placement hooks, loop, evaluation, checkpoint) in this process,
    with two CPU 'devices' standing in for cuda:0 and cuda:1 (the GPU run is in test_gpu.py)."""
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.dist import DistEnv
    from stratbench.strategies.model_parallel import ModelParallelStrategy
    from stratbench.training.engine import Trainer

    monkeypatch.setattr(ModelParallelStrategy, "devices", lambda self: [torch.device("cpu")] * 2)
    monkeypatch.setattr(ModelParallelStrategy, "synchronize", lambda self: None)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = [*EQUIV, "--strategy", "model-parallel", "--balance", "flops", "--output", str(tmp_path)]
    cfg = resolve_config(parser.parse_args(args))
    res = Trainer(cfg, DistEnv(), ModelParallelStrategy).fit()
    assert res["status"] == "ok" and [len(s["pieces"]) for s in res["model_parallel"]["split"]["stages"]] == [
        2,
        3,
    ]
    assert_curves_match(res["metrics"]["loss_curve"], reference_run["metrics"]["loss_curve"], RTOL)
    assert res["metrics"]["val_accuracy"] == reference_run["metrics"]["val_accuracy"]


def build_bn_net(num_classes: int) -> nn.Sequential:
    """A small BatchNorm CNN (`--model test_pipeline:build_bn_net`): two conv-BatchNorm-ReLU blocks and a head."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(16, num_classes)),
    )


def test_batchnorm_sees_the_micro_batches_like_grad_accum(tmp_path, monkeypatch):
    """BatchNorm under a pipeline: a one-stage pipeline in this process (a world of one, gloo) at M = 4 against
    `single --grad-accum 4`, a BatchNorm CNN, fp32. Each BatchNorm normalises over the same 4
    micro-batches in both and updates its running statistics 4 times a step, so the weights, the running
    statistics, num_batches_tracked and the validation loss (which uses the running statistics) agree. (torch's
    shape-inference forward, on the first step and after each evaluation, must not count: it once updated the
    statistics with the whole batch here, with uninitialised memory on later stages - NaN validation loss.)"""
    import argparse

    from stratbench.checkpoints import checkpoint
    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.dist import free_port
    from stratbench.training.engine import run

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):  # fmt: skip
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    # 2 epochs of 2 steps: the evaluation after epoch 1 makes step 3 re-infer the stages' shapes
    common = ["--model", "test_pipeline:build_bn_net", "--data", "synthetic", "--synthetic-samples", "32",
              "--image-size", "8", "--batch-size", "16", "--epochs", "2", "--progress", "false",
              "--measure-flops", "false", "--timing-warmup-steps", "0"]  # fmt: skip
    results, states = {}, {}
    for name, flags in (("pipeline", ["--strategy", "pipeline", "--schedule", "gpipe", "--microbatches", "4"]),
                        ("single", ["--strategy", "single", "--grad-accum", "4"])):  # fmt: skip
        out = tmp_path / name
        results[name] = run(resolve_config(parser.parse_args([*common, *flags, "--output", str(out)])))
        states[name] = checkpoint.load_file(out / "checkpoints" / "last")["model"]
    pipe, ref = results["pipeline"], results["single"]
    assert pipe["status"] == "ok" and pipe["pipeline"]["layout"]["microbatches"] == 4, pipe.get("reason")
    assert list(states["pipeline"]) == list(states["single"])
    assert len(pipe["metrics"]["loss_curve"]) == 4  # 2 epochs of 2 steps
    # 4 micro-batches a step, nothing else (no shape-inference forward)
    assert states["pipeline"]["0.1.num_batches_tracked"].item() == 4 * 4
    for key, value in states["single"].items():
        torch.testing.assert_close(states["pipeline"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert_curves_match(pipe["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], 1e-5)
    assert len(pipe["metrics"]["evaluations"]) == 2
    for a, b in zip(pipe["metrics"]["evaluations"], ref["metrics"]["evaluations"], strict=True):
        assert math.isfinite(a["val_loss"]) and a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
