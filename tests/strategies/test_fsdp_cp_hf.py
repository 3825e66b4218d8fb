"""fsdp --cp (context parallelism, Ulysses) on a Hugging Face model (``--model hf:FOLDER``, a tiny Llama config with
grouped-query attention), gloo on CPU: on 2 processes it trains exactly the model `single` trains (fp64, gradient
clipping on), the validation loss included, each rank feeding its chunk at its global positions and the attention
implementation stratbench registers in transformers' attention interface exchanging q, k, v and the output; the
all-to-alls measured equal the formula to the byte and the memory estimate traces a rank's chunk; a model whose
attention cannot be split by heads is refused in one line before any work."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from conftest import COMM, RTOL, assert_comm_matches_formula, assert_curves_match, train
from stratbench.core.config import TrainConfig
from stratbench.strategies.fsdp import FSDPStrategy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the hf extra: pip install 'stratbench[hf]')",
)

SEQ, BATCH, STEPS = 32, 8, 4
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}  # fmt: skip
"""4 query heads over 2 key/value heads of 8 channels: each rank of cp 2 attends with 2 and 1 of them."""


def _folder(root, name: str, config: dict) -> str:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "config.json").write_text(json.dumps(config))
    return f"hf:{root / name}"


def _flags(model: str) -> list[str]:
    return [
        "--model", model, "--data", "text", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--epochs", "1",
        "--max-steps", str(STEPS), "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "16",
        "--progress", "false", "--timing-warmup-steps", "1", "--precision", "fp64", "--measure-flops", "false",
        "--clip-grad-norm", "0.5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_cp_hf")
    flags = _flags(_folder(root, "tiny-llama", LLAMA))
    return {
        "single": train(root / "single", "--strategy", "single", *flags),
        "cp2": train(root / "cp2", "--strategy", "fsdp", "--cp", "2", *flags, *COMM, nproc=2),
    }


@pytest.mark.distributed
@pytest.mark.equivalence
def test_cp_trains_the_hf_model_single_trains(runs):
    res, ref = runs["cp2"], runs["single"]
    assert res["status"] == "ok" and res["mesh"] == {"dp": 1, "cp": 2} and res["micro_batch_size"] == BATCH
    curve = ref["metrics"]["loss_curve"]
    assert curve[-1] < 0.97 * curve[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], curve, RTOL)
    assert res["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=RTOL)


@pytest.mark.distributed
def test_the_all_to_alls_are_the_formulas_bytes_and_the_estimate_holds(runs):
    """Per step on each rank: q, k, v and the output of both attentions exchanged forward and backward, each the
    rank's (8 x 16 positions x heads x 8 channels) fp64 tensor: 2 x 2 x 8 x 16 x 8 x (2 x 4 + 2 x 2) x 8 B."""
    res = runs["cp2"]
    comm = assert_comm_matches_formula(res, tol=0.0)
    a2a = comm["measured"]["all_to_all"]
    assert a2a["payload_bytes"] == 2 * 2 * BATCH * (SEQ // 2) * 8 * (2 * 4 + 2 * 2) * 8 == 393_216, a2a
    assert a2a["calls"] == 2 * 4 * 2, a2a


def test_the_estimate_traces_a_ranks_chunk_of_the_hf_model(runs):
    """A cp rank's activations are traced on its chunk (8 samples x 16 positions, heads exchanged), as many tokens
    as a plain fsdp rank's 4 x 32: the same bytes within 5% (the whole sequence would be twice them). The
    estimate's peak is not held to the measured one here: on this tiny Hugging Face model it is off for plain
    fsdp too (-19%, -26% at twice the width: measured, fsdp 2 processes), which is the HF estimate's, not cp's."""
    from stratbench.core.config import from_dict
    from stratbench.predicting.estimate import estimate

    cfg = from_dict(TrainConfig, dict(runs["cp2"]["config"]))
    saved = {}
    for name, opts in (("cp2", {"cp": 2}), ("fsdp", {})):
        e = estimate(cfg.replace(strategy_options=opts), 2, "cpu")
        saved[name] = next(r.device_bytes for r in e.rows if r.component == "activations saved for backward")
    assert saved["cp2"] == pytest.approx(saved["fsdp"], rel=0.05), saved


def test_an_hf_attention_that_cannot_be_split_by_heads_is_one_line_before_any_work(tmp_path):
    """Key/value heads C does not divide, a sliding window narrower than the sequence (Mistral's), a soft cap
    handed to the attention (Gemma 2's), an attention outside transformers' interface (Bloom's alibi)."""
    gemma2 = {"model_type": "gemma2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    cases = [
        (LLAMA, 4, "num_key_value_heads 2 do not divide by 4 .*--cp that fit: 1, 2$"),
        (LLAMA | {"model_type": "mistral", "sliding_window": 16}, 2, "sliding window of 16 tokens is narrower than"),
        (gemma2, 2, "hands transformers' attention interface softcap=50.0, which"),
        ({"model_type": "bloom", "vocab_size": 256, "hidden_size": 32, "n_layer": 2, "n_head": 4}, 2,
         "does not go through transformers' attention interface"),
    ]  # fmt: skip
    cpu = torch.device("cpu")
    for i, (config, cp, msg) in enumerate(cases):
        model = _folder(tmp_path, str(i), config)
        cfg = TrainConfig(model=model, data="text", seq_len=SEQ, batch_size=BATCH, strategy="fsdp",
                          strategy_options={"cp": cp})  # fmt: skip
        why = FSDPStrategy.check_supported(cfg, cpu, cp)
        assert why is not None and len(why.splitlines()) == 1, why
        assert re.search(msg, why), why
