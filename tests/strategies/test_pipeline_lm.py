"""pipeline and model-parallel on the built-in transformer (gpt-tiny), split between its blocks: every schedule, an
explicit split, interleaved stages and a 2 x 2 pipeline x data-parallel run train exactly the model `single` trains
on real text (fp64, conftest.RTOL, 2 gloo processes); on synthetic tokens, fp32 and bf16-mixed equal one process on
the same micro-batches bit for bit; a pipeline checkpoint is full, resumes under pipeline and under `single`; the
cost model gives the stages' numbers for a transformer; bad splits are refused in one line before any work."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import RTOL, assert_breakdown_adds_up, assert_curves_match, train

SEQ = 32
LM = [
    "--model", "gpt-tiny", "--seq-len", str(SEQ), "--batch-size", "8", "--epochs", "1", "--max-steps", "6",
    "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "8", "--progress", "false",
    "--timing-warmup-steps", "1", "--measure-flops", "false", "--dist-timeout-s", "60",
]  # fmt: skip
LM64 = [*LM, "--data", "text", "--precision", "fp64"]
PP = ["--strategy", "pipeline"]
FP64 = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """`single` fp64 on text and the 2-process pipelines every test below reads (one run each)."""
    root = tmp_path_factory.mktemp("pipeline-lm")
    out: dict = {"root": root, "single": train(root / "single", "--strategy", "single", *LM64)}
    # gpipe balanced by FLOPs, every phase timed
    out["gpipe"] = train(root / "gpipe", *PP, *LM64, "--schedule", "gpipe", "--microbatches", "4",
                         "--balance", "flops", "--breakdown", "true", "--comm-volume", "true", nproc=2)  # fmt: skip
    # 1f1b split before block 3, saving at step 4 too (pipeline and single resume from it)
    out["1f1b"] = train(root / "1f1b", *PP, *LM64, "--schedule", "1f1b", "--microbatches", "4",
                        "--split-points", "layers.3", "--save-every-steps", "4", "--keep-last", "2", nproc=2)  # fmt: skip
    out["naive"] = train(root / "naive", *PP, *LM64, "--schedule", "naive", nproc=2)
    return out


def _state_names(output) -> list[str]:
    from stratbench.checkpoints import checkpoint

    return list(checkpoint.load_file(output / "checkpoints" / "last")["model"])


def _ok(res: dict, world: int = 2) -> None:
    assert res["status"] == "ok" and res["world_size"] == world, res.get("reason")


def _matches_single(res: dict, ref: dict) -> None:
    curve = ref["metrics"]["loss_curve"]
    assert len(curve) == 6 and curve[-1] < 0.9 * curve[0], (
        "the reference must train, or equal curves prove little"
    )
    assert_curves_match(res["metrics"]["loss_curve"], curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    assert res["metrics"]["val_accuracy"] == ref["metrics"]["val_accuracy"]  # next-token, 8 x 32 tokens


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(("schedule", "m"), [("gpipe", 4), ("1f1b", 4), ("naive", 1)])
def test_pipeline_trains_the_transformer_single_trains(runs, schedule, m):
    """6 steps of a 2-stage pipeline of gpt-tiny over M micro-batches = 6 full-batch steps of one process; the
    evaluation forward through the stages gives single's validation loss and next-token accuracy."""
    res = runs[schedule]
    _ok(res)
    _matches_single(res, runs["single"])
    pipe = res["pipeline"]
    assert pipe["layout"] == {"pp": 2, "dp": 1, "stages": 2, "microbatches": m, "schedule": schedule,
                              "stages_per_rank": 1}  # fmt: skip
    stages = pipe["split"]["stages"]
    assert stages[0]["pieces"][0] == "tok_embeddings" and stages[-1]["pieces"][-1] == "head"
    assert stages[0]["out_shape"] == [SEQ, 192] and stages[-1]["out_shape"] == [SEQ, 256]  # hidden, logits
    # each rank holds only its stage's parameters; they add up to the model
    assert res["sharding"]["param_bytes"] == [s["params"] * FP64 for s in stages]
    assert pipe["split"]["total_params"] == res["model_meta"]["num_parameters"]
    for rank in pipe["ranks"]:
        assert rank["bubble"]["steps"] >= 4 and 0.0 <= rank["bubble"]["median"] < 1.0
    if schedule == "1f1b":
        assert [s["pieces"] for s in stages] == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                                                 ["layers.3", "head"]]  # fmt: skip


