"""FLOPs of a model: forward+backward per sample, counted by torch's FLOP counter on the meta device (MFU in
the run record, the pipeline split's ``--balance flops``, the model's family in ``family``)."""

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


def example_input(n: int, sample_shape: tuple[int, ...], tokens: bool | None = None) -> torch.Tensor:
    """``n`` zero samples of ``sample_shape`` (on the current default device): token ids where ``tokens``
    (None: a 1-d shape (seq_len,) is token ids), else floating point (pixels (C, H, W), a row of features)."""
    ids = len(sample_shape) == 1 if tokens is None else tokens
    return torch.zeros(n, *sample_shape, dtype=torch.long if ids else torch.float32)


def flops_by_op(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    num_classes: int,
    tokens: bool | None = None,
) -> tuple[dict[str, float], set[type[nn.Module]]] | None:
    """(forward+backward FLOPs of one sample per op name, e.g. ``aten.convolution``; the model's module classes),
    counted on the meta device (nothing is allocated, so this works for any model size); None where the model
    cannot be traced there."""
    try:
        with torch.device("meta"):
            model = build()
            x = example_input(2, sample_shape, tokens)
        counter = flop_counter()
        with counter:
            logits = model(x)
            y = torch.zeros(
                logits.shape[:-1], dtype=torch.long, device="meta"
            )  # a class, or a token per position
            loss = nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())
            loss.backward()
        counts = counter.get_flop_counts().get("Global", {})
        return {str(op): n / 2 for op, n in counts.items()}, {type(m) for m in model.modules()}
    except Exception:  # a user model the meta device cannot trace: no MFU rather than a wrong one
        return None


def flops_per_sample(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    num_classes: int,
    tokens: bool | None = None,
) -> float | None:
    """Forward+backward FLOPs of one sample, counted by ``flop_counter`` on the meta device."""
    counted = flops_by_op(build, sample_shape, num_classes, tokens)
    return None if counted is None else sum(counted[0].values())


def linear_flops(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    select: Callable[[nn.Module], list[str]],
    tokens: bool | None = None,
) -> float | None:
    """Forward+backward FLOPs of one sample in the ``nn.Linear`` layers ``select(model)`` names (``--float8``'s
    converted ones, ``transforms.float8.convertible``): each forward product of ``rows x in`` by ``in x out`` is
    ``2 x rows x in x out`` FLOPs and backward makes two more of the same size (the input's gradient and the
    weight's), as ``flop_counter`` counts them. Counted on the meta device (the rows each layer sees, by a
    forward hook); None where it cannot trace."""
    rows: dict[str, int] = {}

    def seen(name: str) -> Callable[..., None]:
        def hook(module: nn.Linear, args: object, out: torch.Tensor) -> None:
            rows[name] = rows.get(name, 0) + out.numel() // module.out_features

        return hook

    try:
        with torch.device("meta"):
            model = build()
            x = example_input(2, sample_shape, tokens)
        names = set(select(model))
        hooks = [
            m.register_forward_hook(seen(n))
            for n, m in model.named_modules()
            if n in names and isinstance(m, nn.Linear)
        ]
        with torch.no_grad():
            model(x)
        for h in hooks:
            h.remove()
    except Exception:  # as flops_by_op: a model the meta device cannot trace has no count
        return None
    layers = dict(model.named_modules())
    forward = sum(2 * r * layers[n].in_features * layers[n].out_features for n, r in rows.items())
    return 3 * forward / 2
