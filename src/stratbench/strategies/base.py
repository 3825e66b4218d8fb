"""The strategy interface every training method implements, and the registry the CLI, the comparison matrix
and the parametrised tests all read.

A strategy is one module holding one ``Strategy`` subclass decorated with ``@register``. It declares its
options as a small dataclass (``Options``; each field becomes a ``--flag``), what it needs
(``check_supported``), and implements set-up, backward, optimizer step, accumulation, collectives and
checkpointing. ``SingleDevice``-style no-op collectives mean the loop never asks "am I distributed?".
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from stratbench.config import TrainConfig, from_dict
from stratbench.errors import ConfigError

if TYPE_CHECKING:
    from stratbench.dist import DistEnv
    from stratbench.precision import Precision

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """This strategy has no options of its own."""


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy available under ``cls.name``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise RuntimeError(f"strategy name {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


class Strategy:
    """Base class. Subclasses override what differs; defaults implement one process on one device."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    needs_process_group: ClassVar[bool] = False
    """True for methods that run one process per device (torch.distributed)."""
    owns_precision: ClassVar[bool] = False
    """True when the strategy translates the precision itself (DeepSpeed, accelerate, FSDP policies)."""
    requirements: ClassVar[str] = "any device"
    """One line for `stratbench list`: what the method needs."""
    launcher: ClassVar[str] = "python"
    """How it is normally launched (python, torchrun, deepspeed, accelerate)."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, precision: Precision, options: Any) -> None:
        self.cfg = cfg
        self.env = env
        self.precision = precision
        self.options = options
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- what it needs ------------------------------------------------------------------------
    @classmethod
    def parse_options(cls, mapping: dict[str, Any]) -> Any:
        return from_dict(cls.Options, dict(mapping), where=f"strategy {cls.name!r} options")

    @classmethod
    def check_supported(cls, cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
        """None when the method can run here with this config, else one line naming the requirement."""
        return None

    @classmethod
    def data_parallel_size(cls, cfg: TrainConfig, world_size: int) -> int:
        """How many ways the global batch is split across processes (DataParallel splits inside one)."""
        return world_size

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move/convert/wrap the model, then build the optimizer on the wrapped parameters."""
        model = self.precision.convert_module(model).to(self.env.device)
        if self.cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = self.wrap(model)
        self.optimizer = make_optimizer(self.model.parameters())
        return self.model, self.optimizer

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module under any wrapper (DDP's ``.module``, DataParallel's, compile's ``_orig_mod``)."""
        while True:
            inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
            if not isinstance(inner, nn.Module):
                return model
            model = inner

    # ---- one step -----------------------------------------------------------------------------
    def forward_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward pass and loss under the precision's autocast; returns (loss, logits)."""
        x = self.precision.convert_input(x)
        with self.precision.autocast():
            logits = model(x)
            loss = loss_fn(logits.float(), y)
        return loss, logits

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step; methods that all-reduce gradients skip it on all but the last."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        assert self.model is not None
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip: float | None) -> bool:
        """Unscale, clip, step and zero the gradients; returns False when the step was skipped."""
        self.precision.unscale(optimizer)
        if clip:
            self.clip_grad_norm(clip)
        stepped = self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return stepped

    # ---- collectives (no-ops with one process) ------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            out: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(out, obj)
            return out
        return [obj]

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()

    def synchronize(self) -> None:
        """Wait for queued device work, so that a clock read after it is honest."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    # ---- state ----------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unwrapped, fp32-or-native state dict on CPU. A collective for sharded methods."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full optimizer state keyed by parameter names (portable across methods). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def save_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
        """Write a full checkpoint: every rank takes part in gathering, global rank 0 writes atomically."""
        from stratbench import checkpoint

        state = {"model": self.model_state_dict(model), "optimizer": self.optimizer_state_dict(model, optimizer)}
        if self.env.is_main:
            checkpoint.save_full(path, state | extra)
        self.barrier()
        return path

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Load any stratbench checkpoint (full file or sharded folder) into this method's model/optimizer."""
        from stratbench import checkpoint

        state = checkpoint.load_any(path)
        self.load_model_state_dict(model, state["model"])
        if optimizer is not None and state.get("optimizer"):
            self.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        return state

    # ---- measurement --------------------------------------------------------------------------
    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this rank actually holds."""
        return {
            "param_bytes": sum(_local_bytes(p) for p in model.parameters()),
            "grad_bytes": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer_state_bytes": sum(
                _local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
            ),
        }

    def memory_devices(self) -> list[torch.device]:
        """Devices whose memory this process should report (DataParallel reports every GPU)."""
        return [self.env.device]


def _local_bytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # DTensor (FSDP2): count the local shard only
    return local.numel() * local.element_size()


def get_strategy(name: str) -> type[Strategy]:
    discover()
    if name not in REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def all_strategies() -> dict[str, type[Strategy]]:
    discover()
    return dict(REGISTRY)


def iter_option_fields() -> Iterator[tuple[type[Strategy], dataclasses.Field]]:
    for cls in all_strategies().values():
        for f in dataclasses.fields(cls.Options):
            yield cls, f


_DISCOVERED = False


def discover() -> None:
    """Import every module in ``stratbench.strategies`` so that each registers itself."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    import importlib
    import pkgutil

    import stratbench.strategies as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "base":
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    _DISCOVERED = True
