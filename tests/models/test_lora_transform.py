"""LoRA (models/transforms/lora.py) in-process: PEFT's adapters on gpt-tiny with the base frozen, the trainable
count the formula gives (which the estimate's memory context uses too), inference re-applying the adapters, and
the bad inputs refused in one line."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from stratbench.core.config import TrainConfig, validate
from stratbench.core.errors import ConfigError
from stratbench.core.optim import optimizer_spec
from stratbench.inference.predictor import build_from_meta
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.models.transforms import Phase, Pipeline, flops_factor
from stratbench.models.transforms.lora import FROZEN_FLOPS_FACTOR, lora_meta, parameter_counts
from stratbench.models.zoo import build_model
from stratbench.strategies.costs import MemoryContext

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the lora extra)")

LM = {"model": "gpt-tiny", "data": "synthetic-tokens", "seq_len": 32, "optimizer": "adamw"}


def _gpt() -> nn.Module:
    return build_model("gpt-tiny", 256, seq_len=32)


def _formula(model: nn.Module, rank: int, leaves: tuple[str, ...] | None = None) -> int:
    """rank x (in + out) per adapted Linear: all but the output head, or those whose name ends in ``leaves``."""
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = linear[:-1] if leaves is None else [(n, m) for n, m in linear if n.rsplit(".", 1)[-1] in leaves]
    return sum(rank * (m.in_features + m.out_features) for _, m in chosen)


def test_the_adapters_train_and_the_base_is_frozen():
    """all-linear: every Linear but the head adapted; only lora_A/lora_B require gradients, the count is the
    formula's (which result.json and the estimate use), keys keep the model's own names (no wrapper prefix), and
    the optimizer holds the adapters only."""
    cfg = TrainConfig(**LM, lora_rank=4)
    model = _gpt()
    base = sum(p.numel() for p in model.parameters())
    want = _formula(model, 4)
    assert parameter_counts(model, cfg) == (want, base + want)
    pipe = Pipeline(cfg)
    model = pipe.apply(model, Phase.BEFORE_WRAP, None)
    assert pipe.applied == ["lora:r4"]
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == want and all(".lora_" in n for n in trainable)
    assert sum(p.numel() for p in model.parameters()) == base + want
    keys = set(model.state_dict())
    assert "layers.0.attention.wq.base_layer.weight" in keys and "output.weight" in keys, sorted(keys)[:6]
    assert not any(k.startswith("base_model") for k in keys)
    opt = optimizer_spec(cfg)(model.parameters())
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == want
    # the estimate's context counts the same adapters, and gradients/optimizer state over them only
    ctx = MemoryContext(cfg, 1, model_info(ModelSpec.from_config(cfg)), None, "cpu")
    assert sum(ctx.trainable_numels) == want and sum(ctx.numels) == base + want
    states = ctx.replicated(buckets=False)
    assert (states.params, states.grads, states.optim) == (4 * (base + want), 4 * want, 2 * 4 * want)
    # the projection: a frozen Linear computes no weight gradient
    assert flops_factor(cfg) == pytest.approx(FROZEN_FLOPS_FACTOR) == pytest.approx(2 / 3)


def test_named_targets_and_inference_rebuilding_the_adapted_model():
    """--lora-targets wq,wv adapts those layers only; a checkpoint's meta rebuilds the same model, whose
    state-dict keys the LoRA run's checkpoint holds."""
    cfg = TrainConfig(**LM, lora_rank=2, lora_targets="wq,wv", lora_alpha=3.0)
    model = Pipeline(cfg).apply(_gpt(), Phase.BEFORE_WRAP, None)
    want = _formula(_gpt(), 2, ("wq", "wv"))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == want
    assert parameter_counts(_gpt(), cfg)[0] == want
    meta = {"model": "gpt-tiny", "num_classes": 256, "seq_len": 32, "lora": lora_meta(cfg)}
    rebuilt = build_from_meta(meta)
    assert set(rebuilt.state_dict()) == set(model.state_dict())
    rebuilt.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(rebuilt.eval()(x), model.eval()(x))


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"lora_rank": -1}, "lora_rank must be 0 (off) or a positive rank, got -1"),
        ({"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha must be positive, got 0.0"),
        ({"lora_rank": 4, "lora_dropout": 1.0}, "lora_dropout must be in [0, 1), got 1.0"),
    ],
)
def test_bad_values_are_refused_in_one_line(changes, said):
    with pytest.raises(ConfigError) as e:
        validate(TrainConfig(**LM, **changes))
    assert str(e.value) == said


def test_targets_that_match_nothing_list_the_linear_layers():
    cfg = TrainConfig(**LM, lora_rank=4, lora_targets="wq,qkv")
    with pytest.raises(ConfigError) as e:
        parameter_counts(_gpt(), cfg)
    assert str(e.value) == (
        "lora_targets 'qkv' matches no nn.Linear of the model; its Linear layers: wq, wk, wv, wo, w1, w2, w3, "
        "output (or all-linear)"
    )
    assert "\n" not in str(e.value)


def test_the_methods_that_cannot_take_lora_say_why_in_train_and_in_the_estimate(capsys):
    """single, ddp, fsdp, fsdp1, deepspeed and accelerate-ddp take it (each run in tests/strategies/test_lora.py or
    docs/finetuning.md); the rest refuse in one line, which `check_supported` returns and the estimate's row of
    the method shows; fsdp --tp and deepspeed --autotp-size refuse it too."""
    from stratbench.cli import main
    from stratbench.strategies.base import all_strategies

    cfg = TrainConfig(**LM, lora_rank=4)
    takes = {n for n, cls in all_strategies().items() if cls.lora_refusal(cfg) is None}
    assert takes == {"single", "ddp", "fsdp", "fsdp1", "deepspeed", "accelerate-ddp"}
    tp = all_strategies()["tp"]
    assert tp.check_supported(cfg, torch.device("cpu"), 2) == tp.lora_refusal(cfg)
    assert "\n" not in tp.lora_refusal(cfg) and "nn.Linear" in tp.lora_refusal(cfg)
    fsdp_tp = cfg.replace(strategy="fsdp", strategy_options={"tp": 2})
    assert "fsdp --tp" in all_strategies()["fsdp"].check_supported(fsdp_tp, torch.device("cpu"), 2)
    assert main(["estimate", "--model", "gpt-tiny", "--data", "synthetic-tokens", "--seq-len", "32",
                 "--batch-size", "4", "--lora-rank", "4", "--strategy", "tp", "--world-size", "2",
                 "--device-type", "cpu"]) == 2  # fmt: skip
    assert "--lora-rank with tp is not supported" in capsys.readouterr().err


def test_lora_and_a_lean_optimizer_compose_in_the_estimate():
    """Adafactor over LoRA's adapters: the estimate prices the factored state of the adapters' shapes (A: rank x
    in, B: out x rank) and nothing for the frozen base, byte for byte what one real step leaves."""
    cfg = TrainConfig(**(LM | {"optimizer": "adafactor"}), lora_rank=4)
    model = Pipeline(cfg).apply(_gpt(), Phase.BEFORE_WRAP, None)
    opt = optimizer_spec(cfg)(model.parameters())
    x = torch.randint(0, 256, (2, 32))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    measured = sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for k, v in state.items()
        if torch.is_tensor(v) and k != "step"
    )
    ctx = MemoryContext(cfg, 1, model_info(ModelSpec.from_config(cfg)), None, "cpu")
    assert ctx.replicated(buckets=False).optim == measured > 0
    assert all(len(s) == 2 for s in ctx.trainable_shapes) and len(ctx.trainable_shapes) == len(opt.state)
