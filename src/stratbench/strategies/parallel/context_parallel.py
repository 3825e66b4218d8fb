"""Context parallelism, Ulysses style (Jacobs et al. 2023, DeepSpeed-Ulysses): the sequence split over the C ranks
of a context-parallel group, each rank computing its chunk of positions through every token-wise layer
(embedding, norms, MLP, head, loss), and each attention exchanging its queries, keys and values by all-to-all
from sequence-sharded (batch, T / C, heads, head_dim) to head-sharded (batch, T, heads / C, head_dim), attending
over the whole sequence with its heads, and exchanging the output back. Rotary positions use the chunk's global
offset, so each rank rotates exactly the positions one process would.

A building block: ``fsdp --cp C`` composes it (its mesh dp x cp: FSDP2 shards over every rank, the ranks of one
cp group read the same samples and each takes its chunk of their positions). The all-to-alls are torch's
``dist.all_to_all_single`` in a differentiable wrapper (the backward is the reverse exchange), so gloo runs them on
CPU; torch's ring attention (``context_parallel``) is CUDA-only
(``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), hence not offered on CPU.

The built-in transformer (``models.transformer``) takes it: each ``Attention`` becomes a ``UlyssesAttention``
(the same module, parameters and state-dict keys, another ``forward``), so checkpoints load under any method.
For the memory estimate's trace the same class runs with no group: the exchanges become the local reshuffles of
the same shapes (what a rank holds after them), on one chunk of T / C positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.core.errors import ConfigError
from stratbench.data.instruct import IGNORE
from stratbench.data.text import is_ft_data
from stratbench.measuring.comm import Collective
from stratbench.models.transformer import SIZES, Attention, Transformer
from stratbench.models.zoo import ac_every
from stratbench.strategies.parallel.fsdp import fsdp2_memory

CP_IMPLS = ("ulysses",)


def check_cp_impl(impl: str) -> None:
    """One line for an implementation this build does not offer (ring attention: see the module's doc)."""
    if impl == "ring":
        raise ConfigError(
            "fsdp --cp-impl ring is not offered: torch's ring attention (context_parallel) is CUDA-only "
            "(aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy) and not built here; "
            "use --cp-impl ulysses"
        )
    if impl not in CP_IMPLS:
        raise ConfigError(f"unknown --cp-impl {impl!r}; choose one of: {', '.join(CP_IMPLS)}")


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of equal chunks along dim 0, differentiable: its gradient is the same exchange of
    the output's gradient (chunk j back to rank j). torch's own (``torch.distributed.nn.functional``) is
    deprecated, and the functional collectives' one is not a c10d call the communication recorder sees."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()  # the chunks as consecutive memory, the output laid out the same (not a view's strides)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """all-to-all of ``x`` (C, ...) over ``group``: chunk j goes to rank j, chunk j of the result came from rank j;
    with no group (the estimate's trace), ``x`` itself (the same shapes and bytes, no traffic)."""
    return x if group is None else _AllToAll.apply(x, group)


