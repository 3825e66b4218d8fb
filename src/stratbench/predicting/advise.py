"""The FairScale "do you really need FSDP or DeepSpeed?" flow as code: try the simplest method first and move
to sharding, activation checkpointing and offload only when the memory estimate says the simpler one does not
fit. Every step is decided by ``stratbench.predicting.estimate``, not by rules of thumb about model size.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import torch

from stratbench.core.config import TrainConfig, validate
from stratbench.core.errors import ConfigError
from stratbench.core.tables import fmt_bytes
from stratbench.data.text import is_text_data
from stratbench.predicting.estimate import Estimate, estimate
from stratbench.predicting.projection import offload_bytes, project
from stratbench.strategies.base import comm_reference_name, get_strategy

COMPARE_SIMPLEST = "single,ddp,fsdp"
"""The methods `stratbench compare` runs after advise chose the baseline or DDP: whether sharding would pay."""


@dataclass(frozen=True)
class Plan:
    """One candidate: a strategy with its options, and whether it recomputes activations."""

    strategy: str
    options: tuple[tuple[str, object], ...] = ()
    activation_checkpointing: bool = False
    why: str = ""
    enough: str = ""
    """Said when this plan is chosen by fitting: the simplest plans say that nothing more is needed."""
    micro_steps: str = "grad_accum"
    """The setting that takes the micro-steps ``plan_config`` adds where a replica spans several devices: gradient
    accumulation, or a pipeline's micro-batches (more of them shrink its bubble, where accumulation would not);
    "": none (context parallelism: a replica's devices split its sequences, each already holding a data-parallel
    rank's tokens)."""

    @property
    def label(self) -> str:
        opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.options)
        return " ".join(
            x
            for x in (
                self.strategy,
                opts,
                "+ activation checkpointing" if self.activation_checkpointing else "",
            )
            if x
        )


@dataclass
class Advice:
    plan: Plan | None
    precision: str
    estimate: Estimate | None
    reasons: list[str] = field(default_factory=list)
    tried: list[tuple[Plan, Estimate]] = field(default_factory=list)
    train_command: str = ""
    compare_command: str = ""
    ranking: list[dict] = field(default_factory=list)
    """goal speed with hardware: every plan with its memory, whether it fits and its projected step time."""
    fine_tuning: str = ""
    """goal fit where full training fits no plan: the ``FINE_TUNING`` entry chosen (its label), else ""."""
    overrides: dict[str, object] = field(default_factory=dict)
    """That entry's config overrides (``lora_rank``, ``optimizer``, ...), which the train command carries."""
    config: TrainConfig | None = None
    """The chosen fine-tuning entry's config as it runs (its overrides, plan and micro-steps), else None."""


def candidates(devices: int, gpus_per_node: int | None = None) -> list[Plan]:
    """Simplest first: each later plan trades speed (communication, recomputation, host transfers) for memory;
    ``gpus_per_node`` (a system's): tensor parallelism no wider than one node."""
    if devices == 1:
        return [
            Plan("single", why="one device, no communication: the baseline", enough="the model and batch fit one device: no sharding or offload needed"),
            Plan("single", activation_checkpointing=True, why="recompute each block's activations in backward (~30% slower)"),
            Plan("deepspeed", (("zero_stage", 2), ("offload_optimizer", "cpu")), why="ZeRO-Offload: optimizer states and step on the CPU, the one method that saves memory on one GPU"),
            Plan("deepspeed", (("zero_stage", 3), ("offload_optimizer", "cpu"), ("offload_params", "cpu")), True, why="ZeRO-Infinity-style: parameters on the CPU too"),
        ]  # fmt: skip
    return [
        Plan("ddp", why="a full replica per device, gradients all-reduced: the fastest multi-device method when it fits", enough="DDP fits, so FSDP/DeepSpeed would only add communication: you do not need them"),
        Plan("ddp-zero", why="DDP + ZeroRedundancyOptimizer: optimizer state sharded (ZeRO-1), same communication as DDP"),
        Plan("fsdp", (("sharding", "grad-op"),), why="FSDP grad-op (ZeRO-2): gradients and optimizer sharded, one all-gather per step"),
        *_node_plans(devices, gpus_per_node)[:1],
        Plan("fsdp", (("sharding", "full"),), why="FSDP full shard (ZeRO-3): parameters sharded too, gathered per block (1.5x DDP's traffic)"),
        *_node_plans(devices, gpus_per_node)[1:],
        *_expert_parallel_plans(devices),
        Plan("fsdp", (("sharding", "full"),), True, why="full shard + activation checkpointing: activations recomputed per block"),
        *_tensor_parallel_plans(devices, gpus_per_node),
        *_context_parallel_plans(devices, gpus_per_node),
        Plan("deepspeed", (("zero_stage", 3), ("offload_optimizer", "cpu")), True, why="ZeRO-3 + optimizer offload: optimizer states and step on the CPU"),
        Plan("deepspeed", (("zero_stage", 3), ("offload_optimizer", "cpu"), ("offload_params", "cpu")), True, why="ZeRO-3 + parameter offload: only the working set stays on the device"),
    ]  # fmt: skip


