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
A Hugging Face decoder (``models.hf.HFCausalLM``) takes it too where its attention goes through transformers'
attention interface: each rank feeds its chunk with global ``position_ids`` (``HFCausalLM.chunk``), and the
model's ``_attn_implementation`` becomes ``hf_ulysses_attention`` registered for the rank's group (the same
exchanges around transformers' sdpa attention, causal over the whole sequence); ``hf_unfit`` refuses, from one
meta-device forward, a model whose attention that would change. For the memory estimate's trace the same code
runs with no group: the exchanges become the local reshuffles of the same shapes (what a rank holds after them),
on one chunk of T / C positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.core.errors import ConfigError
from stratbench.data.instruct import IGNORE
from stratbench.data.text import is_ft_data
from stratbench.measuring.comm import Collective
from stratbench.models.hf import HFCausalLM, attention_calls, is_hf_name, load_config, max_positions
from stratbench.models.transformer import SIZES, Attention
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
    """Every attention of the built-in transformer made a ``UlyssesAttention`` of this rank's group, and every
    Hugging Face model fed chunk ``rank`` of its positions with its attention implementation Ulysses'
    (``hf_ulysses_attention``, registered for this group); returns how many attentions (``cp_unfit`` has refused
    a model with none)."""
    found = attentions(model)
    for attn in found:
        attn.__class__ = UlyssesAttention
        attn.cp_group, attn.cp_rank, attn.cp_size = group, rank, size
    n = len(found)
    for hf in (m for m in model.modules() if isinstance(m, HFCausalLM)):
        hf.chunk = rank
        hf.hf.set_attn_implementation(_ulysses_implementation(group, size))
        n += sum(isinstance(m, hf._stratbench_block_types) for m in hf.modules())
    return n


def hf_ulysses_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    dropout: float = 0.0, scaling: float | None = None, *, group: Any, size: int, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An implementation of transformers' attention interface (``AttentionInterface``) under Ulysses: query
    (b, H, T / C, d), key and value (b, KV, T / C, d) of this rank's positions to all T positions of 1 / C of the
    heads by all-to-all (``seq_to_heads``), transformers' sdpa attention causal over the whole sequence, and the
    output (b, T, H / C, d) back to (b, T / C, H, d) (``heads_to_seq``), as the interface returns it.

    The mask: none is taken. stratbench's ``HFCausalLM`` passes no attention mask (padded fine-tuning batches are
    padded at the end, after every real position, with targets not scored), and transformers makes none for an
    implementation with no mask function registered (``ALL_MASK_ATTENTION_FUNCTIONS``), so what reaches here for
    a chunk is None (a chunk's own causal square would be wrong); the causal pattern over the global sequence is
    sdpa's ``is_causal``, since rank j's chunk holds positions j T / C to (j + 1) T / C in order. Sliding windows
    (as wide as the sequence: ``cp_unfit``) and the other keywords are not applied."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = (seq_to_heads(z.transpose(1, 2), group, size).transpose(1, 2) for z in (query, key, value))
    out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)
    return heads_to_seq(out, group, size), None


_IMPLEMENTATIONS: dict[tuple[int, int], str] = {}
"""(id of the cp group, C) -> the name its Ulysses implementation is registered under in ``AttentionInterface``."""


def _ulysses_implementation(group: Any, size: int) -> str:
    """The name of ``hf_ulysses_attention`` bound to ``group`` and ``size`` in transformers' attention interface
    (registered once per group: the estimate's trace, group None, and a run's group live in one process)."""
    key = (id(group), size)
    if key not in _IMPLEMENTATIONS:
        from transformers import AttentionInterface

        name = f"stratbench_ulysses_{len(_IMPLEMENTATIONS)}"
        AttentionInterface.register(name, functools.partial(hf_ulysses_attention, group=group, size=size))
        _IMPLEMENTATIONS[key] = name
    return _IMPLEMENTATIONS[key]


