"""Expert parallelism (GShard, Lepikhin et al. 2020; torchtitan's ``ExpertParallel``): the E routed experts of each
MoE layer split over the P ranks of an ep group, rank r holding experts r E / P to (r + 1) E / P - 1 (the stacked
``w1``/``w2``/``w3`` cut along dim 0 at set-up, so the module holds only its experts). Each rank routes its own
tokens as one process does (``models.moe``), then:

1. the per-expert counts of the assignments it keeps (the capacity applied on the sending rank, as one process
   applies it to its micro-batch) are exchanged by one all-to-all (E int64 numbers), so that every rank knows how
   many rows it receives from each rank for each of its experts;
2. the kept assignments' token rows, grouped by expert and so by destination rank, go to their experts' ranks by
   ``dist.all_to_all_single`` with those uneven split sizes (``_UnevenAllToAll``: the backward is the reverse
   exchange of the gradients);
3. each local expert runs on the rows it received (each source rank's segment in turn), and the outputs return by
   the reverse all-to-all, where they are weighted by the router and summed per token as one process does.

A building block: ``fsdp --ep E`` composes it (``strategies/fsdp.py``): the dense parts FSDP2-sharded over every
rank, the experts left out of ``fully_shard`` (its ``ignored_params``). This module also holds what fsdp needs of
it beside the exchange: the set-up (``setup_ep``), the refusals (``ep_refusal``, ``moe_layout_unfit``), the comm
rows (``parallel.ep_costs.ep_comm``), the report (``ep_report``) and the checkpoint I/O (``EPCheckpointIO``).

The mesh is (dp = R / E, ep = E) over the R ranks, torchtitan's order: each ep group is E consecutive ranks (its
all-to-alls on the nearest links), each of its ranks holding experts / E of every layer; the dp groups (ranks E
apart) hold the same experts, replicas. Every rank reads its own micro-batch, so all R ranks are data-parallel for
the dense parts: FSDP2 shards and averages them over all R ranks, the 1-D mesh plain fsdp uses. (torchtitan borrows
ep from its dp_shard dimension and shards the dense parts over that whole dimension, which here is every rank too;
it also FSDP-shards the experts over the rest of dp, which ours are not: replicas keep the exchange and the
gradient sum apart from FSDP2, and one all-reduce of the expert gradients over dp is the only extra collective.)

Gradient scaling: rank r's loss is the mean over its own tokens, L_r, and one process accumulating the R
micro-batches steps on (1 / R) sum_r dL_r. FSDP2 averages the dense gradients over the R ranks, which is that. An
expert's weights receive, through the backward all-to-all, the gradient of the tokens routed to it from every rank
of its ep group: sum over the group of dL_r / dw. Each expert gradient is divided by R as it is computed
(``scale_expert_grads``) and, with dp > 1, summed over the dp replicas before the optimizer step
(``EPSetup.sync_grads``: one all-reduce of the rank's expert gradients flattened), which makes (1 / R) sum over
all R ranks; the fp64 tests (ep = R and dp 2 x ep 2) prove it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stratbench.checkpoints import sharded
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.measuring.comm import Collective
from stratbench.models.moe import MoEFeedForward, kept_groups, moe_layers
from stratbench.models.transformer import SIZES
from stratbench.models.zoo import is_moe_model
from stratbench.strategies.parallel.fsdp import FSDPCheckpointIO


class _UnevenAllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows along dim 0 with uneven splits (``send[j]`` rows to rank j, ``recv[j]``
    from it), differentiable: the gradient goes back by the same exchange with the splits swapped.
    ``context_parallel._AllToAll`` exchanges equal chunks only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _UnevenAllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class ExpertExchange:
    """One MoE layer's expert-parallel step (``MoEFeedForward.expert_parallel``): this rank's ``local`` experts are
    global experts ``first`` to ``first + local - 1`` of an ep group of ``size`` ranks."""

    def __init__(self, group: Any, rank: int, size: int, local: int) -> None:
        self.group, self.size, self.local, self.first = group, size, local, rank * local

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        """(size, local): rows each rank sends this rank for each of its experts (one all-to-all of E counts)."""
        import torch.distributed as dist

        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.view(self.size, self.local)

    def __call__(
        self, layer: MoEFeedForward, x: torch.Tensor, gate: torch.Tensor, order: torch.Tensor,
        sizes: list[int], cap: int | None,
    ) -> torch.Tensor:  # fmt: skip
        groups = kept_groups(order, sizes, cap)
        kept = torch.cat(groups)
        token = kept // layer.top_k
        kept_sizes = torch.tensor([len(g) for g in groups], dtype=torch.long)
        per_rank = kept_sizes.view(self.size, self.local)
        recv = self.counts(kept_sizes.to(x.device)).cpu()
        send_splits, recv_splits = per_rank.sum(1).tolist(), recv.sum(1).tolist()
        rows = _UnevenAllToAll.apply(x.index_select(0, token), send_splits, recv_splits, self.group)
        pieces, at = [], 0
        for source in range(self.size):
            for e, n in enumerate(recv[source].tolist()):
                pieces.append(layer.expert(e, rows[at : at + n]))
                at += n
        back = _UnevenAllToAll.apply(torch.cat(pieces), recv_splits, send_splits, self.group)
        return torch.zeros_like(x).index_add_(0, token, back * gate.index_select(0, kept)[:, None])


def apply_ep(model: nn.Module, group: Any, rank: int, size: int) -> list[nn.Parameter]:
    """Every MoE layer of ``model`` keeps only this rank's experts (its slice of the stacked weights along dim 0)
    and exchanges tokens over ``group`` (``ExpertExchange``); returns the expert parameters (left out of FSDP2)."""
    experts = []
    for layer in moe_layers(model):
        local = layer.n_experts // size
        for name in ("w1", "w2", "w3"):
            whole = getattr(layer, name)
            part = nn.Parameter(whole.detach()[rank * local : (rank + 1) * local].clone())
            setattr(layer, name, part)
            experts.append(part)
        layer.expert_parallel = ExpertExchange(group, rank, size, local)
    return experts


def sharded_expert_state(state: dict[str, Any], fqns: list[str], mesh: Any) -> dict[str, Any]:
    """``state`` ({"model", "optimizer"}: ``checkpoints.sharded.module_state``) with each expert weight and its
    optimizer moments made a DTensor on the (dp, ep) ``mesh``, replicated over dp and sharded along dim 0 over ep
    (each rank's slice of the whole (E, ...) tensor), so that the checkpoint folder holds every expert once, under
    the keys and shapes one process saves; the scalar states (Adam's step) stay as they are (equal on every
    rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def whole(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        return DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False)

    optim = state.get("optimizer", {}).get("state", {})
    for fqn in fqns:
        state["model"][fqn] = whole(state["model"][fqn])
        if fqn in optim:
            optim[fqn] = {k: whole(v) for k, v in optim[fqn].items()}
    return state


def scale_expert_grads(params: list[nn.Parameter], data_parallel: int) -> None:
    """Divide each expert gradient by the data-parallel world as it is computed (see the module's docstring)."""
    for p in params:
        p.register_hook(lambda g: g / data_parallel)


def ep_dense(ctx) -> Any:
    """``ctx`` with the routed experts' weights left out (0 elements, ``expert_shapes``): what FSDP2 shards under
    --ep."""
    info = ctx.info
    expert = expert_shapes(ctx)
    numels = [0 if e else n for n, e in zip(info.numels, expert, strict=True)]
    dim0 = [1 if e else d for d, e in zip(info.dim0, expert, strict=True)]  # 1: no division by 0 rows
    shapes = tuple((0,) if e else s for s, e in zip(info.param_shapes, expert, strict=True))
    return dataclasses.replace(ctx, info=dataclasses.replace(info, numels=numels, dim0=dim0, shapes=shapes))


def micro_tokens(cfg: TrainConfig, world: int) -> int:
    """Tokens of one rank's micro-batch (T): what each MoE layer routes per micro-step on that rank."""
    return cfg.batch_size // world // cfg.grad_accum * cfg.seq_len


def top_k_of(cfg: TrainConfig) -> int:
    """The experts each token goes to: --moe-top-k where given (the model is built with it), else the size's."""
    return cfg.moe_top_k or SIZES[cfg.model].moe_top_k


def ep_rows(ctx, ep: int) -> list[Collective]:
    """The all-to-alls of --ep per optimizer step on one rank, at balanced routing (each rank receives as many
    rows as it sends; the real split follows the router, measured): per MoE layer and micro-step, forward the
    E int64 counts, the rank's T x k token rows out (T its micro-batch's tokens) and the returned rows back, and
    in backward the two exchanges reversed, each rows x dim in the compute dtype (a call's payload is its
    input). Activation checkpointing (full: every block) runs the forward's three again in backward: the block's
    last saved tensors (the returned rows, weighted by the router) come after them, so torch's early stop does not
    skip them."""
    cfg = ctx.cfg
    tc = SIZES[cfg.model]
    layers = tc.n_layers - tc.moe_first_dense
    rows = micro_tokens(cfg, ctx.world) * top_k_of(cfg) * tc.dim * ctx.pspec.compute_dtype.itemsize
    steps = layers * cfg.grad_accum
    note = "expert parallelism: token rows to their experts' ranks and back"
    recomputed = [
        Collective(
            "all_to_all",
            steps * (2 * rows + 8 * tc.n_experts),
            3 * steps,
            "backward",
            ep,
            f"recomputed: {note}, counts first",
        )
    ]
    return (recomputed if cfg.activation_checkpointing else []) + [
        Collective(
            "all_to_all",
            steps * (2 * rows + 8 * tc.n_experts),
            3 * steps,
            "forward",
            ep,
            f"{note}, counts first",
        ),
        Collective("all_to_all", steps * 2 * rows, 2 * steps, "backward", ep, f"{note} (gradients)"),
    ]


def ep_unfit(cfg, ep: int, world: int, n_experts: int | None, others: dict[str, int]) -> str | None:
    """One line where ``--ep`` cannot run: a dense model, experts that do not divide by it, a world it does not
    divide (naming the --ep that fit both), or any of ``others`` given (flag
    -> value, falsy when not given): an --ac-mode other than full (its recomputed exchanges are not priced),
    loading a checkpoint, ..."""
    if ep == 1:
        return None
    if n_experts is None:
        return (
            f"fsdp --ep {ep}: model {cfg.model} is dense (no routed experts); --ep takes a mixture of experts"
        )
    if n_experts % ep:
        fits = ", ".join(str(d) for d in range(1, n_experts + 1) if n_experts % d == 0)
        return (
            f"fsdp --ep {ep}: {cfg.model}'s {n_experts} experts do not divide by {ep}; --ep that fit: {fits}"
        )
    if world % ep:
        fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0 and n_experts % d == 0)
        return (f"fsdp --ep {ep}: {world} processes do not divide into expert-parallel groups of {ep}; "
                f"--ep that fit {world} processes and {n_experts} experts: {fits}")  # fmt: skip
    if given := [f"--{k} {v}" for k, v in others.items() if v]:
        return f"fsdp --ep {ep} with {', '.join(given)} is not supported (use fsdp --ep alone)"
    return None


def ep_refusal(cfg: TrainConfig, opts: Any, world: int) -> str | None:
    """One line where fsdp's ``--ep`` (``opts``: fsdp's options) cannot run (``ep_unfit``), or None."""
    n_experts = SIZES[cfg.model].n_experts if is_moe_model(cfg.model) else None
    others = {"tp": opts.tp if opts.tp > 1 else 0, "cp": opts.cp if opts.cp > 1 else 0,
              "replicate": opts.replicate if opts.replicate > 1 else 0, "cpu-offload": opts.cpu_offload,
              "checkpoint-format": opts.checkpoint_format != "sharded" and "full",
              "ac-mode": cfg.activation_checkpointing and cfg.ac_mode != "full" and cfg.ac_mode,
              "resume": cfg.resume, "resume-from": cfg.resume_from, "init-from": cfg.init_from}  # fmt: skip
    return ep_unfit(cfg, opts.ep, world, n_experts, others)


def moe_layout_unfit(cfg: TrainConfig, opts: Any) -> str | None:
    """fsdp trains a mixture of experts with each block a unit and no --tp or --cp: the tensor-parallel plan has
    no entry for the experts, and a sequence split over --cp ranks would balance each chunk's routing, not the
    sequence's."""
    if is_moe_model(cfg.model) and (opts.tp > 1 or opts.cp > 1):
        return f"fsdp --tp {opts.tp} --cp {opts.cp}: model {cfg.model} is a mixture of experts; train it with --tp 1 --cp 1"
    return None


def expert_shapes(ctx) -> list[bool]:
    """Which of the model's parameters are routed experts' weights: the built-in MoE's only 3-D parameters (the
    stacked (E, ...) ``w1``/``w2``/``w3``)."""
    return [len(s) == 3 for s in ctx.info.shapes]


def ep_clip_rows(ctx, ep: int) -> list[Collective]:
    """--clip-grad-norm under --ep (``clip_grad_norm_ep``): the dense gradients' per-parameter norms all-reduced
    over every rank (FSDP2's shards, DTensor: one call), and the squared norm of this rank's experts summed over
    its ep group (one number), both in the weights' dtype."""
    dense = expert_shapes(ctx).count(False)
    return [
        Collective(
            "all_reduce", dense * ctx.param_bytes, 1, "optimizer", ctx.world, "per-parameter norms (dense)"
        ),
        Collective("all_reduce", ctx.param_bytes, 1, "optimizer", ep, "experts' squared norm over ep"),
    ]


def expert_grads_row(ctx, ep: int, dp: int) -> Collective:
    """dp x ep: one all-reduce per optimizer step of the rank's expert gradients (experts / E of every layer's
    stacked (E, ...) weights, the built-in MoE's only 3-D parameters), flattened, in the weights' dtype (FSDP2's
    policy leaves the experts as they are held), over the dp replicas of its ep rank."""
    local = sum(n for n, e in zip(ctx.info.numels, expert_shapes(ctx), strict=True) if e) // ep
    note = "expert gradients summed over the dp replicas of each ep rank"
    return Collective("all_reduce", local * ctx.param_bytes, 1, "optimizer", dp, note, dim="dp")


def ep_mesh_dims(world: int, ep: int) -> dict[str, int]:
    """The (dp, ep) mesh of --ep (``CostModel.mesh_dims``), or {} where ep = world (one dimension)."""
    return {"dp": world // ep, "ep": ep} if world > ep else {}


@dataclasses.dataclass
class EPSetup:
    """What ``setup_ep`` made: the (dp, ep) mesh, this rank's expert parameters and their names in the model."""

    mesh: Any
    params: list[nn.Parameter]
    names: list[str]

    def sync_grads(self) -> None:
        """dp > 1: each expert gradient summed over the dp replicas of this ep rank (one all-reduce of them all,
        flattened), after the step's last micro-batch; nothing with one replica."""
        import torch.distributed as dist

        if self.mesh.size(0) == 1:
            return
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.mesh.get_group("dp"))
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params]), strict=True):
            p.grad = g.view_as(p)


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""The name parts activation checkpointing's and compile's wrappers add, which the state dict's keys leave out."""


