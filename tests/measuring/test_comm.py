"""Communication volume: the ring model, the formulas' arithmetic, and the trace parser on hand-made traces.
The runs that check every method's formula against what it actually sent live with each method's equivalence
run (test_ddp, test_fsdp, test_deepspeed, test_accelerate: ``assert_comm_matches_formula``)."""

from __future__ import annotations

import pytest

from stratbench.core.config import TrainConfig
from stratbench.measuring.comm import Collective, ceil_to, dim0_padded, total_wire, wire_factor
from stratbench.measuring.commvol import parse_trace
from stratbench.measuring.model_trace import ModelSpec, model_info
from stratbench.strategies.base import all_strategies
from stratbench.strategies.costs import MemoryContext


def test_ring_wire_factors():
    assert wire_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert wire_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert wire_factor("reduce_scatter", 2) == pytest.approx(1 / 2)
    assert wire_factor("send_recv", 2) == 1.0
    assert wire_factor("all_reduce", 1) == 0.0
    rows = [Collective("all_reduce", 1000, 2, "backward", 4), Collective("all_gather", 400, 1, "forward", 4)]
    assert total_wire(rows) == pytest.approx(1500 + 300)
    with pytest.raises(ValueError, match="allowed: all_reduce"):
        Collective("allreduce", 1, 1, "backward", 2)
    with pytest.raises(ValueError, match="phase 'fwd'"):
        Collective("all_reduce", 1, 1, "fwd", 2)


def test_padding_rules():
    assert ceil_to(10, 4) == 12 and ceil_to(12, 4) == 12
    # FSDP2 pads dim 0 of each tensor: a (5, 3) weight over 2 ranks moves 6 x 3.
    assert dim0_padded([15, 4], [5, 4], 2) == 18 + 4


def _event(name: str, ts: float, dims: list, types: list, dur: float = 10.0) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"Input Dims": dims, "Input type": types}}


def test_parse_trace_kinds_payloads_and_dtypes():
    events = [
        # DDP's reducer: a TensorList (no dtype on the c10d event), the dtype from gloo's own event.
        _event("c10d::allreduce_", 0, [[[100], [20]], [], []], ["TensorList", "", ""]),
        _event("gloo:all_reduce", 5, [[100], [20]], ["double", "double"], dur=300),
        # FSDP2: all-gather into a tensor (output first), reduce-scatter (input second; gloo runs it as all_reduce).
        _event("c10d::_allgather_base_", 10, [[64], [32], []], ["c10::BFloat16", "c10::BFloat16", ""]),
        _event("gloo:all_gather", 11, [[32]], ["c10::BFloat16"]),
        _event("c10d::_reduce_scatter_base_", 20, [[32], [64], []], ["float", "float", ""]),
        _event("gloo:all_reduce", 21, [[64]], ["float"]),
        # a 0-d fp64 scalar all-reduced (DeepSpeed's overflow check)
        _event("c10d::allreduce_", 30, [[[]], []], ["TensorList", ""]),
        _event("gloo:all_reduce", 31, [[]], ["double"]),
        _event("c10d::barrier", 40, [[1]], ["unsigned char"]),
    ]
    m = parse_trace(events, steps=2, group_size=2)
    d = m.to_dict()["per_step"]
    assert m.unknown_dtype_calls == 0
    assert d["all_reduce"]["payload_bytes"] == pytest.approx((120 * 8 + 8) / 2)
    assert d["all_reduce"]["calls"] == pytest.approx(1.0)
    assert d["all_gather"]["payload_bytes"] == pytest.approx(64 * 2 / 2)
    assert d["reduce_scatter"]["payload_bytes"] == pytest.approx(64 * 4 / 2)
    assert d["all_reduce"]["time_s"] == pytest.approx((300 + 10) * 1e-6 / 2)
    assert "barrier" not in str(d)


def test_every_strategy_has_a_formula_or_says_it_has_none():
    """Every registered method answers comm_model with rows or None ("no model"), never a silent 0, and the
    data-parallel methods send at least the gradients once."""
    cfg = TrainConfig(model="tinynet", width=8, norm="none", data="digits", batch_size=32)
    info = model_info(ModelSpec.from_config(cfg))
    for name, cls in all_strategies().items():
        ctx = MemoryContext(
            TrainConfig(**{**cfg.__dict__, "strategy": name}), 2, info, cls.parse_options({}), "cpu"
        )
        rows = cls.cost.comm_model(ctx)
        if name in ("single", "model-parallel"):
            assert rows == []  # one process (model-parallel: device-to-device copies inside it)
        elif name == "pipeline":  # 2 stages, no replicas: activations forward, their gradients back
            assert rows and "send_recv" in {r.kind for r in rows}, rows
        elif rows is not None:
            assert rows and all(isinstance(r, Collective) for r in rows), name
            grads = sum(r.payload_bytes for r in rows if r.kind in ("all_reduce", "reduce_scatter"))
            assert grads >= info.total * 2, name  # at least the gradients, in a 2-byte or wider dtype


