"""Hugging Face mixtures of experts through ``--model hf:FOLDER`` (stratbench.models.hf_moe): a tiny Mixtral
config folder trains in fp64 under 2-process ddp as one process with ``--grad-accum 2`` does (its training loss
holding ``router_aux_loss_coef x`` transformers' aux loss), result.json's ``moe`` counts the router's choices; the
experts' loop equals transformers' eager experts; Mixtral, Qwen2-MoE and Qwen3-MoE count k of E experts as active
(FLOPs on the meta device too); ``--ep``, ``--moe-top-k``, ``--capacity-factor`` and the methods that do not train
an MoE refuse in one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import RTOL, assert_curves_match, fails, ok_curve, train
from stratbench.core.config import TrainConfig, from_dict
from stratbench.predicting.estimate import estimate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the hf extra: pip install 'stratbench[hf]')",
)

SEQ, BATCH, STEPS, TOP_K, EXPERTS, COEF = 32, 8, 3, 2, 4, 0.02
MIXTRAL = {
    "model_type": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "output_router_logits": True,
    "router_aux_loss_coef": COEF,
}  # fmt: skip
QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1],
    "output_router_logits": True, "router_aux_loss_coef": 0.001,
}  # fmt: skip
"""Layer 1 a dense MLP (mlp_only_layers): 2 routed layers of 8 experts."""
QWEN2_MOE = QWEN3_MOE | {
    "model_type": "qwen2_moe", "shared_expert_intermediate_size": 24, "mlp_only_layers": [],
}  # fmt: skip
"""A shared expert (and its sigmoid gate) in each of 3 routed layers: dense, always active."""


def folder(tmp_path, config: dict) -> str:
    path = tmp_path / config["model_type"]
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    return folder(tmp_path_factory.mktemp("hfmoe"), MIXTRAL)


def build(model: str, device: str = "cpu"):
    from stratbench.models.zoo import build_model

    torch.manual_seed(0)
    with torch.device(device):
        return build_model(model, 256, seq_len=SEQ)


def expert_weights(config: dict, routed_layers: int, experts_intermediate: int) -> int:
    """The routed experts' parameters of the config: gate, up and down projections of each expert."""
    return (
        routed_layers
        * config.get("num_local_experts", config.get("num_experts"))
        * 3
        * 32
        * experts_intermediate
    )


@pytest.mark.parametrize(
    "config, routed, inter",
    [(MIXTRAL, 2, 48), (QWEN3_MOE, 2, 16), (QWEN2_MOE, 3, 16)],
    ids=["mixtral", "qwen3", "qwen2"],
)
def test_active_parameters_and_meta_flops_count_k_of_e_experts(tmp_path, config, routed, inter):
    """Active = total - (E - k) / E of the routed experts (the shared experts and dense layers active); the FLOP
    counter on the meta device (each expert an equal share of the assignments) gives the formula's active FLOPs."""
    from stratbench.models.flops import flops_per_sample
    from stratbench.models.hf import flops_per_token

    name = folder(tmp_path, config)
    model = build(name)
    active, total = model.routing.parameter_split(model)
    assert total == sum(p.numel() for p in model.parameters())
    e, k = model.routing.layers[0].n_experts, config["num_experts_per_tok"]
    assert active == total - expert_weights(config, routed, inter) * (e - k) // e
    assert len(model.routing.layers) == routed
    counted = flops_per_sample(lambda: build(name, "meta"), (SEQ,), 256, True)
    assert counted / SEQ == pytest.approx(flops_per_token(model, SEQ), rel=1e-12)


def test_the_experts_loop_equals_transformers_eager_experts(mixtral):
    """fp64: stratbench's experts (one expert after the other) give transformers' eager experts' logits and
    gradients within 1e-12."""
    model = build(mixtral).double()
    eager = build(mixtral).double()
    eager.hf.set_experts_implementation("eager")
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(tokens), eager(tokens)
    assert (ours - theirs).abs().max() <= 1e-12 * theirs.abs().max()
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 1e-12 * max(q.grad.abs().max(), 1e-30), n


def test_the_training_loss_adds_coef_x_transformers_aux_loss_and_counts_the_routers_choices(mixtral):
    """The loop's training loss (``with_router_loss``) is cross-entropy + 0.02 x the aux loss transformers returns,
    and the counts are the top-k the routers chose (seen by a hook on each router)."""
    from stratbench.models.zoo import model_routing
    from stratbench.training.losses import TokenCrossEntropy, with_router_loss

    model = build(mixtral).double()
    chosen = []
    for router in model.routing.routers:
        router.register_forward_hook(lambda m, args, out: chosen.append(out[2].flatten().clone()))
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    ce = TokenCrossEntropy()
    logits = model(tokens[:, :-1])
    loss = with_router_loss(ce, model_routing(model))(logits, tokens[:, 1:])
    with torch.no_grad():
        aux = model.hf(input_ids=tokens[:, :-1], output_router_logits=True).aux_loss
    assert (loss - ce(logits, tokens[:, 1:])).item() == pytest.approx(
        (COEF * aux).item(), rel=1e-12
    )  # fp32 aux
    counts = [layer.totals.counts.tolist() for layer in model.routing.layers]
    assert counts == [torch.bincount(c, minlength=EXPERTS).tolist() for c in chosen[:2]]


