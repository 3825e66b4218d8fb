"""One process on one device (one CPU or one GPU): the baseline every other method is compared against."""

from __future__ import annotations

from stratbench.strategies.base import CostModel, Strategy, register


class SingleCost(CostModel):
    """Every state on the one device; no collectives."""

    @classmethod
    def memory_model(cls, ctx, rank):
        return ctx.replicated(buckets=False)

    @classmethod
    def comm_model(cls, ctx):
        return []  # one process: no collectives


@register
class SingleDevice(Strategy):
    name = "single"
    takes_moe = True
    description = "one process, one device (CPU or one GPU); the baseline"
    requirements = "any device, one process"
    baseline = True
    spans_devices = False
    takes_float8 = True

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if world_size != 1:
            return (
                f"single runs one process; it was started with world size {world_size} (use ddp, fsdp, ...)"
            )
        return None

    @classmethod
    def quantize_refusal(cls, cfg) -> str | None:
        return None  # QLoRA's NF4 and int8 bases train on one device (tests/strategies/test_qlora.py)

    cost = SingleCost
