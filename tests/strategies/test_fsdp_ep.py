"""fsdp --ep 2 (expert parallelism: each of 2 gloo processes holds 2 of gpt-moe-tiny's 4 experts per layer, tokens
exchanged by all-to-all) in fp64 trains what one process accumulating the ranks' 2 micro-batches trains (dropless
top-2 routing, the load-balancing loss in the loss; no gradient clipping, which the dp x ep run checks), its all-to-alls
carry the bytes the routing counts imply, its checkpoint holds every expert once, and bad layouts are refused in one
line before any work. dp 2 x ep 2 (4 processes: experts split over each ep group of 2, replicated over dp), with
gradient clipping and activation checkpointing, trains what one process accumulating the 4 micro-batches trains,
with the same checks."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import RTOL, assert_curves_match, ok_curve, tiny_lm_fp64, train
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.models.transformer import SIZES
from stratbench.strategies.fsdp import FSDPStrategy

BASE = [a if a != "gpt-tiny" else "gpt-moe-tiny" for a in tiny_lm_fp64(seq=32, batch=8, eval_samples=8)]
FLAGS = [*BASE[: BASE.index("--clip-grad-norm")], "--max-steps", "3"]
# --comm-volume records step 3, the last: its micro-batches are the ones tokens_per_expert_last_micro_batch counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ep")
    return {
        "single": train(root / "single", *FLAGS, "--grad-accum", "2"),
        "ep": train(root / "ep", *FLAGS, "--strategy", "fsdp", "--ep", "2", "--comm-volume", "true", nproc=2),
        "root": root,
    }


DP_EP = [*BASE[: BASE.index("--seq-len")], "--seq-len", "16", *BASE[BASE.index("--batch-size") :]]
DP_EP = [*DP_EP[: DP_EP.index("--eval-samples")], *DP_EP[DP_EP.index("--progress") :]]
DP_EP += ["--max-steps", "3", "--eval-samples", "4", "--activation-checkpointing", "true"]


@pytest.fixture(scope="module")
def dp_ep_runs(tmp_path_factory) -> dict:
    """dp 2 x ep 2 on 4 processes (micro-batches of 2 samples of 16 tokens) and single accumulating those 4, both
    with gradient clipping (0.5) and activation checkpointing (every block)."""
    root = tmp_path_factory.mktemp("dp_ep")
    return {
        "single": train(root / "single", *DP_EP, "--grad-accum", "4"),
        "ep": train(root / "ep", *DP_EP, "--strategy", "fsdp", "--ep", "2", "--comm-volume", "true", nproc=4),
        "root": root,
    }


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ep_2_trains_and_routes_what_one_process_does_and_saves_every_expert(runs):
    """Loss curve and validation loss within 1e-9, the same tokens per expert; the checkpoint folder's experts are
    the whole (4, ...) tensors, equal to one process's within 1e-9."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    res, ref = runs["ep"], runs["single"]
    curve = ref["metrics"]["loss_curve"]
    assert curve[-1] < 0.95 * curve[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(ok_curve(res), curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    assert res["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"]
    assert res["ep"] == {"size": 2, "experts_per_rank": 2}
    root = runs["root"]
    dcp_to_torch_save(root / "ep" / "checkpoints" / "last", root / "ep.pt")
    got = torch.load(root / "ep.pt", weights_only=False)["model"]
    want = torch.load(root / "single" / "checkpoints" / "last", weights_only=False)["model"]
    experts = [k for k in want if k.endswith((".w1", ".w2", ".w3"))]
    assert len(experts) == 3 * 4 and all(got[k].shape[0] == 4 for k in experts)
    for k in experts:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=0)


@pytest.mark.distributed
def test_the_all_to_alls_carry_the_bytes_the_routing_counts_imply(runs):
    """Per MoE layer on rank r in the recorded step: forward the 4 int64 counts, the rank's 128 tokens x 2 rows out
    and the rows its experts received back; backward the same two reversed (a call's payload is its input), rows of
    dim fp64 numbers. The rows rank r receives are its experts' counts in the last micro-batch (summed over the
    ranks). FSDP2's gathers and reduce-scatters are the formula's for the dense parts, to the byte."""
    res, tc = runs["ep"], SIZES["gpt-moe-tiny"]
    comm = res["metrics"]["comm"]
    last, row = res["moe"]["tokens_per_expert_last_micro_batch"], tc.dim * 8
    sent = 4 * 32 * tc.moe_top_k
    for rank, measured in enumerate(comm["measured_per_rank"]):
        received = [layer[2 * rank] + layer[2 * rank + 1] for layer in last]
        want = sum((2 * sent + 2 * r) * row + 4 * 8 for r in received)
        a2a = measured["per_step"]["all_to_all"]
        assert (a2a["payload_bytes"], a2a["calls"]) == (want, 5 * 4), (rank, a2a, want)
    assert len({sum(layer[:2]) for layer in last}) > 1 or sum(last[0][:2]) != sent, "routing left balanced"
    for kind in ("all_gather", "reduce_scatter"):
        c = comm["check"][kind]
        assert c["measured_payload_bytes"] == c["predicted_payload_bytes"], comm["check"]
    balanced = 4 * (4 * sent * row + 4 * 8)
    assert comm["check"]["all_to_all"]["predicted_payload_bytes"] == balanced


def test_bad_ep_input_is_one_line_before_any_work():
    def cfg(model: str = "gpt-moe-tiny", **kw) -> TrainConfig:
        return TrainConfig(model=model, data="text", seq_len=32, batch_size=8, strategy="fsdp", **kw)

    cpu = torch.device("cpu")
    for c, world, says in [
        (
            cfg(strategy_options={"ep": 3}),
            3,
            "gpt-moe-tiny's 4 experts do not divide by 3; --ep that fit: 1, 2, 4",
        ),
        (cfg("gpt-tiny", strategy_options={"ep": 2}), 2, "model gpt-tiny is dense"),
        (
            cfg(strategy_options={"ep": 4}),
            6,
            "^fsdp --ep 4: 6 processes do not divide into expert-parallel groups of 4; --ep that fit 6 processes "
            "and 4 experts: 1, 2$",
        ),
        (cfg(strategy_options={"ep": 4}), 2, "2 processes do not divide into expert-parallel groups of 4"),
        (
            cfg(strategy_options={"ep": 2}, activation_checkpointing=True, ac_mode="selective"),
            2,
            "--ep 2 with --ac-mode selective is not supported",
        ),
        (
            cfg(strategy_options={"ep": 2, "checkpoint_format": "full"}),
            2,
            "with --checkpoint-format full is not",
        ),
        (cfg(strategy_options={"ep": 2}, resume_from="x"), 2, "with --resume-from x is not supported"),
    ]:
        why = FSDPStrategy.check_supported(c, cpu, world)
        assert why is not None and len(why.splitlines()) == 1, why
        assert re.search(says, why), why
    for world in (2, 4, 8):  # ep = world, and dp x ep; with clipping and full recomputation
        ok = cfg(strategy_options={"ep": 2}, clip_grad_norm=0.5, activation_checkpointing=True)
        assert FSDPStrategy.check_supported(ok, cpu, world) is None
    with pytest.raises(ConfigError, match="ep must be a positive integer"):
        FSDPStrategy.parse_options({"ep": 0})


def saved_experts(root, name: str) -> dict[str, torch.Tensor]:
    """The expert weights of the run ``name``'s last checkpoint (a DCP folder, or single's one file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = root / name / "checkpoints" / "last"
    if last.is_dir():
        dcp_to_torch_save(last, root / f"{name}.pt")
        last = root / f"{name}.pt"
    model = torch.load(last, weights_only=False)["model"]
    return {k: v for k, v in model.items() if k.endswith((".w1", ".w2", ".w3"))}


@pytest.mark.distributed
@pytest.mark.equivalence
def test_dp_2_x_ep_2_trains_routes_and_exchanges_what_the_routing_counts_imply(dp_ep_runs):
    """dp 2 x ep 2 against single --grad-accum 4 (the same micro-batches), both clipping the gradient norm to 0.5
    and recomputing every block: loss curve and validation loss within 1e-9, the same tokens per expert, the saved
    experts (replicated over dp, one copy in the folder) within 1e-9. The all-to-alls: each rank sends its 32
    tokens x 2 rows; ranks 0 and 2 (ep coordinate 0, experts 0-1) received together, per layer, what the 4 ranks
    routed to experts 0-1 in the last micro-batch (ranks 1 and 3 likewise for 2-3), to the byte, the forward's
    three exchanges run twice (the recomputation). The all-reduces (the expert gradients over dp, the clipping's
    norms) and FSDP2's rows are the formula's to the byte."""
    res, ref, tc = dp_ep_runs["ep"], dp_ep_runs["single"], SIZES["gpt-moe-tiny"]
    curve = ref["metrics"]["loss_curve"]
    assert curve[-1] < 0.97 * curve[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(ok_curve(res), curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    assert res["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"]
    assert (res["ep"], res["mesh"]) == ({"size": 2, "experts_per_rank": 2}, {"dp": 2, "ep": 2})
    got, want = saved_experts(dp_ep_runs["root"], "ep"), saved_experts(dp_ep_runs["root"], "single")
    assert sorted(got) == sorted(want) and len(want) == 3 * 4
    # atol from the tensor's scale: Adam can leave an element near 0, where rtol alone is noise
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=RTOL * want[k].abs().max().item())
    comm, last, row = res["metrics"]["comm"], res["moe"]["tokens_per_expert_last_micro_batch"], tc.dim * 8
    layers, sent = len(last), 2 * 16 * tc.moe_top_k
    a2a = [m["per_step"]["all_to_all"] for m in comm["measured_per_rank"]]
    assert {a["calls"] for a in a2a} == {8 * layers}, a2a
    for j in range(2):  # the ranks of ep coordinate j: j and j + 2
        received = sum(layer[2 * j] + layer[2 * j + 1] for layer in last)
        want_bytes = 2 * layers * (3 * sent * row + 2 * 4 * 8) + 3 * received * row
        assert a2a[j]["payload_bytes"] + a2a[j + 2]["payload_bytes"] == want_bytes, (j, a2a, want_bytes)
    assert len({a["payload_bytes"] for a in a2a}) > 1, "routing left balanced: the check could not tell"
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        c = comm["check"][kind]
        assert c["measured_payload_bytes"] == c["predicted_payload_bytes"], (kind, comm["check"])
