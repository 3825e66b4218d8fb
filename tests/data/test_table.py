"""A table the user has (`--data table:FILE --target COLUMN`: CSV, TSV, parquet, JSON lines through Hugging Face
`datasets`) as a classification task, and a user's MLP (with a lazy first layer, shaped from one real row) on it
under every data-parallel method: `compare --methods` from the user's folder, every cell ok. Bad tables are one
line before any work; a data set smaller than one batch is refused once, before any cell."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import fails, run_stratbench
from stratbench.core.errors import ConfigError, DataError
from stratbench.data.table import table_data

pytest.importorskip("datasets", reason="table:FILE needs the ft extra (datasets)")

MLP = """from torch import nn


def build(num_classes):
    return nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, num_classes))
"""


def _rows(n: int = 240, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Six features and a learnable yes/no label (the sign of a linear mix)."""
    x = np.random.default_rng(seed).normal(size=(n, 6)) * [1, 2, 3, 1, 10, 0.1] + [0, 5, 0, 0, 100, 0]
    y = ["yes" if v > 0 else "no" for v in (x[:, 0] + 0.25 * (x[:, 1] - 5) - x[:, 2] / 3)]
    return x, y


def _write(path: Path, x: np.ndarray, y: list[str]) -> Path:
    names = [f"f{i}" for i in range(x.shape[1])]
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*names, "label"])
            w.writerows([*map(float, r), lab] for r, lab in zip(x, y, strict=True))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({**dict(zip(names, map(float, r), strict=True)), "label": lab}) + "\n"
                                for r, lab in zip(x, y, strict=True)))  # fmt: skip
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({**{n: x[:, i] for i, n in enumerate(names)}, "label": y}), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_table_is_standardised_features_and_sorted_classes_split_by_the_seed(tmp_path, suffix):
    x, y = _rows()
    t = table_data(f"table:{_write(tmp_path / f'rows{suffix}', x, y)}", "label", 0.25, seed=3)
    assert t["classes"] == ["no", "yes"] and t["meta"]["features"] == [f"f{i}" for i in range(6)]
    assert len(t["train"]) == 180 and len(t["val"]) == 60
    xs, ys = t["train"].tensors
    assert xs.shape == (180, 6) and xs.dtype.is_floating_point and ys.dtype.is_signed
    assert np.allclose(xs.mean(0).numpy(), 0, atol=1e-5) and np.allclose(xs.std(0, unbiased=False).numpy(), 1, atol=1e-4)
    again = table_data(f"table:{tmp_path / f'rows{suffix}'}", "label", 0.25, seed=3)
    assert (again["val"].tensors[1] == t["val"].tensors[1]).all()  # the same split for the same seed


def test_a_bad_table_is_one_line_naming_what_is_wrong(tmp_path):
    x, y = _rows(40)
    path = _write(tmp_path / "rows.csv", x, y)
    with pytest.raises(ConfigError, match=r"needs --target COLUMN, the column to predict; its columns: f0, "):
        table_data(f"table:{path}", "", 0.2, 0)
    with pytest.raises(ConfigError, match=r"--target 'lable' is not a column .* \(did you mean 'label'\?\)"):
        table_data(f"table:{path}", "lable", 0.2, 0)
    text = tmp_path / "text.csv"
    text.write_text("f0,city,label\n1,Oslo,a\n2,Rome,b\n3,Oslo,a\n")
    with pytest.raises(DataError, match=r"column 'city' is text, not a number: drop it or encode it"):
        table_data(f"table:{text}", "label", 0.2, 0)
    hole = tmp_path / "hole.csv"
    hole.write_text("f0,f1,label\n1,2,a\n3,,b\n4,5,a\n6,7,b\n")
    with pytest.raises(DataError, match=r"a missing value in column 'f1', row 2"):
        table_data(f"table:{hole}", "label", 0.2, 0)
    reg = tmp_path / "reg.csv"
    reg.write_text("f0,y\n" + "".join(f"{i},{i * 0.37:.2f}\n" for i in range(40)))
    with pytest.raises(DataError, match=r"--target 'y' has 40 distinct values in 40 rows: .* a regression target"):
        table_data(f"table:{reg}", "y", 0.2, 0)
    for name, content in (("bad.jsonl", b'{"a": 1,\n'), ("enc.csv", b"f0,label\n\xff\xfe,1\n"), ("bad.parquet", b"no")):
        (tmp_path / name).write_bytes(content)  # not what the suffix says: one line, no traceback
        with pytest.raises(DataError, match=rf"--data 'table:.*{name}' could not be read: "):
            table_data(f"table:{tmp_path / name}", "label", 0.2, 0)
    with pytest.raises(ConfigError, match=r"a \.txt file; a table is one of \.csv"):
        (tmp_path / "rows.txt").write_text("a")
        table_data(f"table:{tmp_path / 'rows.txt'}", "label", 0.2, 0)


def test_compare_trains_a_user_mlp_on_a_csv_under_every_data_parallel_method(tmp_path, capsys, monkeypatch):
    """From the user's folder, as they type it; the MLP's first layer is lazy (shaped from one real row, 6
    features, in floating point). A data set smaller than one global batch: one line, nothing written."""
    (tmp_path / "mlp.py").write_text(MLP)
    _write(tmp_path / "rows.csv", *_rows())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = fails(capsys, "compare", "--model", "mlp:build", "--data", "table:rows.csv", "--target", "label",
                "--methods", "single,ddp", "--batch-size", "256", "--output", "runs/big")  # fmt: skip
    assert "the training set (192 samples) is smaller than one global batch (256): lower --batch-size" in err
    assert not (tmp_path / "runs" / "big").exists()
    run_stratbench("compare", "--model", "mlp:build", "--data", "table:rows.csv", "--target", "label", "--methods",
                   "single,ddp,fsdp,deepspeed", "--epochs", "4", "--batch-size", "32", "--lr", "0.1", "--output",
                   "runs/mlp", cwd=tmp_path)  # fmt: skip
    out = tmp_path / "runs" / "mlp"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in records) == ["ddp", "deepspeed", "fsdp", "single"]
    assert all(r["status"] == "ok" and r["metrics"]["val_accuracy"] >= 0.75 for r in records), [
        (r["method"], r["status"], r.get("reason"), r.get("metrics", {}).get("val_accuracy")) for r in records]
    report = (out / "report.md").read_text()
    assert report.startswith("# stratbench compare: mlp:build\n")
    assert "mlp:build on table:rows.csv, 4 epochs, global batch 32; single, ddp, fsdp, deepspeed at fp32" in report
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert all(row["predicted_peak_bytes"] not in ("", "n/a") for row in rows), rows  # traced at (6,) floats
