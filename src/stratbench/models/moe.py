"""A mixture-of-experts feed-forward layer for the built-in transformer (``models.transformer``'s MoE sizes).

Routing is Mixtral's (transformers' ``MixtralSparseMoeBlock``): a linear router, a softmax over the experts, the
top-k kept and, where the model's source does (``norm_topk_prob``: Mixtral, Qwen3-MoE, DeepSeek-V3), renormalised
to sum to 1. Each expert is a SwiGLU MLP; the experts' weights are stacked (E, ...) tensors as torchtitan's
``GroupedExperts`` holds them, so that expert parallelism can shard them along their first dimension.

The experts run one after the other: expert e takes the tokens routed to it (``index_select``), and its weighted
output is added back (``index_add_``), exact and deterministic on CPU. Dropless by default: every token reaches its
k experts. With a capacity factor c, expert e keeps at most ``ceil(c x tokens x k / E)`` of its assignments (the
earliest tokens of the batch first) and the others are dropped (the token keeps its residual) and counted.

A model on the meta device or on fake tensors (FLOP counts, the memory estimate's trace) has no router decisions:
there each expert takes an equal share of the ``tokens x k`` assignments (capacity applied alike), so that the
FLOP counter sees exactly the active FLOPs of a dropless layer and the trace the activations of a balanced one.

The load-balancing loss is Switch's (Fedus et al. 2022, eq. 4) over the top-k assignments: ``E x sum_e f_e x P_e``,
f_e the share of the micro-batch's ``tokens x k`` assignments that went to expert e (no gradient), P_e the mean
router probability of e; 1 when the routing is uniform. (transformers' Mixtral loss is k times this: its shares sum
to k.) The layer keeps each training forward's loss and counts as ``pending``; ``training.losses``
adds ``coef x`` the layers' mean loss to the training loss and commits the counts, once per trained micro-batch, so
that an evaluation forward or an activation-checkpointing recomputation is never counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class RouterRecord:
    """One forward's routing: the load-balancing loss (with its graph), assignments per expert and drops."""

    aux_loss: torch.Tensor
    counts: torch.Tensor
    """Assignments routed to each expert (int64, (E,)), before any drop."""
    dropped: int
    """Assignments over the capacity, dropped (0 when dropless)."""


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values (not a meta or fake tensor, whose router decisions are unknown)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def balanced_counts(assignments: int, n_experts: int) -> list[int]:
    """``assignments`` shared as evenly as whole tokens allow over ``n_experts`` (the first ones take one more)."""
    base, extra = divmod(assignments, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


def capacity(tokens: int, top_k: int, n_experts: int, factor: float | None) -> int | None:
    """Assignments one expert may take: ``ceil(factor x tokens x top_k / n_experts)``; None (no limit) when dropless."""
    return None if factor is None else math.ceil(factor * tokens * top_k / n_experts)


def kept_groups(order: torch.Tensor, sizes: list[int], cap: int | None) -> list[torch.Tensor]:
    """Each expert's kept assignments: ``order`` (the assignments grouped by expert) cut into its ``sizes``, the
    first ``cap`` of each group kept (all when dropless)."""
    groups = order.split(sizes)
    return list(groups) if cap is None else [g[:cap] for g in groups]


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts (stacked weights ``w1``/``w3`` (E, hidden, dim), ``w2`` (E, dim, hidden)), plus
    ``shared`` (a dense MLP every token passes through: DeepSeek's shared experts) when given."""

    def __init__(
        self, dim: int, hidden: int, n_experts: int, top_k: int, *, norm_topk_prob: bool = True,
        capacity_factor: float | None = None, aux_loss_coef: float = 0.0, shared: nn.Module | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.shared = shared
        self.expert_parallel: Callable[..., torch.Tensor] | None = None
        """Expert parallelism's exchange (``strategies.parallel.expert_parallel.ExpertExchange``) replacing
        ``run_experts``' loop where the strategy set it: this module then holds only its rank's experts."""
        self.pending: RouterRecord | None = None
        """The latest forward's routing, taken by the training loss (``take_pending``)."""
        self.totals = RouterTotals()

    def expert_parameters(self) -> int:
        """Parameters of one routed expert."""
        return self.w1[0].numel() + self.w2[0].numel() + self.w3[0].numel()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k weights (T, k) in x's dtype, top-k experts (T, k), router probabilities (T, E)) of tokens (T, dim);
        the softmax in fp32 at least (as Mixtral's, in float)."""
        logits = self.router(x)
        probs = logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k, n = x.shape[0], self.top_k, self.n_experts
        weights, experts, probs = self.route(x)
        flat = experts.flatten()  # assignment a = token a // k, slot a % k
        counts = torch.zeros(n, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        sizes = counts.tolist() if has_data(x) else balanced_counts(tokens * k, n)
        cap = capacity(tokens, k, n, self.capacity_factor)
        order = flat.argsort(stable=True)  # the assignments grouped by expert, each group in token order
        out = self.run_experts(x, weights.flatten(), order, sizes, cap)
        self.record_routing(counts, probs, 0 if cap is None else sum(max(0, s - cap) for s in sizes))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def record_routing(self, counts: torch.Tensor, probs: torch.Tensor, dropped: int) -> None:
        """What the training loss takes of this micro-batch's routing (``pending``; none outside a training
        forward): the load-balancing loss n x sum_e f_e P_e (f_e expert e's share of the tokens x k assignments,
        P_e its mean router probability over ``probs``' tokens), the assignments per expert and those dropped."""
        share = counts.to(probs.dtype) / (probs.shape[0] * self.top_k)
        aux = self.n_experts * (share * probs.mean(0)).sum()
        self.pending = RouterRecord(aux, counts, dropped) if torch.is_grad_enabled() else None

    def run_experts(
        self, x: torch.Tensor, gate: torch.Tensor, order: torch.Tensor, sizes: list[int], cap: int | None
    ) -> torch.Tensor:
        """Each expert's output on its assignments (``order``: the assignments grouped by expert, ``sizes[e]`` of
        them for expert e, the first ``cap`` kept), weighted by ``gate`` and summed per token, (T, dim). The step
        expert parallelism replaces: the groups sent to the ranks that hold their experts and back."""
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, gate, order, sizes, cap)
        out = torch.zeros_like(x)
        for e, kept in enumerate(kept_groups(order, sizes, cap)):
            token = kept // self.top_k
            y = self.expert(e, x.index_select(0, token))
            out.index_add_(0, token, y * gate.index_select(0, kept)[:, None])
        return out

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Held expert ``e``'s SwiGLU on rows ``h``, its weights in the rows' dtype (a no-op where they match;
        under --ep FSDP2's policy does not cast the experts, which it leaves out)."""
        w1, w2, w3 = (w[e].to(h.dtype) for w in (self.w1, self.w2, self.w3))
        return (F.silu(h @ w1.T) * (h @ w3.T)) @ w2.T

    def take_pending(self) -> torch.Tensor:
        """The load-balancing loss of the latest training forward (its graph kept), its counts added to
        ``totals``; called once per trained micro-batch by the training loss."""
        if self.pending is None:
            raise RuntimeError(
                "an MoE layer's training loss was asked for without a training forward before it"
            )
        record, self.pending = self.pending, None
        self.totals.add(record)
        return record.aux_loss


class RouterTotals:
    """One layer's routing summed over the trained micro-batches of this process, kept on the layer's device (no
    host synchronisation per micro-batch; ``router_report`` reads it once)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None
        self.dropped = 0
        self.aux_sum: torch.Tensor | float = 0.0
        self.passes = 0

    def add(self, record: RouterRecord) -> None:
        counts = record.counts.detach()
        self.counts = counts.clone() if self.counts is None else self.counts + counts
        self.last_counts = counts
        self.dropped += record.dropped
        self.aux_sum = self.aux_sum + record.aux_loss.detach()
        self.passes += 1


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of ``model`` (wrapped or not), in order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def router_loss(layers: list[MoEFeedForward]) -> torch.Tensor:
    """``coef x`` the layers' mean load-balancing loss of the latest training forward (their counts committed)."""
    return sum(layer.aux_loss_coef * layer.take_pending() for layer in layers) / len(layers)


class Routing(Protocol):
    """A mixture of experts' routing as the training loop sees it: the built-in layers' (``LayerRouting``) or a
    Hugging Face model's (``models.hf_moe.HFRouting``)."""

    def loss(self) -> torch.Tensor: ...

    def report(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict: ...

    def parameter_split(self, model: nn.Module) -> tuple[int, int]: ...


class LayerRouting:
    """The built-in MoE layers' routing as the training loop sees a model's routing (``models.hf_moe.HFRouting``
    has the same three calls): ``loss`` (coef x the load-balancing loss of the latest training forward, counts
    committed), ``report`` (result.json's ``moe``) and ``parameter_split`` (active, total)."""

    def __init__(self, layers: list[MoEFeedForward]) -> None:
        self.layers = layers

    def loss(self) -> torch.Tensor:
        return router_loss(self.layers)

    def report(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        return router_report(self.layers, reduce_sum)

    def parameter_split(self, model: nn.Module) -> tuple[int, int]:
        return parameter_split(model)


def parameter_split(model: nn.Module) -> tuple[int, int]:
    """(active, total) parameters: a token passes through k of each MoE layer's E routed experts."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum((m.n_experts - m.top_k) * m.expert_parameters() for m in moe_layers(model))
    return total - idle, total


def router_report(layers: list[MoEFeedForward], reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """What result.json's ``moe`` records of a run's MoE layers, summed over the processes by ``reduce_sum`` (an
    all-reduce over the data-parallel ranks, every one holding every layer): the routed assignments per layer and
    expert over every trained micro-batch (``tokens_per_expert``) and their max/mean per layer (1: balanced),
    assignments dropped over the capacity, and the mean load-balancing loss of a layer and micro-batch."""
    n, totals = layers[0].n_experts, [layer.totals for layer in layers]

    def rows(tensors: list[torch.Tensor | None]) -> torch.Tensor:
        return torch.stack([torch.zeros(n) if t is None else t.detach().cpu() for t in tensors]).double()

    counts, last = rows([t.counts for t in totals]), rows([t.last_counts for t in totals])
    scalars = torch.tensor([[t.dropped, float(t.aux_sum), t.passes] for t in totals], dtype=torch.float64)
    counts, last, scalars = (reduce_sum(t) for t in (counts, last, scalars))
    routed = counts.sum().item()
    imbalance = (counts.max(1).values / counts.mean(1).clamp(min=1e-300)).tolist()
    first = layers[0]
    return {
        "experts": n, "top_k": first.top_k, "routing": "dropless" if first.capacity_factor is None else
        f"capacity factor {first.capacity_factor:g}", "aux_loss_coef": first.aux_loss_coef, "layers": len(layers),
        "tokens_per_expert": [[int(c) for c in row] for row in counts.tolist()],
        "tokens_per_expert_last_micro_batch": [[int(c) for c in row] for row in last.tolist()],
        "load_imbalance_per_layer": imbalance, "load_imbalance": max(imbalance) if routed else None,
        "dropped_tokens": int(scalars[:, 0].sum().item()),
        "dropped_fraction": scalars[:, 0].sum().item() / routed if routed else None,
        "aux_loss": scalars[:, 1].sum().item() / scalars[:, 2].sum().item() if scalars[:, 2].sum() else None,
    }  # fmt: skip
