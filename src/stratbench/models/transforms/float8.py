"""``--float8 tensorwise|rowwise``: float8 training of the model's Linear layers through torchao
(``convert_to_float8_training``, torchtitan's ``float8`` converter): each converted Linear casts its input and
weight to float8 e4m3 (the output's gradient to e5m2) with dynamic scales, multiplies with ``torch._scaled_mm``
and returns the result in the input's dtype; the weights, their gradients and the optimizer state stay in the
run's precision. ``tensorwise`` has one scale per tensor (torchao's fastest), ``rowwise`` one per row
(torchao's more accurate recipe). The rest of the model (norms, attention's softmax, the loss) runs in the run's
precision: with ``--precision bf16-mixed`` this is torchtitan's float8 recipe (float8 matmuls, bf16 elsewhere).

Which layers: every ``nn.Linear`` but the output head (the model's last Linear, as torchtitan leaves ``output``
out) whose in- and out-features are multiples of 16, which ``_scaled_mm`` requires. A model with no such layer is
refused. On a GPU only devices with float8 units run it (compute capability 8.9: Ada, Hopper and later); on a
CPU torch's ``_scaled_mm`` has a reference kernel: a correctness run, not a speed measurement (the float8 casts
cost more than they save there).

Memory: a converted Linear saves its input and weight for backward as float8 casts with their scales instead of
the input in the run's dtype (tensorwise; rowwise saves the high-precision tensors and casts again in backward):
the estimate traces the converted model (``traced``), so it counts what the conversion keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.optim import import_torchao
from stratbench.core.precision import Precision
from stratbench.models.transforms.base import Cost, Phase, Transform
from stratbench.models.transforms.lora import linear_layers

MULTIPLE = 16
"""``torch._scaled_mm`` needs both matrix dimensions of a float8 product to be multiples of 16."""


def convertible(model: nn.Module) -> list[str]:
    """The Linear layers ``--float8`` converts: every ``nn.Linear`` but the last (the output head) whose in- and
    out-features are multiples of 16."""
    names, features = linear_layers(model)
    return [n for n, (i, o) in zip(names[:-1], features[:-1], strict=True) if i % MULTIPLE == 0 and o % MULTIPLE == 0]


@dataclass(frozen=True)
class Float8(Transform):
    """The model's Linear layers as torchao ``Float8Linear`` (``recipe``: tensorwise or rowwise)."""

    recipe: str = "tensorwise"
    name = "float8"
    phase = Phase.BEFORE_WRAP
    traced = True
    cost = Cost(
        activations="each converted Linear's saved input and weight as float8 casts (tensorwise; traced)",
        flops="the same matmuls, in float8: the projection prices them at the GPU's fp8 peak (projection.float8_rate)",
        note="weights, gradients and optimizer state unchanged (the run's precision)",
    )

    def applies_to(self, cfg: TrainConfig) -> bool:
        return cfg.float8 != "none"

    def label(self, cfg: TrainConfig) -> str:
        return f"{self.name}:{cfg.float8}"

    def configured(self, cfg: TrainConfig) -> Transform:
        return Float8(cfg.float8)

    def apply(self, model: nn.Module, precision: Precision | None) -> nn.Module:
        names = set(convertible(model))
        if not names:
            raise ConfigError(
                f"--float8 {self.recipe}: the model has no Linear layer to convert (besides the output head, "
                f"every Linear with in- and out-features that are multiples of {MULTIPLE})"
            )
        float8 = import_torchao("torchao.float8")
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        return float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: fqn in names
        )


def float8_unsupported(device: torch.device) -> str | None:
    """Why ``device`` cannot run float8 training, in one line; None where it can (a CPU: a correctness run)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (
            f"--float8 needs a GPU with float8 units (compute capability 8.9 or later: Ada, Hopper, Blackwell); "
            f"{name} is {major}.{minor}"
        )
    return None