def test_a_receive_adds_time_but_no_payload():
    """Point-to-point: the rank's row is what it sends (the formulas' convention); its receive waits count in
    the time only, and the sender counts that tensor."""
    events = [
        _event("c10d::send", 0, [[[100]], [], []], ["TensorList", "", ""]),
        _event("gloo:send", 1, [[100]], ["float"]),
        _event("c10d::recv_", 50, [[[100]], [], []], ["TensorList", "", ""]),
        _event("gloo:recv", 51, [[100]], ["float"]),
    ]
    d = parse_trace(events, steps=1, group_size=2).to_dict()["per_step"]
    assert d["send_recv"]["calls"] == 1 and d["send_recv"]["payload_bytes"] == 400
    assert d["send_recv"]["time_s"] > 0


def test_a_collective_dispatched_twice_is_counted_once():
    """Under a Python dispatch mode the same c10d call appears nested in itself: one call, not two."""
    events = [
        {**_event("c10d::allreduce_", 0, [[[100]], []], ["TensorList", ""]), "tid": 1, "pid": 1, "dur": 50},
        {**_event("c10d::allreduce_", 5, [[[100]], []], ["TensorList", ""]), "tid": 1, "pid": 1, "dur": 40},
        _event("gloo:all_reduce", 10, [[100]], ["float"]),
    ]
    d = parse_trace(events, steps=1, group_size=2).to_dict()["per_step"]
    assert d["all_reduce"]["calls"] == 1 and d["all_reduce"]["payload_bytes"] == 400


def test_a_call_without_its_backend_event_takes_its_kind_s_element_size():
    events = [
        _event("c10d::broadcast_", 0, [[[10]], []], ["TensorList", ""]),
        _event("gloo:broadcast", 1, [[10]], ["double"]),
        _event("c10d::broadcast_", 20, [[[30]], []], ["TensorList", ""]),  # its gloo event is missing
    ]
    m = parse_trace(events, steps=1, group_size=2)
    assert m.unknown_dtype_calls == 0 and m.inferred_dtype_calls == 1
    assert m.to_dict()["per_step"]["broadcast"]["payload_bytes"] == 40 * 8


def _nccl_event(ts: float, collective: str, dtype: str, in_nelems: int, out_nelems: int, dur: float) -> dict:
    """NCCL's ``record_param_comms`` event as torch.profiler exports it (ParamCommsUtils: the element type is
    ``c10::toString(ScalarType)``)."""
    return {"ph": "X", "name": "record_param_comms", "ts": ts, "dur": dur,
            "args": {"Collective name": collective, "dtype": dtype, "In msg nelems": in_nelems,
                     "Out msg nelems": out_nelems, "Group size": 2, "Process Group Name": "0"}}  # fmt: skip


def test_parse_trace_reads_nccl_record_param_comms():
    """On NCCL the backend's element type and transfer time come from ``record_param_comms`` (args "dtype" as
    "Float" / "BFloat16" / "Double", "In msg nelems"), which the gloo tests never exercise."""
    events = [
        # DDP's reducer bucket: a TensorList (no dtype on the c10d event), fp32 gradients
        _event("c10d::allreduce_", 0, [[[100], [20]], [], []], ["TensorList", "", ""]),
        _nccl_event(2, "allreduce", "Float", 120, 120, dur=300),
        # FSDP2 under bf16-mixed: a bf16 all-gather (In msg nelems: this rank's part), an fp32 reduce-scatter
        _event("c10d::allgather_into_tensor_coalesced_", 10, [[[64]], [[32]], []], ["TensorList", "TensorList", ""]),
        _nccl_event(11, "allgather_into_tensor_coalesced", "BFloat16", 32, 64, dur=40),
        _event("c10d::reduce_scatter_tensor_coalesced_", 20, [[[32]], [[64]], []], ["TensorList", "TensorList", ""]),
        _nccl_event(21, "reduce_scatter_tensor_coalesced", "Float", 64, 32, dur=50),
        # DeepSpeed's fp64 overflow check: one 0-d element
        _event("c10d::allreduce_", 30, [[[]], []], ["TensorList", ""]),
        _nccl_event(31, "allreduce", "Double", 1, 1, dur=5),
    ]
    m = parse_trace(events, steps=1, group_size=2)
    d = m.to_dict()["per_step"]
    assert m.unknown_dtype_calls == 0 and m.inferred_dtype_calls == 0
    assert d["all_reduce"]["payload_bytes"] == 120 * 4 + 8 and d["all_reduce"]["calls"] == 2
    assert d["all_gather"]["payload_bytes"] == 64 * 2
    assert d["reduce_scatter"]["payload_bytes"] == 64 * 4
    assert d["all_reduce"]["time_s"] == pytest.approx((300 + 5) * 1e-6)
    assert d["all_gather"]["time_s"] == pytest.approx(40e-6) and d["reduce_scatter"]["time_s"] == pytest.approx(50e-6)
