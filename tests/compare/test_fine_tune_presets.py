"""The fine-tuning presets (ft-quick on a CPU, llm-ft on GPUs), a sweep's pretraining run, and the report's
fine-tuning columns (trainable parameters, each rank's model states split): in process, no training, except one
small sweep that pretrains and fine-tunes through the CLI."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import cli, md_section
from stratbench.compare import report as report_mod
from stratbench.compare.matrix import build_matrix, plan
from stratbench.compare.presets import PRESETS
from stratbench.core.errors import ConfigError


def test_ft_quick_expands_to_every_variant_under_every_method_and_refusals_are_one_line():
    matrix = build_matrix(PRESETS["ft-quick"]())
    cells = {c.name: c for c in matrix.cells}
    methods = ["single", "ddp", "fsdp", "deepspeed-z3"]
    assert list(cells) == [
        *methods, *(f"{m}+lora" for m in methods), *(f"{m}+lora+8bit" for m in methods), *(f"{m}+qlora" for m in methods)
    ]  # fmt: skip
    assert {c.world_size for c in matrix.cells if c.method != "single"} == {2}
    for name, cell in cells.items():
        assert cell.config["data"] == "instruct-stdlib" and cell.precision == "fp32"
        assert cell.config.get("lora_rank", 0) == (8 if "lora" in name else 0), name
        assert cell.config.get("quantize_base", "none") == ("nf4" if name.endswith("+qlora") else "none"), name
        assert cell.config["optimizer"] == ("adamw8bit" if name.endswith("+8bit") else "adamw"), name
    assert cells["deepspeed-z3"].options["zero_stage"] == 3
    assert matrix.pretrain["data"] == "text" and matrix.pretrain["model"] == cells["single"].config["model"]
    # the single fp32 full fine-tuning row is the report's baseline: it keeps the method's own name
    assert cells["single"].label == ""
    plans = {p.cell.name: p for p in plan(matrix)}
    refused = {k: p.reason for k, p in plans.items() if p.status is not None}
    assert list(refused) == ["deepspeed-z3+lora+8bit", "ddp+qlora", "deepspeed-z3+qlora"], refused
    assert {plans[k].status for k in refused} == {"skipped"}
    assert "adamw8bit" in refused["deepspeed-z3+lora+8bit"] and "quantize" in refused["ddp+qlora"]
    assert not any("\n" in why for why in refused.values())


def test_llm_ft_has_llama_8b_full_and_lora_cells_and_is_skipped_without_gpus(monkeypatch):
    from stratbench.compare import presets as presets_mod

    monkeypatch.setattr(presets_mod, "gpu_count", lambda: 8)
    matrix = build_matrix(PRESETS["llm-ft"]())
    names = [c.name for c in matrix.cells]
    assert names[:2] == ["fsdp", "deepspeed-z3"] and "fsdp+lora" in names and "single+lora" in names
    assert all(c.config["model"] == "llama-8b" and c.config["seq_len"] == 2048 for c in matrix.cells)
    assert not any(c.config.get("lora_rank") for c in matrix.cells[:2])  # full fine-tuning: sharded methods only
    assert matrix.gpu_only and matrix.pretrain is None
    monkeypatch.setattr(presets_mod, "gpu_count", lambda: 0)
    plans = plan(build_matrix(PRESETS["llm-ft"]()))
    assert {p.status for p in plans} == {"skipped"} and "measures GPUs" in plans[0].reason


@pytest.mark.parametrize(
    "pretrain, why",
    [({"output": "x"}, "'output' is set by compare"), ({"modle": "gpt-tiny"}, "modle"), ([1], "must be a mapping")],
)
def test_a_bad_pretrain_entry_is_one_line(pretrain, why):
    spec = {"base": {"model": "gpt-tiny", "data": "text"}, "cells": [{"method": "single"}], "pretrain": pretrain}
    with pytest.raises(ConfigError, match=why):
        build_matrix(spec)


def test_pretrain_steps_change_the_pretraining_run_and_the_cells_ids():
    spec = {"base": {"model": "gpt-tiny", "data": "text"}, "cells": [{"method": "single"}]}
    with pytest.raises(ConfigError, match="--pretrain-steps: this matrix has no pretraining run"):
        build_matrix(spec, pretrain_steps=3)
    spec["pretrain"] = {"model": "gpt-tiny", "data": "text", "max_steps": 200}
    ids = {steps: build_matrix(spec, pretrain_steps=steps).cells[0].id for steps in (None, 3)}
    assert build_matrix(spec, pretrain_steps=3).pretrain["max_steps"] == 3 and ids[None] != ids[3]
    assert ids[None] != build_matrix({**spec, "pretrain": None}).cells[0].id  # a cell from a trained start


def _ft_record(label: str, world: int, trainable: int, sharding: dict, **extra) -> dict:
    return {
        "id": f"{label}_fp32_w{world}", "method": label.split("+")[0], "label": label, "precision": "fp32",
        "world_size": world, "batch_size": 8, "status": "ok", "reason": "",
        "machine": {"hostname": "box", "device": "CPU: test (2 cores)"}, "environment": {"device_type": "cpu"},
        "config": {},  # no config: the report's predicted peak (a traced estimate) is not what is tested
        "metrics": {"train_time_s": 2.0, "throughput_samples_per_s": 80.0, "final_loss": 2.5},
        "parameters": {"total": 1_986_240, "trainable": trainable}, "sharding": sharding, **extra,
    }  # fmt: skip


def test_the_fine_tuning_columns_show_trainable_parameters_and_the_model_states_split(tmp_path, monkeypatch):
    monkeypatch.setattr(report_mod, "write_charts", lambda *args, **kwargs: {})  # the tables are what is tested
    lora = {"param_bytes": [7_944_960, 7_944_960], "trainable_param_bytes": [466_944, 466_944],
            "grad_bytes": [466_944, 466_944], "optimizer_state_bytes": [934_112, 934_112]}  # fmt: skip
    full = {"param_bytes": [7_944_960], "trainable_param_bytes": [7_944_960], "grad_bytes": [7_944_960],
            "optimizer_state_bytes": [15_889_928]}  # fmt: skip
    records = [
        _ft_record("single", 1, 1_986_240, full),
        _ft_record("ddp+lora", 2, 116_736, lora),
        {**_ft_record("deepspeed-z3+lora+8bit", 2, 0, {}), "status": "skipped", "metrics": {},
         "reason": "deepspeed/fp32 cannot run here: optimizer 'adamw8bit' keeps its state per whole parameter"},
    ]  # fmt: skip
    paths = report_mod.write_report(report_mod.Report("t", records, ["x"]), tmp_path)
    md = paths["md"].read_text()
    table = [ln for ln in md_section(md, "All measurements") if ln.startswith("| ")]
    assert "| trainable parameters | model states / rank: frozen / trainable weights / grads / optimizer" in table[0]
    assert "| 116,736 of 1,986,240 (5.9%) | 7.13 MiB / 456.00 KiB / 456.00 KiB / 912.22 KiB |" in table[2]
    assert "| 1,986,240 of 1,986,240 (100.0%) | 0 B / 7.58 MiB / 7.58 MiB / 15.15 MiB |" in table[1]
    refused = [ln for ln in md_section(md, "Cells that did not complete (1)") if ln.strip()]
    assert refused == ["- deepspeed-z3+lora+8bit fp32 x2: skipped — deepspeed/fp32 cannot run here: optimizer "
                       "'adamw8bit' keeps its state per whole parameter"]  # fmt: skip
    csv_lines = paths["csv"].read_text().splitlines()
    header = csv_lines[0].split(",")
    lora_row = dict(zip(header, csv_lines[2].split(","), strict=False))
    assert lora_row["trainable_parameters"] == "116736" and lora_row["states_frozen_bytes"] == "7478016"
    # a sweep in which every row trains the whole model shows neither column
    md_full = report_mod.write_report(report_mod.Report("t", records[:1], ["x"]), tmp_path / "full")["md"]
    assert "trainable parameters" not in md_full.read_text()


def test_a_sweep_pretrains_once_and_every_cell_starts_from_its_checkpoint(tmp_path):
    """The matrix's pretrain run is made before the cells into OUTPUT/pretrain, every cell's config starts from its
    last checkpoint, the report names it, and a rerun keeps it."""
    tiny = {"model": "gpt-tiny", "data": "text", "seq_len": 16, "batch_size": 4, "eval_samples": 4,
            "measure_flops": False}  # fmt: skip
    spec = {"name": "ft", "base": {**tiny, "max_steps": 2, "lora_rank": 2, "comm_volume": False,
                                    "breakdown": False, "measure_alloc": False},
            "pretrain": {**tiny, "max_steps": 2}, "cells": [{"method": "single"}]}  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    cli("compare", "--matrix", tmp_path / "m.yaml", "--output", out)
    assert json.loads((out / "pretrain" / "result.json").read_text())["status"] == "ok"
    (cell,) = (out / "cells").iterdir()
    assert yaml.safe_load((cell / "config.yaml").read_text())["init_from"] == str(out / "pretrain/checkpoints/last")
    (rec,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok" and 0 < rec["parameters"]["trainable"] < rec["parameters"]["total"]
    # the adapters' fp32 bytes, measured on the rank, and the frozen base beside them
    assert rec["sharding"]["trainable_param_bytes"] == [4 * rec["parameters"]["trainable"]]
    assert rec["sharding"]["param_bytes"] == [4 * rec["parameters"]["total"]]
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["pretrain"]["status"] == "ok" and meta["pretrain"]["steps"] == 2
    assert "**Started from:** model gpt-tiny trained on data text" in (out / "report.md").read_text()
    again = cli("compare", "--matrix", tmp_path / "m.yaml", "--output", out)
    assert "done before pretrain: gpt-tiny on text, 2 steps: ok" in again
