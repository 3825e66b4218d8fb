"""Hugging Face mixtures of experts as ``--model hf:FOLDER`` (``models.hf``): ``mixtral``, ``qwen2_moe``,
``qwen3_moe``, and any transformers causal LM whose config has a ``router_aux_loss_coef`` and experts, whose
outputs record its routers' ``router_logits``, and whose experts are stacked (E, ...) weights.

Three things stratbench adds to such a model:

- **Its experts run one after the other** (``experts_forward``, registered in transformers' ``ExpertsInterface``
  as ``"stratbench"``): expert e takes the assignments routed to it and its weighted output is added back, as the
  built-in MoE does (``models.moe``), exact and deterministic in every dtype on CPU. transformers' default
  (``grouped_mm``) takes bf16 only on the meta and fake devices, where FLOPs are counted and memory traced; there
  each expert takes an equal share of the ``tokens x k`` assignments (``moe.balanced_counts``), so that the
  counter sees the active FLOPs of a dropless layer and the trace the activations of a balanced one.
- **The auxiliary loss as transformers computes it** (``HFRouting``): each training forward asks for the router
  logits (``output_router_logits``) and keeps the ``aux_loss`` the model returns (``load_balancing_loss_func`` over
  all its routed layers, of the micro-batch); the training loss adds ``router_aux_loss_coef x aux_loss`` where the
  config's ``output_router_logits`` is true, as the model's own forward with labels does (and nothing where it is
  false, as there). result.json's ``moe`` counts each layer's assignments per expert from its router logits' top-k
  (the router's choice: a softmax in fp32, its top k), dropped 0 (the routing is dropless) and the model's aux loss.
- **Active and total parameters** (``parameter_split``): a token passes through every dense weight, the routers,
  the shared experts and k of each routed layer's E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratbench.models.moe import RouterRecord, RouterTotals, balanced_counts, has_data, router_report

EXPERTS_IMPLEMENTATION = "stratbench"
"""The name ``experts_forward`` is registered under in transformers' ``ExpertsInterface``."""
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Where transformers' MoE configs hold their number of routed experts (Mixtral; Qwen-MoE; DeepSeek)."""


def config_experts(config: Any) -> int:
    """The routed experts of a transformers config that trains with a router's auxiliary loss; 0 for a dense one."""
    if getattr(config, "router_aux_loss_coef", None) is None:
        return 0
    return next(
        (int(v) for k in EXPERT_COUNT_KEYS if isinstance(v := getattr(config, k, None), int) and v > 0), 0
    )


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The module class whose output transformers records as ``router_logits`` (``_can_record_outputs``), or None."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return target if isinstance(target, type) else None


