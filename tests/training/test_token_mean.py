"""The masked fine-tuning loss is the token mean of the whole step: padded examples with responses of very
different lengths, split over micro-batches (``--grad-accum``) and ranks, train exactly what one process with the
whole batch in one micro-batch trains (the mean of per-micro-batch means would weight a short response's tokens
more than a long one's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import RTOL, assert_curves_match, train, uneven_ft_flags
from stratbench.data.instruct import IGNORE
from stratbench.training.losses import MaskedTokenCrossEntropy, step_denominator


def _split_loss(logits: torch.Tensor, targets: torch.Tensor, ranks: int, chunks: int) -> torch.Tensor:
    """What the methods compute from ``ranks`` x ``chunks`` micro-batches: each micro-batch's loss divided by the
    chunks, summed per rank, averaged over the ranks (DDP / FSDP / ZeRO's gradient mean)."""
    loss = MaskedTokenCrossEntropy()
    parts = list(zip(logits.chunk(ranks * chunks), targets.chunk(ranks * chunks), strict=True))
    tokens = sum(int((y != IGNORE).sum()) for _, y in parts)
    loss.denominator = step_denominator(tokens, ranks, ranks, chunks)
    per_rank = [sum(loss(x, y) / chunks for x, y in parts[r * chunks : (r + 1) * chunks]) for r in range(ranks)]
    return sum(per_rank) / ranks


@pytest.mark.parametrize(("ranks", "chunks"), [(1, 4), (2, 2), (4, 1)])
def test_split_steps_give_the_whole_steps_token_mean(ranks: int, chunks: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (8, 6))
    targets[:6, 1:] = IGNORE  # six examples score 1 token each, two score 6: uneven micro-batches
    whole = MaskedTokenCrossEntropy()(logits, targets)
    (g_whole,) = torch.autograd.grad(whole, logits)
    split = _split_loss(logits, targets, ranks, chunks)
    (g_split,) = torch.autograd.grad(split, logits)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-15)
    # shared shards (a pipeline's stages) count each shard's tokens once; no token at all is 0, not 0/0
    assert step_denominator(40, world=4, shards=2, chunks=1) == pytest.approx(20 / 2)
    assert step_denominator(0, world=2, shards=2, chunks=2) == pytest.approx(1 / 4)


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ddp_with_accumulation_trains_what_one_micro_batch_trains(tmp_path: Path) -> None:
    """ddp over 2 ranks x --grad-accum 2 equals one process taking the 8 examples at once (fp64, 1e-9); the
    step's token count is one more 8-byte all-reduce, which the communication formula counts."""
    flags = uneven_ft_flags(tmp_path)
    single = train(tmp_path / "single", *flags)
    ddp = train(tmp_path / "ddp", *flags, "--strategy", "ddp", "--grad-accum", "2", "--comm-volume", "true", nproc=2)
    assert_curves_match(ddp["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL)
    check = ddp["metrics"]["comm"]["check"]["all_reduce"]
    assert check["measured_payload_bytes"] == check["predicted_payload_bytes"] == 8 * 1_869_504 + 8
