"""3D parallelism, ``pipeline --pp P --tp T``: a 2-stage pipeline of gpt-tiny whose stages are each split over 2
tensor-parallel processes (4 gloo processes, mesh dp 1 x pp 2 x tp 2) trains exactly the model `single` trains
(fp64 within conftest.RTOL, gradient clipping on), under 1f1b and, resumed from its checkpoint, under gpipe;
each rank holds its stage with the split matrices 1/T; the collectives measured are the cost model's (the
stage sends, Megatron's all-reduces per block and micro-batch); its checkpoint resumes under the same layout
and under `single`; with --sequence-parallel and --vocab-parallel (one more 4-process run) the stages send each
other their sequence shards, the blocks all-gather and reduce-scatter in place of Megatron's all-reduces and the
curve is still single's; bad layouts are refused in one line before any work. Data parallel replicas (dp > 1) need
8 processes, too many for this suite: the mesh coordinates, the data shards and the cost model of 2 x 2 x 2
are checked in process instead (the 8-process run itself is measured in docs/parallelism.md)."""

from __future__ import annotations

import pytest

from conftest import (
    COMM,
    RTOL,
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    fails,
    tiny_lm_fp64,
    train,
)
from stratbench.models.transformer import SIZES

SEQ, BATCH, STEPS, M = 32, 8, 4, 4
LM64 = [*tiny_lm_fp64(SEQ, BATCH, eval_samples=8), "--max-steps", str(STEPS)]
PP_TP = ["--strategy", "pipeline", "--pp", "2", "--tp", "2", "--split-points", "layers.2", "--microbatches", str(M)]  # fmt: skip
CFG = SIZES["gpt-tiny"]
F64 = 8
SP = ["--sequence-parallel", "--vocab-parallel"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """`single`, the 4-process 1f1b pipeline x tp (collectives, phases and allocator measured; a checkpoint at
    step 2) and the same with sequence parallelism and the vocabulary-parallel embedding and head."""
    root = tmp_path_factory.mktemp("pipeline-tp")
    single = train(root / "single", "--strategy", "single", *LM64)
    pp_tp = train(root / "1f1b", *PP_TP, *LM64, "--schedule", "1f1b", "--save-every-steps", "2",
                  "--keep-last", "2", *COMM, nproc=4)  # fmt: skip
    sp = train(root / "1f1b-sp", *PP_TP, *SP, *LM64, "--schedule", "1f1b", *COMM, nproc=4)
    return {"root": root, "single": single, "1f1b": pp_tp, "sp": sp}


def _block_elements() -> tuple[int, int]:
    """(split, replicated) elements of one gpt-tiny block: q, k, v, o, gate, up, down; its two norms."""
    return 4 * CFG.dim * CFG.dim + 3 * CFG.dim * CFG.ffn_hidden, 2 * CFG.dim


@pytest.mark.distributed
@pytest.mark.equivalence
def test_pipeline_x_tp_trains_the_model_single_trains(runs):
    res, ref = runs["1f1b"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["world_size"] == 4 and res["data_parallel_size"] == 1
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)
    assert res["mesh"] == {"dp": 1, "pp": 2, "tp": 2}
    coords = [(r["dp_rank"], r["pp_rank"], r["tp_rank"], r["stages"]) for r in res["pipeline"]["ranks"]]
    assert coords == [(0, 0, 0, [0]), (0, 0, 1, [0]), (0, 1, 0, [1]), (0, 1, 1, [1])]


@pytest.mark.distributed
def test_each_rank_holds_its_stage_with_the_split_matrices_halved(runs):
    """Stage 0: the embedding and blocks 0-1; stage 1: blocks 2-3, the final norm and the head. A rank holds its
    blocks' attention/MLP matrices 1/2 and the rest whole, as the cost model says; the estimate is within 10% of
    the allocator's peak."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.model_trace import model_info
    from stratbench.strategies.costs import MemoryContext
    from stratbench.strategies.parallel.pipeline_parallel import run_spec
    from stratbench.strategies.pipeline import PipelineCost, PipelineStrategy

    split, rep = _block_elements()
    embedding = head = CFG.vocab_size * CFG.dim
    stage0 = embedding + 2 * (split // 2 + rep)
    stage1 = 2 * (split // 2 + rep) + CFG.dim + head
    res = runs["1f1b"]
    assert res["sharding"]["param_bytes"] == [stage0 * F64] * 2 + [stage1 * F64] * 2
    assert res["sharding"]["grad_bytes"] == res["sharding"]["param_bytes"]
    cfg = from_dict(TrainConfig, dict(res["config"]))
    ctx = MemoryContext(cfg, 4, model_info(run_spec(cfg)), PipelineStrategy.parse_options(cfg.strategy_options), "cpu")  # fmt: skip
    held = [PipelineCost.memory_model(ctx, r) for r in range(4)]
    assert [m.params for m in held] == res["sharding"]["param_bytes"]
    assert [m.optim for m in held] == [2 * p for p in res["sharding"]["param_bytes"]]
    assert_estimate_within(res)


@pytest.mark.distributed
def test_collectives_are_the_stage_sends_and_megatrons_all_reduces(runs):
    """Per step and rank: 4 micro-batches of a (2, 32, 192) fp64 hidden state sent across the boundary (every
    tp rank sends its own whole copy to its peer), 2 all-reduces per block each way per micro-batch for the
    stage's 2 blocks, the clipping's two fp64 square sums (over tp, over the stages) and the loss broadcast."""
    res = runs["1f1b"]
    comm = assert_comm_matches_formula(res)
    hidden = BATCH // M * SEQ * CFG.dim * F64
    measured = comm["measured"]
    assert measured["send_recv"]["payload_bytes"] == M * hidden and measured["send_recv"]["calls"] == M
    reduces = 2 * 2 * 2 * M  # blocks x (attention, MLP) x (forward, backward) x micro-batches
    assert measured["all_reduce"]["calls"] == reduces + 2, measured
    assert measured["all_reduce"]["payload_bytes"] == reduces * hidden + 2 * F64, measured
    assert set(measured) == {"send_recv", "all_reduce", "broadcast"}
    assert_breakdown_adds_up(res, schedule_as_backward=True)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_the_checkpoint_resumes_under_pipeline_x_tp_and_single(runs):
    """The step-2 checkpoint holds whole tensors under the model's names (each split one gathered over its tp
    ranks); gpipe pipeline x tp and `single` resumed from it both go on as the uninterrupted run."""
    from stratbench.checkpoints import checkpoint

    root, ref = runs["root"], runs["single"]["metrics"]["loss_curve"]
    ckpts = root / "1f1b" / "checkpoints"
    step2 = next(p for p in ckpts.iterdir() if p.name != "last" and checkpoint.read_meta(p)["progress"]["step"] == 2)  # fmt: skip
    whole = checkpoint.load_file(root / "single" / "checkpoints" / "last")["model"]
    state = checkpoint.load_file(step2)["model"]
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in whole.items()}
    for name, flags, nproc in (("gpipe", [*PP_TP, "--schedule", "gpipe"], 4), ("single", ["--strategy", "single"], 1)):  # fmt: skip
        res = train(root / f"{name}-resumed", *flags, *LM64, "--resume-from", str(step2), nproc=nproc)
        assert res["resumed_from"]["step"] == 2
        assert_curves_match(res["metrics"]["loss_curve"], ref[2:], RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_sequence_parallel_stages_train_the_model_single_trains_sending_their_shards(runs):
    """Sequence and vocabulary parallel in each stage: single's curve; each rank holds its blocks' matrices and
    its stage's embedding or head 1/2; per step each tp rank sends its peer only its half of the sequence of each
    micro-batch's (2, 32, 192) hidden state; per block and micro-batch 2 all-gathers and 2 reduce-scatters each
    way replace the 4 all-reduces (the busiest rank, the last stage: plus the head's input gathered and the logits
    gathered for the loss); the norms' partial gradients and the clipping's two square sums are all-reduced once;
    the memory estimate within 10% of the allocator's peak."""
    res, ref = runs["sp"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["mesh"] == {"dp": 1, "pp": 2, "tp": 2}
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)
    split, rep = _block_elements()
    ends = CFG.vocab_size * CFG.dim // 2  # the embedding or the head, split over the vocabulary
    stage0, stage1 = ends + 2 * (split // 2 + rep), 2 * (split // 2 + rep) + CFG.dim + ends
    assert res["sharding"]["param_bytes"] == [stage0 * F64] * 2 + [stage1 * F64] * 2
    comm = assert_comm_matches_formula(res)
    hidden = BATCH // M * SEQ * CFG.dim * F64
    measured = comm["measured"]
    assert measured["send_recv"]["payload_bytes"] == M * hidden // 2 and measured["send_recv"]["calls"] == M
    blocks = 2 * 2 * 2 * M  # blocks x (attention, MLP) x (forward, backward) x micro-batches, per kind
    assert measured["reduce_scatter"]["calls"] == blocks + M, measured  # + the head's input gradient
    logits = BATCH // M * SEQ * CFG.vocab_size * F64
    assert measured["all_gather"]["payload_bytes"] == (blocks + M) * hidden + M * logits, measured
    norms = (2 * 2 + 1) * CFG.dim * F64
    assert measured["all_reduce"]["payload_bytes"] == norms + 2 * F64, measured
    assert set(measured) == {"send_recv", "all_gather", "reduce_scatter", "all_reduce", "broadcast"}
    assert_estimate_within(res)  # -3.9% (the stage's activations scaled by tp_costs.LocalSlice's SP/VP saving)


def test_bad_layouts_are_refused_in_one_line_before_any_work(capsys, tmp_path):
    out = tmp_path / "refused"
    common = ["train", "--strategy", "pipeline", *LM64, "--output", out]
    err = fails(capsys, *common, "--nproc", "4", "--tp", "3")
    assert "world size 4 is not divisible by --tp 3; use a divisor of 4" in err
    err = fails(capsys, *common, "--nproc", "4", "--pp", "3", "--tp", "2")
    assert "world size 4 is not divisible into pipelines of 3 stages x --tp 2 = 6 processes" in err
    err = fails(capsys, *common, "--nproc", "8", "--pp", "1", "--tp", "8")
    assert "pipeline --tp 8: tp over 8 processes: n_heads 4 and n_kv_heads 4 of gpt-tiny" in err
    assert "--tp that fit: 1, 2, 4" in err
    err = fails(capsys, "train", "--strategy", "pipeline", "--nproc", "4", "--tp", "2", "--model", "tinynet",
                "--data", "synthetic", "--output", out)  # fmt: skip
    assert "tensor parallelism inside pipeline stages splits the built-in transformers" in err
    assert "pipeline --tp 2: " in err and "not model 'tinynet'" in err
    err = fails(capsys, *common, "--nproc", "4", "--pp", "2", "--tp", "2", *SP, "--seq-len", "33")
    assert (
        "pipeline --tp 2: tp over 2 processes with --sequence-parallel: --seq-len 33 does not divide by 2"
        in err
    )
    err = fails(capsys, *common, "--nproc", "2", "--vocab-parallel")
    assert (
        "pipeline --vocab-parallel split(s) each stage over --tp processes: give --tp 2 or more (got 1)"
        in err
    )
    assert not out.exists(), "refused before anything is written"


def test_a_2x2x2_mesh_maps_ranks_reads_data_and_costs_as_torch_lays_it_out():
    """8 processes, dp 2 x pp 2 x tp 2, without running them: the coordinates the strategy gives each rank are
    those of torch's own DeviceMesh (one process posing as each rank on a fake process group); each tp pair of a
    replica reads that replica's shard; the replicas all-reduce the stage's tp-local gradients (half its
    split matrices), as the 8-process run measured (docs/parallelism.md)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stratbench.core.config import TrainConfig
    from stratbench.measuring.model_trace import model_info
    from stratbench.strategies.costs import MemoryContext
    from stratbench.strategies.parallel.pipeline_parallel import resolve_layout, run_spec
    from stratbench.strategies.pipeline import PipelineCost, PipelineOptions

    opts = PipelineOptions(pp=2, tp=2, microbatches=2, split_points="layers.2")
    lay = resolve_layout(opts, 8)
    assert lay.mesh == {"dp": 2, "pp": 2, "tp": 2}
    for rank in range(8):
        dist.init_process_group("fake", rank=rank, world_size=8, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", tuple(lay.mesh.values()), mesh_dim_names=tuple(lay.mesh))
            assert lay.coords(rank) == tuple(mesh.get_local_rank(d) for d in lay.mesh), rank
        finally:
            dist.destroy_process_group()
    assert [lay.coords(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # the data shard each rank reads
    cfg = TrainConfig(model="gpt-tiny", data="text", seq_len=SEQ, batch_size=BATCH, precision="fp64",
                      strategy="pipeline", strategy_options={"pp": 2, "tp": 2, "microbatches": 2,
                                                             "split_points": "layers.2"})  # fmt: skip
    ctx = MemoryContext(cfg, 8, model_info(run_spec(cfg)), opts, "cpu")
    split, rep = _block_elements()
    stage1 = 2 * (split // 2 + rep) + CFG.dim + CFG.vocab_size * CFG.dim
    dp_rows = [r for r in PipelineCost.comm_model(ctx) if r.note == "stage gradients over the replicas"]
    assert [(r.payload_bytes, r.group_size) for r in dp_rows] == [(stage1 * F64, 2)]
    hidden = BATCH // 2 // 2 * SEQ * CFG.dim * F64  # a replica's 4 samples in 2 micro-batches
    tp_rows = [r for r in PipelineCost.comm_model(ctx) if r.note.startswith("tp:")]
    assert sum(r.payload_bytes for r in tp_rows) == 2 * 2 * 2 * 2 * hidden
    assert [PipelineCost.memory_model(ctx, r).params for r in (3, 7)] == [stage1 * F64] * 2


@pytest.mark.parametrize("kept", [("tok_embeddings",), ("norm", "output")])
def test_a_stage_without_blocks_holds_every_parameter_replicated(kept):
    """An embedding-only or head-only stage has nothing the plan splits: ``apply_tp`` on what the rank keeps makes
    each parameter a replicated DTensor (the optimizer and the norm take no mix), its bytes the cost model's
    (whole). (The 4-process runs with --split-points layers.0 and head train `single`'s curve:
    docs/parallelism.md.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stratbench.measuring.model_trace import ModelSpec
    from stratbench.models.split import drop_modules
    from stratbench.strategies.parallel import pipeline_tp
    from stratbench.strategies.parallel.tensor_parallel import apply_tp

    spec = ModelSpec("gpt-tiny", CFG.vocab_size, 0, seq_len=SEQ)
    model = spec.build()
    drop_modules(model, set(kept))
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    finally:
        dist.destroy_process_group()
    params = dict(model.named_parameters())
    assert params and all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in params.values())
    held = sum(p.to_local().numel() for p in params.values())
    assert pipeline_tp.stage_numel(spec, list(kept), 2) == (held, held)
