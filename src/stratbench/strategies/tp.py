"""``tp``: Megatron-style tensor parallelism (Shoeybi et al. 2019) through PyTorch's own
``torch.distributed.tensor.parallel``: every process is one rank of a single tensor-parallel group (no data
parallelism yet: all ranks read the same batch), each holding a 1/T slice of the split matrices as DTensors.

The plan for the built-in transformer (``transformer_plan``), per block: attention wq/wk/wv column-parallel
(each rank computes n_heads/T query heads and n_kv_heads/T key/value heads; the attention reads its local head
count from the projections' output, so ``single`` runs the same code), wo row-parallel; MLP w1/w3
column-parallel, w2 row-parallel. The attention and the MLP each take their input as one replicated DTensor
(``PrepareModuleInput``), so that backward sums the input gradients of their column-parallel projections
locally and all-reduces once per module: Megatron's ``f``/``g`` pair, 2 all-reduces per block forward and 2
backward. The embedding, the norms and the head stay whole on every rank in this first part, as replicated
DTensors (``distribute_module``), so that every parameter is a DTensor (the foreach optimizer and
``clip_grad_norm_`` take no mix of plain tensors and DTensors) and the loss is computed on full logits, the same
on every rank. A model of the user's gives its own plan with a ``tp_plan()`` method; whatever modules that plan
leaves hold their parameters replicated, as above.

Not built yet: sequence parallelism, 2D/3D meshes (fsdp/pipeline x tp), a vocabulary-parallel embedding and
head with a loss-parallel cross-entropy. The memory estimate traces a rank's slice of the model at the whole batch
(``LocalSlice``; docs/memory.md: within 7% of the measured allocator peak on gpt-tiny, 5 cases).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import sharded
from stratbench.core.errors import ConfigError
from stratbench.measuring.comm import Collective
from stratbench.measuring.model_trace import ModelSpec
from stratbench.models.flops import flops_per_sample
from stratbench.models.transformer import Attention, FeedForward, Transformer, TransformerConfig
from stratbench.strategies.base import CheckpointIO, CostModel, Strategy, register
from stratbench.strategies.costs import CPU_FSDP2_RUNTIME_BYTES, RankMemory

HOW_TO_PLAN = (
    "give the model a tp_plan() method returning a torch.distributed.tensor.parallel.parallelize_module plan "
    "(module name -> ColwiseParallel()/RowwiseParallel()/...), as the built-in transformers (gpt-tiny, ...) have"
)


def transformer_plan(model: Transformer) -> dict[str, Any]:
    """Megatron's plan for ``Transformer``: per block q/k/v and gate/up column-parallel, o and down row-parallel,
    each sub-module's input one replicated DTensor (one all-reduce of its input gradient in backward)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    def one_input() -> PrepareModuleInput:
        return PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():  # by type: names under an activation-checkpointing wrapper too
        if isinstance(module, Attention | FeedForward):
            cols, rows = (
                (("wq", "wk", "wv"), ("wo",)) if isinstance(module, Attention) else (("w1", "w3"), ("w2",))
            )
            plan[name] = one_input()
            plan.update({f"{name}.{c}": ColwiseParallel() for c in cols})
            plan.update({f"{name}.{r}": RowwiseParallel() for r in rows})
    return plan


def model_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's tensor-parallel plan: the built-in one for ``Transformer``, the model's own ``tp_plan()``,
    or None (no plan: refused)."""
    if isinstance(model, Transformer):
        return transformer_plan(model)
    own = getattr(model, "tp_plan", None)
    return own() if callable(own) else None


def _planned(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, nn.Module, Any]]:
    """(name, module, style) of every module a plan key names (fnmatch patterns as parallelize_module takes)."""
    return [
        (name, module, style)
        for key, style in plan.items()
        for name, module in model.named_modules()
        if name and fnmatch.fnmatchcase(name, key)
    ]


def _split_dim(module: nn.Module, style: Any) -> int | None:
    """The weight dimension a column-/row-parallel Linear splits (0: its outputs, 1: its inputs), else None."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(module, nn.Linear):
        return None
    if isinstance(style, ColwiseParallel):
        return 0
    return 1 if isinstance(style, RowwiseParallel) else None


