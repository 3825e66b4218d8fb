"""Communication volume, measured: every collective a rank issues during a few optimizer steps.

Route: ``torch.profiler``. Every collective of every library ends in a ``c10d::`` operator of the dispatcher --
``torch.distributed``'s Python functions, DDP's C++ reducer (its bucket all_reduces do not pass through Python),
FSDP1/FSDP2's ``_allgather_base_`` / ``_reduce_scatter_base_``, ZeroRedundancyOptimizer's broadcasts,
``deepspeed.comm`` (a thin layer over ``torch.distributed``) and accelerate -- and the profiler records each with
its argument shapes, on gloo and on NCCL alike. Python-level hooks would miss the reducer; backend hooks
(NCCL's flight recorder) do not exist for gloo. So the ``c10d::`` event gives the logical collective (its kind,
its payload in elements, one call), and the backend's own event (``gloo:all_reduce``, ``nccl:all_reduce``, ...),
which runs on the backend's worker thread, gives the element type and the time the transfer took.

The recorder runs only around chosen steps (the engine uses the warm-up steps after the first, which the step
timer excludes anyway), so its cost never lands in a measured step time.

Where the run spans nodes, each call is also placed on its process group's ranks (``_Call.ranks``), so that its
bytes count on the intra- or the inter-node link (``measuring.comm.link_of``): NCCL's ``record_param_comms``
event names the group's ranks; gloo's events do not, and there torch's flight recorder (one entry per collective:
its process group and sizes, ``enable_group_record``) gives them, matched to the calls in order by element count.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stratbench.measuring.comm import LINKS, Collective, busiest_links, formula_links, rank_links, wire_factor

# c10d operator -> (kind, which argument holds the payload, whether that argument is a per-rank input that the
# payload multiplies by the group size).
_OPS: dict[str, tuple[str, int, bool]] = {
    "c10d::allreduce_": ("all_reduce", 0, False),
    "c10d::allreduce_coalesced_": ("all_reduce", 0, False),
    "c10d::allgather_": ("all_gather", 1, True),
    "c10d::allgather_coalesced_": ("all_gather", 1, True),
    "c10d::_allgather_base_": ("all_gather", 0, False),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "c10d::reduce_scatter_": ("reduce_scatter", 1, False),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "c10d::broadcast_": ("broadcast", 0, False),
    "c10d::send": ("send_recv", 0, False),
    "c10d::recv_": ("send_recv", 0, False),
    "c10d::recv_any_source_": ("send_recv", 0, False),
    "c10d::alltoall_base_": ("all_to_all", 1, False),
    "c10d::alltoall_": ("all_to_all", 1, False),
    "c10d::reduce_": ("all_reduce", 0, False),
    "c10d::gather_": ("all_gather", 1, True),
    "c10d::scatter_": ("broadcast", 1, False),
}
_IGNORED = {"c10d::barrier", "c10d::monitored_barrier_"}
_RECEIVES = {"c10d::recv_", "c10d::recv_any_source_"}
"""Point-to-point receives: the tensor is the sender's payload (counted on the sending rank), so a receive adds
its time to send_recv but neither a call nor bytes: a rank's send_recv row is what it sends, as the formulas."""
_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long": 8, "long int": 8, "int": 4,
    "unsigned char": 1, "signed char": 1, "bool": 1, "short": 2, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}  # fmt: skip
_SCALAR_TYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
}  # fmt: skip
"""NCCL's ``record_param_comms`` events name the element type as ``c10::toString(ScalarType)`` ("Float",
"BFloat16"), not as the op events' C++ type names ("float", "c10::BFloat16")."""
_BACKEND_PREFIXES = ("gloo:", "nccl:", "record_param_comms")