@pytest.mark.distributed
def test_phases_add_up_and_the_cost_model_prices_the_transformer_stages(runs):
    """The gpipe run's phases add up to its step time; the pipeline's cost model, on the same config, gives each
    rank the parameters it held, each stage's sends as measured, and a busiest-stage compute share."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.model_trace import model_info
    from stratbench.strategies.costs import MemoryContext
    from stratbench.strategies.parallel.pipeline_parallel import run_spec
    from stratbench.strategies.pipeline import PipelineCost, PipelineStrategy

    res = runs["gpipe"]
    assert_breakdown_adds_up(res, schedule_as_backward=True)
    flops = [s["flops"] for s in res["pipeline"]["split"]["stages"]]
    assert res["pipeline"]["split"]["balance"] == "flops" and max(flops) < 0.6 * sum(flops)
    cfg = from_dict(TrainConfig, dict(res["config"]))
    opts = PipelineStrategy.parse_options(cfg.strategy_options)
    ctx = MemoryContext(cfg, 2, model_info(run_spec(cfg)), opts, "cpu")
    held = [PipelineCost.memory_model(ctx, r) for r in range(2)]
    assert [m.params for m in held] == res["sharding"]["param_bytes"]
    assert all(m.activations > 0 and m.buckets > 0 for m in held)
    # 4 micro-batches of 2 windows of 32 x 192 fp64 hidden states, each way across the one boundary
    sends = {r.kind: r for r in PipelineCost.comm_model(ctx)}["send_recv"]
    assert sends.payload_bytes == 4 * 2 * SEQ * 192 * FP64 and sends.calls == 4
    for rank in res["metrics"]["comm"]["measured_per_rank"]:
        step = rank["per_step"]["send_recv"]
        assert step["calls"] == 4 and step["payload_bytes"] == sends.payload_bytes, step
    share = PipelineCost.compute_scale(ctx)
    assert max(flops) / sum(flops) < share == pytest.approx(max(flops) / sum(flops) / (1 - 1 / 5))


@pytest.mark.distributed
@pytest.mark.equivalence
def test_interleaved_and_pipeline_x_data_parallel(runs):
    """interleaved-1f1b: 4 stages on 2 processes ([0, 2] and [1, 3]); --pp 2 on 4 processes: 2 replicas of a
    2-stage pipeline, each reading half the batch. Both equal `single`."""
    res = train(runs["root"] / "interleaved", *PP, *LM64, "--schedule", "interleaved-1f1b", nproc=2)
    _ok(res)
    assert [r["stages"] for r in res["pipeline"]["ranks"]] == [[0, 2], [1, 3]]
    _matches_single(res, runs["single"])
    res = train(runs["root"] / "pp2dp2", *PP, *LM64, "--pp", "2", "--microbatches", "2", nproc=4)
    _ok(res, world=4)
    assert res["data_parallel_size"] == 2 and res["per_device_batch_size"] == 4
    _matches_single(res, runs["single"])
    p = res["sharding"]["param_bytes"]
    assert p[0] == p[2] and p[1] == p[3] and p[0] + p[1] == res["model_meta"]["num_parameters"] * FP64


@pytest.mark.distributed
@pytest.mark.equivalence
def test_pipeline_checkpoint_resumes_under_pipeline_and_single(runs):
    """The 1f1b run's step-4 checkpoint holds every tensor under the model's own names; a pipeline and `single`
    resumed from it both continue the reference run exactly."""
    from stratbench.checkpoints import checkpoint

    ckpts = runs["root"] / "1f1b" / "checkpoints"
    step4 = next(p for p in ckpts.iterdir() if p.name != "last" and checkpoint.read_meta(p)["progress"]["step"] == 4)  # fmt: skip
    names = _state_names(runs["root"] / "single")
    state = checkpoint.load_file(step4)
    assert list(state["model"]) == names and sorted(state["optimizer"]["state"]) == sorted(names)
    ref = runs["single"]["metrics"]["loss_curve"][4:]
    for name, flags, nproc in (("pp-resumed", [*PP, "--schedule", "gpipe"], 2), ("single-resumed", ["--strategy", "single"], 1)):  # fmt: skip
        res = train(runs["root"] / name, *flags, *LM64, "--resume-from", str(step4), nproc=nproc)
        _ok(res, nproc)
        assert res["resumed_from"]["step"] == 4
        assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_synthetic_tokens_bit_for_bit_with_one_process_on_the_same_micro_batches(precision, tmp_path):
    """fp32 and bf16-mixed on synthetic tokens: a 2-stage 1f1b pipeline over 4 micro-batches computes every
    kernel call of `single --grad-accum 4` on the same inputs (each stage its blocks' part of the same micro-step,
    the loss divided by 4 alike), so the training curves are equal to the last bit (as
    conftest.RTOL_FP32_SAME_MICRO_BATCHES for ddp; the image pipeline's mixed-precision test measured 0.0 too).
    The evaluation is not: the pipeline evaluates in its 4 micro-batches, `single` the whole batch at once, and
    fp32 kernels of other shapes round otherwise (measured 4.2e-8 apart in fp32)."""
    args = [*LM, "--data", "synthetic-tokens", "--synthetic-samples", "64", "--max-steps", "3", "--precision",
            precision]  # fmt: skip
    ref = train(tmp_path / "single", *args, "--strategy", "single", "--grad-accum", "4")
    res = train(tmp_path / "pipeline", *PP, *args, "--schedule", "1f1b", "--microbatches", "4", nproc=2)
    _ok(res)
    assert res["metrics"]["loss_curve"] == ref["metrics"]["loss_curve"]
    assert math.isfinite(res["metrics"]["val_loss"])
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=1e-6)


def test_model_parallel_trains_the_transformer_like_single_with_cpu_stand_ins(runs, tmp_path, monkeypatch):
    """model-parallel's split, placement hooks, loop, evaluation and checkpoint on gpt-tiny in this process, three
    CPU 'devices' standing in for cuda:0-2 (a GPU machine runs the real placement)."""
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.dist import DistEnv
    from stratbench.strategies.model_parallel import ModelParallelStrategy
    from stratbench.training.engine import Trainer

    monkeypatch.setattr(ModelParallelStrategy, "devices", lambda self: [torch.device("cpu")] * 3)
    monkeypatch.setattr(ModelParallelStrategy, "synchronize", lambda self: None)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = [*LM64, "--strategy", "model-parallel", "--split-points", "layers.1,layers.3", "--output", str(tmp_path)]  # fmt: skip
    res = Trainer(resolve_config(parser.parse_args(args)), DistEnv(), ModelParallelStrategy).fit()
    assert res["status"] == "ok", res.get("reason")
    assert [s["pieces"] for s in res["model_parallel"]["split"]["stages"]] == [
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "head"]]  # fmt: skip
    _matches_single(res, runs["single"])
    assert _state_names(tmp_path) == _state_names(runs["root"] / "single")


# ---- in process: the pieces, and bad splits refused in one line before any work ------------------------


def test_the_stages_compose_to_the_transformer():
    """Embedding | blocks | norm + head, run stage after stage (each block computes its own rotary angles),
    equal the model's forward bit for bit (fp64); the stages' parameters add up to the model's."""
    from stratbench.models.split import pieces_of, split_model, stage_module
    from stratbench.models.zoo import build_model

    torch.manual_seed(0)
    model = build_model("gpt-tiny", 256, seq_len=SEQ).double()
    blocks = [f"layers.{i}" for i in range(4)]
    assert [p.name for p in pieces_of(model)] == ["tok_embeddings", *blocks, "head"]
    split = split_model(model, 3, balance="flops", sample_shape=(SEQ,), tokens=True, name="gpt-tiny")
    assert sum(s.params for s in split.stages) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (4, SEQ))
    out = x
    for stage in split.stages:
        out = stage_module(model, stage)(out)
    assert torch.equal(out, model(x))


def _preflight_error(world: int, *args: str) -> str:
    import argparse

    from stratbench.commands.train import add_config_arguments, resolve_config
    from stratbench.core.errors import StratbenchError
    from stratbench.training.engine import preflight

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = resolve_config(parser.parse_args([*LM, "--data", "synthetic-tokens", *PP, *args]))
    with pytest.raises(StratbenchError) as info:
        preflight(cfg, world_size=world)
    return str(info.value)


def test_bad_splits_of_a_transformer_are_refused():
    line = _preflight_error(2, "--schedule", "interleaved-1f1b", "--stages", "8")
    assert "gpt-tiny has 6 pieces (tok_embeddings, layers.0, layers.1, layers.2, layers.3, head)" in line
    assert "at most 6 stages" in line and "\n" not in line
    line = _preflight_error(2, "--split-points", "layers.1.attention")
    assert "'layers.1.attention' is not a piece a stage can begin at" in line and "layers.0, layers.1" in line
    # a head tied to the embedding cannot sit on another stage than the embedding
    line = _preflight_error(2, "--model", "gpt2-small", "--vocab-size", "512")
    assert "share the parameter 'output.weight' (a tied weight)" in line and "gpt-tiny, llama-8b" in line
