"""fsdp --tp: 2D parallelism (FSDP2 over the mesh's dp dimension, Megatron tensor parallelism over tp) on the
built-in transformer, 4 gloo processes on CPU as a (dp 2, tp 2) mesh: it trains exactly the model `single`
trains (fp64, gradient clipping on), each rank holds 1/4 of the split matrices and 1/2 of the replicated rest
as the cost model says, the collectives measured per kind are FSDP's over dp plus Megatron's over tp, and its
sharded checkpoint resumes under fsdp x tp, under a (dp 1, tp 2) mesh and under single; with --sequence-parallel
and --vocab-parallel (one more 4-process run) it trains the same curve, each rank holds 1/4 of the embedding and
head too, and the measured all-gathers and reduce-scatters take the place of Megatron's all-reduces as the cost
model says; a world, a model, a degree or a sequence that does not fit is refused in one line before any work."""

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

SEQ, BATCH, STEPS, SAVED = 32, 8, 4, 2
LM64 = tiny_lm_fp64(SEQ, BATCH)
FSDP_TP = ["--strategy", "fsdp", "--tp", "2"]
SP = ["--sequence-parallel", "--vocab-parallel"]
CFG = SIZES["gpt-tiny"]
F64 = 8
PARAMS = 9 * CFG.n_layers + 3
"""gpt-tiny's parameter tensors: per block 7 matrices and 2 norms, then the embedding, the final norm, the head."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """single, fsdp --tp 2 on 4 processes saving its sharded checkpoint after step 2 (kept beside the last), and
    the same with sequence parallelism and the vocabulary-parallel embedding and head (loss_parallel)."""
    root = tmp_path_factory.mktemp("fsdp_tp")
    steps = ["--max-steps", str(STEPS)]
    single = train(root / "single", "--strategy", "single", *LM64, *steps)
    save = ["--save-every-steps", str(SAVED), "--keep-last", "2"]
    two_d = train(root / "fsdp-tp", *FSDP_TP, *LM64, *steps, *COMM, *save, nproc=4)
    sp = train(root / "fsdp-tp-sp", *FSDP_TP, *SP, *LM64, *steps, *COMM, nproc=4)
    return {"root": root, "single": single, "fsdp-tp": two_d, "fsdp-tp-sp": sp}


def _split_and_replicated() -> tuple[int, int]:
    """Elements of gpt-tiny that tp splits (q, k, v, o, gate, up, down of every block) and that it replicates
    (embedding, head, norms)."""
    split = CFG.n_layers * (4 * CFG.dim * CFG.dim + 3 * CFG.dim * CFG.ffn_hidden)
    replicated = 2 * CFG.vocab_size * CFG.dim + (2 * CFG.n_layers + 1) * CFG.dim
    return split, replicated


@pytest.mark.distributed
@pytest.mark.equivalence
def test_fsdp_tp_trains_the_model_single_trains(runs, capsys):
    res, ref = runs["fsdp-tp"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["world_size"] == 4 and res["data_parallel_size"] == 2
    assert res["micro_batch_size"] == BATCH // 2, "each tp group takes one dp replica's half of the batch"
    assert res["mesh"] == {"dp": 2, "tp": 2}
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)


@pytest.mark.distributed
def test_each_rank_holds_a_quarter_of_the_split_weights_and_half_the_rest(runs):
    """Split over tp (1/2), then sharded over dp (1/2): 1/4 of the split matrices; the replicated embedding,
    head and norms sharded over dp only: 1/2. The cost model gives the same bytes on every rank."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.predicting.estimate import model_state_bytes

    split, replicated = _split_and_replicated()
    per_rank = runs["fsdp-tp"]["sharding"]["param_bytes"]
    assert per_rank == [(split // 4 + replicated // 2) * F64] * 4, per_rank
    assert runs["fsdp-tp"]["sharding"]["grad_bytes"] == per_rank
    model = model_state_bytes(from_dict(TrainConfig, dict(runs["fsdp-tp"]["config"])), 4)
    assert [m["param_bytes"] for m in model] == [m["grad_bytes"] for m in model] == per_rank
    # the whole estimate: a rank's slice of the model traced at its replica's batch (tp_costs.LocalSlice). On this tiny
    # fp64 case (8 x 32 tokens): 30.4 MiB estimated, 32.1 MiB measured (-5.3%) at gc thresholds 500, 700, 900 and
    # with gc off in the step. It was 33.8-38.4 MiB, with the collector's timing, while a reference cycle kept
    # each rank's tp slices alive after FSDP2 replaced them (test_tp's no-reference-cycle test). On fp32 at 16 x
    # 128 tokens +1.7% (docs/parallelism.md). Before LocalSlice: -13%.
    assert_estimate_within(runs["fsdp-tp"])
    adam = runs["fsdp-tp"]["sharding"]["optimizer_state_bytes"]
    assert [m["optimizer_state_bytes"] for m in model] == adam == [2 * per_rank[0] + 4 * PARAMS] * 4


@pytest.mark.distributed
def test_collectives_are_fsdps_over_dp_and_megatrons_over_tp(runs):
    """Over dp: every unit's tp slices all-gathered for forward and again for backward, their gradients
    reduce-scattered; over tp: 2 all-reduces per block forward and 2 backward of the replica's (4, 32, 192)
    activations; clipping: the 39 per-parameter norms all-reduced over dp, then over tp."""
    res = runs["fsdp-tp"]
    comm = assert_comm_matches_formula(res)
    split, replicated = _split_and_replicated()
    tp_slices = (split // 2 + replicated) * F64  # what one dp group gathers: the whole model's tp half
    measured = comm["measured"]
    assert measured["all_gather"]["payload_bytes"] == 2 * tp_slices, measured
    assert measured["reduce_scatter"]["payload_bytes"] == tp_slices, measured
    activation = BATCH // 2 * SEQ * CFG.dim * F64
    megatron = 4 * CFG.n_layers
    assert measured["all_reduce"]["calls"] == megatron + 2, measured
    assert measured["all_reduce"]["payload_bytes"] == megatron * activation + 2 * PARAMS * F64, measured
    assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert_breakdown_adds_up(res)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_the_sharded_checkpoint_resumes_under_fsdp_tp_another_mesh_and_single(runs):
    """The DCP folder written after step 2 (each rank its dp shard of its tp slice) resumes under fsdp x tp on
    the same (2, 2) mesh (with grad-op sharding and activation checkpointing, which must not change a number),
    on a (dp 1, tp 2) mesh of 2 processes, and under single: each goes on exactly as the uninterrupted single
    run (weights, AdamW moments, schedule and data position back)."""
    root, ref = runs["root"], runs["single"]["metrics"]["loss_curve"]
    folder = root / "fsdp-tp" / "checkpoints" / f"step-{SAVED:08d}"
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 4
    resume = [*LM64, "--max-steps", str(STEPS), "--resume-from", str(folder)]
    same = train(root / "resumed-2x2", *FSDP_TP, *resume, "--sharding", "grad-op", "--activation-checkpointing",
                 nproc=4)  # fmt: skip
    assert same["sharding"]["param_bytes"] == runs["fsdp-tp"]["sharding"]["param_bytes"]
    other = train(root / "resumed-1x2", *FSDP_TP, *resume, nproc=2)
    assert other["mesh"] == {"dp": 1, "tp": 2} and other["micro_batch_size"] == BATCH
    single = train(root / "resumed-single", "--strategy", "single", *resume)
    for res in (same, other, single):
        assert res["resumed_from"]["step"] == SAVED
        assert_curves_match(res["metrics"]["loss_curve"], ref[SAVED:], RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_sequence_and_vocabulary_parallel_train_the_model_single_trains(runs):
    res, ref = runs["fsdp-tp-sp"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["mesh"] == {"dp": 2, "tp": 2}
    assert res["tp"] == {"sequence_parallel": True, "vocab_parallel": True, "loss_parallel": True}
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)


@pytest.mark.distributed
def test_sequence_parallel_holds_and_sends_what_the_cost_model_says(runs):
    """Each rank holds 1/4 of the split matrices, embedding and head (1/T over tp, then 1/2 over dp) and 1/2 of
    the norms. Over tp, per block and step 2 all-gathers and 2 reduce-scatters of the replica's (4, 32, 192)
    activations forward and as many backward in place of the 4 all-reduces (Korthikanti et al.); the ends: the
    head's input gathered and the embedding's output gradient gathered, the embedding's partial lookups and the
    head's input gradient reduce-scattered; all-reduces: FSDP2 sums each of the 9 norms' partial gradients,
    loss_parallel 3 numbers per token, the clipping norms over dp and tp."""
    res = runs["fsdp-tp-sp"]
    split, replicated = _split_and_replicated()
    ends = 2 * CFG.vocab_size * CFG.dim
    norms = replicated - ends
    per_rank = res["sharding"]["param_bytes"]
    assert per_rank == [((split + ends) // 4 + norms // 2) * F64] * 4, per_rank
    comm = assert_comm_matches_formula(res)
    measured = comm["measured"]
    tp_slices = ((split + ends) // 2 + norms) * F64  # what FSDP gathers over dp
    activation = BATCH // 2 * SEQ * CFG.dim * F64
    blocks = 4 * CFG.n_layers  # per kind: 2 per block forward, 2 backward
    assert measured["all_gather"]["payload_bytes"] == 2 * tp_slices + (blocks + 2) * activation, measured
    assert measured["reduce_scatter"]["payload_bytes"] == tp_slices + (blocks + 2) * activation, measured
    tokens = BATCH // 2 * SEQ
    assert measured["all_reduce"]["payload_bytes"] == (norms + 3 * tokens + 2 * PARAMS) * F64, measured
    assert measured["all_reduce"]["calls"] == 2 * CFG.n_layers + 1 + 3 + 2, measured
    assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce"}
    # a rank's slice traced with its norms on 1/T of the positions and 1/T of the logits (tp_costs.LocalSlice): -6.9%
    assert_estimate_within(res)


def test_worlds_models_and_degrees_that_do_not_fit_are_refused_in_one_line(capsys, tmp_path):
    out = tmp_path / "refused"
    err = fails(capsys, "train", *FSDP_TP[:2], "--tp", "3", "--nproc", "4", *LM64, "--output", out)
    assert "fsdp --tp 3: 4 processes do not divide by 3; --tp that fit: 1, 2, 4" in err
    err = fails(capsys, "train", *FSDP_TP[:2], "--tp", "3", "--nproc", "3", *LM64, "--output", out)
    assert (
        "fsdp --tp 3: tp over 3 processes: n_heads 4 and n_kv_heads 4 of gpt-tiny must both divide by 3"
        in err
    )
    assert "--tp that fit: 1, 2, 4" in err
    err = fails(capsys, "train", *FSDP_TP, "--nproc", "4", "--model", "resnet18", "--data", "synthetic",
                "--output", out)  # fmt: skip
    assert "fsdp --tp 2: tp: model 'resnet18' has no tensor-parallel plan" in err and "tp_plan()" in err
    err = fails(capsys, "train", *FSDP_TP[:2], "--tp", "0", "--nproc", "2", *LM64, "--output", out)
    assert "tp must be a positive integer (1: no tensor parallelism), got 0" in err
    err = fails(capsys, "train", *FSDP_TP, *SP, "--nproc", "4", *LM64, "--seq-len", "31", "--output", out)
    assert (
        "fsdp --tp 2: tp over 2 processes with --sequence-parallel: --seq-len 31 does not divide by 2" in err
    )
    assert "give a multiple of 2 (e.g. 32)" in err
    err = fails(capsys, "train", *FSDP_TP[:2], "--sequence-parallel", "--nproc", "4", *LM64, "--output", out)
    assert (
        "fsdp --sequence-parallel split(s) within a tensor-parallel group: give --tp 2 or more (got 1)" in err
    )
    assert not out.exists(), "refused before anything is written"