def _numel(dims: Any, scalar_if_empty: bool = False) -> int:
    """Elements in a profiler ``Input Dims`` entry: a shape (``[]`` is a 0-d tensor when the argument is one),
    or a list of shapes (a TensorList, whose ``[]`` entries are 0-d tensors), possibly nested."""
    if not isinstance(dims, list):
        return 1
    if not dims:
        return 1 if scalar_if_empty else 0
    if all(isinstance(d, int) for d in dims):
        n = 1
        for d in dims:
            n *= d
        return n
    return sum(_numel(d, scalar_if_empty=True) for d in dims)


@dataclass
class _Call:
    kind: str
    numel: int
    ts: float
    itemsize: int | None = None
    dur_us: float = 0.0
    received: bool = False
    per_rank: bool = False
    ranks: tuple[int, ...] | None = None
    """The global ranks of its process group, where the trace or the flight recorder says them."""


@dataclass(frozen=True)
class GroupCall:
    """One collective as torch's flight recorder saw it: its element counts (inputs', outputs') and the global ranks
    of its process group, in the order the rank issued them."""

    numels: frozenset[int]
    ranks: tuple[int, ...]


@dataclass
class CommMeasurement:
    """What one rank sent during ``steps`` optimizer steps, per collective kind, averaged per step."""

    steps: int
    group_size: int
    rows: dict[str, dict[str, float]] = field(default_factory=dict)
    unknown_dtype_calls: int = 0
    inferred_dtype_calls: int = 0
    groups: list[dict[str, Any]] | None = None
    """Per kind and process group (its global ranks): calls and payload bytes per step; None where the groups
    were not recorded (one node)."""
    unplaced_calls: float = 0.0
    """Calls per step whose process group was not found (counted in ``rows``, not in ``groups``)."""

    def per_step(self) -> list[Collective]:
        return [
            Collective(kind, round(r["payload_bytes"]), round(r["calls"]), "other", self.group_size)
            for kind, r in sorted(self.rows.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "group_size": self.group_size,
            "per_step": {
                kind: r | {"wire_bytes": r["payload_bytes"] * wire_factor(kind, self.group_size)}
                for kind, r in sorted(self.rows.items())
            },
            "unknown_dtype_calls": self.unknown_dtype_calls,
            "inferred_dtype_calls": self.inferred_dtype_calls,
        } | ({"groups": self.groups, "unplaced_calls": self.unplaced_calls} if self.groups is not None else {})


def parse_trace(
    events: list[dict[str, Any]], steps: int, group_size: int, groups: list[GroupCall] | None = None
) -> CommMeasurement:
    """Collectives in a Chrome trace (``export_chrome_trace``), as one rank's volume per step; ``groups``: the
    flight recorder's calls of the same steps, which place each call on its process group's ranks."""
    calls: list[_Call] = []
    transport: list[dict[str, Any]] = []
    outer_end: dict[Any, float] = {}  # per thread: where the last counted c10d call ends
    for e in sorted(events, key=lambda e: float(e.get("ts", 0))):
        name = e.get("name", "")
        if e.get("ph") != "X":
            continue
        if name in _OPS:
            # A c10d call inside another one on the same thread is the same collective dispatched again (a
            # Python dispatch mode, a wrapper process group): count the outer one only.
            ts, tid = float(e.get("ts", 0)), (e.get("pid"), e.get("tid"))
            if ts < outer_end.get(tid, float("-inf")):
                continue
            outer_end[tid] = ts + float(e.get("dur", 0) or 0)
        args = e.get("args", {})
        if name in _OPS:
            kind, arg, per_rank = _OPS[name]
            dims, types = args.get("Input Dims", []), args.get("Input type", [])
            type_ = types[arg] if arg < len(types) else ""
            numel = _numel(dims[arg], scalar_if_empty=type_ in _DTYPE_BYTES) if arg < len(dims) else 0
            if per_rank:
                numel *= group_size
            itemsize = _DTYPE_BYTES.get(type_)
            calls.append(_Call(kind, numel, float(e.get("ts", 0)), itemsize, received=name in _RECEIVES,
                               per_rank=per_rank))  # fmt: skip
        elif name.startswith(_BACKEND_PREFIXES) and name not in ("gloo:barrier", "nccl:barrier"):
            transport.append(e)
    _attach_transport(calls, transport, group_size)
    if groups is not None:
        _attach_groups(calls, groups, group_size)
    for c in calls:
        if c.per_rank and c.ranks is not None and len(c.ranks) != group_size:
            # an input taken per rank (allgather_, gather_) is counted over its own group, not the world
            c.numel = c.numel // max(group_size, 1) * len(c.ranks)
    m = CommMeasurement(steps=steps, group_size=group_size)
    # A call whose backend event was not found (seen under load: the worker thread's event of one broadcast
    # missing from the window) takes the element size of the same kind's other calls in these steps, when they
    # all agree; it is counted as inferred. Only a call with nothing to infer from stays unknown.
    sizes: dict[str, set[int]] = defaultdict(set)
    for c in calls:
        if c.itemsize is not None:
            sizes[c.kind].add(c.itemsize)
    for c in calls:
        if c.itemsize is None and len(sizes[c.kind]) == 1:
            c.itemsize = next(iter(sizes[c.kind]))
            m.inferred_dtype_calls += 1
    acc: dict[str, dict[str, float]] = defaultdict(
        lambda: {"calls": 0.0, "payload_bytes": 0.0, "time_s": 0.0}
    )
    for c in calls:
        if c.itemsize is None:
            m.unknown_dtype_calls += 1
            c.itemsize = 4
        row = acc[c.kind]
        row["time_s"] += c.dur_us * 1e-6 / steps
        if not c.received:
            row["calls"] += 1 / steps
            row["payload_bytes"] += c.numel * c.itemsize / steps
    m.rows = dict(acc)
    if groups is not None or any(c.ranks is not None for c in calls):
        _add_groups(m, calls, steps)
    return m


def _add_groups(m: CommMeasurement, calls: list[_Call], steps: int) -> None:
    """``m.groups``: the sent calls per kind and process group, per step; a call of no known group is unplaced."""
    acc: dict[tuple[str, tuple[int, ...]], dict[str, float]] = defaultdict(
        lambda: {"calls": 0.0, "payload_bytes": 0.0}
    )
    for c in calls:
        if c.received:
            continue
        if c.ranks is None:
            m.unplaced_calls += 1 / steps
            continue
        row = acc[(c.kind, c.ranks)]
        row["calls"] += 1 / steps
        row["payload_bytes"] += c.numel * (c.itemsize or 4) / steps
    m.groups = [{"kind": k, "ranks": list(r)} | v for (k, r), v in sorted(acc.items())]


def _group_ranks(value: Any) -> tuple[int, ...] | None:
    """NCCL's ``record_param_comms`` "Process Group Ranks" (a list, or its text "[0, 1]")."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return tuple(int(r) for r in value) if isinstance(value, list) and value else None


def _attach_groups(calls: list[_Call], groups: list[GroupCall], group_size: int) -> None:
    """Give each call with no group yet the ranks of the first unused flight-recorder entry, in issue order, of
    its element count (or its per-rank part)."""
    used = [False] * len(groups)
    for c in sorted(calls, key=lambda c: c.ts):
        if c.ranks is not None:
            continue
        candidates = {c.numel, c.numel // max(group_size, 1)}
        for i, g in enumerate(groups):
            if not used[i] and g.numels & candidates:
                used[i], c.ranks = True, g.ranks
                break


def _transport_numel_and_itemsize(e: dict[str, Any]) -> tuple[int, int | None]:
    args = e.get("args", {})
    if "In msg nelems" in args:  # NCCL's record_param_comms
        dtype = str(args.get("dtype", "")).strip('"')
        return int(args.get("In msg nelems", 0)), _SCALAR_TYPE_BYTES.get(dtype, _DTYPE_BYTES.get(dtype))
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    numel = sum(_numel(d, scalar_if_empty=t in _DTYPE_BYTES) for d, t in zip(dims, types, strict=False))
    itemsize = next((_DTYPE_BYTES[t] for t in types if t in _DTYPE_BYTES), None)
    return numel, itemsize


def _attach_transport(calls: list[_Call], transport: list[dict[str, Any]], group_size: int) -> None:
    """Give each logical call the element type and duration of the backend event that carried it: the first
    unused backend event, in time order, whose element count is the call's (or its per-rank part)."""
    used = [False] * len(transport)
    transport = sorted(transport, key=lambda e: float(e.get("ts", 0)))
    sizes = [_transport_numel_and_itemsize(e) for e in transport]
    for c in sorted(calls, key=lambda c: c.ts):
        candidates = {c.numel, c.numel // max(group_size, 1)}
        for i, e in enumerate(transport):
            if used[i] or float(e.get("ts", 0)) + 1 < c.ts:
                continue
            numel, itemsize = sizes[i]
            if numel in candidates:
                used[i] = True
                c.dur_us = float(e.get("dur", 0))
                if c.itemsize is None:
                    c.itemsize = itemsize
                c.ranks = _group_ranks(e.get("args", {}).get("Process Group Ranks"))
                break


FLIGHT_RECORDER_ENTRIES = "20000"
"""Collectives torch's flight recorder keeps (a ring buffer): enough for the recorded steps of a large model
(DeepSpeed ZeRO-3 gathers per parameter)."""


def enable_group_record() -> None:
    """Turn on torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, read when the first collective is recorded, so
    before the process group starts), unless the user set its size: on gloo it alone says which process group a
    collective ran on. A run over several nodes with ``--comm-volume`` calls it."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def flight_records() -> list[dict[str, Any]] | None:
    """The flight recorder's entries (oldest first), or None where this torch has none or it is off."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None or not dist.is_initialized() or os.environ.get("TORCH_FR_BUFFER_SIZE", "0") == "0":
        return None
    try:
        entries = json.loads(dump(includeCollectives=True, onlyActive=False)).get("entries", [])
    except (RuntimeError, ValueError):
        return None
    return sorted(entries, key=lambda e: int(e.get("record_id", 0)))


def _numel_of(sizes: Any) -> int:
    return sum(_numel(s, scalar_if_empty=True) for s in sizes or [])


def group_calls(entries: list[dict[str, Any]]) -> list[GroupCall]:
    """The flight recorder's entries as ``GroupCall``: each one's process group (its name, the entry's
    ``process_group[0]``) as global ranks, from the groups this process is a member of; barriers left out."""
    names = {name: tuple(dist.get_process_group_ranks(pg)) for pg, name in dist.distributed_c10d._world.pg_names.items()}
    out = []
    for e in entries:
        ranks = names.get(str((e.get("process_group") or [""])[0]))
        if ranks is None or str(e.get("profiling_name", "")).endswith("barrier"):
            continue
        out.append(GroupCall(frozenset({_numel_of(e.get("input_sizes")), _numel_of(e.get("output_sizes"))}), ranks))
    return out


class CommRecorder:
    """Profile the collectives of the steps between ``start()`` and ``stop(steps)``; with the flight recorder on
    (``enable_group_record``), also the process group of each."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._prof: torch.profiler.profile | None = None
        self._first_record: int | None = None
        self.result: CommMeasurement | None = None

    def start(self) -> None:
        entries = flight_records()
        if entries is not None:
            self._first_record = int(entries[-1]["record_id"]) + 1 if entries else 0
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        )
        self._prof.__enter__()

    @property
    def active(self) -> bool:
        return self._prof is not None

    def stop(self, steps: int) -> CommMeasurement:
        assert self._prof is not None, "CommRecorder.stop() before start()"
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        fd, path = tempfile.mkstemp(suffix=".json", prefix="stratbench-comm-")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
        finally:
            os.unlink(path)
        groups = None
        entries = flight_records() if self._first_record is not None else None
        if entries is not None:
            groups = group_calls([e for e in entries if int(e.get("record_id", 0)) >= self._first_record])
        self.result = parse_trace(events, steps, self.group_size, groups)
        return self.result


def comm_report(
    per_rank: list[dict[str, Any] | None], predicted: tuple[list[Collective] | None, str],
    node_of: list[int] | None = None, mesh: dict[str, int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``metrics.comm`` of result.json: measured per rank, the formula (``predicted``: the method's collectives
    for this run, or None and why; ``CostModel.predicted_comm``), and per kind the error of the formula against
    the busiest rank's measured payload; where ``node_of`` (global rank -> node) spans nodes, both split into
    intra- and inter-node bytes (``link_report``), the formula's groups placed on ``mesh``."""
    out: dict[str, Any] = {
        "route": "torch.profiler: c10d operators (kind, payload) and the backend's events (dtype, time)",
        "measured_per_rank": per_rank,
    }
    measured = [r for r in per_rank if r]
    if not measured:
        out["note"] = "not measured: the run had fewer than 3 steps"
        return out
    kinds = sorted({k for r in measured for k in r["per_step"]})

    def busiest(kind: str, key: str) -> float:
        return max(r["per_step"].get(kind, {}).get(key, 0.0) for r in measured)

    out["measured"] = {
        k: {key: busiest(k, key) for key in ("calls", "payload_bytes", "wire_bytes", "time_s")} for k in kinds
    }
    out["wire_bytes_per_step"] = max(sum(v["wire_bytes"] for v in r["per_step"].values()) for r in measured)
    rows, why = predicted
    if node_of and len(set(node_of)) > 1:
        out |= link_report(per_rank, rows, node_of, mesh or {})
    if rows is None:
        out["predicted"], out["predicted_note"] = None, why
        return out
    out["predicted"] = [r.to_dict() for r in rows]
    out["predicted_wire_bytes_per_step"] = sum(r.wire_bytes for r in rows)
    check = {}
    for k in sorted(set(kinds) | {r.kind for r in rows}):
        want = sum(r.payload_bytes for r in rows if r.kind == k)
        got = busiest(k, "payload_bytes") if k in kinds else 0.0
        err = (got - want) / want * 100 if want else (0.0 if got == 0 else None)
        check[k] = {"measured_payload_bytes": got, "predicted_payload_bytes": want, "error_pct": err}
    out["check"] = check
    return out


LINK_RULE = (
    "a call counts on the link its process group spans: intra where all its ranks sit on one node, inter (all "
    "of its payload and ring wire bytes) where they span nodes; busiest rank per link"
)


def link_report(
    per_rank: list[dict[str, Any] | None], rows: list[Collective] | None, node_of: list[int], mesh: dict[str, int]
) -> dict[str, Any]:
    """The measured collectives of each rank (their process groups, ``CommMeasurement.groups``) and the formula's
    rows (placed on ``mesh``) split into intra- and inter-node bytes per step by one rule (``comm.link_of``), each
    side's busiest rank per link: ``metrics.comm.by_link`` and the per-step totals the report shows."""
    measured = [r for r in per_rank if r and r.get("groups") is not None]
    out: dict[str, Any] = {"by_link": {"rule": LINK_RULE, "node_of_rank": node_of, "mesh": mesh}}
    by = out["by_link"]
    if not measured:
        by["note"] = "the process groups of the calls were not recorded (torch's flight recorder is off)"
    else:
        tables = [rank_links(((g["kind"], g["ranks"], g["calls"], g["payload_bytes"]) for g in r["groups"]), node_of)
                  for r in measured]  # fmt: skip
        by["measured"] = busiest_links(tables)
        by["unplaced_calls"] = max(r.get("unplaced_calls", 0.0) for r in measured)
        for link in LINKS:
            out[f"{link}_node_wire_bytes_per_step"] = by["measured"][link]["wire_bytes"]
    if rows is not None:
        by["predicted"] = busiest_links(formula_links(rows, mesh, node_of))
        for link in LINKS:
            out[f"predicted_{link}_node_wire_bytes_per_step"] = by["predicted"][link]["wire_bytes"]
    return out
