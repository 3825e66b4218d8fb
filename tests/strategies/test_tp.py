"""tp (Megatron tensor parallelism on DTensor) on the built-in transformer, 2 gloo processes on CPU: it trains
exactly the model `single` trains (fp64 within conftest.RTOL, gradient clipping on) with the vocabulary-parallel
embedding/head and loss (the default), with sequence parallelism, and with both; each rank holds half of the
split attention/MLP matrices (and of the embedding and head where vocabulary-parallel), the collectives measured
are the formula's to the byte, and its sharded checkpoint resumes under tp (another layout) and loads into single;
models without a plan and shapes that do not divide are refused in one line before any work."""

from __future__ import annotations

import pytest

from conftest import (
    COMM,
    RTOL,
    assert_breakdown_adds_up,
    assert_comm_matches_formula,
    assert_curves_match,
    fails,
    tiny_lm_fp64,
    train,
)
from stratbench.models.transformer import SIZES

SEQ, BATCH, STEPS = 32, 8, 6
LM64 = tiny_lm_fp64(SEQ, BATCH)
TP = ["--strategy", "tp"]
SP_WHOLE_VOCAB = ["--sequence-parallel", "--vocab-parallel", "false"]
CFG = SIZES["gpt-tiny"]
F64 = 8
ACT = BATCH * SEQ * CFG.dim
"""Elements of one (batch, seq, dim) activation."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp")
    single = train(root / "single", "--strategy", "single", *LM64, "--max-steps", str(STEPS))
    tp = train(root / "tp", *TP, *LM64, "--max-steps", str(STEPS), *COMM, nproc=2)
    sp = train(root / "tp-sp", *TP, *SP_WHOLE_VOCAB, *LM64, "--max-steps", str(STEPS), *COMM, nproc=2)
    return {"root": root, "single": single, "tp": tp, "tp-sp": sp}


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("run", ["tp", "tp-sp"])
def test_tp_trains_the_model_single_trains(runs, run):
    """tp: the embedding and head split over the vocabulary, the loss under loss_parallel (the default); tp-sp:
    sequence-parallel, embedding and head whole. The third pairing, both on, is the resumed run's below."""
    res, ref = runs[run], runs["single"]["metrics"]["loss_curve"]
    assert res["status"] == "ok" and res["world_size"] == 2 and res["data_parallel_size"] == 1
    assert res["micro_batch_size"] == BATCH, "every rank of the tensor-parallel group takes the whole batch"
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
    # evaluation reads the logits gathered whole (vocabulary-parallel) or from the gathered sequence
    assert res["metrics"]["val_loss"] == pytest.approx(runs["single"]["metrics"]["val_loss"], rel=RTOL)
    assert res["metrics"]["val_accuracy"] == runs["single"]["metrics"]["val_accuracy"]
    assert res["mesh"] == {"tp": 2}
    sp = run == "tp-sp"
    assert res["tp"] == {"sequence_parallel": sp, "vocab_parallel": not sp, "loss_parallel": not sp}


