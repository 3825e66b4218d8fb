"""Tensor parallelism at run time: ``apply_tp`` splits a model in place over a one-dimensional mesh (the tp
method's whole world, or the tp dimension of fsdp's and the pipeline's meshes) by its plan (``tp_plan``),
the rest of its parameters replicated DTensors (``LocalParams``); the sequence-parallel norms' partial gradients
summed once per step (``reduce_partial_grads``); the training loss on logits split over the vocabulary
(``LossParallel``, ``split_logits``) and the DCP checkpoint a tp-split model writes (``TPCheckpointIO``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import sharded
from stratbench.core.errors import ConfigError
from stratbench.models.transformer import Transformer
from stratbench.strategies.base import CheckpointIO
from stratbench.strategies.parallel.tp_plan import (
    HOW_TO_PLAN,
    TPOptions,
    loss_parallel_applies,
    model_plan,
    unmatched_keys,
)


class GatherLogits:
    """Forward hook on a vocabulary-parallel head: its logits (a DTensor split over the vocabulary) gathered into
    one plain tensor, what evaluation and a loss other than the built-in cross-entropy read; while ``keep`` is
    set (``split_logits``: the training loss under loss_parallel) they stay split."""

    def __init__(self) -> None:
        self.keep = False

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return output if self.keep or not isinstance(output, DTensor) else output.full_tensor()


@contextlib.contextmanager
def split_logits(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s vocabulary-parallel head returns its logits split (a ``Shard(-1)`` DTensor)."""
    hooks = [m._stratbench_gather_logits for m in model.modules() if hasattr(m, "_stratbench_gather_logits")]
    for h in hooks:
        h.keep = True
    try:
        yield
    finally:
        for h in hooks:
            h.keep = False


def _edge_layouts(model: nn.Module, sequence_parallel: bool, vocab_parallel: bool) -> dict[str, tuple]:
    """Where a whole (replicated) module sits inside the sequence-sharded residual stream: the built-in
    transformer's embedding hands on this rank's sequence shard, its head gathers the shards first."""
    from torch.distributed.tensor import Replicate, Shard

    if not (sequence_parallel and isinstance(model, Transformer)) or vocab_parallel:
        return {}
    return {"tok_embeddings": (Replicate(), Shard(1)), "output": (Shard(1), Replicate())}


def _replicate_rest(model: nn.Module, mesh, edges: dict[str, tuple]) -> None:
    """Every module whose own parameters the plan left plain holds them as replicated DTensors, so that the
    model's parameters are all DTensors (the foreach optimizers and ``clip_grad_norm_`` take no mix of plain
    tensors and DTensors), while its forward sees what it would see under ``parallelize_module`` alone
    (``LocalParams``): a user's forward that adds a plain tensor to a plan's output runs as under torch. A
    module ``edges`` names (the built-in transformer's whole embedding and head in the sequence-sharded stream)
    takes a plain input as this rank's part of the first layout, computes on DTensors and hands on its part of
    the second."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def hooks(given, wanted):
        def to_dtensor(module, inputs, mesh):
            return tuple(
                (
                    x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [given], run_check=False)
                ).redistribute(mesh, [Replicate()])
                if isinstance(x, torch.Tensor)
                else x
                for x in inputs
            )

        def to_local(module, output, mesh):
            return output.redistribute(mesh, [wanted]).to_local() if isinstance(output, DTensor) else output

        return to_dtensor, to_local

    for name, module in list(model.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for p in own.values()):
            continue
        if name in edges:
            to_dtensor, to_local = hooks(*edges[name])
            distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)
            continue
        for pname, p in own.items():  # replicated from rank 0 (a broadcast), as distribute_module does
            whole = distribute_tensor(p.detach(), mesh, [Replicate()])
            module.register_parameter(pname, nn.Parameter(whole, requires_grad=p.requires_grad))
        LocalParams(tuple(own)).attach(module)


class LocalParams:
    """Forward hooks that hand a module its replicated DTensor parameters as their local tensors while its inputs
    are plain (as ``parallelize_module`` leaves an unplanned module: plain parameters, plain inputs), and as
    DTensors while an input is a DTensor (DTensor then lays the result out). The swap is FSDP2's own (its
    unsharded parameters are set on the module the same way), so under ``fsdp --tp`` it reads the gathered
    parameter FSDP2 has just put in place; ``to_local`` hands the gradient back as a replicated DTensor."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.held: list[dict[str, Any]] = []  # a stack: the module may be called again inside its own forward

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        from torch.distributed.tensor import DTensor

        held = {n: module._parameters[n] for n in self.names}
        self.held.append(held)
        if any(isinstance(x, DTensor) for x in (*args, *kwargs.values())):
            return
        for n, p in held.items():
            if isinstance(p, DTensor):
                module._parameters[n] = p.to_local()

    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.held:
            module._parameters.update(self.held.pop())


