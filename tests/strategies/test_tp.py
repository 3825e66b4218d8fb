"""tp (Megatron tensor parallelism on DTensor) on the built-in transformer, 2 gloo processes on CPU: it trains
exactly the model `single` trains (fp64 within conftest.RTOL, gradient clipping on), each rank holds half of the
split attention/MLP matrices, the collectives measured are the Megatron formula's, and its sharded checkpoint
resumes under tp and loads into single; models without a plan and head counts that do not divide are refused
in one line before any work."""

from __future__ import annotations

import pytest

from conftest import (
    COMM,
    RTOL,
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    fails,
    train,
)
from stratbench.models.transformer import SIZES

SEQ, BATCH, STEPS = 32, 8, 6
LM64 = [
    "--model", "gpt-tiny", "--data", "text", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--epochs", "1",
    "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "16", "--progress", "false",
    "--timing-warmup-steps", "1", "--precision", "fp64", "--measure-flops", "false", "--clip-grad-norm", "0.5",
]  # fmt: skip
TP = ["--strategy", "tp"]
CFG = SIZES["gpt-tiny"]
F64 = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp")
    single = train(root / "single", "--strategy", "single", *LM64, "--max-steps", str(STEPS))
    tp = train(root / "tp", *TP, *LM64, "--max-steps", str(STEPS), *COMM, nproc=2)
    return {"root": root, "single": single, "tp": tp}


@pytest.mark.distributed
@pytest.mark.equivalence
def test_tp_trains_the_model_single_trains(runs):
    res, ref = runs["tp"], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["world_size"] == 2 and res["data_parallel_size"] == 1
    assert res["micro_batch_size"] == BATCH, "every rank of the tensor-parallel group takes the whole batch"
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)
    assert res["mesh"] == {"tp": 2}


def _split_and_replicated() -> tuple[int, int]:
    """Elements of gpt-tiny that tp splits (q, k, v, o, gate, up, down of every block) and that it replicates
    (embedding, head, norms)."""
    split = CFG.n_layers * (4 * CFG.dim * CFG.dim + 3 * CFG.dim * CFG.ffn_hidden)
    replicated = 2 * CFG.vocab_size * CFG.dim + (2 * CFG.n_layers + 1) * CFG.dim
    return split, replicated


