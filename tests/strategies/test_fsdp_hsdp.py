"""fsdp --replicate (HSDP: FSDP2 on a (replicate, shard) mesh), 4 gloo processes on CPU as (replicate 2, shard 2):
it trains exactly the model `single` trains (fp64), each rank holds half the parameters, gradients and optimizer
state (1/shard, not 1/world) as the cost model says, the collectives measured per kind equal the cost model's rows
to the byte (gathers and reduce-scatters over the shard group, the gradient shards all-reduced over the replicas),
the projection prices the replicas' all-reduce on the inter-node link when a shard group fills a node, and its
sharded checkpoint resumes under plain fsdp and under single. (With --tp 2 on 4 processes the mesh would be
(replicate 2, shard 1, tp 2), which is --sharding none --tp 2 and is refused as such; the 3-D (2, 2, 2) needs 8
processes, checked by hand: docs/parallelism.md.) A world, a degree, a node or a mode that does not fit is refused
in one line before any work."""

from __future__ import annotations

import pytest

from conftest import (
    COMM,
    EQUIV,
    RTOL,
    assert_comm_matches_formula,
    assert_curves_match,
    assert_estimate_within,
    fails,
    train,
)

HSDP = ["--strategy", "fsdp", "--replicate", "2"]
SAVED = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run) -> dict:
    """The shared single fp64 run of EQUIV and fsdp --replicate 2 on 4 processes, saving its sharded checkpoint
    after step 10 (kept beside the last)."""
    root = tmp_path_factory.mktemp("hsdp")
    save = ["--save-every-steps", str(SAVED), "--keep-last", "2"]
    hsdp = train(root / "hsdp", *HSDP, *EQUIV, *COMM, *save, nproc=4)
    return {"root": root, "single": reference_run, "hsdp": hsdp}


@pytest.mark.distributed
@pytest.mark.equivalence
def test_hsdp_trains_the_model_single_trains(runs):
    res, ref = runs["hsdp"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["world_size"] == 4 and res["data_parallel_size"] == 4
    assert res["micro_batch_size"] == 8, "every rank reads its own quarter of the batch"
    assert res["mesh"] == {"replicate": 2, "shard": 2}
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)


