"""fsdp --cp (context parallelism, Ulysses) on the built-in transformer, gloo on CPU: on 2 processes (dp 1 x cp 2)
and on 4 (dp 2 x cp 2) it trains exactly the model `single` trains (fp64, gradient clipping on), the validation
loss included; the all-to-alls measured on each rank equal the formula to the byte (q, k, v and the output of
every attention, forward and backward) and the memory estimate of a rank's chunk holds; padded fine-tuning data
whose length does not divide by C trains the token mean `single` trains; with HSDP (--replicate 2 --cp 2, 4
processes: replicate x shard x cp) the same, to the byte; with tensor parallelism (--tp 2 --cp 2, 4 processes: dp x cp
x tp) the same curve, and FSDP2's, Megatron's and Ulysses' collectives the formulas' to the byte; a world, a model,
heads, a sequence or a combination that does not fit is refused in one line before any work."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import (
    COMM,
    RTOL,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    tiny_lm_fp64,
    train,
    uneven_ft_flags,
)
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.models.transformer import SIZES
from stratbench.strategies.fsdp import FSDPStrategy

SEQ, BATCH, STEPS = 32, 8, 4
LM64 = tiny_lm_fp64(SEQ, BATCH)
CP2 = ["--strategy", "fsdp", "--cp", "2"]
CFG = SIZES["gpt-tiny"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_cp")
    steps = ["--max-steps", str(STEPS)]
    return {
        "single": train(root / "single", "--strategy", "single", *LM64, *steps),
        "cp2": train(root / "cp2", *CP2, *LM64, *steps, *COMM, nproc=2),
        "dp2-cp2": train(root / "dp2-cp2", *CP2, *LM64, *steps, nproc=4),
        "r2-cp2": train(root / "r2-cp2", *CP2, "--replicate", "2", *LM64, *steps, *COMM, nproc=4),
        "tp2-cp2": train(root / "tp2-cp2", *CP2, "--tp", "2", *LM64, *steps, *COMM, nproc=4),
    }


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(("run", "mesh"), [("cp2", {"dp": 1, "cp": 2}), ("dp2-cp2", {"dp": 2, "cp": 2})])
def test_cp_trains_the_model_single_trains(runs, run, mesh):
    res, ref = runs[run], runs["single"]
    assert res["status"] == "ok" and res["mesh"] == mesh and res["data_parallel_size"] == mesh["dp"]
    assert res["micro_batch_size"] == BATCH // mesh["dp"], "the ranks of a cp group take the same samples"
    curve = ref["metrics"]["loss_curve"]
    assert curve[-1] < 0.9 * curve[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)


@pytest.mark.distributed
def test_the_all_to_alls_are_the_formulas_bytes_and_the_estimate_holds(runs):
    """Per step on each rank: 4 all-to-alls per attention forward (q, k, v to heads, the output back), the same
    backward, each the rank's (micro-batch x T/2 x heads x head_dim) tensor in fp64; FSDP2's gathers and
    reduce-scatters over both ranks as plain fsdp's."""
    res = runs["cp2"]
    comm = assert_comm_matches_formula(res, tol=0.0)
    heads = 2 * CFG.n_heads + 2 * CFG.n_kv_heads
    per_layer = BATCH * (SEQ // 2) * CFG.head_dim * heads * 8
    a2a = comm["measured"]["all_to_all"]
    assert a2a["payload_bytes"] == 2 * CFG.n_layers * per_layer, a2a
    assert a2a["calls"] == 2 * 4 * CFG.n_layers, a2a
    assert_estimate_within(res, 0.10)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_with_checkpointing_of_one_block_in_three_the_recomputed_exchanges_are_the_formulas(runs, tmp_path):
    """--activation-checkpointing --ac-mode every:3 (blocks 0 and 3 of 4): the same curve as single, and the
    checkpointed blocks' forward all-to-alls run again in backward, to the byte (full and selective recompute
    every block's, checked by hand: 9,437,184 B per step here)."""
    ac = ["--activation-checkpointing", "--ac-mode", "every:3", "--comm-volume", "true"]
    res = train(tmp_path / "cp2-ac", *CP2, *LM64, "--max-steps", str(STEPS), *ac, nproc=2)
    assert_curves_match(res["metrics"]["loss_curve"], runs["single"]["metrics"]["loss_curve"], RTOL)
    comm = assert_comm_matches_formula(res, tol=0.0)
    per_layer = BATCH * (SEQ // 2) * CFG.head_dim * (2 * CFG.n_heads + 2 * CFG.n_kv_heads) * 8
    assert comm["measured"]["all_to_all"]["payload_bytes"] == (2 * CFG.n_layers + 2) * per_layer


@pytest.mark.distributed
@pytest.mark.equivalence
def test_padded_fine_tuning_data_trains_the_token_mean_single_trains(tmp_path):
    """Responses of very different lengths, padded to each batch's longest: a length that does not divide by 2
    is padded once more (a position after every real one, not scored); the step's token mean and the validation
    means are one process's."""
    flags = uneven_ft_flags(tmp_path, seq_len=47, val_fraction="0.2")
    single = train(tmp_path / "single", *flags)
    cp = train(tmp_path / "cp", *CP2, *flags, nproc=2)
    assert_curves_match(cp["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL)
    assert cp["metrics"]["val_loss"] == pytest.approx(single["metrics"]["val_loss"], rel=RTOL)
    assert cp["metrics"]["val_accuracy"] == pytest.approx(single["metrics"]["val_accuracy"], rel=RTOL)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_hsdp_with_cp_trains_the_model_single_trains_with_the_formulas_bytes(runs):
    """--replicate 2 --cp 2 on 4 processes (replicate 2 x shard 1 x cp 2): FSDP2's 2-D mesh (replicate, shard x cp)
    shards over each cp pair and all-reduces the gradient shards over the 2 replicas; each replica's cp pair
    splits its 4 samples' positions. The curve and validation loss are single's, every collective is the formula's
    to the byte (HSDP's gathers, reduce-scatters and replica all-reduces, Ulysses' all-to-alls at micro-batch 4),
    and the estimate holds."""
    res, ref = runs["r2-cp2"], runs["single"]
    assert res["status"] == "ok" and res["mesh"] == {"replicate": 2, "shard": 1, "cp": 2}
    assert res["data_parallel_size"] == 2 and res["micro_batch_size"] == BATCH // 2
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    comm = assert_comm_matches_formula(res, tol=0.0)
    per_layer = (BATCH // 2) * (SEQ // 2) * CFG.head_dim * (2 * CFG.n_heads + 2 * CFG.n_kv_heads) * 8
    assert comm["measured"]["all_to_all"]["payload_bytes"] == 2 * CFG.n_layers * per_layer
    assert_estimate_within(res, 0.10)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_tp_with_cp_trains_the_model_single_trains_with_the_formulas_bytes(runs):
    """--tp 2 --cp 2 on 4 processes (dp 1 x cp 2 x tp 2, torchtitan's order: each tp pair neighbouring ranks, each
    cp pair 2 apart): the plan gives each rank 2 of the 4 heads, Ulysses exchanges 1 of those over the cp pair on
    a chunk of 16 positions. The curve and validation loss are single's; per step, to the byte: FSDP2 gathers (twice)
    and reduce-scatters (once) each rank's tp slice over dp x cp, Megatron's 4 all-reduces per block are of the
    chunk's (8, 16, 192) activations, Ulysses' all-to-alls move the tp-local heads, clipping all-reduces the 39
    per-parameter norms over dp x cp and over tp; the estimate holds."""
    res, ref = runs["tp2-cp2"], runs["single"]
    assert res["status"] == "ok" and res["mesh"] == {"dp": 1, "cp": 2, "tp": 2}
    assert res["cp"] == {"impl": "ulysses", "size": 2} and res["micro_batch_size"] == BATCH
    assert_curves_match(res["metrics"]["loss_curve"], ref["metrics"]["loss_curve"], RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    measured = assert_comm_matches_formula(res, tol=0.0)["measured"]
    split = CFG.n_layers * (4 * CFG.dim * CFG.dim + 3 * CFG.dim * CFG.ffn_hidden)
    replicated, params = 2 * CFG.vocab_size * CFG.dim + (2 * CFG.n_layers + 1) * CFG.dim, 9 * CFG.n_layers + 3
    tp_slice = (split // 2 + replicated) * 8
    assert measured["all_gather"]["payload_bytes"] == 2 * tp_slice, measured
    assert measured["reduce_scatter"]["payload_bytes"] == tp_slice, measured
    chunk = BATCH * (SEQ // 2) * CFG.dim * 8
    assert measured["all_reduce"]["payload_bytes"] == 4 * CFG.n_layers * chunk + 2 * params * 8, measured
    per_layer = BATCH * (SEQ // 2) * CFG.head_dim * (2 * CFG.n_heads + 2 * CFG.n_kv_heads) // 2 * 8
    assert measured["all_to_all"]["payload_bytes"] == 2 * CFG.n_layers * per_layer, measured
    assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert_estimate_within(res, 0.10)


def _cfg(**opts) -> TrainConfig:
    return TrainConfig(model="gpt-tiny", data="text", seq_len=SEQ, batch_size=BATCH, strategy="fsdp",
                       strategy_options=opts)  # fmt: skip


def test_cp_bad_input_is_one_line_before_any_work():
    cpu = torch.device("cpu")
    for cfg, world, msg in [
        (_cfg(cp=2), 3, "3 processes do not divide into context-parallel groups of 2; --cp that fit: 1, 3"),
        (_cfg(cp=8), 8, "gpt-tiny's n_heads 4 do not divide by 8 .*--cp that fit: 1, 2, 4"),
        (_cfg(cp=2).replace(seq_len=33), 2, "--seq-len 33 does not divide by 2"),
        (_cfg(cp=2).replace(model="tinynet", data="digits"), 2, "'tinynet' is not one"),
        (_cfg(cp=2, tp=2), 6, "--tp 2 --cp 2: 6 processes do not divide into cp x tp groups of 4; --cp that fit with --tp 2: 1, 3"),
        (_cfg(cp=4, tp=2), 8, "--tp 2 --cp 4: gpt-tiny's n_heads 4 do not divide by 2 x 4 .*--cp that fit with --tp 2: 1, 2"),
        (_cfg(cp=2, tp=2, replicate=2), 8, "--tp 2 --cp 2 with --replicate 2 is not supported"),
        (_cfg(cp=2, tp=2, sequence_parallel=True).replace(seq_len=34), 4, "--seq-len 34 does not divide by 2 x --tp 2"),
        (_cfg(cp=2, replicate=2, sharding="full"), 6, "shard groups of 3 ranks .* do not divide into context-parallel groups of 2"),
    ]:
        why = FSDPStrategy.check_supported(cfg, cpu, world)
        assert why is not None and len(why.splitlines()) == 1, why
        assert re.search(msg, why), why
    with pytest.raises(ConfigError, match="3 processes do not divide"):
        FSDPStrategy.data_parallel_size(_cfg(cp=2), 3)
    for opts, msg in [({"cp": 0}, "cp must be a positive integer"), ({"cp": 2, "cp_impl": "ring"}, "CUDA-only"),
                      ({"cp": 2, "tp": 2, "sharding": "none"}, "--tp 2 --cp 2 with --sharding none is not supported"),
                      ({"cp": 2, "cp_impl": "rings"}, "unknown --cp-impl 'rings'; choose one of: ulysses")]:  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            FSDPStrategy.parse_options(opts)


def test_advise_offers_context_parallelism_to_the_built_in_transformers_without_added_micro_steps():
    """advise's cp plans (after the tensor-parallel ones): C = 2, 4, 8 where heads and devices divide, each rank at
    a data-parallel rank's tokens (no gradient accumulation added); none for a model without the built-in
    attention."""
    from stratbench.predicting.advise import applicable, candidates, plan_config

    base = TrainConfig(model="llama-8b", data="text", seq_len=8192, batch_size=16, precision="bf16-mixed")
    plans, _ = applicable(base, candidates(8, 8), 8, "cuda")
    cp = [p for p in plans if dict(p.options).get("cp")]
    assert [dict(p.options)["cp"] for p in cp] == [2, 4, 8] and all(p.activation_checkpointing for p in cp)
    cfg = plan_config(base, cp[0], 8)
    assert cfg.grad_accum == 1 and cfg.strategy_options == {"sharding": "full", "cp": 2}
    plans, _ = applicable(TrainConfig(model="resnet18", batch_size=16), candidates(8, 8), 8, "cuda")
    assert not [p for p in plans if dict(p.options).get("cp")]


def test_with_tp_the_formulas_groups_sit_on_the_meshs_ranks():
    """fsdp --tp 2 --cp 2 on 8 ranks (dp 2 x cp 2 x tp 2): the formula's FSDP2 rows run over dp x cp flattened (4
    ranks, 2 apart), Ulysses' over cp (2 ranks, 2 apart), Megatron's over tp (2 neighbours), as ``mesh_group``
    places them on nodes; dimensions that are not neighbours cannot be flattened."""
    from stratbench.measuring.comm import mesh_group, mesh_span

    cfg = _cfg(cp=2, tp=2)
    opts = FSDPStrategy.parse_options(cfg.strategy_options)
    mesh = FSDPStrategy.cost.predicted_mesh(cfg, 8, opts)
    rows, why = FSDPStrategy.cost.predicted_comm(cfg, 8, opts)
    assert mesh == {"dp": 2, "cp": 2, "tp": 2} and rows, why
    groups = {r.dim: mesh_group(1, mesh, r.dim, r.group_size, 8) for r in rows if r.kind != "all_reduce" or r.dim}
    assert groups == {"dp+cp": [1, 3, 5, 7], "cp": [1, 3], "tp": [0, 1]}, groups
    with pytest.raises(ValueError, match="not neighbours"):
        mesh_span(mesh, "dp+tp")
