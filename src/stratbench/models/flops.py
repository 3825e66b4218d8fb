"""FLOPs of a model: forward+backward per sample, counted by torch's FLOP counter on the meta device (MFU in
the run record, the pipeline split's ``--balance flops``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def flop_counter():
    """The FLOP counter of every count stratbench makes (``torch.utils.flop_counter``, silent): the whole
    model's here (``flops_per_sample``: MFU) and each pipeline piece's (``split.piece_costs``: the
    ``--balance flops`` split), so that the pieces' FLOPs add up to the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def flops_per_sample(
    build: Callable[[], nn.Module], sample_shape: tuple[int, ...], num_classes: int
) -> float | None:
    """Forward+backward FLOPs of one sample, counted by ``flop_counter`` on the meta device (nothing is
    allocated, so this works for any model size)."""
    try:
        with torch.device("meta"):
            model = build()
            x = torch.empty(2, *sample_shape)
            y = torch.zeros(2, dtype=torch.long)
        counter = flop_counter()
        with counter:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        return counter.get_total_flops() / 2
    except Exception:  # a user model the meta device cannot trace: no MFU rather than a wrong one
        return None
