"""The optimizer and learning-rate schedule a run's config asks for: ``OptimizerSpec`` (a class and keyword
arguments) the loop calls on the wrapped model's parameters, strategies that build the optimizer themselves read,
and the memory estimate traces on fake tensors; ``state_bytes``, the exact bytes of state each one keeps for a
parameter of a given shape (what the memory models price); ``lr_lambda`` (warm-up, then constant or cosine)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from stratbench.core.config import TORCHAO_OPTIMIZERS, TrainConfig, optimizer_impl_kwargs


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer class and keyword arguments; callable on parameters. Strategies that build the optimizer
    themselves (ZeroRedundancyOptimizer, DeepSpeed) read ``cls`` and ``kwargs``."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    eager_on_cpu: bool = False
    """Step without torch.compile where every parameter is on a CPU: torchao compiles each parameter's update
    (measured on 2 cores: the first step 27 s for gpt-tiny, 85 s for resnet18, and ~8 MiB of compiler state
    left in the process, which the CPU's allocator peak counts); the states are the same either way."""

    def __call__(self, params) -> torch.optim.Optimizer:
        """The optimizer over the parameters that train: a frozen one (``requires_grad=False``: LoRA's base)
        gets no optimizer state, and a library that sizes its buffers from the optimizer's parameters (DeepSpeed's
        ZeRO partitions) never counts it."""
        return self.prepare(self.cls(trainable(params), **self.kwargs))

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` (this spec's, or a wrapper stepping it: ZeroRedundancyOptimizer) set to step eagerly
        on a CPU where ``eager_on_cpu``."""
        if self.eager_on_cpu:
            optimizer.register_step_pre_hook(_eager_step_on_cpu)
            optimizer.register_step_post_hook(_default_stance)
        return optimizer


def trainable(params) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` that require gradients (all of them unless a transform froze some)."""
    return [p for p in params if p.requires_grad]


def _eager_step_on_cpu(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step: run the optimizer's torch.compile calls eagerly where its parameters are all on a CPU."""
    if all(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
        torch.compiler.set_stance("force_eager")


def _default_stance(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    torch.compiler.set_stance("default")


def import_torchao(module: str = "torchao") -> Any:
    """Import torchao's ``module``, where torchao is installed (None where not), without the warning its import
    logs for each CUDA kernel library a CPU cannot load (one line per library on every rank) or torch pytree's
    warning for each Enum constant it registers. Called before anything that imports it on the way: the lean
    optimizers, QLoRA's NF4, and PEFT (which imports it to check for its quantised layers)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)


def optimizer_spec(cfg: TrainConfig) -> OptimizerSpec:
    """The optimizer ``cfg.optimizer`` names, with the run's learning rate and weight decay."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}
        return OptimizerSpec(torch.optim.SGD, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))
    if cfg.optimizer in TORCHAO_OPTIMIZERS:
        # optional (the lean extra); config.check_optimizer refused its absence before
        optim = import_torchao("torchao.optim")
        return OptimizerSpec(getattr(optim, TORCHAO_OPTIMIZERS[cfg.optimizer]), kwargs, eager_on_cpu=True)
    if cfg.optimizer == "adafactor":
        return OptimizerSpec(torch.optim.Adafactor, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))
    return OptimizerSpec(torch.optim.AdamW, kwargs | optimizer_impl_kwargs(cfg.optimizer_impl))


# ---- state bytes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedStates:
    """torchao's block-quantised AdamW states (torchao 0.18, torchao/optim/adam.py ``_AdamBase._new_buffer``,
    subclass_8bit.py / subclass_4bit.py ``zeros``): a parameter of at least ``MIN_NUMEL`` elements whose count
    ``block`` divides keeps, per state, its codes (``bits`` per element, in uint8), one fp32 scale per block and
    an fp32 lookup table of ``qmap`` entries; any other parameter keeps plain states in its own dtype."""

    bits: int
    block: int
    """torchao's default ``block_size``."""
    qmap: int
    """Entries of the state's lookup table (8-bit: ``create_dynamic_map``'s 256; 4-bit: 16)."""

    MIN_NUMEL = 4096
    """"follow bitsandbytes, only quantize tensors >= 4096 values" (``_new_buffer``)."""

    def bytes_per_state(self, numel: int, itemsize: int) -> int:
        if numel < self.MIN_NUMEL or numel % self.block:
            return numel * itemsize
        return numel * self.bits // 8 + 4 * (numel // self.block) + 4 * self.qmap


QUANTIZED = {"adamw8bit": QuantizedStates(8, 256, 256), "adamw4bit": QuantizedStates(4, 128, 16)}


def state_bytes(optimizer: str, momentum: float, shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of optimizer state a parameter of ``shape`` (elements of ``itemsize`` bytes) holds after its first
    step, its ``step`` counter left out (``step_counter_bytes``). AdamW: two states of the parameter's dtype;
    SGD: a momentum buffer, none without momentum; adamw8bit / adamw4bit: ``QuantizedStates``; Adafactor
    (torch/optim/_adafactor.py, ``_init_group``, no first moment): for a parameter of 2+ dimensions a row
    factor of shape ``shape[:-1] + (1,)`` and a column factor ``shape[:-2] + (1, shape[-1])``, else a full
    second moment, all of the gradient's dtype."""
    numel = math.prod(shape)
    if optimizer == "sgd":
        return numel * itemsize if momentum else 0
    if optimizer in QUANTIZED:
        return 2 * QUANTIZED[optimizer].bytes_per_state(numel, itemsize)
    if optimizer == "adafactor":
        if len(shape) < 2:
            return numel * itemsize
        return (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * itemsize
    return 2 * numel * itemsize


def step_counter_bytes(optimizer: str) -> int:
    """Bytes of the per-parameter ``step`` counter: a 0-dim fp32 tensor on the CPU (torch's AdamW and
    Adafactor, torchao's ``torch.tensor(0.0)``); SGD keeps none."""
    return 0 if optimizer == "sgd" else 4


def states_per_local_shard(optimizer: str) -> bool:
    """Whether the optimizer builds a DTensor parameter's state from its local shard alone, as it would for a
    plain tensor of the shard's shape: the elementwise ones, and torchao's (``_new_buffer`` quantises
    ``p.to_local()``); not Adafactor, whose row and column factors need reductions across the shards (under FSDP2
    its in-place ``pow_`` on a partial norm fails: "in-place operations that require placement changes are not
    supported", torch 2.13)."""
    return optimizer != "adafactor"


def elementwise_slots(optimizer: str, momentum: float) -> int | None:
    """State tensors of the parameter's size and dtype per parameter, for the optimizers whose state is that
    (AdamW two, momentum SGD one, plain SGD none); None for the lean ones, whose state depends on the shape."""
    if optimizer == "adamw":
        return 2
    if optimizer == "sgd":
        return 1 if momentum else 0
    return None


def describe_state(optimizer: str, momentum: float) -> str:
    """The estimate's note on the optimizer-state row: the bytes per element, in words."""
    slots = elementwise_slots(optimizer, momentum)
    if slots is not None:
        return f"{slots} per parameter ({optimizer})"
    if optimizer in QUANTIZED:
        q = QUANTIZED[optimizer]
        return (
            f"2 x {q.bits}-bit codes + an fp32 scale per {q.block} ({optimizer}; under {q.MIN_NUMEL} elements: "
            f"2 per parameter)"
        )
    return "row + column second moments, full for 1-D (adafactor)"


def lr_lambda(cfg: TrainConfig, total_steps: int):
    warm = cfg.lr_warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f