@pytest.mark.distributed
@pytest.mark.equivalence
def test_ddp_trains_and_routes_what_one_process_accumulating_two_micro_batches_does(tmp_path, mixtral):
    """fp64: ddp over 2 processes = single --grad-accum 2 within 1e-9 (each micro-batch its own aux loss, as
    transformers computes it on each device), the same tokens per expert; every token routed to k experts, none
    dropped; active and total parameters; the run's memory estimate prices the total."""
    flags = [
        "--model", mixtral, "--data", "text", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--epochs", "1",
        "--max-steps", str(STEPS), "--optimizer", "adamw", "--lr", "0.003", "--eval-samples", "8", "--progress",
        "false", "--timing-warmup-steps", "1", "--precision", "fp64", "--measure-flops", "false",
    ]  # fmt: skip
    single = train(tmp_path / "single", *flags, "--grad-accum", "2")
    ddp = train(tmp_path / "ddp", *flags, "--strategy", "ddp", nproc=2)
    assert_curves_match(ok_curve(ddp), single["metrics"]["loss_curve"], RTOL)
    moe = single["moe"]
    assert ddp["moe"]["tokens_per_expert"] == moe["tokens_per_expert"]
    assert ddp["moe"]["aux_loss"] == pytest.approx(moe["aux_loss"], rel=1e-9)
    assert [sum(row) for row in moe["tokens_per_expert"]] == [STEPS * BATCH * SEQ * TOP_K] * 2
    assert (moe["experts"], moe["top_k"], moe["aux_loss_coef"], moe["routing"]) == (
        EXPERTS,
        TOP_K,
        COEF,
        "dropless",
    )
    assert (
        moe["dropped_tokens"] == 0 and moe["aux_loss"] >= TOP_K - 1e-6
    )  # transformers' loss: k when uniform
    total = single["model_meta"]["num_parameters"]
    assert (moe["active_parameters"], moe["total_parameters"]) == (
        total - expert_weights(MIXTRAL, 2, 48) // 2,
        total,
    )
    # the estimate of the run: the total parameters priced, a layer traced on fake tensors (experts in equal shares)
    rows = {
        r.component: r.device_bytes for r in estimate(from_dict(TrainConfig, single["config"]), 1, "cpu").rows
    }
    assert rows["parameters"] == 8 * total and rows["activations saved for backward"] > 0


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--strategy", "fsdp", "--ep", "2", "--nproc", "2"], "fsdp --ep 2: model hf:"),
        (["--moe-top-k", "1"], "--moe-top-k 1: model 'hf:"),
        (["--capacity-factor", "1.0"], "--capacity-factor 1.0: model 'hf:"),
        (
            ["--strategy", "pipeline", "--nproc", "2"],
            "is a mixture of experts, which pipeline does not train",
        ),
        (["--strategy", "deepspeed", "--nproc", "2"], "DeepSpeed-MoE replaces the built-in MoE layer only"),
    ],
    ids=["ep", "top-k", "capacity", "pipeline", "deepspeed"],
)
def test_what_a_hugging_face_moe_does_not_take_is_refused_in_one_line(capsys, tmp_path, mixtral, flags, says):
    err = fails(capsys, "train", "--model", mixtral, "--data", "text", "--seq-len", str(SEQ), *flags,
                "--output", str(tmp_path / "out"))  # fmt: skip
    assert says in err, err
    assert not (tmp_path / "out").exists()


def test_a_mixture_of_experts_whose_routers_are_not_found_is_refused_when_built(tmp_path):
    """Llama 4's routers are not recorded as router_logits in transformers 5.24: trained as found, it would lose
    its aux loss and counts, so it is refused in one line (built on the meta device: nothing allocated)."""
    from stratbench.core.errors import ConfigError

    llama4 = {
        "model_type": "llama4_text", "hidden_size": 32, "intermediate_size": 32, "intermediate_size_mlp": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256,
        "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 64,
    }  # fmt: skip
    with pytest.raises(ConfigError, match="model_type 'llama4_text' is a mixture of experts whose routers"):
        build(folder(tmp_path, llama4), "meta")
