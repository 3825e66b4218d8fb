"""QLoRA (`train --lora-rank 4 --quantize-base nf4`, gpt-tiny): the adapted Linears' frozen weights become torchao
NF4 tensors (no gradient, no optimizer state) that still train the adapters; the estimate's parameter bytes are
the real tensors' bytes; the methods that cannot take it refuse in one line; fsdp (FSDP2, 2 gloo ranks) shards
the 4-bit weights and trains what one process trains; predict quantises the checkpoint's base again.
`--quantize-base int8` (bitsandbytes' Linear8bitLt, single only): the same, in process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import RTOL, assert_curves_match, assert_estimate_within, fails, tiny_lm_fp64, train
from stratbench.core.config import TrainConfig
from stratbench.core.dist import DistEnv
from stratbench.core.optim import optimizer_spec
from stratbench.core.precision import Precision
from stratbench.inference.peft_format import merge_adapters
from stratbench.inference.predictor import load_model
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.transforms.quantize_base import is_quantized, nf4_bytes
from stratbench.predicting.estimate import rank_states
from stratbench.strategies.base import local_bytes
from stratbench.strategies.single import SingleDevice

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("torchao") is None,
    reason="needs peft and torchao (the lora and qlora extras)",
)

QLORA = ["--lora-rank", "4", "--quantize-base", "nf4"]
FLAGS = [*tiny_lm_fp64(eval_samples=8), "--measure-alloc", "true", *QLORA]
RESUMED = 1e-4
"""A resumed run's loss against the unbroken run's: the checkpoint holds the base dequantised and loading
quantises it again, which re-derives torchao's double-quantised scales (weights move by up to ~3e-4 of a
N(0, 0.02) weight); measured 3e-6 to 5e-6 relative on the two steps after a fp32 fsdp resume (gpt-tiny)."""
# gpt-tiny: 4 blocks of wq, wk, wv, wo (192 x 192) and w1, w3 (512 x 192), w2 (192 x 512); the head stays as is
ADAPTED = 4 * 7


def _set_up(precision: str, kind: str = "nf4", **kw) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainConfig]:
    """gpt-tiny set up by the single method with QLoRA over a ``kind`` base (the transforms in ORDER, the
    optimizer as a run builds it)."""
    cfg = TrainConfig(
        model="gpt-tiny", data="text", seq_len=32, batch_size=4, optimizer="adamw", lr=3e-3, precision=precision,
        lora_rank=4, quantize_base=kind, **kw,
    )  # fmt: skip
    strategy = SingleDevice(cfg, DistEnv(), Precision(precision, torch.device("cpu")), None)
    torch.manual_seed(0)
    model, optimizer = strategy.setup(ModelSpec.from_config(cfg).build(), optimizer_spec(cfg))
    return model, optimizer, cfg


@pytest.mark.parametrize("precision", ["bf16-true"])
def test_the_adapted_weights_are_frozen_nf4_that_the_adapters_train_over(precision):
    """Exactly the 28 adapted base weights are NF4 in the weights' dtype, frozen, outside the optimizer; five
    AdamW steps on one batch lower its loss; the estimate's parameter bytes equal the tensors' own bytes."""
    model, optimizer, cfg = _set_up(precision, activation_checkpointing=True)
    quantized = {n for n, p in model.named_parameters() if is_quantized(p)}
    assert len(quantized) == ADAPTED and all(n.endswith("base_layer.weight") for n in quantized)
    assert "output.weight" not in quantized
    dtype = Precision(precision, torch.device("cpu")).spec.param_dtype
    for name, p in model.named_parameters():
        assert p.requires_grad == (".lora_" in name), name
        assert p.dtype == dtype, name
    _trains_over_a_frozen_base(model, optimizer, cfg)


def _trains_over_a_frozen_base(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """The quantised weights are outside the optimizer and get no gradient; five AdamW steps on one batch lower
    its loss; the estimate's parameter bytes equal the tensors' own bytes."""
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for p in model.parameters() if is_quantized(p))
    x = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
    assert rank_states(cfg, 1, 0, device_type="cpu").params == sum(local_bytes(p) for p in model.parameters())


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the qlora extra)")
def test_an_int8_base_is_frozen_bitsandbytes_int8_that_the_adapters_train_over():
    """--quantize-base int8: exactly the 28 adapted base layers are bitsandbytes' Linear8bitLt, int8 codes with
    one fp32 scale per output row, frozen; the adapters train over them (as for NF4); the estimate's parameter
    bytes count codes and scales. The state dict holds each weight dequantised under its usual key (no
    bitsandbytes keys), and loading it quantises it back to the same codes and scales; merging the adapters
    gives plain Linears that compute what the int8 model computed."""
    model, optimizer, cfg = _set_up("fp32", "int8")
    quantized = {n: p for n, p in model.named_parameters() if is_quantized(p)}
    assert len(quantized) == ADAPTED and all(n.endswith("base_layer.weight") for n in quantized)
    for name, p in model.named_parameters():
        assert p.requires_grad == (".lora_" in name), name
        assert p.dtype == (torch.int8 if name in quantized else torch.float32), name
    assert all(p.SCB.dtype == torch.float32 and p.SCB.shape == p.shape[:1] for p in quantized.values())
    _trains_over_a_frozen_base(model, optimizer, cfg)

    state = model.state_dict()
    assert [k for k in state if k.endswith(("SCB", "weight_format"))] == []
    assert all(state[n].dtype == torch.float32 for n in quantized)
    codes = {n: (p.detach().clone(), p.SCB.clone()) for n, p in quantized.items()}
    for p in quantized.values():
        p.data.zero_(), p.SCB.zero_()
    model.load_state_dict(state)
    for n, p in quantized.items():
        assert torch.equal(p, codes[n][0]) and torch.equal(p.SCB, codes[n][1]), n

    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        before = model(x)
        merged = merge_adapters(model)
        assert not any(is_quantized(p) for p in merged.parameters())
        torch.testing.assert_close(merged(x), before, rtol=1e-5, atol=1e-5)


def test_nf4_bytes_are_torchaos_split_as_fsdp2_splits_them():
    """A 512 x 192 fp64 weight in NF4 and its two dim-0 halves (torchao's split, what fully_shard calls) hold
    exactly the bytes nf4_bytes gives; 4 bits per weight plus about 1 byte per 64 for the scales."""
    to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
    w = torch.randn(512, 192, dtype=torch.float64)
    q = to_nf4(w, 64, 192)
    assert local_bytes(q) == nf4_bytes(w.numel(), 8) < w.numel() * 0.6
    halves = torch.split(q, 256)
    assert [local_bytes(h) for h in halves] == [nf4_bytes(w.numel(), 8, 2)] * 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--quantize-base", "nf4"], "needs LoRA adapters on top (--lora-rank R > 0)"),
        ([*QLORA, "--strategy", "ddp", "--nproc", "2"], "--quantize-base with ddp is not supported"),
        ([*QLORA, "--strategy", "fsdp", "--nproc", "2", "--cpu-offload"], "fsdp --cpu-offload is not supported"),
        ([*QLORA, "--strategy", "tp", "--nproc", "2"], "--lora-rank with tp is not supported"),
        (["--lora-rank", "4", "--quantize-base", "int8", "--strategy", "fsdp", "--nproc", "2"],
         "bitsandbytes' Int8Params do not shard under FSDP2"),
        (["--lora-rank", "4", "--quantize-base", "int8", "--strategy", "ddp", "--nproc", "2"],
         "--quantize-base int8 with ddp is not supported"),
        (["--lora-rank", "4", "--quantize-base", "fp3"], "quantize_base must be one of none, nf4, int8"),
    ],
)
def test_what_cannot_take_a_quantised_base_is_refused_in_one_line(capsys, tmp_path, argv, says):
    err = fails(capsys, "train", "--output", tmp_path / "run", "--model", "gpt-tiny", "--data", "text", *argv)
    assert says in err and not (tmp_path / "run").exists()


def test_the_estimate_refuses_it_for_a_method_that_cannot_take_it(capsys):
    """The method's own line (with --strategy all, its n/a row), as train says it."""
    err = fails(capsys, "estimate", "--model", "gpt-tiny", "--data", "text", "--seq-len", "32", "--batch-size", "8",
                "--strategy", "ddp", "--world-size", "2", "--device-type", "cpu", *QLORA)  # fmt: skip
    assert "--quantize-base with ddp is not supported" in err


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("qlora") / "single"
    return train(out, *FLAGS, "--max-steps", "4"), out


def test_a_qlora_run_records_its_bytes_and_predict_quantises_again(single):
    """result.json: the transform after the cast, parameter bytes as estimated (the NF4 codes and scales), the
    estimate within 10% of the measured peak; predict rebuilds the model with NF4 weights from model_meta."""
    res, out = single
    assert res["transforms"] == ["lora:r4", "precision:fp64", "quantize_base:nf4"]
    assert res["model_meta"]["lora"]["quantize_base"] == "nf4"
    cfg = TrainConfig(**{k: v for k, v in res["config"].items() if k in TrainConfig.__dataclass_fields__})
    assert res["sharding"]["param_bytes"] == [rank_states(cfg, 1, 0, device_type="cpu").params]
    curve = res["metrics"]["loss_curve"]
    assert curve == sorted(curve, reverse=True), curve
    assert_estimate_within(res, 0.10)
    loaded = load_model(out / "checkpoints" / "last")
    assert sum(is_quantized(p) for p in loaded.model.parameters()) == ADAPTED


@pytest.mark.distributed
@pytest.mark.equivalence
def test_fsdp_shards_the_nf4_base_and_trains_what_one_process_trains(tmp_path, single):
    """FSDP2 over 2 gloo ranks: the single run's fp64 loss curve to 1e-9 (the NF4 codes are all-gathered, not
    re-quantised, so each rank computes with the same dequantised weights; only the gradients' sum order
    differs); each rank's parameter bytes are the estimate's (half of every NF4 code and scale tensor). Resumed
    from its sharded checkpoint (each rank's chunk of the base quantised whole again), its 4th step is the
    unbroken run's to RESUMED."""
    res = train(tmp_path / "fsdp", *FLAGS, "--strategy", "fsdp", "--max-steps", "3", nproc=2)
    assert res["transforms"] == ["lora:r4", "precision:fp64", "quantize_base:nf4"]
    unbroken = single[0]["metrics"]["loss_curve"]
    assert_curves_match(res["metrics"]["loss_curve"], unbroken[:3], RTOL)
    cfg = TrainConfig(**{k: v for k, v in res["config"].items() if k in TrainConfig.__dataclass_fields__})
    assert res["sharding"]["param_bytes"] == [rank_states(cfg, 2, r, device_type="cpu").params for r in (0, 1)]
    assert_estimate_within(res, 0.10)
    resumed = train(tmp_path / "fsdp", *FLAGS, "--strategy", "fsdp", "--max-steps", "4", "--resume", "must", nproc=2)
    assert_curves_match(resumed["metrics"]["loss_curve"], unbroken[3:], RESUMED)
