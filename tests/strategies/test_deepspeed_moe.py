"""deepspeed --ep 2 (DeepSpeed-MoE: each of 2 gloo processes holds 2 of gpt-moe-tiny's 4 experts per layer as
DeepSpeed's ``Experts``, its top-2 gate dropless, tokens exchanged by its all-to-all) trains what one process
accumulating the ranks' 2 micro-batches trains, routes the same tokens, and saves a checkpoint every method loads;
bad layouts are refused in one line before any work.

DeepSpeed has no fp64 mode, so the check is fp32 (SGD with momentum: Adam's update would hide a wrongly scaled
expert gradient). The first step's loss is equal to the bit (the forward is the project's); later steps differ by
fp32 rounding, as DeepSpeed computes each expert's weight gradient in one product over both ranks' tokens in its
capacity buffer where one process sums the micro-batches': measured 5.4e-8 over 6 steps at ZeRO 0, 1 and 2 (fsdp
--ep 2, proved in fp64, is 3.2e-8 off in fp32), against >= 1e-3 for a real difference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import DEEPSPEED, DEEPSPEED_TIMEOUT, assert_curves_match, ok_curve, train
from stratbench.checkpoints import checkpoint
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.strategies.deepspeed import DeepSpeed

FLAGS = [
    "--model", "gpt-moe-tiny", "--data", "text", "--seq-len", "32", "--batch-size", "8", "--epochs", "1",
    "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--eval-samples", "8", "--progress", "false",
    "--timing-warmup-steps", "1", "--precision", "fp32", "--measure-flops", "false", "--max-steps", "4",
    "--clip-grad-norm", "0.5",
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ep_2_trains_routes_and_saves_what_one_process_does(tmp_path: Path) -> None:
    """ZeRO-2 with clipping (the norm over every rank's experts): the curve within 1e-6 of one process's (the first
    step equal), the same tokens per expert, no drops, the aux loss within 1e-6; the checkpoint's whole weights in
    the project's layout (stacked (4, ...) experts), within 1e-5 of one process's."""
    ref = train(tmp_path / "single", *FLAGS, "--grad-accum", "2")
    res = train(tmp_path / "ds", *FLAGS, *DEEPSPEED, "--ep", "2", nproc=2, timeout=DEEPSPEED_TIMEOUT)
    curve, want = ok_curve(res), ref["metrics"]["loss_curve"]
    assert want[-1] < 0.9 * want[0], "the reference must train, or equal curves prove nothing"
    assert curve[0] == want[0]
    assert_curves_match(curve, want, 1e-6)
    moe, ref_moe = res["moe"], ref["moe"]
    assert moe["tokens_per_expert"] == ref_moe["tokens_per_expert"] and moe["dropped_tokens"] == 0
    assert moe["aux_loss"] == pytest.approx(ref_moe["aux_loss"], rel=1e-6)
    assert res["ep"] == {"size": 2, "experts_per_rank": 2, "layer": "deepspeed.moe.layer.MoE"}
    got = checkpoint.load_any(tmp_path / "ds" / "checkpoints" / "last")["model"]
    whole = checkpoint.load_any(tmp_path / "single" / "checkpoints" / "last")["model"]
    assert sorted(got) == sorted(whole) and got["layers.0.feed_forward.w1"].shape[0] == 4
    for k, v in whole.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_bad_deepspeed_ep_input_is_one_line_before_any_work() -> None:
    def cfg(model: str = "gpt-moe-tiny", zero: int = 2, **kw) -> TrainConfig:
        opts = {"zero_stage": zero, **kw.pop("opts", {})}
        return TrainConfig(model=model, data="text", seq_len=32, batch_size=24, strategy="deepspeed",
                           strategy_options=opts, **kw)  # fmt: skip

    cpu = torch.device("cpu")
    for c, world, says in [
        (cfg(opts={"ep": 3}), 3, "gpt-moe-tiny's 4 experts do not divide by 3; --ep that fit: 1, 2, 4"),
        (cfg("gpt-tiny", opts={"ep": 2}), 2, "model gpt-tiny is dense"),
        (cfg(opts={"ep": 4}), 2, "2 processes do not divide into expert-parallel groups of 4"),
        (
            cfg(zero=3),
            2,
            "Native DeepSpeed MoE is not supported with ZeRO Stage 3.*use --zero-stage 0, 1 or 2",
        ),
        (cfg(zero=0, opts={"ep": 2}, clip_grad_norm=0.5), 2, "stage-0 clipping .* use --zero-stage 1 or 2"),
        (cfg(resume_from="x"), 2, "does not resume; start from its weights with --init-from"),
    ]:
        why = DeepSpeed.check_supported(c, cpu, world)
        assert why is not None and len(why.splitlines()) == 1, why
        assert re.search(says, why), why
    assert DeepSpeed.check_supported(cfg(zero=1, opts={"ep": 2}, clip_grad_norm=0.5), cpu, 2) is None
    # the estimate's and advise's rows, before the world is known
    assert "Native DeepSpeed MoE" in DeepSpeed.moe_refusal(cfg(zero=3))
    assert (
        DeepSpeed.moe_refusal(cfg(opts={"ep": 4})) is None and DeepSpeed.moe_refusal(cfg("gpt-tiny")) is None
    )
    with pytest.raises(ConfigError, match="ep must be a positive integer"):
        DeepSpeed.parse_options({"ep": 0})