@dataclass(frozen=True)
class TPShapes:
    """What the cost model and the refusals read from the model and its plan (built on the meta device)."""

    numels: tuple[int, ...]
    """Parameters in ``model.parameters()`` order."""
    split: tuple[int | None, ...]
    """The dimension each parameter is split along (None: replicated)."""
    sizes: tuple[int, ...]
    """The size of that dimension (1 for a replicated parameter)."""
    names: tuple[str, ...]
    transformer: TransformerConfig | None
    has_plan: bool
    unmatched: tuple[str, ...] = ()
    """Plan keys that name no module of the model."""

    def local_numel(self, world: int) -> int:
        return sum(n // world if d is not None else n for n, d in zip(self.numels, self.split, strict=True))


@functools.cache
def tp_shapes(spec: ModelSpec) -> TPShapes:
    """The model of ``spec`` built on the meta device (no memory), its plan and which weights it splits."""
    with torch.device("meta"):
        model = spec.build()
    plan = model_plan(model)
    dims: dict[int, tuple[int, int]] = {}
    for _, module, style in _planned(model, plan or {}):
        d = _split_dim(module, style)
        if d is not None:
            dims[id(module.weight)] = (d, module.weight.shape[d])
            if d == 0 and module.bias is not None:  # split with the outputs; a row-parallel bias stays whole
                dims[id(module.bias)] = (0, module.bias.shape[0])
    named = list(model.named_parameters())
    return TPShapes(
        numels=tuple(p.numel() for _, p in named),
        split=tuple(dims.get(id(p), (None, 1))[0] for _, p in named),
        sizes=tuple(dims.get(id(p), (None, 1))[1] for _, p in named),
        names=tuple(n for n, _ in named),
        transformer=model.config if isinstance(model, Transformer) else None,
        has_plan=plan is not None,
        unmatched=tuple(unmatched_keys(model, plan or {})),
    )


@dataclass(frozen=True)
class LocalSlice:
    """What one of ``world`` tensor-parallel ranks computes, for the memory estimate's trace: every weight the
    model's plan splits narrowed in place to its 1/world slice (a column-parallel Linear's outputs, a row-parallel
    one's inputs), so that the traced activations are a rank's: its heads' queries, keys, values and scores, its
    part of the MLP's hidden state, and the whole-width tensors every rank holds (block inputs, the row-parallel
    outputs before their all-reduce). Hashable: the traces are cached per transform."""

    world: int

    def __call__(self, model: nn.Module) -> None:
        for _, module, style in _planned(model, model_plan(model) or {}):
            d = _split_dim(module, style)
            if d is None:
                continue
            module.weight = _narrowed(module.weight, d, self.world)
            if d == 0 and getattr(module, "bias", None) is not None:
                module.bias = _narrowed(module.bias, 0, self.world)
            if isinstance(module, nn.Linear):
                module.out_features, module.in_features = module.weight.shape


def _narrowed(p: nn.Parameter, dim: int, world: int) -> nn.Parameter:
    """A parameter of ``p``'s kind (fake under the trace's fake mode) with dimension ``dim`` divided by ``world``."""
    shape = list(p.shape)
    shape[dim] //= world
    return nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)


def unmatched_keys(model: nn.Module, plan: dict[str, Any]) -> list[str]:
    """The plan's keys that name no module (``parallelize_module`` skips them silently: weights left whole)."""
    names = [name for name, _ in model.named_modules()]
    return [key for key in plan if not fnmatch.filter(names, key)]


