"""Precision plug-ins: each owns the module/input dtype, autocast, loss scaling and the scaled optimizer step.

The loop calls the same methods for every precision; a precision that has nothing to do returns a no-op
(``nullcontext``, a disabled ``GradScaler``), so the loop has no precision branches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratbench.core.errors import ConfigError, UnsupportedError, did_you_mean


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    param_dtype: torch.dtype
    """dtype of the weights the model holds."""
    compute_dtype: torch.dtype
    """dtype of the matmuls/convolutions."""
    autocast: bool
    loss_scaling: bool
    description: str


SPECS: dict[str, PrecisionSpec] = {
    s.name: s
    for s in [
        PrecisionSpec("fp32", torch.float32, torch.float32, False, False, "full fp32 (TF32 with --tf32)"),
        PrecisionSpec(
            "fp64",
            torch.float64,
            torch.float64,
            False,
            False,
            "model.double(): fp64 weights and compute (Lightning's 64-true); for numerically sensitive work and "
            "for checks that must not depend on the CPU's kernels (rounding ~1e-16)",
        ),
        PrecisionSpec(
            "fp16-true",
            torch.float16,
            torch.float16,
            False,
            False,
            "model.half(): fp16 weights, no master copy, no loss scaling (the source's pure fp16)",
        ),
        PrecisionSpec(
            "bf16-true", torch.bfloat16, torch.bfloat16, False, False, "model.bfloat16(): bf16 weights"
        ),
        PrecisionSpec(
            "fp16-mixed",
            torch.float32,
            torch.float16,
            True,
            True,
            "fp32 weights, fp16 autocast, dynamic loss scaling (GradScaler)",
        ),
        PrecisionSpec(
            "bf16-mixed", torch.float32, torch.bfloat16, True, False, "fp32 weights, bf16 autocast"
        ),
    ]
}


def supported_on(spec: PrecisionSpec, device: torch.device) -> str | None:
    """None if ``spec`` runs on ``device``, else the reason it does not."""
    if device.type == "cuda" and spec.compute_dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        return f"{spec.name} needs bf16 support (NVIDIA Ampere or newer); {name} supports fp32, fp16-true, fp16-mixed"
    return None


def slow_on(spec: PrecisionSpec, device: torch.device) -> str | None:
    """A reason the precision is impractically slow on ``device`` (runs, but should not be benchmarked)."""
    if device.type == "cpu" and spec.compute_dtype is torch.float16:
        return (
            f"{spec.name} on CPU is ~100x slower than fp32 (no fast fp16 convolution backward on CPU); "
            "it needs a GPU to be worth measuring"
        )
    return None


def spec_of(name: str) -> PrecisionSpec:
    """The spec of precision ``name`` (stratbench's spelling); an unknown name is one line naming the known ones."""
    if name not in SPECS:
        raise ConfigError(f"unknown precision {name!r}{did_you_mean(name, SPECS)}; choose one of: {', '.join(SPECS)}")
    return SPECS[name]


class Precision:
    """Owns dtype conversion, autocast and the (scaled) backward/step for one precision choice."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.spec = spec_of(name)
        self.device = device
        reason = supported_on(self.spec, device)
        if reason:
            raise UnsupportedError(reason)
        # GradScaler() without a device means CUDA and silently disables itself on CPU: name the device.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.spec.loss_scaling)
        self.skipped_steps = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def loss_input(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits as the loss sees them: half precisions are upcast to fp32, fp32 and fp64 are kept as they are;
        an output that is no tensor (GoogLeNet's main and auxiliary logits in training) as it is, for a user's
        loss to take (the built-in loss refuses it in one line)."""
        if not isinstance(logits, torch.Tensor) or logits.dtype in (torch.float32, torch.float64):
            return logits
        return logits.float()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.spec.param_dtype is not torch.float32:
            return module.to(dtype=self.spec.param_dtype)
        return module

    def convert_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and self.spec.param_dtype is not torch.float32:
            return x.to(self.spec.param_dtype)
        return x

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.spec.autocast:
            return torch.autocast(self.device.type, dtype=self.spec.compute_dtype)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None = None) -> None:
        scaled = self.scaler.scale(loss)
        if backward is None:
            scaled.backward()
        else:
            backward(scaled)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place (before clipping); a no-op without loss scaling."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step through the scaler; returns False when the step was skipped (inf/NaN gradients)."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "skipped": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped", 0))


TF32_GPUS = "an NVIDIA GPU of the Ampere generation or newer"
"""Where TF32 exists: `train` refuses --tf32 elsewhere, and estimate/advise refuse it for such a profile."""


def configure_tf32(enabled: bool, device: torch.device) -> None:
    if enabled:
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            raise UnsupportedError(f"--tf32 needs {TF32_GPUS}; this device is {where}")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def cpu_native_16bit(dtype: torch.dtype) -> bool:
    """Whether torch runs ``dtype`` (bf16 or fp16) convolutions and matrix products in oneDNN on this CPU."""
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        enabled = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
        return bool(enabled and getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return False
