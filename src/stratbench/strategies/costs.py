"""The types and formulas the strategies' cost models share: what one rank holds (``RankMemory``), what a cost
model reads (``MemoryContext``), the sharding arithmetic (ZeroRedundancyOptimizer's partition, FSDP2's dim-0
chunks) and the library defaults that size buffers.

A leaf below the strategies and the estimate: it imports nothing of either (docs/memory.md gives every formula).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.optim import (
    describe_state,
    elementwise_slots,
    state_bytes,
    states_per_local_shard,
    step_counter_bytes,
)
from stratbench.core.precision import SPECS
from stratbench.data.text import is_ft_data
from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelInfo
from stratbench.models.transforms.lora import adapter_shapes
from stratbench.models.transforms.quantize_base import quantized_names, weight_bytes

MiB = 1024**2

# FSDP2 on CPU: DTensor's sharding propagation runs each new op on fake tensors, which record their stack; the
# source lines of those frames stay in Python's linecache, and its cache of op schemas stays too. Not tensor
# memory (on a GPU it is host memory), but malloc's on a CPU: 0.31-0.34 MiB above the other methods, measured
# at 2 ranks (tinynet, fp32 and bf16-mixed; tracemalloc names linecache and torch/distributed/tensor).
CPU_FSDP2_RUNTIME_BYTES = MiB // 3

# Tensor parallelism (tp, pipeline --tp) on CPU: the same kind of memory, more of it (a block's DTensor ops are
# many and varied: Megatron's column/row-parallel matmuls, their redistributes and all-reduces). Measured on this
# VM (AMD EPYC, torch 2.13.0+cpu, gpt-tiny fp64, sequence 32, 2026-11-25) as the allocator peak minus the traced
# terms: tp over 2 ranks 2.1 MiB (batch 4); pipeline --pp 2 --tp 2 3.3 and 4.2 MiB at micro-batches of 2 and 4,
# ~2.4 MiB at none. Its part of the traced activations is exact (autograd saves 1,226,752 bytes per block on a
# real tp rank, as the traced slice does).
CPU_TP_RUNTIME_BYTES = 2 * MiB

# DeepSpeed defaults that size its buffers (elements), from deepspeed/runtime/zero/config.py.
DS_REDUCE_BUCKET = 500_000_000
DS_PARAM_PERSISTENCE = 100_000
DS_PREFETCH_BUCKET = 50_000_000


# ------------------------------------------------------------------------------------------------
# Sharding arithmetic the strategies' memory models share.


def zero_partition(numels: list[int], world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition (torch/distributed/optim/zero_redundancy_optimizer.py): parameters
    sorted by size, largest first, each given to the rank with the fewest elements so far (first on ties)."""
    sizes = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):  # stable, like torch's sorted
        r = sizes.index(min(sizes))
        owned[r].append(i)
        sizes[r] += numels[i]
    return owned


