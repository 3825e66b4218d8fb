"""Communication a training method does per optimizer step: the types its formula returns and the ring model.

A strategy's ``comm_model`` (classmethod, next to its ``memory_model``) returns the collectives one rank takes
part in per optimizer step, as ``Collective`` rows: their kind, payload, calls and phase. The measured side
(what the run actually sent) is recorded in the same terms, so a prediction and a measurement compare row by
row, and the projection to other hardware prices the same rows with an alpha-beta cost.

Payload is the full-size tensor a call reduces or assembles: all_reduce -- its tensor; all_gather -- its
output; reduce_scatter -- its input; broadcast / send / recv -- the tensor. Bytes on the wire per rank follow
from the payload under the ring model (``wire_factor``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all")
PHASES = ("forward", "backward", "optimizer", "other")


@dataclass(frozen=True)
class Collective:
    """One kind of collective in one phase of one optimizer step, as seen by one rank."""

    kind: str
    payload_bytes: int
    """Sum of the payloads of these calls (see the module doc for what payload means per kind)."""
    calls: int
    """How many calls carry that payload (a bucketed all_reduce is several calls)."""
    phase: str
    group_size: int
    """Ranks taking part in each call."""
    note: str = ""
    """Where it comes from, e.g. 'gradient buckets' or 'BatchNorm buffers broadcast'."""
    bucket_bytes: int = 0
    """Where > 0, the payload goes out as DDP's reducer sends it: a first bucket of ``DDP_FIRST_BUCKET_BYTES``,
    then buckets of up to this many bytes, each as soon as backward has produced its gradients (the schedule the
    projection overlaps with compute); 0: ``calls`` equal calls."""
    dim: str = ""
    """The device-mesh dimension the group runs over (``CostModel.mesh_dims`` names them: "dp", "pp", "tp"; "dp+cp":
    two neighbouring ones flattened, ``mesh_span``), which says where its ranks sit and so which links it crosses;
    "": ``group_size`` neighbouring ranks."""
    critical: bool = False
    """True where the next op waits for the call's result (Megatron's all-reduces between a row-parallel matmul
    and the residual add): no compute runs under it, whatever the method's ``comm_overlap``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"collective kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"collective phase {self.phase!r}; allowed: {', '.join(PHASES)}")

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends under the ring model."""
        return self.payload_bytes * wire_factor(self.kind, self.group_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"wire_bytes": self.wire_bytes}


def wire_factor(kind: str, n: int) -> float:
    """Bytes sent per rank per payload byte by a ring algorithm over ``n`` ranks (0 for one rank).

    all_reduce = reduce_scatter + all_gather: 2(n-1)/n; all_gather and reduce_scatter: (n-1)/n; a broadcast
    pipelined along the ring: (n-1)/n per rank on average; send/recv: 1; all_to_all: (n-1)/n."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}; allowed: {', '.join(KINDS)}")
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind == "send_recv":
        return 1.0
    return (n - 1) / n


def total_payload(rows: list[Collective], kind: str | None = None) -> int:
    return sum(r.payload_bytes for r in rows if kind is None or r.kind == kind)


def total_wire(rows: list[Collective]) -> float:
    return sum(r.wire_bytes for r in rows)


def ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def dim0_padded(numels: list[int], dim0: list[int], n: int) -> int:
    """Elements FSDP2 moves for these parameters: each is chunked along dim 0 into ``n`` equal shards, dim 0
    padded up to a multiple of ``n`` (the all-gather output and the reduce-scatter input are that size)."""
    return sum(ceil_to(d, n) * (e // d if d else e) for e, d in zip(numels, dim0, strict=True))


DDP_BUCKET_CAP_MB = 25.0
"""DistributedDataParallel's default ``bucket_cap_mb`` (MiB; torch/nn/parallel/distributed.py)."""
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""DDP's first bucket (the last layers' gradients, reduced first) is capped at 1 MiB
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), so that communication starts early in backward."""


def ddp_buckets(payload: float, cap_bytes: float) -> list[float]:
    """The bucket sizes, in reduction order, of ``payload`` gradient bytes under DDP's reducer with buckets of
    ``cap_bytes``: the first at most ``DDP_FIRST_BUCKET_BYTES``, the rest at most ``cap_bytes`` (the last holds
    what is left; DDP cuts at parameter boundaries, which this byte-level split ignores)."""
    if payload <= 0:
        return []
    sizes = [min(payload, float(DDP_FIRST_BUCKET_BYTES), cap_bytes)]
    left = payload - sizes[0]
    while left > 0:
        sizes.append(min(cap_bytes, left))
        left -= sizes[-1]
    return sizes


def replicated_grads(ctx: Any, note: str = "gradient buckets (DDP's reducer)") -> list[Collective]:
    """DDP's traffic per optimizer step: the gradients all-reduced once (bucketed; ``no_sync`` on all but the
    last micro-step), of the trained parameters only (a frozen one has no gradient: LoRA's base), in the weights' dtype, in buckets of the method's ``bucket_cap_mb`` (DDP's 25 MiB where
    it has none). BatchNorm buffers are broadcast from rank 0 before every forward (``broadcast_buffers``, the
    default) where the model has any."""
    n = ctx.world
    if n <= 1:
        return []
    cap = float(getattr(ctx.options, "bucket_cap_mb", DDP_BUCKET_CAP_MB)) * 2**20
    payload = sum(ctx.trainable_numels) * ctx.param_bytes
    rows = [Collective("all_reduce", payload, len(ddp_buckets(payload, cap)), "backward", n, note, int(cap))]
    if ctx.info.buffer_bytes:
        rows.append(
            Collective(
                "broadcast", ctx.info.buffer_bytes * ctx.cfg.grad_accum, ctx.cfg.grad_accum, "forward", n,
                "buffers (BatchNorm statistics) broadcast from rank 0 before each forward",
            )
        )  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------
# Where the bytes go: intra-node and inter-node links (docs/communication.md, "Intra- and inter-node bytes").

LINKS = ("intra", "inter")
"""intra: every rank of a call's process group sits on one node (NVLink, shared memory); inter: its ranks span
nodes (the NICs)."""


def link_of(ranks: Iterable[int], node_of: Sequence[int]) -> str:
    """The link a call over the process group of ``ranks`` (global ranks) is counted on: "intra" where they all sit
    on one node of ``node_of`` (global rank -> node), else "inter", all of its bytes. A ring over ranks on two nodes
    crosses the NICs on every step of the ring (each node's last rank sends to the next node), and a NIC is the
    slowest link such a call waits for, so its bytes are not divided between the links."""
    return "intra" if len({node_of[r] for r in ranks}) <= 1 else "inter"


def mesh_span(mesh: dict[str, int], dim: str) -> tuple[int, int] | None:
    """(ranks, stride) of a group over ``dim`` of ``mesh`` (outermost first, row-major): the dimension's size and
    the product of the dimensions after it; ``dim`` may join neighbouring dimensions with "+" (FSDP2 over fsdp's
    dp x cp flattened: "dp+cp"), the product of their sizes. None where ``mesh`` does not name it."""
    parts, names = dim.split("+") if dim else [], list(mesh)
    if not parts or any(p not in mesh for p in parts):
        return None
    last = names.index(parts[-1])
    if names[last - len(parts) + 1 : last + 1] != parts:
        raise ValueError(f"mesh dimensions {dim!r} are not neighbours in the mesh {names}")
    return math.prod(mesh[p] for p in parts), math.prod(mesh[n] for n in names[last + 1 :])


def mesh_group(rank: int, mesh: dict[str, int], dim: str, group_size: int, world: int) -> list[int]:
    """The global ranks of the process group in which ``rank`` takes part in a ``Collective`` over ``dim`` of
    ``mesh`` (``CostModel.mesh_dims``: outermost first, row-major, the last dimension's ranks neighbours): the
    ranks sharing ``rank``'s coordinates on every other dimension, the whole dimension's group also where the
    row's ``group_size`` is smaller (a pipeline's stage-to-stage pair runs on the stages' group). A ``dim`` the mesh
    does not name: ``group_size`` neighbouring ranks (the whole world for a plain ddp or fsdp row)."""
    if span := mesh_span(mesh, dim):
        size, stride = span
        base = rank - (rank // stride) % size * stride
        return [base + k * stride for k in range(size)]
    size = max(1, min(group_size, world))
    start = rank // size * size
    return list(range(start, min(start + size, world)))


def _link_table() -> dict[str, dict[str, dict[str, float]]]:
    return {link: defaultdict(lambda: {"calls": 0.0, "payload_bytes": 0.0, "wire_bytes": 0.0}) for link in LINKS}


def rank_links(calls: Iterable[tuple[str, Sequence[int], float, float]], node_of: Sequence[int]) -> dict[str, Any]:
    """One rank's bytes per step on each link, per kind: ``calls`` as (kind, the group's global ranks, calls,
    payload bytes), each counted on ``link_of`` its group, its wire bytes by the ring over the group's size."""
    table = _link_table()
    for kind, ranks, n, payload in calls:
        row = table[link_of(ranks, node_of)][kind]
        row["calls"] += n
        row["payload_bytes"] += payload
        row["wire_bytes"] += payload * wire_factor(kind, len(ranks))
    return {link: {k: dict(v) for k, v in sorted(kinds.items())} for link, kinds in table.items()}


def formula_links(rows: list[Collective], mesh: dict[str, int], node_of: Sequence[int]) -> list[dict[str, Any]]:
    """Per rank, the formula's rows on each link (``rank_links``): each row's group placed on the mesh
    (``mesh_group``) and the nodes of ``node_of``, so that it compares with the measured calls' groups."""
    world = len(node_of)
    return [
        rank_links(
            ((r.kind, mesh_group(rank, mesh, r.dim, r.group_size, world), r.calls, r.payload_bytes) for r in rows),
            node_of,
        )
        for rank in range(world)
    ]


def busiest_links(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per link: the largest per-step payload and wire bytes of any rank (``rank_links`` tables), in total and per
    kind (each kind's own busiest rank): the measured and the predicted side reduce alike."""
    out: dict[str, Any] = {}
    for link in LINKS:
        kinds = sorted({k for r in per_rank for k in r.get(link, {})})
        per_kind = {
            k: {key: max(r.get(link, {}).get(k, {}).get(key, 0.0) for r in per_rank)
                for key in ("calls", "payload_bytes", "wire_bytes")}
            for k in kinds
        }  # fmt: skip
        out[link] = {
            key: max((sum(v[key] for v in r.get(link, {}).values()) for r in per_rank), default=0.0)
            for key in ("payload_bytes", "wire_bytes")
        } | {"per_kind": per_kind}
    return out