def _project(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    y = h @ weight if transposed else h @ weight.T
    return y if bias is None else y + bias


def _expert(experts: nn.Module, e: int, h: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a stacked experts module on rows ``h``, as transformers' ``grouped_mm`` forward computes
    it (gate and up projection or up alone, the activation, down projection, biases and post-norm where present)."""
    t = experts.is_transposed
    if experts.has_gate:
        bias = experts.gate_up_proj_bias[e] if experts.has_bias else None
        y = experts._apply_gate(_project(h, experts.gate_up_proj[e], bias, t))
    else:
        bias = experts.up_proj_bias[e] if experts.has_bias else None
        y = experts.act_fn(_project(h, experts.up_proj[e], bias, t))
    y = _project(y, experts.down_proj[e], experts.down_proj_bias[e] if experts.has_bias else None, t)
    return experts.post_expert_norm(y) if experts.has_post_expert_norm else y


def experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted outputs summed per token (T, dim): the assignments grouped by expert (a stable sort,
    each group in token order), each expert's group through it, weighted and added back; on the meta or fake
    device, where the routing is unknown, an equal share of the assignments per expert."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    n = experts.num_experts
    if has_data(hidden_states):
        sizes = torch.bincount(flat, minlength=n).tolist()
    else:
        sizes = balanced_counts(tokens * k, n)
    gate = top_k_weights.reshape(-1)
    out = torch.zeros_like(hidden_states)
    for e, kept in enumerate(flat.argsort(stable=True).split(sizes)):
        token = kept // k
        y = _expert(experts, e, hidden_states.index_select(0, token))
        out.index_add_(0, token, (y * gate.index_select(0, kept)[:, None]).to(out.dtype))
    return out


def use_stratbench_experts(model: nn.Module) -> None:
    """Run ``model``'s stacked experts (``HFRouting.of`` found them) by ``experts_forward``, registered in
    transformers once; a model whose experts transformers cannot switch keeps its own."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)


def stacked_experts(model: nn.Module, n_experts: int) -> list[nn.Module]:
    """The modules holding a layer's routed experts as stacked (E, ...) weights (transformers'
    ``@use_experts_implementation`` classes: every own weight E rows long, one of them 3-d), in order."""
    found = []
    for m in model.modules():
        own = list(m.parameters(recurse=False))
        if (
            hasattr(m, "is_transposed")
            and own
            and all(p.shape[0] == n_experts for p in own)
            and any(p.dim() == 3 for p in own)
        ):
            found.append(m)
    return found


@dataclass
class RoutedLayer:
    """One routed layer as ``models.moe.router_report`` reads it: its experts, top-k, coefficient and totals."""

    n_experts: int
    top_k: int
    aux_loss_coef: float
    capacity_factor: float | None = None
    """None: transformers' routing is dropless."""
    totals: RouterTotals = field(default_factory=RouterTotals)


class HFRouting:
    """A Hugging Face MoE's routing as the training loop sees it (``models.moe.LayerRouting``'s protocol):
    ``keep`` takes a training forward's ``aux_loss`` and router logits, ``loss`` returns ``coef x aux_loss`` and
    commits the layers' counts (once per trained micro-batch), ``report`` is result.json's ``moe``."""

    def __init__(
        self, config: Any, routers: list[nn.Module], n_experts: int, experts: list[nn.Module]
    ) -> None:
        self.top_k = int(getattr(config, "num_experts_per_tok", None) or routers[0].top_k)
        self.coef = (
            float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0
        )
        self.layers = [RoutedLayer(n_experts, self.top_k, self.coef) for _ in routers]
        self.routers, self.experts = routers, experts
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    @classmethod
    def of(cls, model: nn.Module) -> HFRouting | None:
        """``model``'s routing (a transformers ``PreTrainedModel``), or None for a dense model."""
        config = model.config
        n = config_experts(config)
        router = router_class(model)
        if not n or router is None:
            return None
        routers = [m for m in model.modules() if isinstance(m, router)]
        experts = stacked_experts(model, n)
        if not routers or len(experts) != len(routers):
            return None
        return cls(config, routers, n, experts)

    def keep(self, aux_loss: torch.Tensor, router_logits: tuple[torch.Tensor, ...]) -> None:
        self.pending = (aux_loss, tuple(router_logits))

    def loss(self) -> torch.Tensor:
        """``coef x`` the latest training forward's aux loss (its graph kept), each layer's assignments counted."""
        if self.pending is None:
            raise RuntimeError(
                "a Hugging Face MoE's training loss was asked for without a training forward before it"
            )
        (aux, logits), self.pending = self.pending, None
        with torch.no_grad():
            for layer, layer_logits in zip(self.layers, logits, strict=True):
                chosen = layer_logits.float().softmax(-1).topk(self.top_k, dim=-1).indices.flatten()
                counts = torch.bincount(chosen, minlength=layer.n_experts)
                # the model's aux loss (fp32 in transformers) in each layer, summed over micro-batches in fp64
                layer.totals.add(RouterRecord(aux.detach().double(), counts, 0))
        return self.coef * aux

    def report(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """result.json's ``moe`` routing (``models.moe.router_report``): its aux loss is transformers' of the model."""
        return router_report(self.layers, reduce_sum)

    def _experts_parameters(self, share: int) -> int:
        """``share`` of each routed layer's E experts' parameters."""
        stacked = sum(p.numel() for m in self.experts for p in m.parameters(recurse=False))
        return stacked * share // self.layers[0].n_experts

    def parameter_split(self, model: nn.Module) -> tuple[int, int]:
        """(active, total) parameters: k of each routed layer's E experts, every other weight."""
        total = sum(p.numel() for p in model.parameters())
        return total - self._experts_parameters(self.layers[0].n_experts - self.top_k), total

    def active_matmul_weights(self) -> int:
        """The weights a token multiplies that are no ``nn.Linear``: the routers' (where not a Linear) and k of
        each routed layer's E experts."""
        routers = sum(m.weight.numel() for m in self.routers if not isinstance(m, nn.Linear))
        return routers + self._experts_parameters(self.top_k)