def _node_plans(devices: int, gpus_per_node: int | None) -> list[Plan]:
    """Over several nodes of ``gpus_per_node`` (a system's), the two ways of sharding that keep the gathers inside
    a node: HSDP (before full sharding: more memory, less traffic across nodes) and ZeRO++ (after it: ZeRO-3's
    memory plus a node's secondary copy of the parameters, a quarter of its inter-node bytes)."""
    g = gpus_per_node or 0
    if not g or devices <= g or devices % g:
        return []
    nodes = devices // g
    return [
        Plan("fsdp", (("sharding", "full"), ("replicate", nodes)), why=f"HSDP: FSDP full shard inside each node's {g} devices, {nodes} replicas across nodes; the per-block gathers stay on the node's links and only the gradient shards cross the NICs, once a step (an all-reduce at the end of backward): fewer inter-node calls than full sharding over every rank, for {nodes}x its model states per device"),
        Plan("deepspeed", (("zero_stage", 3), ("zero_hpz", g)), why=f"ZeRO-3 + hpZ: a copy of the parameters sharded over each node's {g} devices, so the backward gather stays in the node: 2/3 of ZeRO-3's inter-node bytes for 1/{g} of the parameters more memory"),
        Plan("deepspeed", (("zero_stage", 3), ("zero_hpz", g), ("zero_quantized_weights", True), ("zero_quantized_gradients", True)), why=f"ZeRO++: hpZ over each node's {g} devices, int8 weight gathers (qwZ) and int4 gradient all-to-alls (qgZ): ~1/4 of ZeRO-3's inter-node bytes; wins where ZeRO-3 waits on the inter-node link (needs DeepSpeed's CUDA quantizer kernel: dropped where it cannot be built)"),
    ]  # fmt: skip


EP_DEGREES = (2, 4, 8, 16, 32, 64, 128, 256)
"""Expert-parallel degrees advise tries for a mixture of experts (``applicable`` keeps those the model's experts and
the devices divide, and that ``fsdp --ep`` runs: a dense model is offered none)."""


def _expert_parallel_plans(devices: int) -> list[Plan]:
    """FSDP full shard of the dense parts with E-way expert parallelism: each rank holds experts / E of every MoE
    layer whole (never gathered) and exchanges its routed tokens by all-to-all, on the critical path."""
    return [
        Plan("fsdp", (("sharding", "full"), ("ep", e)), why=f"expert parallelism: experts / {e} of every MoE layer whole on each device, tokens sent to their experts' devices and back by all-to-all (on the critical path, over the links the ep group of {e} crosses), the dense parts FSDP full shard")
        for e in EP_DEGREES if e <= devices and devices % e == 0
    ]  # fmt: skip


def ep_choice(ranking: list[dict]) -> str | None:
    """One line naming the expert-parallel degree advise would take: of the ``--ep`` plans ranked, those that fit
    and the fastest of them; None where no ep plan was ranked (a dense model)."""
    ep = [r for r in ranking if "--ep " in r["plan"]]
    if not ep:
        return None
    degree = {id(r): r["plan"].split("--ep ")[1].split()[0] for r in ep}
    said = "; ".join(f"--ep {degree[id(r)]} {'fits' if r['fits'] else 'does not fit'}"
                     + (f", {r['step_s'] * 1e3:.1f} ms/step" if r["step_s"] else "") for r in ep)  # fmt: skip
    fit = [r for r in ep if r["fits"] and r["step_s"]]
    if not fit:
        return f"expert parallelism: no degree fits ({said})"
    best = min(fit, key=lambda r: r["step_s"])
    return f"expert parallelism: --ep {degree[id(best)]} is the fastest degree that fits ({said})"


