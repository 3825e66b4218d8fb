"""The mixture-of-experts layer and sizes (stratbench.models.moe, models.transformer's MoE sizes): the routed
output against a token-by-token reference, the capacity factor's drops, the load-balancing loss and its place in the
training loss, the active parameters and FLOPs the counter sees, and bad configs and methods refused in one line."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError, UnsupportedError
from stratbench.models.flops import flops_per_sample
from stratbench.models.moe import MoEFeedForward, parameter_split, router_loss
from stratbench.models.transformer import SIZES, build_transformer, flops_per_token, parameter_count
from stratbench.models.zoo import model_routing
from stratbench.training.engine import preflight
from stratbench.training.losses import TokenCrossEntropy, with_router_loss

# Active parameters as published: Mixtral-8x7B 12.9B (mistral.ai/news/mixtral-of-experts), Qwen3-30B-A3B 3.3B
# (its Hugging Face model card), DeepSeek-V3 37B (arXiv 2412.19437, abstract). The V3-style shape has plain
# multi-head attention in place of MLA: 1.7B more a token, hence its wider margin.
ACTIVE = {"mixtral-8x7b": (12.9e9, 0.01), "qwen3-30b-a3b": (3.3e9, 0.02), "deepseek-v3-style": (37e9, 0.05)}


def layer(capacity_factor: float | None = None, shared: bool = False) -> MoEFeedForward:
    torch.manual_seed(0)
    ffn = MoEFeedForward(8, 6, 4, 2, capacity_factor=capacity_factor, aux_loss_coef=0.5,
                         shared=nn.Linear(8, 8, bias=False) if shared else None).double()  # fmt: skip
    for p in ffn.parameters():
        nn.init.normal_(p, std=0.5)
    return ffn


def reference(ffn: MoEFeedForward, x: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """Token by token: the softmax over the experts, the top-2 renormalised, each chosen expert's SwiGLU weighted;
    with ``cap``, an expert past its first ``cap`` assignments (in token order) is skipped."""
    out, seen = torch.zeros_like(x), [0] * ffn.n_experts
    for t in range(x.shape[0]):
        probs = torch.softmax(ffn.router.weight @ x[t], -1)
        top = torch.topk(probs, 2)
        for w, e in zip(top.values / top.values.sum(), top.indices.tolist(), strict=True):
            seen[e] += 1
            if cap is None or seen[e] <= cap:
                h = x[t]
                out[t] += w * (ffn.w2[e] @ (torch.nn.functional.silu(ffn.w1[e] @ h) * (ffn.w3[e] @ h)))
    return out


def test_routed_output_equals_the_token_by_token_reference_and_counts_every_assignment():
    ffn, x = layer(shared=True), torch.randn(3, 5, 8, dtype=torch.float64)
    out = ffn(x)
    flat = x.reshape(-1, 8)
    want = reference(ffn, flat) + ffn.shared(flat)
    assert (out.reshape(-1, 8) - want).abs().max() < 1e-12
    counts = ffn.pending.counts
    assert counts.sum() == 15 * 2 and ffn.pending.dropped == 0
    out.sum().backward()  # every expert's weights take part in the graph (DDP needs no unused parameters)
    assert all(p.grad is not None for p in ffn.parameters())


def test_capacity_factor_drops_the_assignments_past_each_experts_capacity_and_counts_them():
    ffn, x = layer(capacity_factor=0.5), torch.randn(16, 8, dtype=torch.float64)
    out = ffn(x)
    cap = math.ceil(0.5 * 16 * 2 / 4)
    counts = ffn.pending.counts.tolist()
    assert ffn.pending.dropped == sum(max(0, c - cap) for c in counts) > 0
    assert (out - reference(ffn, x, cap)).abs().max() < 1e-12


def test_load_balancing_loss_is_switchs_and_joins_the_training_loss_once_per_forward():
    ffn, x = layer(), torch.randn(20, 8, dtype=torch.float64)
    ffn(x)
    probs = torch.softmax(x @ ffn.router.weight.T, -1)
    share = ffn.pending.counts.double() / 40
    assert ffn.pending.aux_loss.item() == pytest.approx(4 * (share * probs.mean(0)).sum().item(), rel=1e-12)
    loss = router_loss([ffn])  # coef x the layers' mean; the counts committed
    assert loss.item() == pytest.approx(0.5 * 4 * (share * probs.mean(0)).sum().item(), rel=1e-12)
    assert ffn.totals.passes == 1 and ffn.totals.counts.sum() == 40 and ffn.pending is None
    with torch.no_grad():
        ffn(x)  # an evaluation forward leaves nothing for the training loss
    assert ffn.pending is None and ffn.totals.passes == 1
    with torch.no_grad():
        ffn.router.weight.zero_()  # uniform probabilities: the loss is 1 whatever the shares
    ffn(x)
    assert ffn.pending.aux_loss.item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("name", list(ACTIVE))
def test_moe_sizes_have_their_published_active_parameters_on_meta(name):
    with torch.device("meta"):
        model = build_transformer(name)
    active, total = parameter_split(model)
    assert total == parameter_count(model.config) and active == parameter_count(model.config, active=True)
    published, tol = ACTIVE[name]
    assert abs(active / published - 1) < tol, (name, active)


def test_the_flop_counter_sees_the_active_flops_on_the_meta_device():
    """On the meta device each expert takes an equal share of the tokens x k assignments: exactly the dropless
    layer's FLOPs (k experts a token), which the formula counts from the active parameters."""
    cfg, seq = SIZES["gpt-moe-tiny"], 32
    counted = flops_per_sample(lambda: build_transformer("gpt-moe-tiny"), (seq,), cfg.vocab_size, tokens=True)
    assert counted == flops_per_token(cfg, seq) * seq
    # gpt-tiny has the same active MLP width (2 x 256 = 512); the router comes on top
    dense = flops_per_token(SIZES["gpt-tiny"], seq)
    assert flops_per_token(cfg, seq) - dense == 6 * cfg.n_layers * cfg.dim * cfg.n_experts


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"moe_top_k": 5}, "moe_top_k 5 must be an integer from 1 to n_experts 4"),
        ({"moe_top_k": 0}, "moe_top_k 0 must be an integer from 1 to n_experts 4"),
        ({"capacity_factor": 0.0}, "capacity_factor 0.0 must be > 0"),
        ({"capacity_factor": -1.0}, "capacity_factor -1.0 must be > 0"),
        ({"aux_loss_coef": -0.1}, "aux_loss_coef -0.1 must be a number >= 0"),
        ({"n_experts": 0}, "moe_top_k 2 applies to a mixture of experts; this model is dense"),
    ],
)
def test_bad_moe_configs_are_one_line_errors_naming_the_value(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        replace(SIZES["gpt-moe-tiny"], **overrides).check()
    assert "\n" not in str(err.value)


def test_an_moe_option_on_a_dense_model_is_refused():
    with pytest.raises(ConfigError, match="capacity_factor 1.25 applies to a mixture of experts"):
        replace(SIZES["gpt-tiny"], capacity_factor=1.25).check()


def test_the_training_loss_adds_coef_times_the_layers_mean_load_balancing_loss():
    torch.manual_seed(0)
    model = build_transformer("gpt-moe-tiny").double()
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ce = TokenCrossEntropy()
    logits = model(x)
    aux = [block.feed_forward.pending.aux_loss.item() for block in model.layers]
    loss = with_router_loss(ce, model_routing(model))(logits, y)
    assert loss.item() == pytest.approx(ce(logits, y).item() + 0.01 * sum(aux) / 4, rel=1e-12)
    assert with_router_loss(ce, model_routing(build_transformer("gpt-tiny"))) is ce  # a dense model: the loss alone


@pytest.mark.parametrize(
    ("strategy", "options", "words"),
    [
        ("pipeline", {}, "model gpt-moe-tiny is a mixture of experts, which pipeline does not train; train it under "
         "ddp, ddp-zero, deepspeed, fsdp, single"),
        ("tp", {}, "which tp does not train"),
        ("dp", {}, "which dp does not train"),
        ("fsdp", {"tp": 2}, "fsdp --tp 2 --cp 1: model gpt-moe-tiny is a mixture of experts; train it with --tp 1"),
    ],
)  # fmt: skip
def test_methods_that_do_not_train_an_moe_refuse_it_in_one_line_before_any_work(strategy, options, words):
    cfg = TrainConfig(model="gpt-moe-tiny", data="text", seq_len=32, strategy=strategy, strategy_options=options)
    with pytest.raises(UnsupportedError, match=words) as err:
        preflight(cfg, world_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("model", "flags", "words"),
    [
        ("gpt-moe-tiny", {"moe_top_k": 5}, "--moe-top-k 5 must be from 1 to gpt-moe-tiny's 4 experts"),
        ("gpt-moe-tiny", {"capacity_factor": 0.0}, "--capacity-factor 0.0 must be > 0"),
        ("gpt-tiny", {"moe_top_k": 2}, "--moe-top-k 2 applies to a mixture of experts .*; model 'gpt-tiny' has none"),
        ("gpt-tiny", {"capacity_factor": 1.25}, "--capacity-factor 1.25 applies to a mixture of experts"),
    ],
)  # fmt: skip
def test_bad_routing_flags_are_one_line_errors_before_any_work(model, flags, words):
    cfg = TrainConfig(model=model, data="text", seq_len=32, **flags)
    with pytest.raises(ConfigError, match=words) as err:
        preflight(cfg, world_size=1)
    assert "\n" not in str(err.value)
