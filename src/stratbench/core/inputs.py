"""A model's input as a user's data gives it: one tensor (an image, a row of features, token ids), a tuple of
tensors (``model(*inputs)``) or a mapping of names to tensors (``model(**inputs)``); what the loop does to an
input (moving it, casting it to the precision's dtype) it does to each tensor in it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

Inputs = torch.Tensor | tuple | list | Mapping
"""One tensor, a tuple/list of tensors, or a mapping of names to tensors."""


def map_inputs(fn: Callable[[torch.Tensor], torch.Tensor], x: Inputs) -> Inputs:
    """``fn`` applied to each tensor of ``x`` (anything else in it kept as it is), the structure kept."""
    if isinstance(x, Mapping):
        return {k: map_inputs(fn, v) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return type(x)(map_inputs(fn, v) for v in x)
    return fn(x) if torch.is_tensor(x) else x


def call_model(model: nn.Module, x: Inputs) -> Any:
    """``model(x)``, ``model(*x)`` for a tuple or list, ``model(**x)`` for a mapping."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, tuple | list):
        return model(*x)
    return model(x)


def check_inputs(x: Any, where: str) -> str:
    """What the first item's input is ("a tensor", "a tuple of 2 tensors", "a mapping of tensors mask, ids");
    one line (a ValueError) naming ``where`` when it is none of them."""
    if torch.is_tensor(x):
        return "a tensor"
    parts = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, tuple | list) else None
    if parts and all(torch.is_tensor(p) for p in parts):
        if isinstance(x, Mapping):
            return f"a mapping of tensors {', '.join(map(str, x))}"
        return f"a {type(x).__name__} of {len(parts)} tensors"
    raise ValueError(f"{where}: an item's input must be a tensor, a tuple of tensors or a mapping of names to tensors, "
                     f"got {type(x).__name__}")  # fmt: skip
