"""A user's matrix file: the example in docs/usage.md ("Your own matrix") builds the cells it says, and a mistake
in a file is one line naming the file, the line and the closest known name."""

from __future__ import annotations

import re

import yaml

from conftest import REPO, fails
from stratbench.compare.matrix import build_matrix


def test_the_documented_matrix_example_builds_its_cells():
    block = re.search(r"```yaml\n(.*?)```", (REPO / "docs" / "usage.md").read_text(), re.S).group(1)
    m = build_matrix(yaml.safe_load(block))
    assert m.heading == "My model, four ways" and m.timeout_s == 600
    assert [(c.name, c.precision, c.world_size, c.nodes) for c in m.cells] == [
        ("single", "fp32", 1, 1), ("single", "bf16-mixed", 1, 1), ("ddp", "fp32", 2, 1), ("fsdp", "fp32", 2, 1),
        ("deepspeed-z1", "fp32", 2, 1), ("deepspeed-z3", "fp32", 2, 1), ("fsdp-small-units", "fp32", 2, 1),
        ("ddp", "fp32", 4, 2)]  # fmt: skip
    assert m.cells[6].options == {"wrap": "size", "wrap_min_params": 1000}


def test_a_mistake_in_a_matrix_file_names_its_line_and_the_closest_name(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {model: tinynet, epochz: 2}\ncells:\n  - {method: single}\n")
    err = fails(capsys, "compare", "--matrix", bad, "--dry-run")
    assert f"{bad} line 2: matrix base: unknown option(s) 'epochz' (did you mean 'epochs'?)" in err
    bad.write_text("name: x\ncells:\n  - {method: single}\n  - method: ddp\n    colour: red\n")
    err = fails(capsys, "compare", "--matrix", bad, "--dry-run")
    assert f"{bad} line 4: matrix cell entry 2: unknown key(s) colour" in err
