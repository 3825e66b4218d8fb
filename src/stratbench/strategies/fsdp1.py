"""``fsdp1``: the legacy ``FullyShardedDataParallel`` wrapper as the source used it: an auto-wrap policy on
Linear and Conv2d modules (``ModuleWrapPolicy``), flat parameters, a ``ShardingStrategy``. Kept next to FSDP2
(``fsdp``) so that the two generations can be compared in one table.

On CPU: FSDP1 needs ``device_id=torch.device("cpu")``; ``CPUOffload`` fails there (it moves parameters between
a GPU and the host), so it is refused with a clear line. HYBRID_SHARD shards within a node and replicates
across nodes on a 2-D ``(nodes, ranks per node)`` device mesh built here (FSDP1 would otherwise derive its
groups from the CUDA device count).

Precision as fsdp's: FSDP1's ``MixedPrecision`` (gathered in the compute dtype, reduced in fp32), except for a model
with BatchNorm under a mixed precision (``fsdp.weights_cast_by_autocast``), whose weights stay fp32 and are cast
per op by autocast: FSDP1 would otherwise give every BatchNorm a unit of its own with mixed precision off
(``MixedPrecision._module_classes_to_ignore``), 53 more units beside ResNet-50's 54 Linear/Conv2d ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from stratbench.measuring.comm import Collective, ceil_to
from stratbench.strategies.base import CostModel, Strategy, register
from stratbench.strategies.costs import RankMemory, lean_refusal
from stratbench.strategies.parallel.fsdp import (
    CHECKPOINT_FORMATS,
    FSDPCheckpointIO,
    choice,
    gather_itemsize,
    policy_precision,
    weights_cast_by_autocast,
)

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclasses.dataclass(kw_only=True)
class FSDP1Options:
    """Options of the fsdp1 (legacy FullyShardedDataParallel) strategy."""

    sharding_strategy: str = "FULL_SHARD"
    """fsdp1: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP-like) or HYBRID_SHARD (shard within a node, replicate across nodes)."""
    use_orig_params: bool = False
    """fsdp1: expose the original parameters (views into the flat shards) to the optimizer instead of the flat parameters."""
    cpu_offload: bool = False
    """fsdp1: offload the flat parameter shards (and their gradients and optimizer step) to the host with FSDP1's CPUOffload; needs CUDA."""
    checkpoint_format: str = "sharded"
    """sharded (a torch.distributed.checkpoint folder, each rank writes its shards) or full (one file written by rank 0)."""

    def __post_init__(self) -> None:
        self.sharding_strategy = str(self.sharding_strategy).upper().replace("-", "_")
        choice("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        choice("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)


