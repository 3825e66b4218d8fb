"""Training methods. Each module registers one strategy; ``base.discover()`` imports them all."""

from stratbench.strategies.base import (
    REGISTRY,
    CheckpointIO,
    CostModel,
    Strategy,
    all_strategies,
    get_strategy,
    register,
)

__all__ = ["REGISTRY", "CheckpointIO", "CostModel", "Strategy", "all_strategies", "get_strategy", "register"]
