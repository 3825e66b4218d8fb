"""The llm-long preset (long sequences on a CPU): planned in process, no training. gpt-tiny-long at 4096 and 1024
tokens under single, fsdp, fsdp with selective and full activation checkpointing and fsdp --cp 2, one sequence
per data-parallel rank; every cell runs here and each label names its sequence."""

from __future__ import annotations

import dataclasses

from stratbench.compare.matrix import build_matrix, plan
from stratbench.compare.presets import PRESET_HELP, PRESETS
from stratbench.models.transformer import SIZES


def test_llm_long_plans_every_row_at_both_sequences():
    matrix = build_matrix(PRESETS["llm-long"]())
    rows = ["single", "fsdp", "fsdp+sac", "fsdp+ac", "fsdp-cp2"]
    cells = {c.name: c for c in matrix.cells}
    assert list(cells) == [*rows, *(f"{r}-1k" for r in rows)]
    assert "llm-long" in PRESET_HELP
    for name, c in cells.items():
        assert c.config["model"] == "gpt-tiny-long" and c.precision == "fp32", name
        seq = 1024 if name.endswith("-1k") else 4096
        assert c.config["seq_len"] == seq <= SIZES["gpt-tiny-long"].max_seq_len, name
        ac = c.config.get("activation_checkpointing", False)
        assert (ac, c.config.get("ac_mode", "full")) == (
            (True, "selective") if "+sac" in name else (True, "full") if "+ac" in name else (False, "full")
        ), name
        cp = c.options.get("cp")
        assert (c.world_size, c.batch_size, cp) == (
            (1, 1, None) if name.startswith("single") else (2, 1, 2) if "cp2" in name else (2, 2, None)
        ), name
    assert cells["single"].label == ""  # the 4k single row is the report's baseline
    assert SIZES["gpt-tiny-long"] == dataclasses.replace(SIZES["gpt-tiny"], max_seq_len=4096)
    refused = {p.cell.name: p.reason for p in plan(matrix) if p.status is not None}
    assert refused == {}, refused
