"""The moe-quick preset (a mixture of experts on a CPU, expert parallelism by fsdp and DeepSpeed-MoE), planned in process, and the report's MoE columns: shown
where a row trained an MoE, with its active / total parameters and its routing; absent from a dense sweep."""

from __future__ import annotations

from stratbench.compare import columns
from stratbench.compare.matrix import build_matrix, plan
from stratbench.compare.presets import PRESET_HELP, PRESETS
from stratbench.compare.rows import Footnotes
from stratbench.models.transformer import SIZES


def test_moe_quick_plans_every_row():
    matrix = build_matrix(PRESETS["moe-quick"]())
    cells = {c.name: c for c in matrix.cells}
    assert list(cells) == ["single", "ddp", "fsdp", "fsdp-ep2", "deepspeed-moe-ep2"]
    assert "moe-quick" in PRESET_HELP and SIZES["gpt-moe-tiny"].is_moe
    for name, c in cells.items():
        assert c.config["model"] == "gpt-moe-tiny" and c.precision == "fp32", name
        assert c.world_size == (1 if name == "single" else 2), name
    assert cells["fsdp-ep2"].options == {"ep": 2}
    assert cells["deepspeed-moe-ep2"].options["ep"] == 2 and cells["deepspeed-moe-ep2"].options["zero_stage"] == 2
    assert [c.options.get("ep") for c in build_matrix(PRESETS["moe-quick"](4)).cells] == [None, None, None, 4, 4]
    refused = {p.cell.name: p.reason for p in plan(matrix) if p.status is not None}
    assert refused == {}, refused


def _record(id_: str, moe: dict | None) -> dict:
    return {"machine": {"hostname": "box", "device": "CPU: test (2 cores)"}, "environment": {"device_type": "cpu"},
            "config": {}, "batch_size": 8, "reason": "", "id": id_, "method": "single", "precision": "fp32",
            "world_size": 1, "status": "ok", "metrics": {"train_time_s": 1.0, "throughput_samples_per_s": 8.0},
            **({"moe": moe} if moe else {})}  # fmt: skip


def test_a_sweep_record_keeps_the_runs_moe_block():
    """compare's results.jsonl line carries result.json's ``moe`` (the report's MoE columns read it there)."""
    from stratbench.compare.runner import make_record

    cell = build_matrix(PRESETS["moe-quick"]()).cells[0]
    moe = {"active_parameters": 1_872_576, "total_parameters": 3_052_224, "load_imbalance": 1.5}
    env = {"device_type": "cpu"}
    assert make_record(cell, "ok", result={"moe": moe, "environment": env})["moe"] == moe
    assert "moe" not in make_record(cell, "ok", result={"environment": env})


def test_moe_columns_show_active_parameters_and_the_load():
    moe = {"active_parameters": 1_872_576, "total_parameters": 3_052_224, "load_imbalance": 1.8108,
           "dropped_fraction": 0.0}  # fmt: skip
    capped = {**moe, "load_imbalance": 1.25, "dropped_fraction": 0.5123}
    rows = columns.build_rows([_record("a", moe), _record("b", capped), _record("dense", None)], Footnotes())
    assert [r.text["moe_active"] for r in rows] == ["1.87M of 3.05M", "1.87M of 3.05M", "–"]
    assert [r.text["moe_balance"] for r in rows] == ["1.81x", "1.25x, 51.2% dropped", "–"]
    assert "moe_active" in [c.key for c in columns.shown_columns(rows)]
    line = dict(zip(columns.csv_fields(), columns.csv_row(rows[1]), strict=True))
    assert (line["moe_active_parameters"], line["moe_total_parameters"]) == (1_872_576, 3_052_224)
    assert (line["moe_load_imbalance"], line["moe_dropped_fraction"]) == (1.25, 0.5123)
    dense = columns.build_rows([_record("dense", None)], Footnotes())
    assert "moe_active" not in [c.key for c in columns.shown_columns(dense)]


def test_llm_moe_splits_the_experts_over_every_gpu_where_they_divide(monkeypatch):
    """llm-moe on 8 GPUs: fsdp, fsdp --ep 8, DeepSpeed-MoE --ep 8 at ZeRO-1/2; on one GPU no expert parallelism."""
    from stratbench.compare import presets as presets_mod

    monkeypatch.setattr(presets_mod, "gpu_count", lambda: 8)
    cells = {c.name: c for c in build_matrix(PRESETS["llm-moe"]()).cells}
    assert list(cells) == ["fsdp", "fsdp-ep8", "deepspeed-moe-ep8-z1", "deepspeed-moe-ep8-z2"]
    assert all(c.config["model"] == "qwen3-30b-a3b" and c.world_size == 8 for c in cells.values())
    assert [c.options.get("ep") for c in cells.values()] == [None, 8, 8, 8]
    monkeypatch.setattr(presets_mod, "gpu_count", lambda: 1)
    assert [c.name for c in build_matrix(PRESETS["llm-moe"]()).cells] == ["fsdp", "deepspeed-moe-z1", "deepspeed-moe-z2"]
