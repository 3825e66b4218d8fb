"""DeepSpeed-MoE (Rajbhandari et al. 2022; ``deepspeed.moe.layer.MoE``) as a building block: the deepspeed strategy
trains a mixture of experts (``models.moe``) by swapping each ``MoEFeedForward`` for ``DeepSpeedMoEFeedForward``,
which keeps the project's layer around DeepSpeed's: the same router weight becomes DeepSpeed's gate
(``TopKGate.wg``), rank r of an ep group of E keeps the SwiGLU experts r N / E to (r + 1) N / E - 1 as DeepSpeed's
``Experts``, DeepSpeed's ``MOELayer`` dispatches the tokens into an (experts, capacity, dim) buffer, exchanges it by
all-to-all over the ep group and combines the outputs, and the engine reduces the expert gradients over its expert
data-parallel groups (divided by the whole data-parallel world, as the dense ones).

What DeepSpeed-MoE does differently from the project's layer (and so from single, ddp, fsdp and fsdp --ep):
- top-1: the gate weight is the router's probability p (Switch's); the project renormalises the top-k weights to 1
  (``norm_topk_prob``, Mixtral's), so under --moe-top-k 1 the outputs differ. Top-2 and top-k > 2 renormalise as
  the project does (2nd expert sampling and random token selection are turned off: deterministic top-k).
- the load-balancing loss: DeepSpeed's top-2 gate computes GShard's over the first choices only; the layer adds the
  project's Switch loss over all k assignments instead (``E x sum_e f_e x P_e``, from the gate's own logits, which
  for top-1 and top-k > 2 is DeepSpeed's own ``l_aux``), so that the training loss is the project's.
- dropless (``drop_tokens=False``): every expert's buffer is as long as the busiest expert's assignments on any
  rank of the ep group (an all-reduce of the max), and the all-to-all carries the padded buffer (E x capacity x dim
  numbers), not the routed rows: more bytes than fsdp --ep's uneven all-to-all whenever the routing is uneven.
- with --capacity-factor c: the same capacity, ceil(c x tokens x k / E) (``min_capacity`` 0; DeepSpeed computes it
  in float32), but DeepSpeed's drop order: top-1 keeps the tokens ``torch.topk`` picks among its equal 0/1 mask
  (random token selection off), top-2 the first choices before the second ones, top-k > 2 the highest
  probabilities; the project keeps the earliest tokens. The number dropped per expert is the same, its count past
  the capacity, which the layer reports.
- ZeRO-3 is refused by DeepSpeed itself ("Native DeepSpeed MoE is not supported with ZeRO Stage 3"), and so by the
  strategy before any work.

A checkpoint holds DeepSpeed's own files (an expert file per expert) plus the whole model in the project's layout
(``whole_moe_state``: the experts gathered over the ep group into the (N, ...) stacks), which every method loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from stratbench.models.moe import MoEFeedForward, RouterRecord, RouterTotals, capacity, moe_layers
from stratbench.models.transformer import FeedForward

NATIVE_MOE_ZERO3 = "Native DeepSpeed MoE is not supported with ZeRO Stage 3"
"""DeepSpeed's own words (deepspeed 0.19, ``engine._validate_zero3_moe_compatibility``) when its MoE meets ZeRO-3."""


class DeepSpeedMoEFeedForward(MoEFeedForward):
    """A ``MoEFeedForward`` whose routed experts are DeepSpeed's ``MoE`` (``self.moe``) with ``ep`` ranks per expert
    set, this rank holding experts ``ep_rank x N / ep`` on; the shared expert, the routing record the training loss
    takes and the totals the report reads are the project's. Built from a project layer, whose weights it copies."""

    def __init__(self, layer: MoEFeedForward, ep: int, ep_rank: int) -> None:
        # nn.Module's set-up only: the router and the stacked experts become DeepSpeed's gate and Experts below
        nn.Module.__init__(self)
        from deepspeed.moe.layer import MoE

        self.n_experts, self.top_k, self.norm_topk_prob = layer.n_experts, layer.top_k, layer.norm_topk_prob
        self.capacity_factor, self.aux_loss_coef = layer.capacity_factor, layer.aux_loss_coef
        self.expert_parallel = None
        self.pending: RouterRecord | None = None
        self.totals = RouterTotals()
        hidden, dim = layer.w1.shape[1:]
        local = layer.n_experts // ep
        dropless = layer.capacity_factor is None
        self.moe = MoE(
            dim, FeedForward(dim, hidden), num_experts=layer.n_experts, ep_size=ep, k=layer.top_k,
            capacity_factor=1.0 if dropless else layer.capacity_factor,
            eval_capacity_factor=1.0 if dropless else layer.capacity_factor, min_capacity=0,
            drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False,
        )  # fmt: skip
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
            for j, expert in enumerate(self.experts):
                e = ep_rank * local + j
                for name in ("w1", "w2", "w3"):
                    getattr(expert, name).weight.copy_(getattr(layer, name)[e])
        self.shared = layer.shared

    @property
    def experts(self) -> nn.ModuleList:
        """This rank's experts (DeepSpeed's ``Experts.deepspeed_experts``), each a SwiGLU ``FeedForward``."""
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    def expert_parameters(self) -> int:
        return sum(p.numel() for p in self.experts[0].parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out, _, counts = self.moe(x)
        tokens, k, n = x.shape[0], self.top_k, self.n_experts
        # the project's load-balancing loss over the gate's own fp32 probabilities (DeepSpeed's gate computes
        # its logits from the fp32 input and weight, as here)
        wg = self.moe.deepspeed_moe.gate.wg.weight
        probs = F.linear(x.float(), wg.float()).softmax(-1)
        cap = capacity(tokens, k, n, self.capacity_factor)
        self.record_routing(counts.long(), probs, 0 if cap is None else int((counts - cap).clamp(min=0).sum()))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)


