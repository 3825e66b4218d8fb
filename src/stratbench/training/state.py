"""Everything besides the model and optimizer that a resume needs, as one object saved and restored symmetrically
(torchtitan's ``TrainState``): progress, the LR scheduler, the precision's loss scaler, and every rank's RNG."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from stratbench.core.dist import rng_state, set_rng_state

if TYPE_CHECKING:
    from stratbench.strategies.base import Strategy


@dataclasses.dataclass
class Progress:
    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epochs completed."""
    batch_in_epoch: int = 0
    """Optimizer steps done in the current epoch (where the data order resumes)."""


class TrainState:
    """Progress, scheduler, precision state and RNG. ``state_dict`` is a collective (it gathers every rank's RNG)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, strategy: Strategy) -> None:
        self.progress = Progress()
        self.scheduler = scheduler
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return {
            "progress": dataclasses.asdict(self.progress),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.strategy.precision.state_dict(),
            "rng": self.strategy.all_gather_object(rng_state()),
            "world_size": self.strategy.env.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress = Progress(**state["progress"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.precision.load_state_dict(state.get("precision", {}))
        # Each rank continues its own random stream where the world size is unchanged; on another world size
        # the streams cannot be mapped and the seeded defaults stay (data order is reseeded per epoch anyway).
        rngs = state.get("rng")
        env = self.strategy.env
        if rngs and state.get("world_size") == env.world_size:
            set_rng_state(rngs[env.rank] if isinstance(rngs, list) else rngs)
