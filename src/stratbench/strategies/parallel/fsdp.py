"""FSDP2 (``fully_shard``) as a building block: its memory and communication per rank (``fsdp2_memory``,
``fsdp2_comm``), the precision a sharding wrapper applies (``PolicyPrecision``: a mixed-precision policy, or fp32
gathers cast by autocast for a BatchNorm model, ``weights_cast_by_autocast``) and the checkpoint I/O of a sharded
model (``FSDPCheckpointIO``: a DCP folder or one full file). The fsdp, fsdp1 and accelerate-fsdp methods compose
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path

import torch
from torch import nn

from stratbench.checkpoints import sharded  # also registers the "dcp" checkpoint layout reader on discovery
from stratbench.core.errors import ConfigError
from stratbench.core.precision import Precision
from stratbench.measuring.comm import Collective, dim0_padded
from stratbench.measuring.model_trace import ModelSpec, fake_mode
from stratbench.strategies.base import CheckpointIO
from stratbench.strategies.costs import CPU_FSDP2_RUNTIME_BYTES, RankMemory, chunk_rows

CHECKPOINT_FORMATS = ("sharded", "full")


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """One line naming ``value`` and the allowed ones when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")


class PolicyPrecision(Precision):
    """The precision as a sharding wrapper applies it: no autocast (the wrapper's mixed-precision policy casts
    the gathered weights and the inputs) unless ``autocasts`` (set by the wrapper: ``weights_cast_by_autocast``),
    and a loss scaler that agrees across ranks on skipping a step."""

    autocasts: bool = False
    """The wrapper gathers fp32 weights and the precision's autocast casts them per op."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        if self.spec.loss_scaling:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # Each rank sees only its gradient shards: the scaler must all-reduce "found inf" so that every
            # rank skips the same steps (a plain GradScaler would let the shards diverge).
            self.scaler = ShardedGradScaler(device.type, enabled=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        return super().autocast() if self.autocasts else contextlib.nullcontext()

    def report(self) -> str:
        """How the weights reach the compute dtype, for result.json."""
        if not self.spec.autocast:
            return f"{self.spec.param_dtype} as held"
        how = "fp32, cast per op by autocast" if self.autocasts else "gathered in the compute dtype (policy)"
        return f"{how} ({self.spec.compute_dtype})"


def policy_precision(precision: Precision) -> PolicyPrecision:
    return PolicyPrecision(precision.name, precision.device)


BATCHNORM_TAKES_HALF_WEIGHTS: dict[str, bool] = {"cpu": False, "cuda": False}
"""Whether a device's batch_norm takes 16-bit weights beside fp32 running statistics, which is what a policy
gathering in the compute dtype hands a BatchNorm (it casts a unit's parameters, never its buffers). cpu: no, the
forward raises "expected scalar type BFloat16 but found Float" (torch 2.13 here). cuda: no, a BatchNorm2d's
backward raises "Expected running_mean to have type BFloat16 but got Float": PyTorch's own FSDP2 test asserts it
on a GPU (test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py, ``_test_norm_modules``; also
torchtitan issue 674), not run here. Both take fp32 weights with 16-bit activations (their mixed-type kernels,
what `single` runs under autocast). A device not listed is taken not to."""


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def has_batchnorm_weights(model: nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm with parameters (affine): what a 16-bit gather would hand it."""
    return any(_is_batchnorm(m) and any(True for _ in m.parameters(recurse=False)) for m in model.modules())


def _policy_would_fail_batchnorm(spec, device_type: str) -> bool:
    """A mixed precision's policy would hand BatchNorm 16-bit weights on a device that refuses them."""
    return spec.autocast and not BATCHNORM_TAKES_HALF_WEIGHTS.get(device_type, False)


def weights_cast_by_autocast(model: nn.Module, device_type: str, spec) -> bool:
    """Whether FSDP gathers the weights in fp32 and the precision's autocast casts them per op (Lightning's FSDP
    bf16-mixed), instead of gathering them in the compute dtype (a ``MixedPrecisionPolicy``: torchtitan's). So
    for a mixed precision on a model with BatchNorm weights on a device whose batch_norm cannot take them in 16
    bits (``BATCHNORM_TAKES_HALF_WEIGHTS``). The ways to keep the policy cost more: a unit per BatchNorm (PyTorch's
    FSDP2 advice, FSDP1's default) adds 53 units to ResNet-50's 17, each gathered, hooked and reduced apart (with
    them fsdp took 2.7x `single`'s step on one H200, 2026-11-26); one ``fully_shard([...])`` group of them all
    deadlocked in a backward prefetch under activation checkpointing (2 gloo ranks, torch 2.13). The price:
    gathers in fp32, 2x the bytes."""
    return _policy_would_fail_batchnorm(spec, device_type) and has_batchnorm_weights(model)


@functools.cache
def _spec_has_batchnorm_weights(spec: ModelSpec) -> bool:
    """``has_batchnorm_weights`` of the model of ``spec`` for the cost model, built on the meta device (llama-8b:
    0.04 s; on fake tensors, where a model cannot be built on meta: 3.8 s)."""
    try:
        with torch.device("meta"):
            return has_batchnorm_weights(spec.build())
    except Exception:  # an init that reads values: fake tensors carry on where meta ones cannot
        with fake_mode():
            return has_batchnorm_weights(spec.build())


def gathers_fp32(ctx) -> bool:
    """The cost model's ``weights_cast_by_autocast``: the run's model, precision and device."""
    return _policy_would_fail_batchnorm(ctx.pspec, ctx.device_type) and _spec_has_batchnorm_weights(
        ModelSpec.from_config(ctx.cfg)
    )


def gather_itemsize(ctx) -> int:
    """Bytes per element of the gathered weights: the compute dtype under a mixed precision's policy, else (fp32
    gathers under autocast, or a precision without one) the weights' own."""
    return (
        ctx.pspec.compute_dtype.itemsize if ctx.pspec.autocast and not gathers_fp32(ctx) else ctx.param_bytes
    )


def gathered_bytes(ctx, n: int, itemsize: int) -> int:
    """Bytes one all-gather of every parameter moves under FSDP2 over ``n`` ranks: each padded along dim 0 to a
    multiple of ``n`` in ``itemsize``; a QLoRA NF4 weight gathers its 4-bit codes and scales instead
    (torchao's FSDP2 all-gather hooks: ``MemoryContext.param_bytes_of``)."""
    quantized = ctx.quantized
    plain = [i for i, q in enumerate(quantized) if not q]
    elems = dim0_padded([ctx.numels[i] for i in plain], [ctx.dim0[i] for i in plain], n)
    return elems * itemsize + sum(ctx.param_bytes_of(i) for i, q in enumerate(quantized) if q)


def fsdp2_comm(ctx, sharding: str):
    """FSDP2's traffic per optimizer step. Each parameter is a dim-0-chunked DTensor, so every call moves the
    parameters padded to a multiple of the shard group along dim 0. full: all-gather before forward and again
    before backward (every unit, the root included, is resharded after forward), reduce-scatter of the
    gradients; grad-op: one all-gather (kept from forward to backward); none (replicate): all-reduce.
    Gathers in the policy's param dtype (the compute dtype under a mixed precision; fp32 for a BatchNorm model,
    cast by autocast: ``gather_itemsize``), reductions in fp32 then; with gradient accumulation full sharding
    gathers and reduce-scatters every micro-step, grad-op/none reduce once."""
    n = ctx.world
    if n <= 1:
        return []
    gather_bytes = gather_itemsize(ctx)
    reduce_bytes = reduce_itemsize(ctx)
    units = unit_count(ctx)  # one call per unit (blocks + root, as wrapped)
    if sharding == "none":
        note = "replicated (HSDP with a shard group of one)"
        return [Collective("all_reduce", sum(ctx.trainable_numels) * reduce_bytes, units, "backward", n, note)]
    micro = ctx.cfg.grad_accum
    gather = gathered_bytes(ctx, n, gather_bytes) * micro
    rows = [Collective("all_gather", gather, units * micro, "forward", n, "parameters before forward")]
    if sharding == "full":
        rows.append(Collective("all_gather", gather, units * micro, "backward", n, "again for backward"))
    reduces = gradient_reductions(ctx, sharding)
    reduced = trained_padded(ctx, n) * reduce_bytes * reduces
    rows.append(Collective("reduce_scatter", reduced, units * reduces, "backward", n, "gradients"))
    return rows


def reduce_itemsize(ctx) -> int:
    """Bytes per element of the reduced gradients: fp32 under a mixed precision's policy, else the weights'."""
    return 4 if ctx.pspec.autocast else ctx.param_bytes


def unit_count(ctx) -> int:
    """FSDP2 units as wrapped (the blocks and the root): one gather / reduce call each."""
    return max(1, sum(1 for u in ctx.info.block_units if u))


def gradient_reductions(ctx, sharding: str) -> int:
    """How many times per optimizer step the gradients are reduced: every micro-step under full sharding (only
    shards are kept), once for grad-op / none (the sync is off until the last micro-step)."""
    return ctx.cfg.grad_accum if sharding == "full" else 1


def trained_padded(ctx, n: int) -> int:
    """Elements of the trained parameters' gradients as FSDP2 reduce-scatters them over ``n`` ranks (each padded
    along dim 0 to a multiple of ``n``); a frozen parameter (LoRA's base) is gathered but has no gradient."""
    trained = [(e, d) for e, d, t in zip(ctx.numels, ctx.dim0, ctx.trainable, strict=True) if t]
    return dim0_padded([e for e, _ in trained], [d for _, d in trained], n)


def hsdp_comm(ctx, sharding: str, replicate: int) -> list[Collective]:
    """HSDP's traffic per optimizer step on a (replicate = R, shard = world / R) mesh (FSDP2 on a 2-D mesh):
    FSDP2's all-gathers and reduce-scatters (``fsdp2_comm``) over each shard group of world / R ranks (dim
    "shard"), then each rank's gradient shard all-reduced over the R replicas (dim "replicate"): the
    reduce-scatter's output, 1/S of the padded gradients, in the reduce dtype, once per unit and reduction."""
    shard = dataclasses.replace(ctx, world=ctx.world // replicate)
    rows = [dataclasses.replace(r, dim="shard") for r in fsdp2_comm(shard, sharding)]
    reduces = gradient_reductions(ctx, sharding)
    s = shard.world
    payload = trained_padded(ctx, s) // s * reduce_itemsize(ctx) * reduces
    note = f"gradient shards (1/{s}) over the replicas"
    rows.append(
        Collective("all_reduce", payload, unit_count(ctx) * reduces, "backward", replicate, note, dim="replicate")
    )
    return rows


def fsdp2_memory(ctx, rank: int, sharding: str, offload: bool):
    """FSDP2's per-rank model states: every parameter split along dim 0 (torch.chunk: the last ranks may get
    fewer rows), gradients and optimizer state alike; units gathered whole around their forward/backward."""
    info, world, pd = ctx.info, ctx.world, ctx.param_bytes
    total = sum(ctx.numels)
    # each parameter's local elements (LoRA's adapters included); gradients and optimizer state for the trained
    # ones only (with LoRA the frozen base has neither)
    shards = [
        n if sharding == "none" else n // d0 * chunk_rows(d0, world, rank)
        for n, d0 in zip(ctx.numels, ctx.dim0, strict=True)
    ]
    trained = sum(n for n, t in zip(shards, ctx.trainable, strict=True) if t)
    shapes = ctx.shapes
    if sharding != "none":  # each rank's dim-0 chunk of every parameter (a 0-dim one counted as one row)
        shapes = [(chunk_rows(s[0], world, rank), *s[1:]) for s in (s or (1,) for s in shapes)]
    trained_shapes = [s for s, t in zip(shapes, ctx.trainable, strict=True) if t]
    params = sum(ctx.param_bytes_of(i, n) for i, n in enumerate(shards))  # an NF4 weight: its split codes
    m = RankMemory(params=params, grads=trained * pd, optim=ctx.shard_optim_bytes(trained_shapes))
    m.step_scalars = 4 * len(ctx.trainable_numels) if ctx.adam else 0
    m.cpu_runtime, m.cpu_runtime_note = CPU_FSDP2_RUNTIME_BYTES, "DTensor's op caches and linecache, measured"
    m.sharding_note = {"full": "sharded 1/N", "grad-op": "sharded 1/N at rest", "none": "replicated"}[
        sharding
    ]
    if sharding != "none":
        # The unit being computed and the one prefetched: the two largest units (the whole model when it has
        # no block units, only the root -- not twice the model).
        gathered_dtype = gather_itemsize(ctx)
        units = sorted((sum(info.numels[i] for i in u) for u in info.block_units if u), reverse=True)
        unit_bytes = sorted((ctx.unit_bytes(u, gathered_dtype) for u in info.block_units if u), reverse=True)
        # + the reduce-scatter input of the largest unit: its gradients copied into one flat buffer (in the
        # reduce dtype) while the unsharded gradients still exist (measured: ResNet-18 on 2 CPU ranks was 11-12%
        # above the estimate without it, 2-5% with it).
        reduce_bytes = 4 if ctx.pspec.autocast else pd
        everything = ctx.unit_bytes(list(range(len(ctx.numels))), gathered_dtype)
        unsharded = everything if sharding == "grad-op" else sum(unit_bytes[:2])
        # with LoRA only the adapters' gradients are reduced: the unit's share of them (spread like the base)
        reduced = units[0] if all(ctx.trainable) else units[0] * sum(ctx.trainable_numels) // total
        m.gathered = unsharded + reduced * reduce_bytes
        if not all(ctx.trainable) and sharding == "full" and len(units) > 1:
            # A frozen base (LoRA) leaves one more unit unsharded through backward: the first block's input (a
            # frozen embedding's output) needs no gradient, so FSDP2 registers no post-backward hook on it and
            # reshards it only in the root's final callback. Measured on 2 CPU ranks (gpt-tiny fp64, rank 4): the
            # peak 3.3 MiB above the same run's estimate without this, one block's weights
            m.gathered += unit_bytes[0]
            m.gather_note += " + one more unit (frozen base, measured)"
        m.gather_note = (
            "all unsharded from forward to backward"
            if sharding == "grad-op"
            else "2 largest units (current + prefetch)"
            if len(units) > 1
            else "the whole model (one unit: the root)"
        ) + " + the largest unit's reduce-scatter buffer"
    elif offload:
        m.gathered, m.gather_note = total * pd, "offloaded parameters copied to the device"
    if offload:
        m.offload_params_to_host(with_grads_and_optim=True)
        m.step_scratch = 0  # the optimizer steps on the host
    return m


class FSDPCheckpointIO(CheckpointIO):
    """``sharded`` (default): a ``torch.distributed.checkpoint`` folder, each rank writing its own shards and
    reading them back whatever world size wrote them; ``full``: the base's one file, gathered on rank 0 (an
    earlier sharded folder at the path is replaced only once the new file is complete)."""

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        if self.strategy.options.checkpoint_format == "full":
            return super().save_checkpoint(path, model, optimizer, extra)
        return sharded.save_sharded(path, model, optimizer, extra, is_main=self.strategy.env.is_main)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        if sharded.is_dcp(path):  # each rank reads its own shards, whatever world size wrote them
            return sharded.load_sharded(path, model, optimizer)
        return super().load_checkpoint(path, model, optimizer)