@pytest.mark.distributed
def test_each_rank_holds_one_shard_groups_share(runs):
    """Parameters, gradients and SGD momentum are 1/2 of single's on every rank (the shard group's size, not
    the world's 4), and the cost model gives the same bytes; its whole estimate holds to the measured peak."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.predicting.estimate import model_state_bytes

    single, hsdp = runs["single"]["sharding"], runs["hsdp"]["sharding"]
    phi = single["param_bytes"][0]  # fp64; dim 0 of every tinynet tensor is even: the halves are exact
    assert hsdp["param_bytes"] == hsdp["grad_bytes"] == [phi // 2] * 4, hsdp
    assert hsdp["optimizer_state_bytes"] == [single["optimizer_state_bytes"][0] // 2] * 4, hsdp
    model = model_state_bytes(from_dict(TrainConfig, dict(runs["hsdp"]["config"])), 4)
    assert [m["param_bytes"] for m in model] == hsdp["param_bytes"]
    assert [m["optimizer_state_bytes"] for m in model] == hsdp["optimizer_state_bytes"]
    assert_estimate_within(runs["hsdp"])  # the whole estimate against the allocator's peak (--measure-alloc)


@pytest.mark.distributed
def test_collectives_equal_the_formula_per_kind_and_group(runs):
    """Over each shard group of 2: every unit gathered for forward and again for backward (2Φ in all), its
    gradients reduce-scattered (Φ); over the 2 replicas: each rank's gradient shard all-reduced (Φ/2). Each kind
    runs over one group only, so per kind is per group here."""
    comm = assert_comm_matches_formula(runs["hsdp"], tol=0.0)
    phi = runs["single"]["sharding"]["param_bytes"][0]
    measured = {k: v["payload_bytes"] for k, v in comm["measured"].items()}
    assert measured == {"all_gather": 2 * phi, "reduce_scatter": phi, "all_reduce": phi // 2}, measured
    groups = {(r["kind"], r["dim"], r["group_size"]) for r in comm["predicted"]}
    assert groups == {("all_gather", "shard", 2), ("reduce_scatter", "shard", 2), ("all_reduce", "replicate", 2)}


def test_the_projection_prices_the_replicas_across_nodes_and_the_shards_inside_one():
    """On 2 nodes of 8 with --replicate 2 the mesh is (replicate 2, shard 8): a shard group is one node, its
    gathers stay on the node's link; the all-reduce's 2 ranks are a node apart and cross the NICs."""
    from stratbench.core.config import TrainConfig
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.predicting.projection import ranks_per_node
    from stratbench.strategies.base import get_strategy
    from stratbench.strategies.costs import MemoryContext

    cfg = TrainConfig(model="gpt-tiny", data="text", batch_size=16, strategy="fsdp",
                      strategy_options={"replicate": 2})  # fmt: skip
    cls = get_strategy("fsdp")
    ctx = MemoryContext(cfg, 16, model_info(ModelSpec.from_config(cfg)), cls.parse_options({"replicate": 2}))
    mesh = cls.cost.mesh_dims(ctx)
    assert mesh == {"replicate": 2, "shard": 8}
    placed = {(r.kind, r.dim): ranks_per_node(r, mesh, 8) for r in cls.cost.comm_model(ctx)}
    assert placed == {("all_gather", "shard"): 8, ("reduce_scatter", "shard"): 8, ("all_reduce", "replicate"): 1}


@pytest.mark.distributed
@pytest.mark.equivalence
def test_the_sharded_checkpoint_resumes_under_plain_fsdp_and_single(runs):
    """The DCP folder written after step 10 (each rank its shard; the replicas hold equal ones) resumes under
    plain fsdp on 2 processes and under single, each going on exactly as the uninterrupted single run."""
    root, ref = runs["root"], runs["single"]["metrics"]["loss_curve"]
    folder = root / "hsdp" / "checkpoints" / f"step-{SAVED:08d}"
    assert (folder / ".metadata").is_file()
    resume = [*EQUIV, "--resume-from", str(folder)]
    plain = train(root / "resumed-fsdp", "--strategy", "fsdp", *resume, nproc=2)
    single = train(root / "resumed-single", "--strategy", "single", *resume)
    for res in (plain, single):
        assert res["resumed_from"]["step"] == SAVED
        assert_curves_match(res["metrics"]["loss_curve"], ref[SAVED:], RTOL)


def test_replicas_that_do_not_fit_are_refused_in_one_line(capsys, tmp_path):
    out = tmp_path / "refused"
    lm = ["--model", "gpt-tiny", "--data", "text", "--batch-size", "8", "--max-steps", "2", "--output", out]
    err = fails(capsys, "train", *HSDP[:2], "--replicate", "0", "--nproc", "4", *lm)
    assert "replicate must be a positive integer (1: plain FSDP, no HSDP), got 0" in err
    err = fails(capsys, "train", *HSDP[:2], "--replicate", "3", "--nproc", "4", *lm)
    assert "fsdp --replicate 3: 4 processes do not divide by 3; --replicate that fit: 1, 2" in err
    err = fails(capsys, "train", *HSDP[:2], "--replicate", "4", "--nproc", "4", *lm)
    assert "leave shard groups of 1 rank (that is --sharding none); --replicate that fit: 1, 2" in err
    err = fails(capsys, "train", *HSDP[:2], "--replicate", "3", "--tp", "2", "--nproc", "8", *lm)
    assert "fsdp --replicate 3: 4 data-parallel ranks (8 processes / --tp 2) do not divide by 3" in err
    err = fails(capsys, "train", *HSDP, "--sharding", "none", "--nproc", "4", *lm)
    assert "fsdp --replicate 2 with --sharding none: none already replicates the whole model" in err
    assert "for HSDP give --sharding full or grad-op with --replicate" in err
    err = fails(capsys, "train", *HSDP, "--nproc", "2", "--nnodes", "4", *lm)
    assert (
        "fsdp --replicate 2: a shard group of 4 ranks (8 processes / 2) does not fit nodes of 2 processes; "
        "--replicate 4 keeps it in a node, or give --shard-across-nodes" in err
    )
    err = fails(capsys, "train", "--strategy", "ddp", "--replicate", "2", "--nproc", "4", *lm)
    assert "--replicate does not apply to strategy 'ddp' (an option of fsdp); its options:" in err
    assert not out.exists(), "refused before anything is written"