class FSDP1Cost(CostModel):
    """FSDP1's flat parameters, one per Linear/Conv2d unit (and the root), with the run's sharding strategy."""

    @staticmethod
    def units(ctx) -> list[tuple[int, bool]]:
        """(elements, trained) of each FlatParameter: one per Linear/Conv2d unit, the root (the rest) after them,
        then with LoRA one per adapter matrix (PEFT's ``lora_A``/``lora_B`` are nn.Linear modules, so the policy
        wraps each on its own: every FlatParameter is all frozen or all trained, as FSDP1 requires). Without
        LoRA every unit trains; with it, the adapters only."""
        info, lora = ctx.info, ctx.cfg.lora_rank > 0
        base = [(sum(info.numels[i] for i in u), not lora) for u in info.layer_units if u]
        return base + [(n, True) for n, _ in ctx.adapters]

    @classmethod
    def memory_model(cls, ctx, rank):
        """One FlatParameter per Linear/Conv2d unit (plus the root), padded to a multiple of the shard group and
        split evenly; units gathered whole around their forward/backward; gradients and optimizer state of the
        trained units only."""
        opts, info, pd = ctx.options, ctx.info, ctx.param_bytes
        kind = opts.sharding_strategy
        shards = {"NO_SHARD": 1, "HYBRID_SHARD": max(1, ctx.world // ctx.cfg.nnodes)}.get(kind, ctx.world)
        units = cls.units(ctx)
        local = sum(-(-e // shards) for e, _ in units)
        trained = [-(-e // shards) for e, t in units if t]
        m = RankMemory(params=local * pd, grads=sum(trained) * pd, optim=ctx.flat_optim_bytes(sum(trained)))
        m.step_scalars = 4 * len(trained) if ctx.adam else 0
        at_rest = " at rest" if kind == "SHARD_GRAD_OP" else ""
        m.sharding_note = "replicated" if shards == 1 else f"sharded 1/{shards}{at_rest}"
        if shards > 1:
            m.gathered = (sum(ctx.numels) if kind == "SHARD_GRAD_OP" else 2 * info.largest_layer) * pd
            m.gather_note = (
                "all unsharded from forward to backward" if at_rest else "2 layers (current + prefetch)"
            )
        elif opts.cpu_offload:
            m.gathered, m.gather_note = sum(ctx.numels) * pd, "offloaded parameters copied to the device"
        if opts.cpu_offload:
            m.offload_params_to_host(with_grads_and_optim=True)
            m.step_scratch = 0
        return m

    @classmethod
    def comm_model(cls, ctx):
        """One FlatParameter per Linear/Conv2d unit (and the root), each padded to a multiple of the shard group.
        FULL_SHARD: all-gather before forward and again before backward, reduce-scatter; SHARD_GRAD_OP: one
        all-gather; NO_SHARD: all-reduce. Gathered in the compute dtype under a mixed precision (in fp32 for a
        BatchNorm model, cast by autocast: ``gather_itemsize``), reduced in fp32. HYBRID_SHARD (two process
        groups) has no model yet."""
        kind, n, info = ctx.options.sharding_strategy, ctx.world, ctx.info
        if kind == "HYBRID_SHARD":
            return None
        if n <= 1:
            return []
        spec = ctx.pspec
        gather_bytes = gather_itemsize(ctx)
        reduce_bytes = 4 if spec.autocast else ctx.param_bytes
        units = cls.units(ctx)
        trained = [ceil_to(e, n) for e, t in units if t]
        if kind == "NO_SHARD":
            return [Collective("all_reduce", sum(e for e, t in units if t) * reduce_bytes, 1, "backward", n, "flat parameters")]
        elems, micro = sum(ceil_to(e, n) for e, _ in units), ctx.cfg.grad_accum
        calls = len(units) * micro
        rows = [
            Collective("all_gather", elems * gather_bytes * micro, calls, "forward", n, "flat parameters")
        ]
        if kind == "FULL_SHARD":
            # The root unit (the parameters outside every Linear/Conv2d, e.g. norms) stays gathered from forward
            # to backward: only the wrapped units are gathered again.
            root = (
                ceil_to(sum(info.numels[i] for i in info.layer_units[-1]), n) if info.layer_units[-1] else 0
            )
            again = (elems - root) * gather_bytes * micro
            rows.append(
                Collective("all_gather", again, calls - (micro if root else 0), "backward", n, "again")
            )
        # a frozen unit (LoRA's base) has no gradient to reduce
        rows.append(
            Collective(
                "reduce_scatter", sum(trained) * reduce_bytes * micro, len(trained) * micro, "backward", n,
                "gradients",
            )
        )  # fmt: skip
        return rows


class FSDP1CheckpointIO(FSDPCheckpointIO):
    """FSDP2's layouts (sharded folder or one full file) with FSDP1's full state dicts, FSDP1's deprecation
    chatter silenced."""

    def _full_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # offload_to_cpu=True full state dicts fail on CPU with FSDP1; there the gathered state already is on CPU.
        return StateDictOptions(full_state_dict=True, cpu_offload=self.strategy.env.device.type == "cuda")

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        with _quiet():
            return get_model_state_dict(model, options=self._full_options())

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with _quiet():
            return get_optimizer_state_dict(model, optimizer, options=self._full_options())

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        with _quiet():
            return super().save_checkpoint(path, model, optimizer, extra)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        with _quiet():
            return super().load_checkpoint(path, model, optimizer)


@register
class FSDP1Strategy(Strategy):
    name = "fsdp1"
    description = (
        "legacy FullyShardedDataParallel (flat parameters, Linear/Conv2d auto-wrap); --sharding-strategy"
    )
    requirements = (
        "torch.distributed (gloo on CPU, nccl on CUDA); one process per device; --cpu-offload needs CUDA"
    )
    launcher = "torchrun"
    needs_process_group = True
    Options = FSDP1Options

    def __init__(self, cfg, env, precision, options) -> None:
        super().__init__(cfg, env, policy_precision(precision), options)

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        opts = cls.parse_options(cfg.strategy_options)
        if device.type not in ("cpu", "cuda"):
            return f"fsdp1 runs on cpu or cuda devices, not {device.type}"
        if cfg.clip_grad_norm and cfg.precision == "fp64":
            return "fsdp1 with --clip-grad-norm cannot run fp64: FullyShardedDataParallel.clip_grad_norm_ computes the norms in fp32 and fails on fp64 gradients; use fp32, or fsdp (FSDP2)"
        if why := lean_refusal(cfg, "FSDP1 steps flat, sharded parameters (FlatParameter)"):
            return why
        if opts.cpu_offload and device.type != "cuda":
            return "fsdp1 --cpu-offload needs a CUDA device (FSDP1's CPUOffload fails on CPU); fsdp --cpu-offload works on CPU"
        if opts.sharding_strategy == "HYBRID_SHARD" and world_size % cfg.nnodes:
            return f"fsdp1 HYBRID_SHARD needs the world size ({world_size}) to be a multiple of the node count ({cfg.nnodes})"
        return None

    cost = FSDP1Cost
    checkpoint_io_class = FSDP1CheckpointIO

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        opts, spec, device = self.options, self.precision.spec, self.env.device
        # A device mesh (not a process group) also makes FSDP1's sharded state dicts DTensors rather than the
        # deprecated ShardedTensor.
        from torch.distributed.device_mesh import init_device_mesh

        if opts.sharding_strategy == "HYBRID_SHARD":
            nodes = self.cfg.nnodes
            mesh = init_device_mesh(
                device.type, (nodes, self.env.world_size // nodes), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(device.type, (self.env.world_size,), mesh_dim_names=("shard",))
        mixed = None
        self.precision.autocasts = weights_cast_by_autocast(model, device.type, spec)
        if spec.autocast and not self.precision.autocasts:
            # fp32 flat parameters, gathered in the compute dtype, gradients reduced in fp32
            mixed = MixedPrecision(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
        wrapped = FSDP(
            model,
            # FSDP1 on CPU has no current device to pick: it must be named (device_id=None fails).
            device_id=device if device.type == "cpu" else device.index,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear, nn.Conv2d}),
            sharding_strategy=ShardingStrategy[opts.sharding_strategy],
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=True) if opts.cpu_offload else None,
            use_orig_params=opts.use_orig_params,
            device_mesh=mesh,
        )
        self.units = len(FSDP.fsdp_modules(wrapped))
        return wrapped

    def report(self) -> dict:
        """The FSDP units (each flat parameter's gather/reduce group, the root included) and how the weights
        reach the compute dtype."""
        return {"fsdp": {"units": self.units, "weights": self.precision.report()}}

    def accumulate(self, is_last_micro_step: bool) -> contextlib.AbstractContextManager:
        # Skip the gradient reduction on all but the last micro-step where whole gradients are kept anyway;
        # FULL_SHARD/HYBRID_SHARD reduce every micro-step so that only gradient shards are held.
        if is_last_micro_step or self.options.sharding_strategy not in ("SHARD_GRAD_OP", "NO_SHARD"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # The flat gradient shards' norm must be reduced over the ranks: FSDP1's own method does it.
        return self.model.clip_grad_norm_(max_norm)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the deprecation chatter FSDP1's optimizer state dict code prints on every rank at every save
    (torch's own internals call the deprecated helpers; there is nothing for a user to change)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*_get_pg_default_device.*")
        warnings.filterwarnings("ignore", message=r"Multiple backends are registered.*")
        yield
