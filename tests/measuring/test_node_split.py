"""Where the bytes go: each rank's node, and every collective counted on the link its process group spans
(intra-node: all its ranks on one node; inter-node: its ranks on several, all of its bytes), measured from the
trace and predicted from the method's formula on its mesh by the same rule (docs/communication.md, "Intra- and
inter-node bytes"). In-process on hand-made traces, and one real run of 2 "nodes" x 2 processes on loopback
(fsdp --tp 2: tensor-parallel groups inside a node, FSDP's data-parallel groups across the two)."""

from __future__ import annotations

import json

import pytest

from conftest import run_nodes
from stratbench.compare.cells import comm_cell
from stratbench.compare.rows import Footnotes, Row
from stratbench.core.dist import node_of_process
from stratbench.measuring.comm import Collective, link_of, mesh_group
from stratbench.measuring.commvol import GroupCall, comm_report, parse_trace
from stratbench.measuring.records import as_run_record

NODE_OF = [0, 0, 1, 1]
"""2 nodes x 2 processes: ranks 0-1 on node 0, 2-3 on node 1."""
MESH = {"dp": 2, "tp": 2}


def test_node_of_a_process_from_its_launcher(monkeypatch):
    for name in ("GROUP_RANK", "GROUP_WORLD_SIZE", "SLURM_NODEID", "SLURM_NNODES", "CROSS_RANK", "CROSS_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert node_of_process() == (0, 1)
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_NNODES", "4")
    assert node_of_process() == (3, 4)
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun (stratbench's launcher on every node) comes first
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert node_of_process() == (1, 2)


def test_groups_on_the_mesh_and_the_rule():
    # (dp 2, tp 2) row-major: tp groups are neighbours, dp groups 2 apart; HSDP's (replicate, shard) alike
    assert mesh_group(3, MESH, "tp", 2, 4) == [2, 3] and mesh_group(3, MESH, "dp", 2, 4) == [1, 3]
    assert mesh_group(5, {"dp": 2, "pp": 2, "tp": 2}, "pp", 2, 8) == [5, 7]
    assert mesh_group(2, {}, "", 4, 4) == [0, 1, 2, 3]  # no dimension: the whole world (plain ddp / fsdp)
    assert link_of([2, 3], NODE_OF) == "intra" and link_of([1, 3], NODE_OF) == "inter"
    assert link_of([0, 1, 2, 3], NODE_OF) == "inter"  # a ring over both nodes crosses them: all of it inter


def _event(name: str, ts: float, dims: list, types: list) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": 5.0, "args": {"Input Dims": dims, "Input type": types}}


def _rank_trace(rank: int) -> dict:
    """One step of a (dp 2, tp 2) rank on gloo: a world all-reduce of 100 fp32, a tp all-gather of 2 x 32 and a
    dp all-reduce of 100 (the same size as the first: placed by order), with the flight recorder's groups."""
    events = [
        _event("c10d::allreduce_", 0, [[[100]], []], ["TensorList", ""]),
        _event("gloo:all_reduce", 1, [[100]], ["float"]),
        _event("c10d::_allgather_base_", 10, [[64], [32], []], ["float", "float", ""]),
        _event("gloo:all_gather", 11, [[32]], ["float"]),
        _event("c10d::allreduce_", 20, [[[100]], []], ["TensorList", ""]),
        _event("gloo:all_reduce", 21, [[100]], ["float"]),
    ]
    tp, dp = tuple(mesh_group(rank, MESH, "tp", 2, 4)), tuple(mesh_group(rank, MESH, "dp", 2, 4))
    groups = [GroupCall(frozenset({100}), (0, 1, 2, 3)), GroupCall(frozenset({32, 64}), tp),
              GroupCall(frozenset({100}), dp)]  # fmt: skip
    return parse_trace(events, steps=1, group_size=4, groups=groups).to_dict()


def test_measured_split_equals_the_formula_split():
    per_rank = [_rank_trace(r) for r in range(4)]
    assert per_rank[3]["groups"][0] == {"kind": "all_gather", "ranks": [2, 3], "calls": 1.0, "payload_bytes": 256.0}
    rows = [Collective("all_reduce", 400, 1, "backward", 4), Collective("all_gather", 256, 1, "forward", 2, dim="tp"),
            Collective("all_reduce", 400, 1, "backward", 2, dim="dp")]  # fmt: skip
    comm = comm_report(per_rank, (rows, ""), NODE_OF, MESH)
    by = comm["by_link"]
    assert by["measured"] == by["predicted"], by
    assert by["measured"]["intra"]["per_kind"] == {"all_gather": {"calls": 1.0, "payload_bytes": 256.0, "wire_bytes": 128.0}}
    assert by["measured"]["inter"]["per_kind"]["all_reduce"]["payload_bytes"] == 800
    # ring wire bytes over each call's own group: 400 x 2·3/4 (world) + 400 x 2·1/2 (dp pair)
    assert comm["inter_node_wire_bytes_per_step"] == 600 + 400 and comm["intra_node_wire_bytes_per_step"] == 128
    assert by["unplaced_calls"] == 0
    # one node: no split, result.json as before
    assert "by_link" not in comm_report(per_rank, (rows, ""), [0, 0, 0, 0], MESH)
    # a call the flight recorder did not see is unplaced, not guessed
    lost = parse_trace([_event("c10d::allreduce_", 0, [[[7]], []], ["TensorList", ""])], 1, 4, groups=[]).to_dict()
    assert lost["groups"] == [] and lost["unplaced_calls"] == 1


def test_nccl_events_name_the_group():
    """NCCL's record_param_comms event carries the group's ranks itself: no flight recorder needed."""
    nccl = {"ph": "X", "name": "record_param_comms", "ts": 1, "dur": 5.0,
            "args": {"In msg nelems": 100, "dtype": "Float", "Process Group Ranks": "[1, 3]"}}  # fmt: skip
    m = parse_trace([_event("c10d::allreduce_", 0, [[[100]], []], ["TensorList", ""]), nccl], 1, 4).to_dict()
    assert m["groups"] == [{"kind": "all_reduce", "ranks": [1, 3], "calls": 1.0, "payload_bytes": 400.0}]


def _comm_text(comm: dict) -> str:
    rec = as_run_record({"method": "fsdp", "status": "ok", "metrics": {"comm": comm}})
    row = Row(rec, {}, {})
    comm_cell(rec, row, Footnotes(), None)
    return row.text["comm"]


def test_report_shows_intra_and_inter_where_the_run_spans_nodes():
    one_node = {"wire_bytes_per_step": 3 * 2**20, "check": {}}
    assert _comm_text(one_node) == "3.00 MiB¹"
    two = one_node | {"intra_node_wire_bytes_per_step": 2**20, "inter_node_wire_bytes_per_step": 2 * 2**20}
    assert _comm_text(two) == "3.00 MiB¹; intra 1.00 MiB, inter 2.00 MiB²"


@pytest.mark.distributed
def test_two_nodes_measured_intra_inter_equal_the_formula(tmp_path):
    """fsdp --tp 2 on 2 nodes x 2 processes (loopback): Megatron's all-reduces over tp stay inside a node, FSDP's
    gathers and reduce-scatters over dp cross the nodes, measured to the byte as the formula places them."""
    out = tmp_path / "run"
    run_nodes(out, "train", "--strategy", "fsdp", "--tp", "2", "--model", "gpt-tiny", "--data", "text",
              "--seq-len", "16", "--batch-size", "4", "--max-steps", "3", "--eval-samples", "8", "--eval-every-epoch", "false", "--save-every-epoch", "false",
              "--progress", "false",
              "--precision", "fp64", "--measure-flops", "false", "--comm-volume", "true", nnodes=2, nproc=2)  # fmt: skip
    res = json.loads((out / "result.json").read_text())
    assert res["status"] == "ok" and res["world_size"] == 4
    assert res["metrics"]["node_of_rank"] == NODE_OF
    comm = res["metrics"]["comm"]
    by = comm["by_link"]
    assert by["mesh"] == MESH and by["unplaced_calls"] == 0
    assert by["measured"] == by["predicted"], by
    assert set(by["measured"]["intra"]["per_kind"]) == {"all_reduce"}
    assert set(by["measured"]["inter"]["per_kind"]) == {"all_gather", "reduce_scatter"}
    assert comm["inter_node_wire_bytes_per_step"] == comm["predicted_inter_node_wire_bytes_per_step"] > 0

