"""--activation-checkpointing with --ac-mode full | selective | every:N: every mode's gradients equal no
checkpointing's bit for bit (fp64), the allocator peaks measured on gpt-tiny fall in the order none > selective >
full with every:2 between none and full, the memory estimate (a trace of the checkpointed model) within 10% of
each, the projection's recomputed FLOPs per mode, and a bad mode refused in one line."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_estimate_within, train
from stratbench.core.config import TrainConfig, validate
from stratbench.core.errors import ConfigError
from stratbench.models.transformer import build_transformer
from stratbench.models.transforms import flops_factor
from stratbench.models.zoo import apply_activation_checkpointing
from stratbench.strategies.fsdp import FSDPStrategy

MODES = ("full", "selective", "every:2", "every:3")


def _grads(mode: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_transformer("gpt-tiny", vocab_size=256, max_seq_len=64).double()
    if mode:
        assert apply_activation_checkpointing(model, mode) == {"every:2": 2, "every:3": 2}.get(mode, 4)
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return [p.grad for p in model.parameters()]


def test_every_mode_gives_the_gradients_of_no_checkpointing():
    ref = _grads(None)
    for mode in MODES:
        assert all(torch.equal(g, r) for g, r in zip(_grads(mode), ref, strict=True)), mode


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ac_modes")
    flags = ["--model", "gpt-tiny", "--data", "text", "--seq-len", "256", "--batch-size", "8", "--epochs", "1",
             "--max-steps", "3", "--timing-warmup-steps", "1", "--eval-samples", "8", "--progress", "false",
             "--measure-alloc", "true", "--measure-flops", "false"]  # fmt: skip
    out = {"none": train(root / "none", *flags)}
    for mode in ("full", "selective", "every:2"):
        out[mode] = train(root / mode.replace(":", ""), *flags, "--activation-checkpointing", "--ac-mode", mode)
    return out


def test_measured_peaks_fall_in_order_and_the_estimate_holds_for_each_mode(peaks):
    peak = {m: max(r["metrics"]["cpu_alloc_peak_bytes"]) for m, r in peaks.items()}
    assert peak["none"] > peak["selective"] > peak["full"], peak
    assert peak["none"] > peak["every:2"] > peak["full"], peak
    assert peaks["selective"]["transforms"] == ["activation_checkpointing:selective"], peaks["selective"]["transforms"]
    for mode, res in peaks.items():
        assert_estimate_within(res, 0.10), mode
    curve = peaks["none"]["metrics"]["loss_curve"]
    for mode in ("full", "selective", "every:2"):  # fp32: the same kernels, recomputed: the same numbers
        assert peaks[mode]["metrics"]["loss_curve"] == curve, mode


def test_recomputed_flops_and_bad_modes():
    cfg = TrainConfig(model="gpt-tiny", data="text", activation_checkpointing=True)
    factors = {m: flops_factor(cfg.replace(ac_mode=m)) for m in ("full", "selective", "every:2", "every:4")}
    assert factors == pytest.approx({"full": 4 / 3, "selective": 7 / 6, "every:2": 7 / 6, "every:4": 13 / 12})
    assert flops_factor(cfg.replace(activation_checkpointing=False)) == 1.0
    for bad in ("partial", "every:0", "every:x", "every:"):
        with pytest.raises(ConfigError, match=f"unknown ac_mode '{bad}'; choose one of: full, selective, every:N"):
            validate(cfg.replace(ac_mode=bad))
    tp = cfg.replace(strategy="fsdp", strategy_options={"tp": 2}, ac_mode="selective", seq_len=32)
    why = FSDPStrategy.check_supported(tp, torch.device("cpu"), 2)
    assert why and "--ac-mode selective is not supported" in why, why