def _tied(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) pairs that share one Parameter, per shared Parameter (a tied embedding and head)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group share one Parameter again: ``parallelize_module`` and ``distribute_module`` give every
    module its own DTensor copy. The copies must be laid out alike (refused before any work otherwise)."""
    for (module, name), *rest in groups:
        first = getattr(module, name)
        for other, other_name in rest:
            if getattr(other, other_name).placements != first.placements:
                raise ConfigError(
                    f"tp: the plan splits the tied parameter {name} differently where it is shared"
                )
            other.register_parameter(other_name, first)


def _grads_laid_out_as_params(model: nn.Module) -> None:
    """A split parameter whose gradient comes back replicated (the vocabulary-parallel embedding's: DTensor's
    embedding backward gives every rank the whole (vocab, dim) gradient) keeps only its own slice of it, before
    it is accumulated: a local slice, no communication, and 1/T of the gradient's memory as the cost model says.

    The hook keeps the parameter's placements, not the parameter: a hook stored on a tensor that refers back to
    it makes a reference cycle, and a parameter that FSDP2 then replaces by its dp shard (``fsdp --tp``: every
    split matrix, a rank's whole tp slice) stayed alive until Python's garbage collector happened to run,
    inside the measured step or not (test_tp: no reference cycle keeps a tensor alive)."""
    from torch.distributed.tensor import DTensor

    def keep_own_slice(placements):
        def hook(grad):
            if isinstance(grad, DTensor) and all(pl.is_replicate() for pl in grad.placements):
                return grad.redistribute(grad.device_mesh, placements)
            return grad

        return hook

    for p in model.parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            p.register_hook(keep_own_slice(p.placements))


def apply_tp(
    model: nn.Module, mesh, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> None:
    """Split ``model`` in place over the one-dimensional ``mesh`` (the tp dimension of a larger mesh under 2D/3D):
    its plan's modules become DTensor slices, the rest replicated DTensors on the same mesh. For the built-in
    transformer, ``sequence_parallel`` shards the norms and the residual stream along the sequence and
    ``vocab_parallel`` splits the embedding and the head over the vocabulary: the model then returns the
    logits gathered whole, except within ``split_logits`` (the loss under ``loss_parallel``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model_plan(model, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    if plan is None:  # checked before any work too (check_supported)
        raise ConfigError(f"tp: the model has no tensor-parallel plan; {HOW_TO_PLAN}")
    if sequence_parallel and not isinstance(model, Transformer):  # checked before any work too
        raise ConfigError(
            "tp --sequence-parallel builds the built-in transformers' plan only, not a tp_plan()"
        )
    unmatched = unmatched_keys(model, plan)
    if unmatched:  # checked before any work too (check_supported), on the model as built, unwrapped
        raise ConfigError(f"tp: the plan names no module of the model: {', '.join(unmatched)}")
    ties = _tied(model)
    parallelize_module(model, mesh, plan)
    _replicate_rest(model, mesh, _edge_layouts(model, sequence_parallel, vocab_parallel))
    _retie(ties)
    _grads_laid_out_as_params(model)
    if vocab_parallel and isinstance(model, Transformer) and model.output is not None:  # a stage may lack it
        model.output._stratbench_gather_logits = hook = GatherLogits()
        model.output.register_forward_hook(hook)


def reduce_partial_grads(model: nn.Module) -> None:
    """Sum, in one all-reduce per mesh, the gradients backward leaves as partial sums on replicated weights (a
    sequence-parallel norm's: each rank's share of the positions), so that clipping and the optimizer read them
    whole; left partial, each DTensor op of the step would all-reduce them again (measured: 4 all-reduces per
    norm per AdamW step with clipping)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[nn.Parameter]] = {}
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            if grad.device_mesh.ndim == 1 and all(pl.is_replicate() for pl in p.placements):
                groups.setdefault(grad.device_mesh, []).append(p)
            else:  # not on this rank's one tp dimension: let DTensor sum it
                p.grad = grad.redistribute(grad.device_mesh, p.placements)
    for mesh, params in groups.items():
        local = [p.grad.to_local() for p in params]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, g, part in zip(params, local, flat.split([g.numel() for g in local]), strict=True):
            p.grad = DTensor.from_local(part.view_as(g), mesh, p.placements, run_check=False)


class LossParallel:
    """The training loss on logits split over the vocabulary (``loss_parallel``), for a method whose model has a
    vocabulary-parallel head (tp, fsdp --tp --vocab-parallel); its ``wrap`` sets ``split_loss``
    (``splits_loss``). Without it the loop's forward and backward run unchanged."""

    split_loss: bool = False
    """The training loss runs on the logits split over the vocabulary (set by ``wrap``)."""

    def _loss_context(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.split_loss else contextlib.nullcontext()

    def forward_loss(self, model, x, y, loss_fn):
        """The loss on the logits split over the vocabulary (``loss_parallel``: each rank's share of the softmax
        and the target logits, summed by small all-reduces); the logits returned are that split DTensor."""
        if not self.split_loss:
            return super().forward_loss(model, x, y, loss_fn)
        x = self.precision.convert_input(x)
        with split_logits(model), self.precision.autocast(), self._loss_context():
            logits = model(x)
            loss = loss_fn(self.precision.loss_input(logits), y)
        return loss.to_local(), logits

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_context():  # loss_parallel's backward must run under it too
            super().backward(loss)


def splits_loss(model: nn.Module, cfg, opts: TPOptions) -> bool:
    """Whether ``model`` (after ``apply_tp``) has a vocabulary-parallel head whose logits the loss reads split."""
    split_head = any(hasattr(m, "_stratbench_gather_logits") for m in model.modules())
    return split_head and loss_parallel_applies(cfg, opts)


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
