"""Errors that the CLI turns into one clear line and a non-zero exit, before any work starts."""

from __future__ import annotations


def did_you_mean(name: str, choices) -> str:
    """" (did you mean 'x' or 'y'?)" for the (at most two) choices closest to a mistyped ``name``; '' where
    none is close."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


class StratbenchError(Exception):
    """Base class: the message is shown to the user as is."""

    exit_code = 2


class ConfigError(StratbenchError):
    """A bad option value or combination."""


class UnsupportedError(StratbenchError):
    """The method or precision cannot run on this machine; ``reason`` names the requirement."""

    exit_code = 3


class CheckpointError(StratbenchError):
    """A checkpoint that is missing, corrupt, or not one stratbench can load."""


class DataError(StratbenchError):
    """A data set that is missing or unreadable."""


class DivergedError(StratbenchError):
    """The loss became NaN/inf without a loss scaler to skip the step: the run stopped (status "diverged")."""

    exit_code = 4


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; a failed CPU allocation is a plain RuntimeError saying so."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )
