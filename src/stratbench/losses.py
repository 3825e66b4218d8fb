"""The training loss: cross-entropy (optionally with label smoothing) or the user's own function.

A user loss is given as ``package.module:function`` and found like ``--model``/``--data`` builders (sys.path,
then the working directory). It is called as ``fn(logits, targets)`` and returns a scalar tensor; an
``nn.Module`` class is instantiated without arguments first. The validation loss stays plain cross-entropy
whatever the training loss, so that runs with different losses report comparable validation numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from stratbench.config import TrainConfig
from stratbench.errors import ConfigError

LOSSES = ("cross-entropy",)
"""Built-in losses (``--loss``); anything else must be a ``package.module:function``."""


def _resolve(spec: str) -> Callable:
    from stratbench.models import import_builder

    fn = import_builder(spec, "loss", noun="loss")
    if isinstance(fn, type):  # an nn.Module class (import_builder refuses other classes)
        try:
            fn = fn()
        except TypeError as exc:
            raise ConfigError(
                f"loss {spec!r}: the module class cannot be built without arguments ({exc})"
            ) from None
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise ConfigError(f"loss {spec!r} is not a loss: it must take (logits, targets) ({exc})") from None
    except ValueError:
        pass  # no signature to read: the first call checks it
    return fn


def check_loss(cfg: TrainConfig) -> None:
    """Before any work: a known loss name, or an importable user loss taking (logits, targets)."""
    if ":" in cfg.loss:
        if cfg.label_smoothing:
            raise ConfigError(
                f"--label-smoothing applies to cross-entropy only; the loss {cfg.loss!r} is the user's own"
            )
        _resolve(cfg.loss)
    elif cfg.loss not in LOSSES:
        raise ConfigError(
            f"unknown loss {cfg.loss!r}; choose one of: {', '.join(LOSSES)} (with --label-smoothing X), "
            "or a function as 'package.module:function'"
        )


def build_loss(cfg: TrainConfig) -> Callable:
    """The loss function the loop calls as ``loss_fn(logits, targets)``."""
    check_loss(cfg)
    if ":" in cfg.loss:
        return _resolve(cfg.loss)
    return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)


def describe_loss(cfg: TrainConfig) -> dict[str, Any]:
    """What result.json records about the loss."""
    out: dict[str, Any] = {"name": cfg.loss, "validation_loss": "cross-entropy"}
    if ":" not in cfg.loss:
        out["label_smoothing"] = cfg.label_smoothing
    return out