def unsupported(cfg, world: int) -> str | None:
    """One line saying why ``cfg`` cannot run under tp over ``world`` processes, or None."""
    shapes = tp_shapes(ModelSpec.from_config(cfg))
    if not shapes.has_plan:
        return f"tp: model {cfg.model!r} has no tensor-parallel plan; {HOW_TO_PLAN}"
    if shapes.unmatched:
        return f"tp: the plan of model {cfg.model!r} names no module of it: {', '.join(shapes.unmatched)}"
    tc = shapes.transformer
    if tc is not None and (tc.n_heads % world or tc.n_kv_heads % world):
        fits = [t for t in range(1, tc.n_heads + 1) if tc.n_heads % t == 0 and tc.n_kv_heads % t == 0]
        return (
            f"tp over {world} processes: n_heads {tc.n_heads} and n_kv_heads {tc.n_kv_heads} of {cfg.model} must "
            f"both divide by {world}; --nproc that fit: {', '.join(map(str, fits))}"
        )
    for name, d, size in zip(shapes.names, shapes.split, shapes.sizes, strict=True):
        if d is not None and size % world:
            return f"tp over {world} processes: {name} dim {d} of size {size} does not divide by {world}"
    return None


def transformer_comm(ctx) -> list[Collective] | None:
    """Megatron's tensor-parallel traffic per optimizer step, per block and micro-batch: forward all-reduces
    the row-parallel outputs of attention (wo) and MLP (w2), backward all-reduces the gradient of the attention's
    and the MLP's input (their column-parallel projections' input gradients summed locally first): each a
    (b, s, dim) activation, b the micro-batch (every rank takes the whole batch): forward in the compute dtype
    (the row-parallel matmul's output), backward in the residual stream's dtype, the weights' (under autocast the
    gradient of the bf16 cast is fp32 before the sum; measured: bf16-mixed sends 2 bytes forward, 4 back). The
    replicated embedding, norms and head need no communication (every rank computes the same values and
    gradients). With --clip-grad-norm, ``clip_grad_norm_`` on DTensors stacks one norm per parameter and
    all-reduces them once (measured: 39 scalars for gpt-tiny's 39 parameters). A model of the user's: no model
    (its plan's traffic is not derived)."""
    shapes = tp_shapes(ModelSpec.from_config(ctx.cfg))
    tc = shapes.transformer
    if tc is None:
        return None
    if ctx.world <= 1:
        return []
    cfg, n = ctx.cfg, ctx.world
    micro = cfg.grad_accum
    elements = (cfg.batch_size // micro) * cfg.seq_len * tc.dim
    forward, backward = elements * ctx.pspec.compute_dtype.itemsize, elements * ctx.param_bytes
    calls = 2 * tc.n_layers * micro
    rows = [
        Collective("all_reduce", calls * forward, calls, "forward", n, "row-parallel outputs (wo, w2)"),
        Collective("all_reduce", calls * backward, calls, "backward", n, "attention and MLP input gradients"),
    ]
    if cfg.clip_grad_norm:
        norms = len(shapes.numels) * ctx.param_bytes
        rows.append(
            Collective("all_reduce", norms, 1, "optimizer", n, "per-parameter gradient norms (clipping)")
        )
    return rows


class TPCost(CostModel):
    """1/T of the split weights (with their gradients and optimizer state) plus the replicated rest per rank."""

    @classmethod
    def memory_model(cls, ctx, rank):
        shapes = tp_shapes(ModelSpec.from_config(ctx.cfg))
        local, pd = shapes.local_numel(ctx.world), ctx.param_bytes
        m = RankMemory(params=local * pd, grads=local * pd, optim=ctx.opt_slots * local * pd)
        m.step_scalars = 4 * len(shapes.numels) if ctx.adam else 0
        m.cpu_runtime, m.cpu_runtime_note = CPU_FSDP2_RUNTIME_BYTES, "DTensor's op caches (as FSDP2's)"
        m.sharding_note = f"split weights 1/{ctx.world}, embedding, norms and head replicated"
        # every rank computes the whole batch through its slice of the split matrices
        m.data_ranks, m.trace_transform = 1, LocalSlice(ctx.world)
        return m

    @classmethod
    def comm_model(cls, ctx):
        return transformer_comm(ctx)

    @classmethod
    def comm_overlap(cls, ctx) -> float:
        """None of it: each all-reduce sits between a row-parallel matmul and the op that needs its sum (no
        asynchronous or micro-pipelined TP here), so it is on the critical path."""
        return 0.0

    @classmethod
    def compute_scale(cls, ctx) -> float:
        """A rank's share of the whole batch's FLOPs: its slice of the split matrices and attention heads plus the
        replicated rest (embedding, norms, head), counted on the meta device (``LocalSlice``)."""
        return local_flop_share(ModelSpec.from_config(ctx.cfg), ctx.world)


@functools.cache
def local_flop_share(spec: ModelSpec, world: int) -> float:
    """The forward+backward FLOPs of one tp rank's slice of the model over the whole model's (1.0 where either
    cannot be counted: no saving is claimed)."""
    whole = flops_per_sample(spec.build, spec.sample_shape, spec.num_classes)

    def build_slice() -> nn.Module:
        model = spec.build()
        LocalSlice(world)(model)
        return model

    local = flops_per_sample(build_slice, spec.sample_shape, spec.num_classes)
    return local / whole if whole and local else 1.0


class TPCheckpointIO(CheckpointIO):
    """A ``torch.distributed.checkpoint`` folder (the ``dcp`` layout fsdp writes): each rank writes its slices,
    keyed by parameter names with their global shapes, so the folder resumes under tp on another world size and
    loads whole into any other method (``checkpoint.load_any``); a full file loads too."""

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        return sharded.save_sharded(path, model, optimizer, extra, is_main=self.strategy.env.is_main)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        if sharded.is_dcp(path):
            return sharded.load_sharded(path, model, optimizer)
        return super().load_checkpoint(path, model, optimizer)


def _replicate_rest(model: nn.Module, mesh) -> None:
    """Every module whose own parameters the plan left plain holds them as replicated DTensors, its inputs made
    replicated DTensors and its outputs plain again, so that the model's parameters are all DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(module, inputs, mesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor) else x
            for x in inputs
        )

    def to_local(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tp(model: nn.Module, mesh) -> None:
    """Split ``model`` in place over the one-dimensional ``mesh`` (the tp dimension of a larger mesh under 2D/3D):
    its plan's modules become DTensor slices, the rest replicated DTensors on the same mesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model_plan(model)
    if plan is None:  # checked before any work too (check_supported)
        raise ConfigError(f"tp: the model has no tensor-parallel plan; {HOW_TO_PLAN}")
    unmatched = unmatched_keys(model, plan)
    if unmatched:  # checked before any work too (check_supported), on the model as built, unwrapped
        raise ConfigError(f"tp: the plan names no module of the model: {', '.join(unmatched)}")
    parallelize_module(model, mesh, plan)
    _replicate_rest(model, mesh)


@register
class TPStrategy(Strategy):
    name = "tp"
    description = "tensor parallel (Megatron 1D on DTensor): attention and MLP matrices split over the ranks"
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA); a model with a tensor-parallel plan"
    launcher = "torchrun"
    needs_process_group = True
    check_settings = {"model": "gpt-tiny", "data": "text"}  # the default image model has no tp plan

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type not in ("cpu", "cuda"):
            return f"tp runs on cpu or cuda devices, not {device.type}"
        return unsupported(cfg, world_size)

    @classmethod
    def data_parallel_size(cls, cfg, world_size: int) -> int:
        return 1  # every rank of the one tensor-parallel group computes the whole batch

    cost = TPCost
    checkpoint_io_class = TPCheckpointIO

    def data_shard(self) -> tuple[int, int]:
        return 0, 1  # the same batches on every rank

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("tp",))
        apply_tp(model, mesh)
        return model

    def report(self) -> dict[str, Any]:
        return {"mesh": {"tp": self.env.world_size}}

    # clip_grad_norm: the base's torch.nn.utils.clip_grad_norm_ works on DTensor gradients (the norm of the split
    # ones is reduced over the mesh), so every rank scales by the same global factor.
