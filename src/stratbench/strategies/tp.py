"""``tp``: Megatron-style tensor parallelism (Shoeybi et al. 2019) through PyTorch's own
``torch.distributed.tensor.parallel``: every process is one rank of a single tensor-parallel group (no data
parallelism: all ranks read the same batch), each holding a 1/T slice of the split matrices as DTensors.

The plan for the built-in transformer (``transformer_plan``, torchtitan's llama plan), per block: attention
wq/wk/wv column-parallel (each rank computes n_heads/T query heads and n_kv_heads/T key/value heads; the attention
reads its local head count from the projections' output, so ``single`` runs the same code), wo row-parallel; MLP
w1/w3 column-parallel, w2 row-parallel. The attention and the MLP each take their input as one replicated
DTensor (``PrepareModuleInput``), so that backward sums the input gradients of their column-parallel projections
locally and all-reduces once per module: Megatron's ``f``/``g`` pair, 2 all-reduces per block forward and 2
backward. Options (``TPOptions``):

* ``--vocab-parallel`` (on by default): the token embedding row-parallel over the vocabulary (each rank looks up
  its rows, the partial lookups summed) and the head column-parallel, its logits left split (``Shard(-1)``) for
  the cross-entropy under ``loss_parallel`` (``TPStrategy.forward_loss``/``backward``); evaluation, and a loss
  other than the built-in cross-entropy (a user's, label smoothing), read them gathered whole (``GatherLogits``).
  A tied embedding/head (gpt2-small, llama-1b) stays one tensor: both styles split it along the vocabulary.
  Off: embedding and head whole on every rank (replicated DTensors).
* ``--sequence-parallel`` (Korthikanti et al. 2022): the residual stream and the norms are sharded along the
  sequence (``SequenceParallel``); each block gathers its norm's output before the attention and the MLP and
  reduce-scatters their row-parallel outputs back into sequence shards, so the all-reduces become all-gather +
  reduce-scatter (the same bytes) and the norms' activations are 1/T per rank. The norms' weight gradients come
  out as partial sums and are all-reduced once per step (``reduce_partial_grads``). The model has no dropout.

Whatever the plan leaves (norms, a whole embedding/head) holds its parameters replicated, so that every parameter
is a DTensor (the foreach optimizer and ``clip_grad_norm_`` take no mix of plain tensors and DTensors), while each
such module computes on their local tensors from the plain inputs it has under torch's ``parallelize_module``
(``LocalParams``): a plan is applied as torch applies it, and the model's forward runs unchanged. A model of the
user's gives its own plan with a ``tp_plan()`` method (checked before any work: ``parallel.tp_plan.model_plan``): the two options
above apply to the built-in plan only (``--sequence-parallel`` with a user's plan is refused: its layouts are the
user's). The communication model (``transformer_comm``) matches the measured bytes per kind exactly on gpt-tiny
(fp64 and bf16-mixed, each option on and off: tests/strategies/test_tp.py; docs/communication.md).

The building blocks are in ``strategies/parallel/``: the plans and the refusals in ``tp_plan``, ``apply_tp``,
loss parallel and the checkpoint I/O in ``tensor_parallel``, the slice, the traffic rows and ``TPCost`` in
``tp_costs``; this file is the method that composes them.

2D and 3D meshes: fsdp and pipeline call ``apply_tp`` with their mesh's tp dimension (``fsdp --tp``,
``pipeline --pp --tp``). The memory estimate traces a rank's slice of the model at the whole batch
(``LocalSlice``; docs/memory.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratbench.strategies.base import Strategy, register
from stratbench.strategies.costs import lean_refusal
from stratbench.strategies.parallel.tensor_parallel import (
    LossParallel,
    TPCheckpointIO,
    apply_tp,
    reduce_partial_grads,
    splits_loss,
)
from stratbench.strategies.parallel.tp_costs import TPCost
from stratbench.strategies.parallel.tp_plan import TPOptions, unsupported


@register
class TPStrategy(LossParallel, Strategy):
    name = "tp"
    splits_model = True
    description = "tensor parallel (Megatron 1D on DTensor): attention and MLP matrices split over the ranks"
    requirements = "torch.distributed (gloo on CPU, nccl on CUDA); a model with a tensor-parallel plan"
    launcher = "torchrun"
    needs_process_group = True
    check_settings = {"model": "gpt-tiny", "data": "text"}  # the default image model has no tp plan
    Options = TPOptions

    @classmethod
    def lora_refusal(cls, cfg) -> str | None:
        if cfg.lora_rank:
            return "--lora-rank with tp is not supported: its plan shards nn.Linear modules, which LoRA replaces by PEFT's adapter layers"
        return None

    @classmethod
    def check_supported(cls, cfg, device, world_size):
        if device.type not in ("cpu", "cuda"):
            return f"tp runs on cpu or cuda devices, not {device.type}"
        if why := cls.lora_refusal(cfg):
            return why
        return lean_refusal(cfg, "tensor parallelism shards the weight matrices (DTensors)") or unsupported(cfg, world_size)

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
        opts = self.options
        apply_tp(model, mesh, sequence_parallel=opts.sequence_parallel, vocab_parallel=opts.vocab_parallel)
        self.split_loss = splits_loss(model, self.cfg, opts)
        return model

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip: float | None) -> bool:
        assert self.model is not None
        reduce_partial_grads(self.model)
        return super().optimizer_step(optimizer, clip)

    def report(self) -> dict[str, Any]:
        opts = self.options
        return {
            "mesh": {"tp": self.env.world_size},
            "tp": {
                "sequence_parallel": opts.sequence_parallel,
                "vocab_parallel": opts.vocab_parallel,
                "loss_parallel": self.split_loss,
            },
        }

    # clip_grad_norm: the base's torch.nn.utils.clip_grad_norm_ works on DTensor gradients (the norm of the split
    # ones is reduced over the mesh), so every rank scales by the same global factor.