def chunk_rows(dim0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 torch.chunk that rank holds (FSDP2's sharding: the last ranks may get fewer or none)."""
    size = -(-dim0 // world)
    return max(0, min(dim0, (rank + 1) * size) - rank * size)


@dataclass
class RankMemory:
    """Model-state bytes of one rank, split by where they live, as a strategy's ``memory_model`` gives them."""

    params: int = 0
    grads: int = 0
    optim: int = 0
    master: int = 0
    buckets: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optim: int = 0
    host_master: int = 0
    step_scalars: int = 0
    """AdamW's per-parameter ``step`` counters (0-dim float32 tensors kept on the CPU)."""
    gathered: int = 0
    """Unsharded parameters held transiently around a unit's forward/backward (current + prefetched)."""
    gather_note: str = ""
    units_note: str = ""
    """The units a sharding method gathers one at a time, in words (FSDP's ``--wrap``); empty where none."""
    sharding_note: str = ""
    bucket_note: str = ""
    grads_whole_in_backward: bool = False
    """True where every gradient stays until a reduction at the end of backward (DeepSpeed ZeRO 0/1)."""
    grads_in_backward: int | None = None
    """Bytes of gradients the rank holds at the end of backward where it holds only part of the traced model's
    (DeepSpeed-MoE at ZeRO 0/1: the dense gradients and its own experts'); None: ``grads_whole_in_backward``'s."""
    saved_extra: int = 0
    saved_extra_note: str = ""
    """Activations the method saves beyond the traced model's (DeepSpeed-MoE's experts on their padded rows): added
    to the saved activations and the working peak."""
    step_scratch: int | None = None
    """Optimizer-step temporaries; None: the foreach kernels' rule (one parameter-sized list on CUDA)."""
    activations: int | None = None
    """Activations the method computes itself (a pipeline stage: its micro-batches in flight); None: the whole
    model traced at the per-device micro-batch."""
    activation_note: str = ""
    data_ranks: int | None = None
    """How many ways the global batch is split per micro-step, where it is not the world size (tensor-parallel
    ranks all compute the same batch: 1); the traced micro-batch is the batch over these and accumulation."""
    trace_transform: Callable[[nn.Module], None] | None = None
    """Applied in place to the model before it is traced, where a rank computes a slice of it (a tensor-parallel
    rank's narrowed matrices); hashable (the traces are cached), e.g. a frozen dataclass with ``__call__``."""
    trace_seq_len: int | None = None
    """The positions one sample has on this rank, where it is not the run's --seq-len (a context-parallel rank's
    chunk, T / C): the trace runs on that many; None: the run's."""
    trace_precision: str | None = None
    """The precision the method's forward/backward really runs in, where it is not the run's: DeepSpeed converts
    the model to fp16/bf16 itself and runs it without autocast (its activations are a ``*-true`` run's, with no
    autocast weight casts); None: the run's precision."""
    runs_linear: bool | None = None
    """Whether this rank runs an nn.Linear (a CPU's 16-bit matrix products keep buffers); None: the whole model
    runs on every rank, so it does if the model has one."""
    cpu_runtime: int = 0
    cpu_runtime_note: str = ""
    """Memory the method's own runtime keeps on a CPU outside tensors (FSDP2's DTensor caches)."""

    def offload_params_to_host(self, with_grads_and_optim: bool = False) -> None:
        self.host_params, self.params = self.host_params + self.params, 0
        if with_grads_and_optim:
            self.host_grads, self.grads = self.host_grads + self.grads, 0
            self.host_optim, self.optim = self.host_optim + self.optim, 0

    def offload_optimizer_to_host(self) -> None:
        self.host_optim, self.optim = self.host_optim + self.optim, 0
        self.host_master, self.master = self.host_master + self.master, 0


@dataclass
class MemoryContext:
    """What a strategy's memory model reads: the run config, world size, model shapes and parsed options."""

    cfg: TrainConfig
    world: int
    info: ModelInfo
    options: Any
    device_type: str = "cuda"
    busiest_rank: bool = False
    """Price expert parallelism's exchanges at the busiest rank of an ep group (the projection: every all-to-all
    waits for it; ``parallel.ep_costs``); False: at balanced routing (the formula a run's --comm-volume check and
    ``estimate`` state)."""
    routed_counts: list[list[int]] | None = None
    """A measured MoE run's assignments per layer and expert (result.json's ``moe.tokens_per_expert``), where the
    projection was calibrated on one: the busiest rank's share is read from them; None: a stated default."""
    routed_source: str = ""
    """Where ``routed_counts`` come from (the calibration run), said in the exchanges' note."""

    @functools.cached_property
    def adapters(self) -> list[tuple[int, int]]:
        """(numel, dim 0) of each parameter LoRA adds (``--lora-rank``; none without): A then B per Linear.
        Resolved once per context: ``numels``, ``dim0``, ``trainable`` and ``shapes`` all read it."""
        return adapter_shapes(self.info.linear_names, self.info.linear_features, self.cfg)

    @property
    def numels(self) -> list[int]:
        """Every parameter's numel the run holds: the model's (``info.numels``), then LoRA's adapters."""
        return self.info.numels + [n for n, _ in self.adapters]

    @property
    def dim0(self) -> list[int]:
        """Dim 0 of each of ``numels`` (FSDP2 shards along it)."""
        return self.info.dim0 + [d for _, d in self.adapters]

    @property
    def trainable(self) -> list[bool]:
        """Whether each of ``numels`` trains (has a gradient and optimizer state): all of them, or with LoRA the
        adapters only (the base frozen)."""
        base = self.cfg.lora_rank <= 0
        return [base] * len(self.info.numels) + [True] * len(self.adapters)

    @functools.cached_property
    def quantized(self) -> list[bool]:
        """Whether each of ``numels`` is stored quantised (``--quantize-base nf4|int8``: the weights of the Linear
        layers LoRA adapts); none without."""
        out = [False] * len(self.numels)
        names = set(quantized_names(self.info.linear_names, self.cfg))
        if not names:  # (a ModelInfo made by hand may not say where its Linear weights are)
            return out
        for name, i in zip(self.info.linear_names, self.info.linear_weights, strict=True):
            out[i] = name in names
        return out

    def param_bytes_of(self, i: int, local: int | None = None) -> int:
        """Bytes parameter ``i`` holds on a rank that has ``local`` of its elements (None: all of them): a
        quantised weight's codes and scales (``quantize_base.weight_bytes``: NF4's split evenly as FSDP2 splits
        them; int8's codes and per-row scales, whole), else the weights' dtype per element."""
        n = self.numels[i]
        local = n if local is None else local
        if self.quantized[i]:
            kind = self.cfg.quantize_base
            return weight_bytes(kind, n, self.dim0[i], self.param_bytes, n // local) if local else 0
        return local * self.param_bytes

    def unit_bytes(self, indices: list[int], itemsize: int) -> int:
        """Bytes of a unit's parameters gathered whole in ``itemsize`` (an NF4 weight gathers its 4-bit codes)."""
        return sum(self.param_bytes_of(i) if self.quantized[i] else self.numels[i] * itemsize for i in indices)

    @property
    def trainable_numels(self) -> list[int]:
        """The numels of the trained parameters (gradients and optimizer state are counted over these)."""
        return [n for n, t in zip(self.numels, self.trainable, strict=True) if t]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shape of each of ``numels``: the model's (``info.param_shapes``), then LoRA's adapters (A: rank x
        in, B: out x rank); the lean optimizers' state depends on them."""
        return self.info.param_shapes + [(d, n // d) for n, d in self.adapters]

    @property
    def trainable_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the trained parameters (optimizer state is priced over these)."""
        return [s for s, t in zip(self.shapes, self.trainable, strict=True) if t]

    @property
    def pspec(self):
        return SPECS[self.cfg.precision]

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the weights the model holds."""
        return self.pspec.param_dtype.itemsize

    @property
    def half(self) -> bool:
        return self.pspec.compute_dtype.itemsize < 4

    @property
    def opt_slots(self) -> int:
        return opt_slots(self.cfg)

    @property
    def adam(self) -> bool:
        """Whether the optimizer keeps a ``step`` counter per parameter (AdamW, the lean ones; not SGD)."""
        return step_counter_bytes(self.cfg.optimizer) > 0

    def optim_bytes(self, shapes: list[tuple[int, ...]]) -> int:
        """Optimizer-state bytes of whole parameters of these shapes, in the weights' dtype
        (``core.optim.state_bytes``: exact for every optimizer, the lean ones included)."""
        cfg = self.cfg
        return sum(state_bytes(cfg.optimizer, cfg.momentum, tuple(s), self.param_bytes) for s in shapes)

    def shard_optim_bytes(self, local_shapes: list[tuple[int, ...]]) -> int:
        """Optimizer-state bytes of DTensor parameters whose local shards have these shapes (FSDP2): priced as
        whole parameters of the shards' shapes, where the optimizer builds its state from the shard alone
        (``core.optim.states_per_local_shard``; the others are refused: a ConfigError, an n/a row)."""
        if not states_per_local_shard(self.cfg.optimizer):
            raise ConfigError(lean_refusal(self.cfg, "its factors cannot be built from a row shard (DTensor)") or "")
        return self.optim_bytes(local_shapes)

    def flat_optim_bytes(self, numel: int, itemsize: int | None = None) -> int:
        """Optimizer-state bytes of ``numel`` elements of flattened or sharded parameters: only the optimizers
        whose state is per element can be priced so (the methods that shard refuse the others in their
        ``check_supported``; here a ConfigError makes the estimate's row n/a)."""
        slots = elementwise_slots(self.cfg.optimizer, self.cfg.momentum)
        if slots is None:
            raise ConfigError(lean_refusal(self.cfg, "this method shards or flattens them") or "")
        return slots * numel * (self.param_bytes if itemsize is None else itemsize)

    def replicated(self, buckets: bool) -> RankMemory:
        """Every rank holds everything (single, DataParallel, DDP); DDP adds a bucket copy of the gradients."""
        n, pd = self.trainable_numels, self.param_bytes
        trained = sum(n)
        with_buckets = buckets and self.world > 1
        return RankMemory(
            params=sum(self.param_bytes_of(i) for i in range(len(self.numels))),
            grads=trained * pd,
            optim=self.optim_bytes(self.trainable_shapes),
            step_scalars=4 * len(n) if self.adam else 0,
            buckets=trained * pd if with_buckets else 0,
            bucket_note="DDP all-reduce buckets" if with_buckets else "",
            sharding_note="replicated" if self.world > 1 else "",
        )


def loop_collectives(cfg: TrainConfig, world: int) -> list[Collective]:
    """The collectives the training loop itself adds to any method's, per optimizer step: on fine-tuning data the
    all-reduce of the step's response-token count (one fp64 scalar, waited for: the masked loss's divisor,
    ``training.losses.step_denominator``); none otherwise or on one process."""
    if world <= 1 or not is_ft_data(cfg.data):
        return []
    note = "the step's response-token count (the masked loss's divisor)"
    return [Collective("all_reduce", 8, 1, "other", world, note, critical=True)]


def opt_slots(cfg: TrainConfig) -> int:
    """Optimizer state tensors of the parameter's size per parameter: AdamW two, momentum SGD one, plain SGD
    none; 0 for the lean optimizers, whose state is not per element (``MemoryContext.optim_bytes`` prices every
    optimizer exactly; this count is for the projection's share of the states a rank steps)."""
    slots = elementwise_slots(cfg.optimizer, cfg.momentum)
    return 0 if slots is None else slots


def optimizer_note(cfg: TrainConfig) -> str:
    """The optimizer-state row's note in the estimate's breakdown."""
    return describe_state(cfg.optimizer, cfg.momentum)


def lean_refusal(cfg: TrainConfig, why: str) -> str | None:
    """A method's one-line refusal of a memory-lean optimizer (``why``: what the method does to parameters that
    the optimizer cannot take); None for sgd and adamw."""
    if elementwise_slots(cfg.optimizer, cfg.momentum) is not None:
        return None
    return f"optimizer {cfg.optimizer!r} keeps its state per whole parameter and {why}: use sgd or adamw"


class NoMemoryModel(ConfigError):
    """The strategy has no memory model: the estimate says so instead of reporting 0."""