CP_DEGREES = (2, 4, 8)
"""Context-parallel degrees advise tries (within a node: four all-to-alls per attention on the critical path)."""


def _context_parallel_plans(devices: int, gpus_per_node: int | None = None) -> list[Plan]:
    """FSDP full shard with C-way context parallelism and activation checkpointing (the built-in transformers and
    Hugging Face decoders whose attention splits by heads; ``applicable`` drops them for other models and head
    counts C does not divide): for sequences whose
    activations do not fit a device even checkpointed and split over tensor-parallel ranks. Each rank computes
    1/C of every sequence of its replica's batch: the tokens per rank of a data-parallel plan, no micro-steps
    added."""
    degrees = [c for c in CP_DEGREES if c <= devices and devices % c == 0 and (gpus_per_node is None or c <= gpus_per_node)]
    return [
        Plan("fsdp", (("sharding", "full"), ("cp", c)), True, micro_steps="", why=f"context parallelism: each of {c} devices holds 1/{c} of every sequence's activations (Ulysses: q, k, v and the output exchanged by all-to-all in every attention, on the critical path), FSDP full shard + activation checkpointing")
        for c in degrees
    ]  # fmt: skip


TP_DEGREES = (2, 4, 8)
"""Tensor-parallel degrees advise tries: within one 8-GPU node, where its all-reduces run on the fast links."""


PP_DEGREES = (2, 4)
"""Pipeline stages of the 3D plans advise tries (each stage tensor-parallel over one node's GPUs)."""


def _tensor_parallel_plans(devices: int, gpus_per_node: int | None = None) -> list[Plan]:
    """Plans that split each block's matrices (a model with a tensor-parallel plan; ``applicable`` drops them for
    the others): 2D (FSDP over devices / T replicas of T-way tensor parallelism), 3D (pipelines of P stages of
    T-way tensor parallelism, their micro-batches as many as the micro-steps) and tensor parallelism over all
    devices, each rank then holding 1/T of the attention/MLP activations as well as of their weights, at the
    micro-batch a data-parallel plan has (``plan_config``). With a system, T at most its GPUs per node: a tp
    group across nodes would run its per-block all-reduces over the NICs."""
    degrees = [t for t in TP_DEGREES if gpus_per_node is None or t <= gpus_per_node]
    plans = [
        Plan("fsdp", (("sharding", "full"), ("tp", t)), a, why=f"2D: {t}-way tensor parallelism inside, FSDP full shard over the {devices // t} groups{' + activation checkpointing' if a else ''}")
        for t in degrees if t < devices and devices % t == 0 for a in (False, True)
    ]  # fmt: skip
    plans += [
        Plan("pipeline", (("pp", pp), ("tp", t), ("schedule", "1f1b")), micro_steps="microbatches", why=f"3D: {pp} pipeline stages of {t}-way tensor parallelism, {devices // (pp * t)} data-parallel replicas; each stage holds 1/{pp} of the layers, and its 1f1b schedule at most {pp} micro-batches' activations")
        for t in degrees for pp in PP_DEGREES if pp * t <= devices and devices % (pp * t) == 0
    ]  # fmt: skip
    if devices in degrees:
        plans += [Plan("tp", (), a, why=f"{devices}-way tensor parallelism{' + activation checkpointing' if a else ''}: every device computes the whole batch through 1/{devices} of each block") for a in (False, True)]  # fmt: skip
    return plans


def plan_config(base: TrainConfig, plan: Plan, devices: int) -> TrainConfig:
    """The config ``plan`` runs: ``base`` with its strategy, options and recomputation. Where the plan splits the
    batch fewer ways than it has devices (its tensor-parallel groups each take one share whole), its gradient
    accumulation is multiplied by the difference where the global batch allows (a pipeline's micro-batches are
    that many instead: ``Plan.micro_steps``), so that each rank computes the micro-batch a data-parallel plan's
    rank would: the same global batch, and 1/T of each block's activations."""
    cls = get_strategy(plan.strategy)
    cfg = base.replace(strategy=plan.strategy, strategy_options=dict(plan.options),
                       activation_checkpointing=plan.activation_checkpointing)  # fmt: skip
    world = cls.devices_for_world(devices)
    dp = cls.data_parallel_size(cfg, world)
    accum = base.grad_accum * (world // dp)
    if not plan.micro_steps:
        return cfg
    if dp < world and plan.micro_steps != "grad_accum":
        return cfg.replace(strategy_options={**cfg.strategy_options, plan.micro_steps: world // dp})
    if dp < world and base.batch_size % (dp * accum) == 0:
        cfg = cfg.replace(grad_accum=accum)
    return cfg


def applicable(base: TrainConfig, plans: list[Plan], devices: int, device_type: str) -> tuple[list[Plan], list[str]]:
    """The plans the model and devices admit (``Strategy.check_supported``: a model without a tensor-parallel plan,
    or whose heads do not divide by T, is not offered the tensor-parallel ones) and whose data-parallel ranks
    split the global batch evenly (a tensor-parallel group takes one share whole), with a note per plan dropped
    for its batch. None left for the batch: one line saying which batches would split."""
    device, out, notes, ranks = torch.device(device_type), [], [], set()
    for plan in plans:
        cls = get_strategy(plan.strategy)
        world = cls.devices_for_world(devices)
        cfg = plan_config(base, plan, devices)
        dp = cls.data_parallel_size(cfg, world) * cfg.grad_accum
        if base.batch_size % dp:
            ranks.add(dp)
            notes.append(f"{plan.label}: n/a, the global batch {base.batch_size} does not split over its {dp} data-parallel ranks")  # fmt: skip
            continue
        if cls.refusal(cfg, device, world) is None:
            out.append(plan)
    if not out and ranks:
        d, b = min(ranks), base.batch_size
        hint = " or ".join(str(x) for x in (b // d * d, (b // d + 1) * d) if x)
        raise ConfigError(
            f"--batch-size {b} is not divisible by --devices {d} (train splits the global batch evenly over "
            f"devices); use e.g. {hint}"
        )
    return out, notes


FINE_TUNING: tuple[tuple[str, dict[str, object]], ...] = (
    ("full training", {}),
    ("full training + adamw8bit", {"optimizer": "adamw8bit"}),
    ("full training + adamw4bit", {"optimizer": "adamw4bit"}),
    ("full training + adafactor", {"optimizer": "adafactor"}),
    ("LoRA r16", {"lora_rank": 16}),
    ("LoRA r16 + adamw8bit", {"lora_rank": 16, "optimizer": "adamw8bit"}),
    ("QLoRA r16", {"lora_rank": 16, "quantize_base": "nf4"}),
)
"""What ``advise --goal fit`` tries, in this order, where full training at the requested micro-batch fits no plan:
(label, TrainConfig overrides), each under every plan that takes it (``Strategy.check_supported``: the LoRA and
lean-optimizer refusals) at the largest micro-batch that fits (more ``--grad-accum``, the same global batch). Full
training first (at a smaller micro-batch), then AdamW's memory-lean replacements (same model, smaller states),
then LoRA adapters over all linear layers (frozen base: no gradients or states for it; a lower rank saves
little more: the adapters' states are ~1% of the base's), then QLoRA (the same adapters over a 4-bit NF4 base:
single and fsdp take it). An entry applies only where it changes nothing the user chose (``_applies``)."""


def default_precision(device_type: str, bf16_ok: bool) -> str:
    """bf16-mixed where supported (no loss scaling, half the activation memory), fp16-mixed on older GPUs."""
    if device_type != "cuda":
        return "fp32"  # CPU fp16 is ~100x slower and CPU bf16 gains little: keep fp32
    return "bf16-mixed" if bf16_ok else "fp16-mixed"


def advise(
    base: TrainConfig,
    devices: int,
    device_memory: int,
    goal: str = "speed",
    device_type: str = "cuda",
    headroom: float = 0.9,
    system=None,
    calibration=None,
    basis: str = "efficiency",
) -> Advice:
    """Pick the first (simplest, fastest) plan whose estimated total per device fits ``headroom`` x memory; with
    ``goal="speed"`` and a hardware ``system`` (stratbench.measuring.hardware), the plan with the shortest projected step
    time among those that fit, its compute priced on ``basis`` (``projection.BASES``; the command: auto)."""
    if goal not in ("fit", "speed"):
        raise ConfigError(f"unknown goal {goal!r}; choose one of: fit, speed")
    if goal == "speed" and system is not None:
        return _fastest(base, devices, device_memory, device_type, headroom, system, calibration, basis)
    budget = int(device_memory * headroom)
    plans = candidates(devices)
    if goal == "fit" and devices > 1:
        # Only memory matters: keep DDP's speed when it fits, otherwise go straight to the sharded plans.
        plans = plans[:1] + plans[3:]
    offered = plans
    plans, skipped = applicable(base, plans, devices, device_type)
    advice = Advice(None, base.precision, None)
    reasons = advice.reasons
    reasons.append(
        f"budget: {headroom:.0%} of {fmt_bytes(device_memory)} per device = {fmt_bytes(budget)} (the rest is headroom "
        "for allocator fragmentation and cuDNN workspaces)"
    )
    reasons += skipped
    for plan in plans:
        world = get_strategy(plan.strategy).devices_for_world(devices)
        cfg = plan_config(base, plan, devices)
        label = plan.label + accumulated(base, cfg)
        est = _estimate(cfg, world, device_type, label, reasons)
        if est is None:
            continue
        advice.tried.append((plan, est))
        if est.total_bytes <= budget:
            advice.plan, advice.estimate = plan, est
            reasons.append(f"{label}: {fmt_bytes(est.total_bytes)} per device fits -> chosen ({plan.why})")
            reasons += [est.units] if est.units else []
            break
        reasons.append(f"{label}: {fmt_bytes(est.total_bytes)} per device does not fit")
    if advice.plan is None and goal == "fit":
        _fine_tune(base, offered, devices, device_memory, device_type, budget, advice)
        if advice.plan is not None:
            advice.train_command, advice.compare_command = commands(advice.config, advice.plan, devices, advice.overrides)
            return advice
    if advice.plan is None:
        reasons.append(
            "nothing fits at this batch: lower --batch-size and use --grad-accum to keep the global batch, "
            "or use more devices"
        )
        return advice
    if advice.plan.enough:
        reasons.append(advice.plan.enough)
    chosen = plan_config(base, advice.plan, devices)
    advice.train_command, advice.compare_command = commands(chosen, advice.plan, devices)
    return advice


def _applies(base: TrainConfig, overrides: dict[str, object]) -> bool:
    """A ``FINE_TUNING`` entry changes only what the user left as it was: the optimizer where it is AdamW (the
    lean ones replace AdamW), any other field where it has its default (no LoRA, no quantised base)."""
    fields = TrainConfig.__dataclass_fields__
    return all(
        getattr(base, k) == ("adamw" if k == "optimizer" else fields[k].default) and getattr(base, k) != v
        for k, v in overrides.items()
    )


def _fine_tune(
    base: TrainConfig, plans: list[Plan], devices: int, memory: int, device_type: str, budget: int, advice: Advice
) -> None:
    """The first ``FINE_TUNING`` entry that fits under a plan keeping everything on the device, else the first
    that fits with host offload (parameters or optimizer states over PCIe every step cost more than a 4-bit base
    or a leaner optimizer), simplest plan first, at the largest micro-batch that fits: set on ``advice`` with one
    line saying it; else a line per entry saying it fits nowhere."""
    entries = _fine_tune_entries(base, plans, devices, device_type, advice.reasons)
    smallest: dict[str, tuple[int, str, int]] = {}
    notes: dict[str, list[str]] = {label: [] for label, *_ in entries}  # "plan: n/a: why" (no Linear to adapt)
    # whether each entry's plan moves states over the host link, priced once (model_info per config)
    tiers = [[_offloads(cand, plan, devices, device_type) for plan in usable] for _, _, cand, usable in entries]
    for offloads in (False, True):
        for i, (label, overrides, cand, usable) in enumerate(entries):
            for plan, tier in zip(usable, tiers[i], strict=True):
                if tier != offloads:
                    continue
                found, least = _largest_micro_batch(cand, plan, devices, device_type, budget, notes[label])
                if least is not None and (label not in smallest or least.total_bytes < smallest[label][0]):
                    smallest[label] = (least.total_bytes, plan.label, least.micro_batch)
                if found is not None:
                    _misses([e[0] for e in entries[:i]], smallest, notes, advice.reasons)
                    _choose(base, advice, label, overrides, plan, *found, memory, devices, offloads)
                    return
    _misses([label for label, *_ in entries], smallest, notes, advice.reasons)


def _misses(
    labels: list[str], smallest: dict[str, tuple[int, str, int]], notes: dict[str, list[str]], reasons: list[str]
) -> None:
    """One line per entry that fitted nowhere it was tried: its least memory and plan, or why no plan took it."""
    for label in labels:
        if label not in smallest:
            why = notes[label][0].split(": n/a: ", 1)[-1] if notes[label] else "no plan takes it"
            reasons.append(f"{label}: n/a: {why}")
            continue
        least, plan_label, micro = smallest[label]
        reasons.append(
            f"{label}: fits no plan, even at micro-batch {micro} (least: {fmt_bytes(least)} per device, {plan_label})"
        )


def _fine_tune_entries(
    base: TrainConfig, plans: list[Plan], devices: int, device_type: str, reasons: list[str]
) -> list[tuple[str, dict[str, object], TrainConfig, list[Plan]]]:
    """The ``FINE_TUNING`` entries that apply to ``base``, each with its config and the plans that take it; an
    entry this install or configuration refuses is one "label: n/a: why" line among ``reasons``."""
    out = []
    for label, overrides in FINE_TUNING:
        if not _applies(base, overrides):
            continue
        cand = base.replace(**overrides)
        try:
            validate(cand)  # e.g. a lean optimizer without torchao installed
            usable, _ = applicable(cand, plans, devices, device_type)
        except ConfigError as exc:
            reasons.append(f"{label}: n/a: {exc}")
            continue
        out.append((label, dict(overrides), cand, usable))
    return out


def _offloads(cand: TrainConfig, plan: Plan, devices: int, device_type: str) -> bool:
    """Whether the plan moves parameters or optimizer states over the host link every step (the projection's
    ``offload_bytes``, priced on rank 0)."""
    world = get_strategy(plan.strategy).devices_for_world(devices)
    return offload_bytes(plan_config(cand, plan, devices), world, 0, device_type) > 0


def _choose(
    base: TrainConfig, advice: Advice, label: str, overrides: dict[str, object], plan: Plan, cfg: TrainConfig,
    est: Estimate, memory: int, devices: int, offloads: bool,
) -> None:  # fmt: skip
    """Set the chosen fine-tuning entry on ``advice`` with the lines that say why."""
    accum = f" --grad-accum {cfg.grad_accum}" if cfg.grad_accum != base.grad_accum else ""
    advice.plan, advice.estimate, advice.config = plan, est, cfg
    advice.fine_tuning, advice.overrides = label, overrides
    where = "; no entry fits on the device alone, this one with host offload" if offloads else ""
    advice.reasons.append(
        f"full training with {base.optimizer} fits no plan at this micro-batch; {label} does{where}: "
        f"{plan.label}{accum}, {fmt_bytes(est.total_bytes)} per device -> chosen ({plan.why})"
    )
    advice.reasons.append(
        f"{base.model} on {devices} x {fmt_bytes(memory)}: {label}, {plan.label}, micro-batch "
        f"{est.micro_batch}, ~{fmt_bytes(est.total_bytes)} per device"
    )


def _largest_micro_batch(
    cand: TrainConfig, plan: Plan, devices: int, device_type: str, budget: int, notes: list[str]
) -> tuple[tuple[TrainConfig, Estimate] | None, Estimate | None]:
    """((config, estimate) at the largest micro-batch per rank that fits ``budget``, reached by accumulating more
    micro-steps, or None; the estimate at the smallest micro-batch the model trains at, or None where the plan
    cannot be estimated). That smallest is tried first (a plan that does not fit there fits nowhere), then the
    larger ones bisected: the estimate grows with the micro-batch. A pipeline's micro-batches are its own: tried
    as ``plan_config`` gives them. ``notes`` gains "label: n/a: why" where the estimate refuses the config."""
    cls = get_strategy(plan.strategy)
    world = cls.devices_for_world(devices)
    first = plan_config(cand, plan, devices)
    per_rank = cand.batch_size // (cls.data_parallel_size(first, world) * first.grad_accum)
    sizes = [m for m in range(per_rank, 0, -1) if per_rank % m == 0] if plan.micro_steps == "grad_accum" else [per_rank]
    configs = [first.replace(grad_accum=first.grad_accum * (per_rank // m)) for m in sizes]
    estimates: dict[int, Estimate | None] = {}

    def priced(i: int) -> Estimate | None:
        if i not in estimates:
            try:
                estimates[i] = _estimate(configs[i], world, device_type, plan.label, notes)
            except ValueError:  # a micro-batch the model cannot train at (BatchNorm over one value per channel)
                estimates[i] = None
        return estimates[i]

    n_notes, floor = len(notes), None
    for i in range(len(sizes) - 1, -1, -1):  # the smallest micro-batch the model trains at
        if priced(i) is not None or len(notes) > n_notes:  # priced, or refused whatever the micro-batch
            floor = i if estimates[i] is not None else None
            break
    if floor is None:
        return None, None
    least = estimates[floor]
    if least.total_bytes > budget:
        return None, least
    lo, hi = 0, floor  # the first index that fits lies in [lo, hi]; hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        e = priced(mid)
        lo, hi = (lo, mid) if e is not None and e.total_bytes <= budget else (mid + 1, hi)
    return (configs[hi], estimates[hi]), least


def _estimate(
    cfg: TrainConfig, world: int, device_type: str, label: str, reasons: list[str]
) -> Estimate | None:
    """The plan's estimate, or None with "label: n/a: why" among the reasons where the model cannot take the plan
    (e.g. fsdp's blocks on a model that has none: train would refuse it alike)."""
    try:
        return estimate(cfg, world, device_type)
    except ConfigError as exc:
        reasons.append(f"{label}: n/a: {exc}")
        return None


def accumulated(base: TrainConfig, cfg: TrainConfig) -> str:
    """The label's " (--grad-accum N: ...)" where ``plan_config`` accumulated more than ``base`` does (or
    " (--microbatches N: ...)" where it gave a pipeline its micro-steps as micro-batches), else ""."""
    added = {k: v for k, v in cfg.strategy_options.items() if k not in base.strategy_options}
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in added.items() if k == "microbatches"]
    if cfg.grad_accum != base.grad_accum:
        flags.insert(0, f"--grad-accum {cfg.grad_accum}")
    return f" ({', '.join(flags)}: the micro-batch per rank of the data-parallel plans)" if flags else ""


SPEED_TIE = 0.03
"""Projected step times within this fraction of the fastest count as a tie (the simpler plan wins)."""


def _fastest(base, devices, device_memory, device_type, headroom, system, calibration, basis) -> Advice:
    """Every candidate plan estimated and projected on ``system``; the fastest that fits wins."""
    gpn = min(devices, system.gpus_per_node)
    if devices % gpn:
        raise ConfigError(
            f"--devices {devices} is not a whole number of {system.key} nodes of {system.gpus_per_node}"
        )
    nodes = devices // gpn
    budget = int(device_memory * headroom)
    advice = Advice(None, base.precision, None)
    advice.reasons.append(
        f"budget: {headroom:.0%} of {fmt_bytes(device_memory)} per device = {fmt_bytes(budget)}; step times projected "
        f"on {nodes} x {gpn} {system.gpu.name} ({system.key}, stratbench.predicting.projection)"
    )
    fitting = []
    plans, skipped = applicable(base, candidates(devices, system.gpus_per_node), devices, device_type)
    advice.reasons += skipped
    for plan in plans:
        world = get_strategy(plan.strategy).devices_for_world(devices)
        cfg = plan_config(base, plan, devices).replace(nnodes=nodes)
        est = _estimate(cfg, world, device_type, plan.label, advice.reasons)
        if est is None:
            continue
        advice.tried.append((plan, est))
        p = project(cfg, system, nodes, gpn, calibration, memory=False, basis=basis)
        fits = est.total_bytes <= budget
        advice.ranking.append({"plan": plan.label, "memory_bytes": est.total_bytes, "fits": fits,
                               "step_s": p.step_s, "status": p.status, "dominant": p.dominant,
                               "grad_accum": cfg.grad_accum, "tokens_per_s": p.tokens_per_s,
                               "efficiency_from": p.efficiency_from, "uncalibrated": p.uncalibrated})  # fmt: skip
        time_text = f"{p.step_s * 1e3:.1f} ms/step ({p.dominant})" if p.step_s else p.status
        advice.reasons.append(
            f"{plan.label}{accumulated(base, cfg)}: {fmt_bytes(est.total_bytes)} per device, "
            f"{'fits' if fits else 'does not fit'}, {time_text}"
        )
        if fits and p.step_s:
            fitting.append((plan, est, p))
    if line := ep_choice(advice.ranking):
        advice.reasons.append(line)
    if not fitting:
        advice.reasons.append("nothing that fits has a projection: lower --batch-size or use more devices")
        return advice
    # The projection cannot tell apart steps a few percent apart: the simplest plan within SPEED_TIE wins.
    fastest = min(p.step_s for _, _, p in fitting)
    best = next(x for x in fitting if x[2].step_s <= fastest * (1 + SPEED_TIE))
    advice.plan, advice.estimate = best[0], best[1]
    advice.reasons.append(
        f"chosen: {best[0].label}, the simplest plan that fits within {SPEED_TIE:.0%} of the shortest projected "
        f"step ({fastest * 1e3:.1f} ms; {best[0].why})"
    )
    advice.reasons += [best[1].units] if best[1].units else []
    if best[2].uncalibrated:  # the ranking holds; the absolute step times are evidence from other models' runs
        advice.reasons.append(
            f"step times UNCALIBRATED: {best[2].efficiency_source}; --calibrate result.json from one real run "
            "replaces it"
        )
    elif best[2].efficiency_from == "roofline":  # priced op by op (projection.auto_basis): said, with its band
        band = best[2].error_band
        sure = f" (held-out median error {band['median']:.0%})" if band else ""
        advice.reasons.append(f"step times on the {best[2].basis}{sure}; --calibrate result.json from one real run "
                              "replaces it")  # fmt: skip
    chosen = plan_config(base, best[0], devices)
    advice.train_command, advice.compare_command = commands(chosen, best[0], devices)
    return advice


def commands(
    base: TrainConfig, plan: Plan, devices: int, overrides: dict[str, object] | None = None
) -> tuple[str, str]:
    """The exact `stratbench train` and `stratbench compare` command lines to run next; ``overrides``: a
    ``FINE_TUNING`` entry's fields, each as its train flag (the optimizer is there already)."""
    args = ["stratbench", "train", "--model", base.model, *data_flags(base)]
    args += ["--batch-size", str(base.batch_size)]
    if base.grad_accum > 1:
        args += ["--grad-accum", str(base.grad_accum)]
    args += ["--precision", base.precision, *(["--tf32", "true"] if base.tf32 else []), "--optimizer",
             base.optimizer, "--strategy", plan.strategy]  # fmt: skip
    for k, v in base.strategy_options.items():  # the plan's options, as plan_config completed them
        args += [f"--{k.replace('_', '-')}", str(v)]
    if plan.activation_checkpointing:
        args += ["--activation-checkpointing", "true"]
    tuned = {f"--{k.replace('_', '-')}": str(v) for k, v in (overrides or {}).items()}
    args += [x for flag, v in tuned.items() if flag != "--optimizer" for x in (flag, v)]  # the optimizer is there
    cls = get_strategy(plan.strategy)
    if cls.spans_devices:
        args += ["--nproc", str(devices)]
    train = shlex.join(args)
    # the baseline or DDP chosen: does sharding pay at all? Another method: against DDP, the reference
    others = (
        COMPARE_SIMPLEST if cls.baseline or cls.comm_reference else f"{comm_reference_name()},{plan.strategy}"
    )
    # a language model is the preset's model no more: the sweep gets the model and its text data
    data = ["--model", base.model, *data_flags(base)] if is_text_data(base.data) else ["--data", "synthetic"]
    # a fine-tuning entry's fields go to every cell: the sweep compares the methods on what train would run
    compare = shlex.join(["stratbench", "compare", "--preset", "seed", *data, *(x for kv in tuned.items() for x in kv), "--only", others])
    return train, compare


def data_flags(base: TrainConfig) -> list[str]:
    """The flags of the model's input in a train command: the text data, window and vocabulary of a language
    model, or the image size (and tinynet's width)."""
    if is_text_data(base.data):
        vocab = ["--vocab-size", str(base.vocab_size)] if base.vocab_size is not None else []
        return ["--data", base.data, "--seq-len", str(base.seq_len), *vocab]
    width = ["--width", str(base.width)] if base.model == "tinynet" else []
    return [*width, "--image-size", str(base.image_size)]