@pytest.mark.distributed
def test_each_rank_holds_half_the_split_weights_and_the_cost_model_says_so(runs):
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.strategies.base import get_strategy
    from stratbench.strategies.costs import MemoryContext

    split, replicated = _split_and_replicated()
    assert runs["single"]["sharding"]["param_bytes"] == [(split + replicated) * F64]
    per_rank = runs["tp"]["sharding"]["param_bytes"]
    assert per_rank == [(split // 2 + replicated) * F64] * 2, per_rank
    assert runs["tp"]["sharding"]["grad_bytes"] == per_rank
    cfg = from_dict(TrainConfig, dict(runs["tp"]["config"]))
    ctx = MemoryContext(cfg, 2, model_info(ModelSpec.from_config(cfg)), None, "cpu")
    memory = get_strategy("tp").cost.memory_model(ctx, 0)
    assert memory.params == memory.grads == per_rank[0] and memory.optim == 2 * per_rank[0]


@pytest.mark.distributed
def test_collectives_are_megatrons_two_all_reduces_per_block_each_way(runs):
    """Forward: after wo and w2; backward: the attention's and the MLP's input gradient; each (b, s, dim) in
    fp64; plus the one all-reduce of the clipping's per-parameter norms (39 parameters)."""
    comm = assert_comm_matches_formula(runs["tp"])
    activation = BATCH * SEQ * CFG.dim * F64
    per_way = 2 * CFG.n_layers
    measured = comm["measured"]["all_reduce"]
    assert measured["calls"] == 2 * per_way + 1, measured
    assert measured["payload_bytes"] == 2 * per_way * activation + (9 * CFG.n_layers + 3) * F64, measured
    assert set(comm["measured"]) == {"all_reduce"}
    assert_breakdown_adds_up(runs["tp"])


@pytest.mark.distributed
def test_bf16_mixed_sends_the_forward_in_bf16_and_the_backward_in_fp32(runs):
    """Under autocast the row-parallel outputs are bf16 and the input gradients fp32 (the residual stream's)."""
    lm32 = [a if a != "fp64" else "bf16-mixed" for a in LM64]
    res = train(runs["root"] / "tp-bf16", *TP, *lm32, "--max-steps", "3", *COMM, nproc=2)
    comm = assert_comm_matches_formula(res)
    activation = BATCH * SEQ * CFG.dim
    norms = (9 * CFG.n_layers + 3) * 4
    assert comm["measured"]["all_reduce"]["payload_bytes"] == 2 * CFG.n_layers * activation * (2 + 4) + norms


@pytest.mark.distributed
@pytest.mark.equivalence
def test_the_sharded_checkpoint_resumes_under_tp_and_loads_into_single(runs):
    """3 steps under tp, saved as a DCP folder (each rank its slices); tp (with activation checkpointing) and
    single each resume it and go on exactly as the uninterrupted single run does (weights, AdamW moments, schedule
    and data position back)."""
    root, ref = runs["root"], runs["single"]["metrics"]["loss_curve"]
    train(root / "tp3", *TP, *LM64, "--max-steps", "3", nproc=2)
    folder = root / "tp3" / "checkpoints" / "last"
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 2
    resumed = train(root / "tp-resumed", *TP, *LM64, "--max-steps", str(STEPS), "--resume-from", str(folder),
                    "--activation-checkpointing", nproc=2)  # fmt: skip
    # the plan finds the blocks' attention and MLP under the checkpoint wrappers: still split
    assert resumed["sharding"]["param_bytes"] == runs["tp"]["sharding"]["param_bytes"]
    assert resumed["resumed_from"]["step"] == 3
    assert_curves_match(resumed["metrics"]["loss_curve"], ref[3:], RTOL)
    single = train(root / "single-resumed", "--strategy", "single", *LM64, "--max-steps", str(STEPS),
                   "--resume-from", str(folder))  # fmt: skip
    assert single["resumed_from"]["step"] == 3
    assert_curves_match(single["metrics"]["loss_curve"], ref[3:], RTOL)


def test_a_model_without_a_plan_and_heads_that_do_not_divide_are_refused_in_one_line(capsys, tmp_path):
    out = tmp_path / "refused"
    err = fails(capsys, "train", *TP, "--nproc", "2", "--model", "resnet18", "--data", "synthetic",
                "--output", out)  # fmt: skip
    assert "model 'resnet18' has no tensor-parallel plan" in err and "tp_plan()" in err
    err = fails(capsys, "train", *TP, "--nproc", "3", *LM64, "--output", out)
    assert "n_heads 4 and n_kv_heads 4 of gpt-tiny must both divide by 3; --nproc that fit: 1, 2, 4" in err
    assert not out.exists(), "refused before anything is written"


USER_MODEL = """\
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class Mlp(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Linear(3 * 8 * 8, 32)  # left out of the plan: replicated
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.down(torch.relu(self.up(torch.relu(self.stem(x.flatten(1))))))

    def tp_plan(self):
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def build(num_classes):
    return Mlp(num_classes)
"""
USER = [
    "--model", "mlp:build", "--data", "digits", "--image-size", "8", "--batch-size", "32", "--epochs", "1",
    "--max-steps", "6", "--optimizer", "adamw", "--lr", "0.01", "--precision", "fp64", "--progress", "false",
    "--measure-flops", "false", "--timing-warmup-steps", "1",
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.equivalence
def test_a_users_model_brings_its_own_plan(tmp_path):
    """tp_plan(): up column-parallel (its bias split too), down row-parallel (its bias added once, replicated),
    the stem the plan leaves replicated; the same loss curve as single."""
    (tmp_path / "mlp.py").write_text(USER_MODEL)
    single = train(tmp_path / "single", "--strategy", "single", *USER, cwd=tmp_path)
    res = train(tmp_path / "tp", *TP, *USER, nproc=2, cwd=tmp_path)
    ref = single["metrics"]["loss_curve"]
    assert ref[-1] < 0.9 * ref[0], ref
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    stem, up, down = 192 * 32 + 32, 32 * 64 + 64, 64 * 10
    assert res["sharding"]["param_bytes"] == [(stem + up // 2 + down // 2 + 10) * F64] * 2


def test_a_plan_naming_no_module_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    """parallelize_module skips a key that matches nothing: the weights would silently stay whole."""
    (tmp_path / "mlp_typo.py").write_text(USER_MODEL.replace('"down": Rowwise', '"dwn": Rowwise'))
    monkeypatch.chdir(tmp_path)
    user = [a if a != "mlp:build" else "mlp_typo:build" for a in USER]
    err = fails(capsys, "train", *TP, *user, "--nproc", "2", "--output", tmp_path / "out")
    assert "the plan of model 'mlp_typo:build' names no module of it: dwn" in err
    assert not (tmp_path / "out").exists()
