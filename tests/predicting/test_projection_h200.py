"""The projection against the project's own H200 runs (benchmarks/projection_h200.py): its results file holds what
the benchmark computes now, for a run's projection row and its trace diagnosis (one run: the whole file takes
~20 s), and the measured roofline is priced from the calibrate-hw profile of that GPU."""

from __future__ import annotations

import importlib
import sys

import pytest

import conftest


@pytest.fixture(scope="module")
def h200():
    folder = str(conftest.REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("projection_h200")
    finally:
        sys.path.remove(folder)


def test_a_runs_row_and_diagnosis_in_the_results_file_are_todays(h200):
    runs = h200.measured_runs()
    assert len(runs) >= 11 and all(len(r) == 2 for n, r in runs.items() if "compile" not in n and "fp32" not in n)
    on = h200.systems()
    assert on[0].gpu.roofline.measured and not on[1].gpu.roofline.measured
    name = "ho-mobilenet_v2-b256"
    text = h200.RESULTS.read_text()
    table = h200.render([h200.row(name, runs[name], on)]).splitlines()
    assert next(line for line in table if line.startswith(f"| {name} |")) in text.splitlines()
    diagnosis = h200.diagnosis_lines({name: runs[name]}, on[0])
    assert diagnosis[-1].startswith(f"| {name} |") and diagnosis[-1] in text.splitlines()
    ms, kernels = h200.kernel_ms(h200.TRACES / f"traces_{name}.json.gz")
    assert ms["batch norm"] > ms["depthwise conv"] > ms["GEMM, conv, layout"] > 0 and kernels > 500
