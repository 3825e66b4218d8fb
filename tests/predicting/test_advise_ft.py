"""advise --goal fit where full training fits no plan: it tries the FINE_TUNING entries (a smaller micro-batch,
the memory-lean optimizers, LoRA) priced by the same estimate, picks the first that fits, says it in one line and
prints a train command that carries it; where full training fits, the answer is today's (in process, no training)."""

from __future__ import annotations

import importlib.util
import shlex
from types import SimpleNamespace

import pytest

from stratbench.cli import build_parser
from stratbench.commands.train import resolve_config
from stratbench.core.config import TrainConfig
from stratbench.predicting.advise import advise
from stratbench.predicting.estimate import estimate
from stratbench.training import engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("torchao") is None,
    reason="needs peft and torchao (the lora and lean extras)",
)

BASE = TrainConfig(model="gpt-tiny", data="text", seq_len=32, batch_size=8, precision="fp32", optimizer="adamw")


def _least_full(base: TrainConfig) -> int:
    """Full training's smallest total on one device: micro-batch 1, with or without recomputation."""
    one = base.replace(grad_accum=base.batch_size)
    return min(estimate(one.replace(activation_checkpointing=a), 1).total_bytes for a in (False, True))


def _memory(total: int) -> int:
    """The device memory whose 90% budget is 1 MiB under ``total``."""
    return int((total - (1 << 20)) / 0.9)


def _train_config(command: str) -> TrainConfig:
    """The config train would run from advise's command line, checked as train checks it."""
    cfg = resolve_config(build_parser().parse_args(shlex.split(command)[1:]))
    engine.check_config(cfg, cfg.nproc * cfg.nnodes)
    return cfg


def test_full_training_keeps_its_answer_where_it_fits():
    a = advise(BASE, 1, int(estimate(BASE, 1).total_bytes / 0.9) + 1, goal="fit")
    assert a.plan is not None and a.plan.strategy == "single" and not a.fine_tuning and not a.overrides
    assert "--lora-rank" not in a.train_command and "--grad-accum" not in a.train_command


def test_a_lean_optimizer_where_full_adamw_fits_nowhere():
    memory = _memory(_least_full(BASE))
    a = advise(BASE, 1, memory, goal="fit")
    assert a.fine_tuning == "full training + adamw8bit" and a.plan.strategy == "single", a.reasons
    line = a.reasons[-1]  # the answer in one line
    assert line.startswith("gpt-tiny on 1 x ") and line.endswith(" per device"), a.reasons
    assert f": full training + adamw8bit, single, micro-batch {a.estimate.micro_batch}, ~" in line, line
    cfg = _train_config(a.train_command)
    assert cfg.optimizer == "adamw8bit" and cfg.lora_rank == 0
    assert cfg.batch_size // cfg.grad_accum == a.estimate.micro_batch  # the global batch kept, micro-steps added
    assert estimate(cfg, 1).total_bytes == a.estimate.total_bytes <= 0.9 * memory


def test_lora_where_no_full_training_fits():
    """With SGD (no lean entry replaces it) and a budget under full training's least: LoRA r16, its flag in the
    command, its estimate the command's."""
    base = BASE.replace(optimizer="sgd", momentum=0.9)
    a = advise(base, 1, _memory(_least_full(base)), goal="fit")
    assert a.fine_tuning == "LoRA r16" and a.overrides == {"lora_rank": 16}, a.reasons
    assert not any("adamw8bit" in r for r in a.reasons)  # the lean optimizers replace AdamW only
    assert "full training: fits no plan, even at micro-batch 1" in " ".join(a.reasons)
    assert any(r.startswith("gpt-tiny on 1 x ") and ": LoRA r16, single" in r for r in a.reasons), a.reasons
    cfg = _train_config(a.train_command)
    assert cfg.lora_rank == 16 and cfg.optimizer == "sgd"
    assert estimate(cfg, 1).total_bytes == a.estimate.total_bytes


def test_a_lora_step_on_a_gpu_is_priced_over_the_adapters():
    """The foreach kernels' parameter-sized list (AdamW's sqrt(v)) covers the parameters stepped: LoRA's adapters,
    not the frozen base (it was the whole model's size: Llama-3-8B's LoRA step peak 30 GiB too high)."""
    rows = {r.component: r.device_bytes for r in estimate(BASE.replace(lora_rank=16), 1).rows}
    assert rows["optimizer step scratch"] == rows["gradients"] > 0, rows
    assert rows["optimizer step scratch"] < rows["parameters"] / 4, rows



def test_an_entry_on_the_device_is_chosen_before_one_with_host_offload(monkeypatch):
    """Where LoRA fits only with its parameters on the host (ZeRO-3 + parameter offload: every step over PCIe)
    and QLoRA fits on the device, QLoRA on the device is chosen, as most users would run it (the first LoRA plan
    that fitted used to win: Llama 3 8B on a 16 GiB card got LoRA with ZeRO-Infinity). The fits are set here (a
    model where this happens takes minutes to estimate); which plans offload is the projection's own count. The
    compare line carries the entry's flags too."""
    from stratbench.predicting import advise as advise_module

    real = advise_module._largest_micro_batch

    def fits(cand, plan, devices, device_type, budget, notes):
        offloads = dict(plan.options).get("offload_params") == "cpu"
        ok = (cand.lora_rank and cand.quantize_base == "nf4" and plan.strategy == "single") or (
            cand.lora_rank and cand.quantize_base == "none" and offloads
        )
        if ok:  # priced as advise prices it, and fitted as the case says
            return real(cand, plan, devices, device_type, 1 << 60, notes)
        return None, SimpleNamespace(total_bytes=1 << 40, micro_batch=1)  # too big at its smallest micro-batch

    monkeypatch.setattr(advise_module, "_largest_micro_batch", fits)
    base = BASE.replace(optimizer="sgd", momentum=0.9)
    a = advise(base, 1, _memory(_least_full(base)), goal="fit")
    assert a.fine_tuning == "QLoRA r16" and a.plan.strategy == "single", a.reasons
    assert "LoRA r16: fits no plan, even at micro-batch" in " ".join(a.reasons), a.reasons
    compare = shlex.split(a.compare_command)
    assert compare[compare.index("--lora-rank") + 1] == "16" and "--quantize-base" in compare, a.compare_command
    assert _train_config(a.train_command).quantize_base == "nf4"
