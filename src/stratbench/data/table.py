"""``--data table:FILE --target COLUMN``: a table the user has (CSV/TSV, parquet, JSON or JSON lines), read
through Hugging Face ``datasets`` (the ``ft`` extra), as a classification task: every other column is a numeric
feature, standardised by the training split's mean and spread; the target's distinct values are the classes
(sorted). Items are (features ``(F,)`` float32, class); the model is the user's (``--model mynet:build``, an MLP).

Refused in one line before any training: a file that is not there or of another kind, no ``--target`` or one
that is not a column, a feature column that is not numeric (name it, to drop or encode it), a missing value, a
target of more distinct values than half the rows (a regression target: not taken here)."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from stratbench.core.errors import ConfigError, DataError, did_you_mean

PREFIX = "table:"
BUILDERS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".json": "json", ".jsonl": "json"}
"""The file kinds a table may be, and the ``datasets`` builder of each."""


def is_table_data(spec: str) -> bool:
    return spec.startswith(PREFIX)


def table_path(spec: str) -> Path:
    """The FILE of ``table:FILE``, checked: there, and of a kind ``BUILDERS`` reads."""
    path = Path(spec[len(PREFIX) :]).expanduser()
    if not spec[len(PREFIX) :]:
        raise ConfigError(f"--data {spec!r}: give the file, e.g. table:rows.csv")
    if not path.is_file():
        raise DataError(f"--data {spec!r}: no file {str(path)!r}")
    if path.suffix.lower() not in BUILDERS:
        raise ConfigError(f"--data {spec!r}: a {path.suffix or 'suffix-less'} file; a table is one of "
                          f"{', '.join(BUILDERS)}")  # fmt: skip
    return path


def _header(path: Path, spec: str) -> list[str] | None:
    """The column names, read without loading the table (None where the kind needs the whole file); a file
    that is not what its suffix says is one line."""
    try:
        return _read_header(path)
    except (ValueError, OSError) as exc:  # bad JSON, not UTF-8, not parquet (pyarrow's ArrowInvalid)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise DataError(f"--data {spec!r} could not be read: {reason}") from None


def _read_header(path: Path) -> list[str] | None:
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        with path.open(newline="") as f:
            return next(csv.reader(f, delimiter="\t" if suffix == ".tsv" else ","), [])
    if suffix == ".jsonl":
        with path.open() as f:
            first = json.loads(f.readline() or "{}")
        return list(first) if isinstance(first, dict) else None
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return None


def check_table(spec: str, target: str | None) -> None:
    """The file and the target column, before any work (one line naming what is wrong)."""
    path = table_path(spec)
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"--data {spec!r} needs the datasets package: pip install 'stratbench[ft]'")
    columns = _header(path, spec)
    if not target:
        listed = f"; its columns: {', '.join(columns)}" if columns else ""
        raise ConfigError(f"--data {spec!r} needs --target COLUMN, the column to predict{listed}")
    if columns is not None and target not in columns:
        raise ConfigError(f"--target {target!r} is not a column of {path}{did_you_mean(target, columns)}; its "
                          f"columns: {', '.join(columns)}")  # fmt: skip


def _load(path: Path, spec: str):
    """The table as a pyarrow Table, through ``datasets``."""
    datasets = importlib.import_module("datasets")
    datasets.disable_progress_bars()  # a bar per load in every cell's log says nothing
    builder = BUILDERS[path.suffix.lower()]
    extra = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **extra).data.table
    except Exception as exc:  # datasets raises many types for a malformed file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise DataError(f"--data {spec!r} could not be read: {reason}") from None


def _features(table, target: str, spec: str) -> tuple[np.ndarray, list[str]]:
    """The numeric columns other than the target, as a (rows, F) float64 array, and their names."""
    import pyarrow as pa

    names = [c for c in table.column_names if c != target]
    wrong = [c for c in names if not (pa.types.is_integer(table[c].type) or pa.types.is_floating(table[c].type)
                                       or pa.types.is_boolean(table[c].type))]  # fmt: skip
    if wrong:
        kind = table[wrong[0]].type
        kind = "text" if pa.types.is_string(kind) or pa.types.is_large_string(kind) else str(kind)
        raise DataError(f"--data {spec!r}: column {wrong[0]!r} is {kind}, not a number: drop it or encode it as "
                        "numbers first")  # fmt: skip
    if not names:
        raise DataError(f"--data {spec!r}: no feature columns besides --target {target!r}")
    x = np.stack([table[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in names], axis=1)
    if np.isnan(x).any():
        row, col = np.argwhere(np.isnan(x))[0]
        raise DataError(f"--data {spec!r}: a missing value in column {names[col]!r}, row {row + 1}")
    return x, names


def _classes(table, target: str, spec: str) -> tuple[np.ndarray, list[str]]:
    """Each row's class index and the class names (the target's distinct values, sorted)."""
    values = table[target].to_pylist()
    if any(v is None for v in values):
        raise DataError(f"--data {spec!r}: a missing value in the target column {target!r}, row "
                        f"{values.index(None) + 1}")  # fmt: skip
    distinct = sorted(set(values), key=lambda v: (str(type(v)), v))
    if len(distinct) > max(2, len(values) // 2):
        raise DataError(f"--data {spec!r}: --target {target!r} has {len(distinct)} distinct values in "
                        f"{len(values)} rows: a class per row or so, a regression target (only classification "
                        "is taken)")  # fmt: skip
    index = {v: i for i, v in enumerate(distinct)}
    return np.array([index[v] for v in values], dtype=np.int64), [str(v) for v in distinct]


def table_data(spec: str, target: str, val_fraction: float, seed: int) -> dict:
    """train, val (TensorDatasets), class names and what was read (``meta``), split by a seeded shuffle."""
    check_table(spec, target)
    path = table_path(spec)
    table = _load(path, spec)
    if target not in table.column_names:
        raise ConfigError(f"--target {target!r} is not a column of {path}{did_you_mean(target, table.column_names)}")
    x, names = _features(table, target, spec)
    y, classes = _classes(table, target, spec)
    n = len(y)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise DataError(f"--data {spec!r}: {n} rows leave none to train on after --val-fraction {val_fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    train_idx, val_idx = order[n_val:], order[:n_val]
    mean, std = x[train_idx].mean(0), x[train_idx].std(0)
    std[std == 0] = 1.0  # a constant column stays 0 rather than dividing by zero
    xs = torch.from_numpy((x - mean) / std).float()
    ys = torch.from_numpy(y)
    return {
        "train": TensorDataset(xs[train_idx], ys[train_idx]),
        "val": TensorDataset(xs[val_idx], ys[val_idx]),
        "classes": classes,
        "meta": {"table": str(path), "target": target, "features": names, "rows": n},
    }