def state_dict_key(name: str) -> str:
    """A parameter's name in the (possibly wrapped) model as ``get_state_dict`` keys it."""
    for part in WRAPPERS:
        name = name.replace(part, "")
    return name


def setup_ep(model: nn.Module, env: Any, ep: int) -> EPSetup:
    """--ep E: the (dp = world / E, ep = E) mesh (E consecutive ranks an ep group); each rank keeps experts / E of
    every MoE layer by its ep coordinate (``apply_ep``) and exchanges tokens within its ep group; the expert
    gradients divided by the world (``scale_expert_grads``), then summed over dp (``EPSetup.sync_grads``)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = env.world_size // ep
    mesh = init_device_mesh(env.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    experts = apply_ep(model, mesh.get_group("ep"), mesh.get_local_rank("ep"), ep)
    names = {id(p): state_dict_key(n) for n, p in model.named_parameters()}
    scale_expert_grads(experts, env.world_size)
    if env.is_main:
        n = moe_layers(model)[0].n_experts
        print(f"fsdp --ep {ep}: mesh dp {dp} x ep {ep}, ranks {mesh.mesh.tolist()}: each rank holds {n // ep} of each "
              f"MoE layer's {n} experts (not FSDP-sharded; replicated over dp, gradients summed over it), tokens "
              "exchanged by all-to-all in the ep group; the dense parts FSDP2-sharded over every rank", flush=True)  # fmt: skip
    return EPSetup(mesh, experts, [names[id(p)] for p in experts])


def clip_grad_norm_ep(model: nn.Module, setup: EPSetup, max_norm: float) -> torch.Tensor:
    """--clip-grad-norm under --ep: the 2-norm over every parameter once, torchtitan's split: the dense gradients'
    (FSDP2's DTensor shards: ``get_total_norm`` reduces them over the mesh) and the experts' (this rank's squared
    norm summed over its ep group; the dp replicas hold the same gradients, counted once); then every gradient
    scaled by the one factor, as ``clip_grad_norm_`` does. Returns the total norm."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    ids = {id(p) for p in setup.params}
    dense = [p for p in model.parameters() if p.grad is not None and id(p) not in ids]
    norm = torch.nn.utils.get_total_norm([p.grad for p in dense])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    squares = torch.nn.utils.get_total_norm([p.grad for p in setup.params if p.grad is not None]) ** 2
    dist.all_reduce(squares, group=setup.mesh.get_group("ep"))
    total = (norm.to(squares.dtype) ** 2 + squares).sqrt()
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(setup.params, max_norm, total)
    return total


def ep_report(model: nn.Module, ep: int, world: int) -> dict[str, Any]:
    """result.json's ``ep``: the group size and the experts each rank holds of every MoE layer; with dp > 1 the
    (dp, ep) ``mesh``."""
    own = {"ep": {"size": ep, "experts_per_rank": moe_layers(model)[0].n_experts // ep}}
    return own | ({"mesh": ep_mesh_dims(world, ep)} if world > ep else {})


class EPCheckpointIO(FSDPCheckpointIO):
    """FSDP2's checkpoints (``FSDPCheckpointIO``); under --ep the sharded folder holds each expert weight (and its
    optimizer moments) as the ranks' slices of the whole (E, ...) tensor (``sharded_expert_state``): saved, not
    loaded back (--ep refuses --resume and --init-from, and a run that finds a checkpoint to resume)."""

    def save_checkpoint(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> Path:
        st = self.strategy
        if st.options.ep == 1:
            return super().save_checkpoint(path, model, optimizer, extra)
        state = sharded_expert_state(
            sharded.module_state(model, optimizer), st.ep_setup.names, st.ep_setup.mesh
        )
        return sharded.save_sharded(path, model, optimizer, extra, is_main=st.env.is_main, state=state)

    def load_checkpoint(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        if self.strategy.options.ep > 1:
            raise ConfigError(f"fsdp --ep {self.strategy.options.ep}: loading a checkpoint ({path}) under expert "
                              "parallelism is not supported (the checkpoint was saved; load it with fsdp)")  # fmt: skip
        return super().load_checkpoint(path, model, optimizer)