def cp_unfit(cfg, cp: int, tp: int, replicate: int, world: int, sequence_parallel: bool = False) -> str | None:
    """One line where ``--cp C`` cannot run: a world C (x --tp T) does not divide, a model whose attention the plan
    cannot split (neither a built-in transformer nor a Hugging Face decoder whose attention goes plainly through
    transformers' attention interface: ``hf_unfit``), heads or key/value heads C (x T) does not divide, a sequence C
    does not divide (text windows; C x T under --sequence-parallel), HSDP's shard groups (world / R consecutive
    ranks) that C does not divide, --tp and --replicate together (with --tp, a Hugging Face model has no plan:
    ``tp_plan.unsupported`` refuses it first)."""
    if cp == 1:
        return None
    if why := cp_world_unfit(cp, world, tp):
        return why
    if tp > 1 and replicate > 1:
        return (f"fsdp --tp {tp} --cp {cp} with --replicate {replicate} is not supported: the mesh dp x cp x tp "
                "composes with plain FSDP (HSDP composes with --cp or with --tp, not both)")  # fmt: skip
    if replicate > 1 and (world // replicate) % cp:
        return (f"fsdp --cp {cp} --replicate {replicate}: shard groups of {world // replicate} ranks ({world} "
                f"processes / {replicate}) do not divide into context-parallel groups of {cp}")  # fmt: skip
    if cfg.model not in SIZES and not is_hf_name(cfg.model):
        return (
            f"fsdp --cp {cp}: context parallelism splits the attention of the built-in transformers "
            f"({', '.join(SIZES)}) and of Hugging Face decoders (hf:FOLDER); {cfg.model!r} is not one"
        )
    if is_hf_name(cfg.model) and (why := hf_unfit(cfg, cp)):
        return why
    if why := heads_unfit(cfg, cp, tp):
        return why
    split = cp * tp if sequence_parallel else cp
    if not is_ft_data(cfg.data) and cfg.seq_len % split:
        by = (f"{cp} x --tp {tp} (--sequence-parallel splits each rank's chunk over tp)" if split != cp
              else f"{cp} (each rank takes 1/C of the positions)")  # fmt: skip
        return f"fsdp --cp {cp}: --seq-len {cfg.seq_len} does not divide by {by}"
    return None


def heads_unfit(cfg, cp: int, tp: int) -> str | None:
    """One line where heads or key/value heads do not divide by C (x T: tensor parallelism gives each rank 1/T of
    them, Ulysses 1/C of those), naming the --cp that fit."""
    hf = is_hf_name(cfg.model)
    for heads, kv_heads, _ in sorted(set(attention_shapes(cfg))):
        for what, n in (("num_attention_heads" if hf else "n_heads", heads), ("num_key_value_heads" if hf else "n_kv_heads", kv_heads)):  # fmt: skip
            if n % (cp * tp) == 0:
                continue
            if tp == 1:
                fits = ", ".join(str(c) for c in range(1, n + 1) if n % c == 0)
                return f"fsdp --cp {cp}: {cfg.model}'s {what} {n} do not divide by {cp} (Ulysses gives each rank 1/C of the heads); --cp that fit: {fits}"
            fits = ", ".join(str(c) for c in range(1, n // tp + 1) if heads % (c * tp) == kv_heads % (c * tp) == 0)
            return (f"fsdp --tp {tp} --cp {cp}: {cfg.model}'s {what} {n} do not divide by {tp} x {cp} (tensor "
                    f"parallelism gives each rank 1/T of the heads, Ulysses 1/C of those); --cp that fit with --tp {tp}: {fits}")  # fmt: skip
    return None


def hf_unfit(cfg, cp: int) -> str | None:
    """One line where a Hugging Face model's attention cannot be split by heads (``models.hf.attention_calls``,
    one forward on the meta device): none goes through transformers' attention interface, one is not causal or
    hands it more than a plain causal attention takes (a soft cap, sinks, ...), a sliding window narrower than the
    sequence, a model that takes no ``position_ids``, or positions past the model's (padded fine-tuning batches
    are padded to a multiple of C)."""
    calls, head = attention_calls(cfg.model), f"fsdp --cp {cp}: {cfg.model}"
    padded = -(-cfg.seq_len // cp) * cp if is_ft_data(cfg.data) else cfg.seq_len
    limit = max_positions(load_config(cfg.model))
    if calls.error:
        return f"{head}: its forward on the meta device failed ({calls.error}); its attention cannot be split"
    if not calls.shapes:
        return (f"{head}: its attention does not go through transformers' attention interface "
                "(ALL_ATTENTION_FUNCTIONS), whose implementation Ulysses replaces; llama, mistral, qwen2, gpt2 do")  # fmt: skip
    if not calls.causal:
        return f"{head}: an attention of it is not causal (is_causal), and Ulysses runs causal attention"
    if calls.extras:
        return (f"{head}: its attention hands transformers' attention interface {', '.join(calls.extras)}, which "
                "Ulysses' causal attention over the exchanged heads does not apply")  # fmt: skip
    if calls.windows and calls.windows[0] < padded:
        return (f"{head}: its sliding window of {calls.windows[0]} tokens is narrower than the {padded}-token "
                f"sequence, and Ulysses attends over the whole of it; choose --seq-len at most {calls.windows[0]}")  # fmt: skip
    if not calls.takes_positions:
        return f"{head}: its forward takes no position_ids, so a rank's chunk cannot be given its global positions"
    if limit is not None and padded > limit:
        return f"{head}: fine-tuning batches padded to a multiple of {cp} reach {padded} positions, past its max_position_embeddings {limit}"
    return None


def attention_shapes(cfg) -> list[tuple[int, int, int]]:
    """(heads, key/value heads, head size) of each attention of one forward: a built-in transformer's from its
    size, a Hugging Face model's as the meta forward recorded them (``attention_calls``)."""
    if is_hf_name(cfg.model):
        return list(attention_calls(cfg.model).shapes)
    tc = SIZES[cfg.model]
    return [(tc.n_heads, tc.n_kv_heads, tc.head_dim)] * tc.n_layers


def cp_world_unfit(cp: int, world: int, tp: int = 1) -> str | None:
    """One line where ``world`` processes do not form groups of ``cp`` (x ``tp``: each cp rank a tp group),
    naming the degrees that fit."""
    if cp == 1 or (world % (cp * tp) == 0 and world >= cp * tp):
        return None
    if tp == 1:
        fits = ", ".join(str(c) for c in range(1, world + 1) if world % c == 0)
        return f"fsdp --cp {cp}: {world} processes do not divide into context-parallel groups of {cp}; --cp that fit: {fits}"
    fits = ", ".join(str(c) for c in range(1, world // tp + 1) if world % (c * tp) == 0)
    return (f"fsdp --tp {tp} --cp {cp}: {world} processes do not divide into cp x tp groups of {cp * tp}; --cp that "
            f"fit with --tp {tp}: {fits}")  # fmt: skip


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
    rank's micro-batch, once per micro-step. The attentions are the built-in transformer's or a Hugging Face
    model's (``attention_shapes``: one per decoder layer). With --tp T (mesh dp x cp x tp) each rank exchanges its
    tensor-parallel slice, H / T and KV / T heads, at the micro-batch of world / (C T) replicas."""
    cfg, tp = ctx.cfg, getattr(ctx.options, "tp", 1)
    shapes = [(h // tp, kv // tp, d) for h, kv, d in attention_shapes(cfg)]
    micro = cfg.batch_size // (ctx.world // (cp * tp)) // cfg.grad_accum
    tokens = micro * (cfg.seq_len // cp)
    nbytes = ctx.pspec.compute_dtype.itemsize
    calls = 4 * len(shapes) * cfg.grad_accum
    per_fwd = tokens * sum((2 * h + 2 * kv) * d for h, kv, d in shapes) * nbytes * cfg.grad_accum
    note = "Ulysses: q, k, v to heads and the output back, per attention"
    rows = [
        Collective("all_to_all", per_fwd, calls, "forward", cp, note, dim="cp", critical=True),
        Collective("all_to_all", per_fwd, calls, "backward", cp, f"{note} (gradients)", dim="cp", critical=True),
    ]
    if cfg.activation_checkpointing:  # the checkpointed blocks' exchanges run again (selective too: measured)
        layers = len(shapes)
        blocks = -(-layers // ac_every(cfg.ac_mode))
        again = dataclasses.replace(rows[0], payload_bytes=per_fwd * blocks // layers,
                                    calls=calls * blocks // layers, phase="backward", note=f"recomputed: {note}")  # fmt: skip
        rows.append(again)
    return rows


@dataclasses.dataclass(frozen=True)
class CPChunk:
    """The estimate's trace of one context-parallel rank (hashable: traces are cached per transform): every
    attention Ulysses' with no group (``apply_cp``: the exchanges as local reshuffles of the same shapes), traced
    on a chunk of T / C positions (``RankMemory.trace_seq_len``); with --tp, ``tp_slice`` (the rank's
    tensor-parallel slice, ``tp_costs.LocalSlice``) cut first, so that the exchanges move its H / T heads."""

    cp: int
    tp_slice: Callable[[nn.Module], None] | None = None

    def __call__(self, model: nn.Module) -> None:
        if self.tp_slice is not None:
            self.tp_slice(model)
        apply_cp(model, None, 0, self.cp)


def cp_mesh(
    model: nn.Module, env: Any, c: int, replicate: int = 1, tp: int = 1
) -> tuple[dict[str, int], Any, int, Any]:
    """A (dp, cp) mesh whose cp groups (C consecutive ranks) exchange each attention's heads, every attention made
    Ulysses' (``apply_cp``), printed once; returns the mesh's shape ((replicate, shard, cp) under HSDP: FSDP2's
    2-D mesh (replicate, shard x cp) holds each cp group inside a shard group), this rank's cp group, its place in
    it and the mesh. With --tp T the mesh is (dp, cp, tp), torchtitan's order (pp, dp_replicate, dp_shard, cp, tp:
    torchtitan/distributed/parallel_dims.py): each tp group T consecutive ranks (the per-block collectives on the
    nearest links), each cp group C ranks T apart; the caller splits the model over ``mesh["tp"]``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = env.world_size
    dims = (world // (c * tp), c, tp) if tp > 1 else (world // c, c)
    mesh = init_device_mesh(env.device.type, dims, mesh_dim_names=("dp", "cp", "tp")[: len(dims)])
    group, rank = mesh["cp"].get_group(), env.rank // tp % c
    n = apply_cp(model, group, rank, c)
    shape = dict(zip(("dp", "cp", "tp"), dims, strict=False))
    shards = "FSDP2 shards over every rank"
    if tp > 1:
        shards = f"a tp group's ranks hold 1/{tp} of each block's heads; FSDP2 shards their slices over dp x cp"
    if replicate > 1:
        shape = {"replicate": replicate, "shard": world // (replicate * c), "cp": c}
        shards = f"FSDP2 shards over shard x cp ({world // replicate} ranks), gradient shards all-reduced over replicate"
    if env.is_main:
        dims_line = " x ".join(f"{k} {v}" for k, v in shape.items())
        print(f"fsdp mesh: {dims_line}, ranks {mesh.mesh.tolist()} (the ranks of one cp group read the same samples, "
              f"1/{c} of the positions each; {n} attentions exchange heads by all-to-all (Ulysses); {shards})",
              flush=True)  # fmt: skip
    return shape, group, rank, mesh


def cp_memory(ctx, shard, at: int, units_note: str) -> Any:
    """--cp C: FSDP2's states sharded over ``shard`` (every rank, or HSDP's shard group: ``fsdp2_memory``, this
    rank ``at`` in it); the activations of one chunk of T / C positions of the replica's micro-batch (``CPChunk``:
    all positions of 1/C of the heads in attention)."""
    c, r = ctx.options.cp, ctx.options.replicate
    m = fsdp2_memory(shard, at, ctx.options.sharding, ctx.options.cpu_offload)
    over = f"over a shard group (N = {shard.world}), replicated {r}x" if r > 1 else f"over every rank (N = {ctx.world})"
    m.sharding_note += f" {over}; activations of T / {c} positions (cp {c})"
    m.data_ranks = ctx.world // c
    m.trace_transform, m.trace_seq_len = CPChunk(c), ctx.cfg.seq_len // c
    m.units_note = units_note
    return m