def seq_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """(batch, T / C, heads, d) of this rank's positions -> (batch, T, heads / C, d) of its heads, all positions
    in order (rank j's chunk is positions j T / C to (j + 1) T / C)."""
    b, t, h, d = x.shape
    chunks = x.reshape(b, t, size, h // size, d).permute(2, 0, 1, 3, 4)  # (C, b, t, h/C, d): chunk j -> rank j
    out = _exchange(chunks, group)  # (C, b, t, h/C, d): chunk j = rank j's positions, my heads
    return out.permute(1, 0, 2, 3, 4).reshape(b, size * t, h // size, d)


def heads_to_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The reverse of ``seq_to_heads``: (batch, T, heads / C, d) -> (batch, T / C, heads, d)."""
    b, t_all, h, d = x.shape
    t = t_all // size
    chunks = x.reshape(b, size, t, h, d).permute(1, 0, 2, 3, 4)  # (C, b, t, h/C, d): positions of rank j -> j
    out = _exchange(chunks, group)  # (C, b, t, h/C, d): chunk j = heads of rank j, my positions
    return out.permute(1, 2, 0, 3, 4).reshape(b, t, size * h, d)


class UlyssesAttention(Attention):
    """``Attention`` on a chunk of the sequence: its projections and rotary at the chunk's global positions
    (``first_position``), then ``attend`` between two all-to-alls: to all positions of 1 / C of the heads and
    back. Set up by ``apply_cp`` (``cp_group``, ``cp_rank``, ``cp_size``; the group None in the estimate's trace)."""

    cp_group: Any = None
    cp_rank: int = 0
    cp_size: int = 1

    def first_position(self, t: int) -> int:
        return self.cp_rank * t

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group, size = self.cp_group, self.cp_size
        q, k, v = (seq_to_heads(z, group, size) for z in (q, k, v))
        return heads_to_seq(super().attend(q, k, v), group, size)


def attentions(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if type(m) is Attention or isinstance(m, UlyssesAttention)]


def apply_cp(model: nn.Module, group: Any, rank: int, size: int) -> int:
    """Every attention of the built-in transformer made a ``UlyssesAttention`` of this rank's group; returns how
    many (``cp_unfit`` has refused a model with none)."""
    found = attentions(model)
    for attn in found:
        attn.__class__ = UlyssesAttention
        attn.cp_group, attn.cp_rank, attn.cp_size = group, rank, size
    return len(found)


def cp_unfit(cfg, cp: int, tp: int, replicate: int, world: int) -> str | None:
    """One line where ``--cp C`` cannot run: a world C does not divide, a model that is not the built-in
    transformer (its attention is the one the plan splits), heads or key/value heads C does not divide, a
    sequence C does not divide (text windows), --tp or --replicate beside it (not composed yet)."""
    if cp == 1:
        return None
    if why := cp_world_unfit(cp, world):
        return why
    if tp > 1 or replicate > 1:
        other = f"--tp {tp}" if tp > 1 else f"--replicate {replicate}"
        return f"fsdp --cp {cp} with {other} is not supported: context parallelism composes with plain FSDP (mesh dp x cp)"
    if cfg.model not in SIZES:
        return (
            f"fsdp --cp {cp}: context parallelism splits the attention of the built-in transformers "
            f"({', '.join(SIZES)}); {cfg.model!r} is not one"
        )
    tc = SIZES[cfg.model]
    for what, n in (("n_heads", tc.n_heads), ("n_kv_heads", tc.n_kv_heads)):
        if n % cp:
            fits = ", ".join(str(c) for c in range(1, n + 1) if n % c == 0)
            return f"fsdp --cp {cp}: {cfg.model}'s {what} {n} do not divide by {cp} (Ulysses gives each rank 1/C of the heads); --cp that fit: {fits}"
    if not is_ft_data(cfg.data) and cfg.seq_len % cp:
        return f"fsdp --cp {cp}: --seq-len {cfg.seq_len} does not divide by {cp} (each rank takes 1/C of the positions)"
    return None


def cp_world_unfit(cp: int, world: int) -> str | None:
    """One line where ``world`` processes do not form groups of ``cp``, naming the degrees that fit."""
    if cp == 1 or (world % cp == 0 and world >= cp):
        return None
    fits = ", ".join(str(c) for c in range(1, world + 1) if world % c == 0)
    return f"fsdp --cp {cp}: {world} processes do not divide into context-parallel groups of {cp}; --cp that fit: {fits}"


def local_chunk(x: torch.Tensor, y: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions of a (batch, T) pair of token ids and targets: chunk ``rank`` of ``size``. Padded
    fine-tuning batches whose T does not divide are padded at the end first (token 0, target IGNORE: after every
    real position under causal attention, and not scored)."""
    pad = -x.shape[1] % size
    if pad:
        x = F.pad(x, (0, pad), value=0)
        y = F.pad(y, (0, pad), value=IGNORE)
    t = x.shape[1] // size
    return x[:, rank * t : (rank + 1) * t], y[:, rank * t : (rank + 1) * t]


def chunk_eval_sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(batch, 3): each sample's summed cross-entropy, correct predictions and scored tokens over this chunk (the
    cp group sums them, then divides: each sample's token means, as one process computes them)."""
    losses = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE)
    n = targets.shape[0]
    scored = (targets != IGNORE).to(losses.dtype).view(n, -1)
    correct = (logits.argmax(-1) == targets).to(losses.dtype).view(n, -1) * scored
    return torch.stack(((losses.view(n, -1) * scored).sum(1), correct.sum(1), scored.sum(1)), dim=1)


def ulysses_rows(ctx, cp: int) -> list[Collective]:
    """Ulysses' all-to-alls per optimizer step: per attention forward q, k and v to heads (b x T/C x (H + 2 KV) x
    head_dim elements) and the output back (b x T/C x H x head_dim), in the compute dtype; the same in backward
    (the gradients' reverse exchanges); with activation checkpointing the checkpointed blocks' forward ones again
    in backward (every block under full and selective, which recomputes the exchanges; one in N under every:N). b is a
    rank's micro-batch, once per micro-step."""
    cfg = ctx.cfg
    tc = SIZES[cfg.model]
    micro = cfg.batch_size // (ctx.world // cp) // cfg.grad_accum
    elems = micro * (cfg.seq_len // cp) * tc.head_dim
    nbytes = ctx.pspec.compute_dtype.itemsize
    calls = 4 * tc.n_layers * cfg.grad_accum
    per_fwd = elems * (2 * tc.n_heads + 2 * tc.n_kv_heads) * nbytes * tc.n_layers * cfg.grad_accum
    note = "Ulysses: q, k, v to heads and the output back, per attention"
    rows = [
        Collective("all_to_all", per_fwd, calls, "forward", cp, note, dim="cp", critical=True),
        Collective("all_to_all", per_fwd, calls, "backward", cp, f"{note} (gradients)", dim="cp", critical=True),
    ]
    if cfg.activation_checkpointing:  # the checkpointed blocks' exchanges run again (selective too: measured)
        blocks = -(-tc.n_layers // ac_every(cfg.ac_mode))
        again = dataclasses.replace(rows[0], payload_bytes=per_fwd * blocks // tc.n_layers,
                                    calls=calls * blocks // tc.n_layers, phase="backward", note=f"recomputed: {note}")  # fmt: skip
        rows.append(again)
    return rows


@dataclasses.dataclass(frozen=True)
class CPChunk:
    """The estimate's trace of one context-parallel rank (hashable: traces are cached per transform): every
    attention a ``UlyssesAttention`` with no group (the exchanges as local reshuffles of the same shapes), traced
    on a chunk of T / C positions (``RankMemory.trace_seq_len``)."""

    cp: int

    def __call__(self, model: nn.Module) -> None:
        if isinstance(model, Transformer):
            apply_cp(model, None, 0, self.cp)


def cp_mesh(model: nn.Module, env: Any, c: int) -> tuple[dict[str, int], Any, int]:
    """A (dp, cp) mesh whose cp groups (C consecutive ranks) exchange each attention's heads, every attention made
    Ulysses' (``apply_cp``), printed once; returns the mesh's shape, this rank's cp group and its place in it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = env.world_size
    mesh = init_device_mesh(env.device.type, (world // c, c), mesh_dim_names=("dp", "cp"))
    group, rank = mesh["cp"].get_group(), env.rank % c
    n = apply_cp(model, group, rank, c)
    if env.is_main:
        print(f"fsdp mesh: dp {world // c} x cp {c}, ranks {mesh.mesh.tolist()} (the ranks of one cp group read "
              f"the same samples, 1/{c} of the positions each; {n} attentions exchange heads by all-to-all "
              "(Ulysses); FSDP2 shards over every rank)", flush=True)  # fmt: skip
    return {"dp": world // c, "cp": c}, group, rank


def cp_memory(ctx, rank: int, units_note: str) -> Any:
    """--cp C: FSDP2's states sharded over every rank (``fsdp2_memory``); the activations of one chunk of T / C
    positions of the replica's micro-batch (``CPChunk``: all positions of 1/C of the heads in attention)."""
    c = ctx.options.cp
    m = fsdp2_memory(ctx, rank, ctx.options.sharding, ctx.options.cpu_offload)
    m.sharding_note += f" over every rank (N = {ctx.world}); activations of T / {c} positions (cp {c})"
    m.data_ranks = ctx.world // c
    m.trace_transform, m.trace_seq_len = CPChunk(c), ctx.cfg.seq_len // c
    m.units_note = units_note
    return m
