"""The typed records of a sweep (measuring/records.py): an old results.jsonl line still loads, a value not recorded
(null, NaN) reads as None, a field of the wrong type is refused naming it, numbers stay as written, today's records
carry the schema, and a calibration line parses or says why it cannot."""

from __future__ import annotations

import pytest

from stratbench.compare.matrix import build_matrix
from stratbench.compare.rows import is_baseline, is_baseline_run, is_comm_reference
from stratbench.compare.runner import append_record, load_run_records, make_record
from stratbench.measuring.records import (
    SCHEMA,
    CalibrationRecord,
    RecordError,
    RunRecord,
    calibration_problem,
    record_problem,
)

# A line as the first compare sweeps wrote it: no schema, label, data_parallel_size or per_device_batch_size.
OLD_LINE = {
    "id": "single_fp32_w1_b64_0", "method": "single", "precision": "fp32", "world_size": 1, "batch_size": 64,
    "status": "ok", "reason": "", "machine": {"hostname": "vm", "device": "CPU: x (2 cores)"},
    "environment": {"device_type": "cpu"}, "config": {"model": "tinynet", "batch_size": 64},
    "metrics": {"train_time_s": 2, "throughput_samples_per_s": 640.5, "peak_memory_bytes": [100, None, 300]},
}  # fmt: skip


def test_an_old_line_loads_with_defaults_and_today_s_records_carry_the_schema(tmp_path):
    rec = RunRecord.from_dict(OLD_LINE)
    assert rec.schema == 1 and rec.label == "single" and rec.name == "single" and rec.ok
    assert rec.devices == 1 and rec.global_batch == 64 and rec.per_device_batch == 64 and not rec.on_gpu
    assert rec.machine.name == "vm (CPU: x (2 cores))" and rec.model_name == "tinynet"
    assert rec.metrics.train_time_s == 2 and isinstance(
        rec.metrics.train_time_s, int
    )  # as written: the csv shows 2
    assert rec.metrics.peak_memory_bytes == [100, 300] and rec.metrics.val_accuracy is None
    assert rec.metrics.evaluations == [] and rec.repeats == {} and rec.log is None
    assert is_baseline(rec) and is_baseline_run(rec) and not is_comm_reference(rec)
    cell = build_matrix(
        {"base": {"model": "tinynet"}, "cells": [{"method": "ddp", "precision": "bf16-mixed"}]}
    ).cells[0]
    new = make_record(cell, "skipped", "not here", environment={"device_type": "cpu"})
    assert new["schema"] == SCHEMA
    append_record(tmp_path, OLD_LINE)
    append_record(tmp_path, new)
    with open(tmp_path / "results.jsonl", "a") as fh:
        fh.write('{"id": "torn", "sta')  # a sweep killed while writing its last line
    loaded = load_run_records(tmp_path)
    assert list(loaded) == [OLD_LINE["id"], cell.id]
    assert loaded[cell.id].status == "skipped" and loaded[cell.id].reason == "not here"
    assert is_comm_reference(loaded[cell.id]) and not is_baseline_run(loaded[cell.id])