def apply_deepspeed_moe(model: nn.Module, ep: int, rank: int) -> int:
    """Swap every ``MoEFeedForward`` of ``model`` for ``DeepSpeedMoEFeedForward`` with ``ep`` ranks per expert set
    (this process its rank ``rank % ep``: DeepSpeed's ep groups are consecutive ranks); returns the layers swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoEFeedForward) and not isinstance(child, DeepSpeedMoEFeedForward):
                setattr(parent, name, DeepSpeedMoEFeedForward(child, ep, rank % ep))
                swapped += 1
    return swapped


def moe_param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups DeepSpeed's ZeRO needs with MoE: the dense parameters, and the experts in
    groups of their own marked ``moe`` (``split_params_into_different_moe_groups_for_optimizer``)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer([{"params": params, "name": "dense"}])


def whole_moe_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``module.state_dict()`` on this rank, on CPU) in the project's layout: each DeepSpeed MoE layer's
    gate as ``router.weight`` and its experts, all-gathered over the ep group (a collective: every rank calls it),
    as the stacked ``w1``/``w2``/``w3`` (N, ...) tensors one process holds."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    prefixes = {id(m): p for p, m in module.named_modules()}
    out = dict(state)
    for layer in moe_layers(module):
        if not isinstance(layer, DeepSpeedMoEFeedForward):
            continue
        pre = prefixes[id(layer)] + "."
        for key in [k for k in out if k.startswith(pre + "moe.")]:
            del out[key]
        out[pre + "router.weight"] = layer.moe.deepspeed_moe.gate.wg.weight.detach().cpu().clone()
        group = groups._get_expert_parallel_group(layer.moe.expert_group_name)
        for name in ("w1", "w2", "w3"):
            local = torch.stack([getattr(e, name).weight.detach() for e in layer.experts])
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            out[pre + name] = torch.cat(parts).cpu()
    return out


def ep_refusal(
    model: str, n_experts: int | None, ep: int, world: int | None, stage: int, autotp: int, clip: float | None
) -> str | None:
    """One line where deepspeed cannot train ``model`` (``n_experts`` routed experts, None: dense) with ``--ep``:
    a dense model under --ep > 1, experts or processes that do not divide by it, ZeRO-3 (DeepSpeed refuses its
    native MoE there), AutoTP (no plan for the experts), or gradient clipping at ZeRO-0 with the experts split
    (its norm there is each rank's over its own experts: measured 3e-4 off one process's loss in 6 steps, where
    ZeRO-1/2's is the whole model's); None where it can. ``world`` None: not known yet (the estimate's rows)."""
    if n_experts is None:
        if ep > 1:
            return f"deepspeed --ep {ep}: model {model} is dense (no routed experts); --ep takes a mixture of experts"
        return None
    if n_experts % ep:
        fits = ", ".join(str(d) for d in range(1, n_experts + 1) if n_experts % d == 0)
        return (
            f"deepspeed --ep {ep}: {model}'s {n_experts} experts do not divide by {ep}; --ep that fit: {fits}"
        )
    if clip and stage == 0 and ep > 1:
        return (f"deepspeed --ep {ep} --zero-stage 0 --clip-grad-norm {clip:g}: DeepSpeed's stage-0 clipping takes "
                "each rank's norm over its own experts only; use --zero-stage 1 or 2")  # fmt: skip
    if world is not None and world % ep:
        return f"deepspeed --ep {ep}: {world} processes do not divide into expert-parallel groups of {ep}"
    if stage == 3:
        return (f'deepspeed --zero-stage 3 with model {model} (a mixture of experts): DeepSpeed refuses it ("'
                f'{NATIVE_MOE_ZERO3}"); use --zero-stage 0, 1 or 2')  # fmt: skip
    if autotp > 1:
        return (
            f"deepspeed --autotp-size {autotp} with model {model}: AutoTP has no plan for the routed experts"
        )
    return None


def ds_moe_layers(model: nn.Module) -> list[DeepSpeedMoEFeedForward]:
    """The DeepSpeed-MoE layers ``apply_deepspeed_moe`` put in ``model`` (wrapped or not), in order."""
    return [m for m in model.modules() if isinstance(m, DeepSpeedMoEFeedForward)]