def _split_and_replicated(vocab_parallel: bool) -> tuple[int, int]:
    """Elements of gpt-tiny that tp splits (q, k, v, o, gate, up, down of every block; embedding and head where
    vocabulary-parallel) and that it replicates (the norms; embedding and head otherwise)."""
    ends = 2 * CFG.vocab_size * CFG.dim
    split = CFG.n_layers * (4 * CFG.dim * CFG.dim + 3 * CFG.dim * CFG.ffn_hidden) + ends * vocab_parallel
    replicated = (2 * CFG.n_layers + 1) * CFG.dim + ends * (not vocab_parallel)
    return split, replicated


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["tp", "tp-sp"])
def test_each_rank_holds_half_the_split_weights_and_the_cost_model_says_so(runs, run):
    """Vocabulary-parallel (tp): half the embedding and half the head per rank too; tp-sp keeps them whole."""
    from stratbench.core.config import TrainConfig, from_dict
    from stratbench.measuring.model_trace import ModelSpec, model_info
    from stratbench.strategies.base import get_strategy
    from stratbench.strategies.costs import MemoryContext

    split, replicated = _split_and_replicated(vocab_parallel=run == "tp")
    assert runs["single"]["sharding"]["param_bytes"] == [(split + replicated) * F64]
    per_rank = runs[run]["sharding"]["param_bytes"]
    assert per_rank == [(split // 2 + replicated) * F64] * 2, per_rank
    assert runs[run]["sharding"]["grad_bytes"] == per_rank
    cfg = from_dict(TrainConfig, dict(runs[run]["config"]))
    strategy = get_strategy("tp")
    ctx = MemoryContext(
        cfg, 2, model_info(ModelSpec.from_config(cfg)), strategy.parse_options(cfg.strategy_options), "cpu"
    )
    memory = strategy.cost.memory_model(ctx, 0)
    assert memory.params == memory.grads == per_rank[0] and memory.optim == 2 * per_rank[0]


@pytest.mark.distributed
def test_collectives_are_megatrons_two_all_reduces_per_block_each_way(runs):
    """Forward: after wo and w2, and the embedding's partial lookups; backward: the attention's, the MLP's and
    the head's input gradient; each (b, s, dim) in fp64; loss_parallel's 3 all-reduces of one number per token;
    the one all-reduce of the clipping's per-parameter norms (39 parameters)."""
    comm = assert_comm_matches_formula(runs["tp"])
    per_way = 2 * CFG.n_layers + 1
    measured = comm["measured"]["all_reduce"]
    assert measured["calls"] == 2 * per_way + 3 + 1, measured
    loss, norms = 3 * BATCH * SEQ, 9 * CFG.n_layers + 3
    assert measured["payload_bytes"] == (2 * per_way * ACT + loss + norms) * F64, measured
    assert set(comm["measured"]) == {"all_reduce"}
    assert_breakdown_adds_up(runs["tp"])


@pytest.mark.distributed
def test_sequence_parallel_turns_each_all_reduce_into_an_all_gather_and_a_reduce_scatter(runs):
    """Per block each way 2 all-gathers and 2 reduce-scatters of (b, s, dim) in place of the 2 all-reduces, plus
    the whole head's input gathered forward and the whole embedding's output gradient gathered backward; the
    norms' weight gradients (partial sums over the sequence shards) all-reduced once, beside the clipping's."""
    comm = assert_comm_matches_formula(runs["tp-sp"])
    measured, blocks = comm["measured"], 2 * CFG.n_layers
    assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce"}, measured
    assert measured["all_gather"]["calls"] == 2 * (blocks + 1)
    assert measured["all_gather"]["payload_bytes"] == 2 * (blocks + 1) * ACT * F64
    assert measured["reduce_scatter"]["calls"] == 2 * blocks
    assert measured["reduce_scatter"]["payload_bytes"] == 2 * blocks * ACT * F64
    assert measured["all_reduce"]["calls"] == 2
    norms = (2 * CFG.n_layers + 1) * CFG.dim + 9 * CFG.n_layers + 3
    assert measured["all_reduce"]["payload_bytes"] == norms * F64
    assert_breakdown_adds_up(runs["tp-sp"])


@pytest.mark.distributed
def test_bf16_mixed_sequence_and_vocabulary_parallel_send_in_the_dtypes_the_formula_says(runs):
    """Under autocast the row-parallel outputs (reduce-scattered forward) and their gradients (all-gathered
    backward) are bf16; the norms' outputs (all-gathered forward), the residual stream's gradients
    (reduce-scattered backward), the embedding's lookups and the loss's all-reduces are fp32."""
    lm32 = [a if a != "fp64" else "bf16-mixed" for a in LM64]
    res = train(
        runs["root"] / "tp-bf16", *TP, "--sequence-parallel", *lm32, "--max-steps", "3", *COMM, nproc=2
    )
    comm = assert_comm_matches_formula(res)
    blocks, measured = 2 * CFG.n_layers, comm["measured"]
    each_way = blocks * ACT * (2 + 4) + 2 * ACT * 4  # + the embedding and the head, fp32
    assert measured["all_gather"]["payload_bytes"] == measured["reduce_scatter"]["payload_bytes"] == each_way
    norms = (2 * CFG.n_layers + 1) * CFG.dim + 9 * CFG.n_layers + 3
    assert measured["all_reduce"]["payload_bytes"] == (3 * BATCH * SEQ + norms) * 4


@pytest.mark.distributed
@pytest.mark.equivalence
def test_the_sharded_checkpoint_resumes_under_tp_and_loads_into_single(runs):
    """3 steps under tp (vocabulary-parallel), saved as a DCP folder (each rank its slices of the matrices, the
    embedding and the head); tp with sequence parallelism on too (and activation checkpointing) and single each
    resume it and go on exactly as the uninterrupted single run does (weights, AdamW moments, schedule and data
    position back)."""
    root, ref = runs["root"], runs["single"]["metrics"]["loss_curve"]
    train(root / "tp3", *TP, *LM64, "--max-steps", "3", nproc=2)
    folder = root / "tp3" / "checkpoints" / "last"
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 2
    resumed = train(root / "tp-resumed", *TP, *LM64, "--max-steps", str(STEPS), "--resume-from", str(folder),
                    "--activation-checkpointing", "--sequence-parallel", nproc=2)  # fmt: skip
    # the plan finds the blocks' attention and MLP under the checkpoint wrappers: still split
    assert resumed["sharding"]["param_bytes"] == runs["tp"]["sharding"]["param_bytes"]
    assert resumed["resumed_from"]["step"] == 3 and resumed["tp"]["sequence_parallel"]
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


TUTORIAL_LM = """\
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.attention_norm = nn.Parameter(torch.ones(dim))  # RMSNorm weights the block holds itself
        self.ffn_norm = nn.Parameter(torch.ones(dim))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = F.rms_norm(x, (d,), self.attention_norm)
        # -1: the heads this rank holds (all of them in one process)
        q, k, v = (w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(a)
        return x + self.w2(F.silu(self.w1(F.rms_norm(x, (d,), self.ffn_norm))))


class LM(nn.Module):
    def __init__(self, vocab_size, dim=32, n_heads=4, n_layers=2, max_seq_len=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(max_seq_len, dim))  # learned positions, held by the model
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def tp_plan(self):
        plan = {}
        for i in range(len(self.layers)):
            plan |= {f"layers.{i}.{n}": ColwiseParallel() for n in ("wq", "wk", "wv", "w1")}
            plan |= {f"layers.{i}.{n}": RowwiseParallel() for n in ("wo", "w2")}
        return plan


def build(vocab_size):
    return LM(vocab_size)
"""
"""A small transformer written as torch's tensor-parallel tutorial writes one (plain modules, the plan from outside
the forward), whose block holds its norms' weights itself and whose root holds learned positions: parameters the
plan leaves plain in modules whose forward adds a plan's output to a plain tensor."""
LM_USER = [a if a != "gpt-tiny" else "tutorial_lm:build" for a in tiny_lm_fp64(16, 8)]


@pytest.mark.distributed
@pytest.mark.equivalence
def test_a_users_transformer_written_as_torchs_tutorial_trains_as_single_under_tp_and_fsdp_tp(tmp_path):
    """The user's plan is applied as parallelize_module applies it: the modules it leaves hold replicated DTensors
    (for the optimizer and clipping) but compute on plain tensors, so ``x = x + self.wo(a)`` runs as under torch
    (it failed with "aten.add.Tensor got mixed torch.Tensor and DTensor"). tp and fsdp --tp (FSDP2 swapping its
    gathered parameters in, on a dp 1 x tp 2 mesh) give single's loss curve in fp64, each rank holding half of
    the q/k/v/o and MLP matrices."""
    (tmp_path / "tutorial_lm.py").write_text(TUTORIAL_LM)
    steps = ["--max-steps", "4"]
    single = train(tmp_path / "single", "--strategy", "single", *LM_USER, *steps, cwd=tmp_path)
    tp = train(tmp_path / "tp", *TP, *LM_USER, *steps, nproc=2, cwd=tmp_path)
    fsdp_tp = train(tmp_path / "fsdp-tp", "--strategy", "fsdp", "--tp", "2", "--wrap", "Block", *LM_USER, *steps,
                    nproc=2, cwd=tmp_path)  # fmt: skip
    ref = single["metrics"]["loss_curve"]
    assert ref[-1] < 0.95 * ref[0], ref
    for res in (tp, fsdp_tp):
        assert res["status"] == "ok"
        assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)
        assert res["metrics"]["val_loss"] == pytest.approx(single["metrics"]["val_loss"], rel=RTOL)
    split = 2 * (4 * 32 * 32 + 2 * 32 * 128)  # per block: wq, wk, wv, wo and w1, w2
    assert tp["sharding"]["param_bytes"] == [single["sharding"]["param_bytes"][0] - split // 2 * F64] * 2


BAD_PLANS = {
    "raise ValueError('no plan for this size')": "LM.tp_plan() raised ValueError: no plan for this size (",
    "return list(plan.items())": "LM.tp_plan() returned a list, not a mapping; give the model a tp_plan() method",
    "return {k: 'colwise' for k in plan}": "LM.tp_plan() maps 'layers.0.wq' to 'colwise' (type str), not a ParallelStyle",
    "return {0: v for v in plan.values()}": "LM.tp_plan() has the key 0 (type int), not a module name",
}  # fmt: skip


@pytest.mark.parametrize("last_line", list(BAD_PLANS))
def test_a_tp_plan_that_raises_or_is_no_plan_is_refused_in_one_line(capsys, tmp_path, monkeypatch, last_line):
    """Before any process starts and before anything is written, under tp, fsdp --tp and estimate alike."""
    name = f"bad_plan_{list(BAD_PLANS).index(last_line)}"
    (tmp_path / f"{name}.py").write_text(
        TUTORIAL_LM.replace("        return plan\n", f"        {last_line}\n")
    )
    monkeypatch.chdir(tmp_path)
    user = [a if a != "tutorial_lm:build" else f"{name}:build" for a in LM_USER]
    out = tmp_path / "out"
    for method in (TP, ["--strategy", "fsdp", "--tp", "2"]):
        err = fails(capsys, "train", *method, *user, "--nproc", "2", "--output", out)
        assert f"tp: {BAD_PLANS[last_line]}" in err
    err = fails(capsys, "estimate", *TP, "--model", f"{name}:build", "--data", "text", "--seq-len", "16",
                "--world-size", "2")  # fmt: skip
    assert f"tp: {BAD_PLANS[last_line]}" in err
    assert not out.exists(), "refused before anything is written"


def test_a_plan_naming_no_module_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    """parallelize_module skips a key that matches nothing: the weights would silently stay whole."""
    (tmp_path / "mlp_typo.py").write_text(USER_MODEL.replace('"down": Rowwise', '"dwn": Rowwise'))
    monkeypatch.chdir(tmp_path)
    user = [a if a != "mlp:build" else "mlp_typo:build" for a in USER]
    err = fails(capsys, "train", *TP, *user, "--nproc", "2", "--output", tmp_path / "out")
    assert "the plan of model 'mlp_typo:build' names no module of it: dwn" in err
    assert not (tmp_path / "out").exists()


def test_shapes_that_do_not_divide_and_a_users_plan_under_sequence_parallel_are_refused_in_one_line(
    capsys, tmp_path, monkeypatch
):
    """Before any process starts and before anything is written: a vocabulary that does not divide (vocabulary-
    parallel, the default), a sequence that does not (sequence-parallel), and --sequence-parallel on a model that
    brings its own plan (its layouts are its own)."""
    out = tmp_path / "refused"
    err = fails(capsys, "train", *TP, "--nproc", "2", *LM64, "--vocab-size", "257", "--output", out)
    assert (
        "tp over 2 processes with --vocab-parallel: the vocabulary of 257 tokens does not divide by 2" in err
    )
    assert "(e.g. 258) or --vocab-parallel false" in err
    lm33 = [a if a != str(SEQ) else "33" for a in LM64]
    err = fails(capsys, "train", *TP, "--nproc", "2", *lm33, "--sequence-parallel", "--output", out)
    assert "tp over 2 processes with --sequence-parallel: --seq-len 33 does not divide by 2" in err
    (tmp_path / "mlp_sp.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    user = [a if a != "mlp:build" else "mlp_sp:build" for a in USER]
    err = fails(capsys, "train", *TP, *user, "--nproc", "2", "--sequence-parallel", "--output", out)
    assert "tp --sequence-parallel builds the built-in transformers' plan only; model 'mlp_sp:build'" in err
    assert not out.exists(), "refused before anything is written"


TIED_MODEL = """\
from dataclasses import replace

from stratbench.models.transformer import SIZES, Transformer


def build(vocab_size):
    return Transformer(replace(SIZES["gpt-tiny"], vocab_size=vocab_size, tie_embeddings=True))
"""


@pytest.mark.distributed
@pytest.mark.equivalence
def test_a_tied_embedding_and_head_stay_one_tensor_split_over_the_vocabulary(tmp_path):
    """gpt-tiny with its head tied to its embedding (as gpt2-small and llama-1b are): both styles split the one
    matrix along the vocabulary, so it stays one parameter (1/2 of it per rank, counted once) and trains as
    single's (sequence-parallel too); its gradient is the rank's slice, not the whole matrix."""
    (tmp_path / "tied_lm.py").write_text(TIED_MODEL)
    lm = [a if a != "gpt-tiny" else "tied_lm:build" for a in LM64]
    single = train(tmp_path / "single", "--strategy", "single", *lm, "--max-steps", "3", cwd=tmp_path)
    res = train(tmp_path / "tp", *TP, "--sequence-parallel", *lm, "--max-steps", "3", nproc=2, cwd=tmp_path)
    assert_curves_match(res["metrics"]["loss_curve"], single["metrics"]["loss_curve"], RTOL)
    split, norms = _split_and_replicated(vocab_parallel=True)
    tied = split - CFG.vocab_size * CFG.dim  # the head is the embedding
    assert single["sharding"]["param_bytes"] == [(tied + norms) * F64]
    assert res["sharding"]["param_bytes"] == res["sharding"]["grad_bytes"] == [(tied // 2 + norms) * F64] * 2


def test_no_reference_cycle_keeps_a_split_weight_or_a_steps_tensor_alive():
    """With the garbage collector off: apply_tp's model (vocabulary-parallel: every kind of split weight) runs a
    forward and backward under loss_parallel, then each parameter is replaced as FSDP2 replaces it by its dp
    shard (``fsdp --tp``); nothing of that leaves a tensor in cyclic garbage. A cycle would keep the old weights
    (a rank's whole tp slice: 6.75 MiB on the 4-process fsdp --tp run of test_fsdp_tp) and the step's
    temporaries alive until the collector happens to run, and the measured allocator peak then moved by 3-7 MiB
    with the collector's thresholds. One process posing as tp rank 0 of 2 on a fake process group."""
    import gc

    import torch
    import torch._dynamo  # noqa: F401 (see below)
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stratbench.measuring.model_trace import ModelSpec
    from stratbench.strategies.parallel.tensor_parallel import apply_tp, split_logits

    model = ModelSpec("gpt-tiny", CFG.vocab_size, 0, seq_len=SEQ).build().double()
    x = torch.randint(0, CFG.vocab_size, (2, SEQ))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    # torch._dynamo is imported above, not by the first distribute_tensor (torch/_compile.py:47): that one-time
    # import leaves its caller's frames, and the parameter being split, in a cycle (torch's, not a step's).
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage instead of freed
    try:
        apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), vocab_parallel=True)
        with split_logits(model), loss_parallel():
            nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(p.detach().clone()))
        del p
        gc.collect()
        cyclic = [f"{type(t).__name__}{tuple(t.shape)}" for t in gc.garbage if isinstance(t, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        dist.destroy_process_group()
    assert not cyclic, f"tensors only a reference cycle kept alive: {cyclic}"