def test_values_not_recorded_read_as_none():
    """null and NaN (json's diverged loss) are measures not recorded: None, a list's entry left out, a curve's gap."""
    line = {**OLD_LINE, "host_load_mean": None, "sharding": {"param_bytes": [1, None]}, "repeats": {"n": 3},
            "metrics": {"throughput_samples_per_s": None, "val_accuracy": float("nan"), "mfu": None,
                        "peak_memory_bytes": [None, 300, float("nan")], "breakdown": None, "comm": None,
                        "evaluations": [{"epoch": 1}], "loss_curve": [1.0, float("nan"), None], "peak_memory_kind": None}}  # fmt: skip
    rec = RunRecord.from_dict(line)
    m = rec.metrics
    assert m.throughput_samples_per_s is None and m.val_accuracy is None and m.mfu is None and rec.host_load_mean is None
    assert m.peak_memory_bytes == [300] and m.breakdown is None and m.comm is None and m.peak_memory_kind == ""
    assert m.evaluations == [{"epoch": 1}] and m.loss_curve[0] == 1.0 and all(x != x for x in m.loss_curve[1:])
    assert rec.sharding == {"param_bytes": [1, None]} and rec.repeats == {"n": 3} and rec.world == 1
    assert RunRecord.from_dict({**OLD_LINE, "schema": 2}).schema == 2


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"metrics": {"peak_memory_bytes": ["1", 2]}}, "metrics.peak_memory_bytes is ['1', 2], not a list of numbers >= 0"),
        ({"metrics": {"peak_memory_bytes": [-5]}}, "metrics.peak_memory_bytes is [-5], not a list of numbers >= 0"),
        ({"metrics": {"throughput_samples_per_s": "fast"}}, "metrics.throughput_samples_per_s is 'fast', not a number >= 0"),
        ({"metrics": {"mfu": True}}, "metrics.mfu is True, not a number >= 0"),
        ({"metrics": {"epoch_time_s": "x"}}, "metrics.epoch_time_s is 'x', not a list of numbers >= 0"),
        ({"metrics": {"breakdown": [1]}}, "metrics.breakdown is [1], not an object"),
        ({"metrics": {"evaluations": [{"epoch": 1}, 2]}}, "metrics.evaluations is [{'epoch': 1}, 2], not a list of objects"),
        ({"metrics": {"loss_curve": [1.0, "a"]}}, "metrics.loss_curve is [1.0, 'a'], not a list of numbers"),
        ({"metrics": "lots"}, "metrics is 'lots', not an object"),
        ({"world_size": "two"}, "world_size is 'two', not a whole number >= 0"),
        ({"world_size": 1.5}, "world_size is 1.5, not a whole number >= 0"),
        ({"host_load_mean": True}, "host_load_mean is True, not a number >= 0"),
        ({"machine": [1]}, "machine is [1], not an object"),
        ({"machine": {"hostname": 3}}, "machine.hostname is 3, not a string"),
        ({"status": 0}, "status is 0, not a string"),
        ({"sharding": {"grad_bytes": ["x"]}}, "sharding.grad_bytes is ['x'], not a list of numbers >= 0"),
        ({"mesh": {"tp": "two"}}, "mesh.tp is 'two', not a whole number >= 0"),
        ({"transforms": ["compile", 3]}, "transforms is ['compile', 3], not a list of strings"),
        ({"repeats": {"n": 3, "metrics": {"throughput_samples_per_s": "x"}}},
         "repeats.metrics.throughput_samples_per_s is 'x', not an object"),
        ({"repeats": {"n": 3, "metrics": {"final_loss": {"median": "low"}}}},
         "repeats.metrics.final_loss.median is 'low', not a number"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_refused_naming_it(change, why):
    """A value no stratbench writes is refused in one line naming the field, not shown as a number it is not (a
    list holding a string used to read as its other entries: ["1", 2] became "2 B")."""
    line = {**OLD_LINE, **change}
    if isinstance(change.get("metrics"), dict):
        line["metrics"] = {**OLD_LINE["metrics"], **change["metrics"]}
    assert record_problem(line) == why
    with pytest.raises(RecordError) as exc:
        RunRecord.from_dict(line)
    assert str(exc.value) == why and len(str(exc.value).splitlines()) == 1
    assert record_problem(["not", "a", "record"]) == "not a JSON object but ['not', 'a', 'record']"
    assert record_problem(OLD_LINE) is None


@pytest.mark.parametrize(
    "line",
    [
        {"id": "p", "status": "ok", "calibration": {"kind": "probe", "for": ["a", "b"], "nproc": 2, "threads": 1,
                                                    "what": "probe x2", "profile": "calibration/p/probe.yaml"}},
        {"id": "s", "status": "failed", "reason": "boom", "calibration": {"kind": "single", "for": ["a"]}},
        {"id": "x", "calibration": {"kind": "warm-up", "for": []}},
        {"id": "x", "calibration": {"kind": "single", "for": "a"}},
        {"id": "x", "calibration": {"kind": "probe", "for": [], "nproc": "2"}},
        {"id": "x", "calibration": "single"},
        {"calibration": {"kind": "single", "for": []}},
        "a line",
    ],
)  # fmt: skip
def test_a_calibration_line_parses_or_says_why_as_the_sweep_s_check_does(line):
    why = calibration_problem(line)
    if why:
        with pytest.raises(RecordError, match="calibration"):
            CalibrationRecord.from_dict(line)
        return
    rec = CalibrationRecord.from_dict(line)
    assert rec.kind == line["calibration"]["kind"] and rec.for_cells == line["calibration"]["for"]
    assert rec.run.id == line["id"] and rec.run.status == line["status"]
    if rec.kind == "probe":
        assert (rec.nproc, rec.threads, rec.what, rec.profile) == (
            2,
            1,
            "probe x2",
            "calibration/p/probe.yaml",
        )
    else:
        assert (rec.nproc, rec.threads, rec.profile, rec.run.reason) == (1, None, "", "boom")


def test_every_record_the_project_ships_reads():
    """The rules refuse only what no stratbench wrote: every results.jsonl, calibration.jsonl and result.json under
    benchmarks/ (written by the versions of 2026-11-22 to 26, negative import bytes included) passes them."""
    import json

    from conftest import REPO

    files = [*REPO.glob("benchmarks/**/*.jsonl"), *REPO.glob("benchmarks/**/result.json")]
    checked = 0
    for path in files:
        text = path.read_text()
        for n, line in enumerate([text] if path.suffix == ".json" else text.splitlines(), 1):
            if not line.strip():
                continue
            problem = calibration_problem if path.name == "calibration.jsonl" else record_problem
            assert problem(json.loads(line)) is None, (path, n)
            checked += 1
    assert checked > 100
