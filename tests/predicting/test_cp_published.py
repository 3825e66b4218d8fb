"""The long-context check against torchtitan's CP table (benchmarks/cp_published.py, issue 46 item 5): the ring's
bytes by hand for one row, and the committed results file holds what the projection gives today (the calibration,
every published row's projected and baseline numbers and the summary lines; the memory estimates, ~2 minutes of
tracing, are left to the script). Meta device and arithmetic only: no training."""

from __future__ import annotations

import importlib
import sys

import pytest

import conftest
from stratbench.measuring.hardware import resolve

RESULTS = conftest.REPO / "benchmarks" / "cp_published_2026-11-28.md"
GIB = 2**30


@pytest.fixture(scope="module")
def cp_published():
    folder = str(conftest.REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("cp_published")
    finally:
        sys.path.remove(folder)


def test_ring_bytes_of_the_262k_row_by_hand(cp_published):
    """262,144 tokens, CP 8, 32 layers, 8 KV heads x 128, bf16 K and V, fp32 dK and dV: K and V of the whole
    sequence are 1 GiB per layer, so 32 GiB gathered in forward, 64 GiB in backward (the recomputed forward's and
    backward's own), and 8 passes of a rank's 1/8 of dK, dV in fp32 per layer: 64 GiB."""
    fwd, bwd, dkv = cp_published.ring_rows(262_144, 8)
    assert (fwd.kind, fwd.payload_bytes, fwd.calls, fwd.phase) == ("all_gather", 32 * GIB, 32, "forward")
    assert (bwd.kind, bwd.payload_bytes, bwd.calls, bwd.phase) == ("all_gather", 64 * GIB, 64, "backward")
    assert (dkv.kind, dkv.payload_bytes, dkv.calls, dkv.group_size) == ("send_recv", 64 * GIB, 256, 8)
    assert cp_published.ring_rows(262_144, 8, ac=False)[1].payload_bytes == 32 * GIB


def test_the_committed_results_are_what_the_projection_gives(cp_published):
    system = resolve("h100-sxm")
    cal, plain = cp_published.calibrated(system), cp_published.calibrated(system, float8=False)
    preds = cp_published.predict_rows(system, cal, plain, memory=False)
    assert preds[0].projected == pytest.approx(cp_published.ANCHOR.tps, rel=1e-6)  # calibrated on it
    assert preds[0].bf16_only == pytest.approx(cp_published.ANCHOR.tps, rel=1e-6)
    text = RESULTS.read_text()
    lines = text.splitlines()
    assert f"Calibration: one bf16 efficiency, {cal.efficiency:.2%} of" in text
    for x in preds:
        # the committed line is this one with the memory estimate and its error in place of "-"
        expected = cp_published.table_line(x).removesuffix(" - |")
        assert any(line.startswith(expected) for line in lines), expected
        assert f"    {x.row.quoted}" in lines
    for line in cp_published.summary(preds) + cp_published.reading(preds):
        assert f"- {line}" in lines, line
