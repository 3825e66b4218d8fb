"""The step's phase breakdown (--breakdown) and per-rank profiler traces (--profile) on one process; every
method's 2-process run checks the breakdown on every rank (conftest.assert_breakdown_adds_up), and the unit
tests below check that the check can fail."""

from __future__ import annotations

import json
import re
import time

import pytest

from conftest import TINY, assert_breakdown_adds_up, fails, train
from stratbench.measuring.clock import PhaseClock, breakdown_report


def test_phases_add_up_and_traces_name_them(tmp_path):
    out = tmp_path / "run"
    res = train(
        out, *TINY, "--max-steps", "8", "--timing-warmup-steps", "2", "--breakdown", "true", "--profile", "2"
    )
    b = assert_breakdown_adds_up(res)
    assert set(b["share"]) == {"data", "forward", "backward", "optimizer", "other"}
    # Each phase is timed on its own: with what no span covered they make the whole step, and that part is small.
    assert abs(sum(b["share"].values()) + b["unattributed_share"] - 1) < 1e-9
    assert 0 <= b["unattributed_median_share"] < 0.02, b
    compute = sum(b["share"][p] for p in ("forward", "backward", "optimizer"))
    assert abs(b["not_compute_share"] - (1 - compute)) < 1e-12 and 0 < b["not_compute_share"] < 1
    # 8 steps: 2 of warm-up and 2 traced are kept out of the step-time statistics and of the breakdown.
    assert res["metrics"]["measured_steps"] == 4 == b["per_rank_s"][0]["measured_steps"]
    trace = json.loads((out / "traces" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"phase:data", "phase:forward", "phase:backward", "phase:optimizer", "phase:other"} <= names
    assert not list((out / "traces").rglob("*.tmp*"))
    # TensorBoard's PyTorch profiler plug-in (torch_tb_profiler) takes every folder under --logdir that holds a
    # file matching its WORKER_PATTERN (consts.py) as a run, the name before the suffix as the worker.
    pattern = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")
    found = [p for p in (out / "traces").rglob("*") if p.is_file() and pattern.match(p.name)]
    assert [p.relative_to(out / "traces").as_posix() for p in found] == ["plugins/profile/run/rank0.pt.trace.json"]
    assert pattern.match(found[0].name).group(1) == "rank0"
    assert found[0].read_bytes() == (out / "traces" / "rank0.json").read_bytes()


def test_bad_profile_value_is_refused_before_any_work(tmp_path, capsys):
    line = fails(capsys, "train", "--output", tmp_path / "x", *TINY, "--profile", "-1")
    assert "profile" in line and "-1" in line, line
    assert not (tmp_path / "x" / "result.json").exists()


def _one_step(body) -> dict:
    """A result whose breakdown is one PhaseClock step around ``body(clock)``, timed like the loop times it."""
    clock = PhaseClock(lambda: None)
    t0 = time.perf_counter()
    body(clock)
    clock.end_step(time.perf_counter() - t0, measured=True)
    return {"metrics": {"breakdown": breakdown_report([clock.summary()])}}


def _timed(clock, name: str, seconds: float) -> None:
    with clock.phase(name):
        time.sleep(seconds)


def test_the_check_fails_on_uncovered_work_and_on_spans_timed_twice():
    def covered(clock):
        for name in ("data", "forward", "backward", "optimizer", "other"):
            _timed(clock, name, 0.01)

    assert_breakdown_adds_up(_one_step(covered))

    def gap(clock):  # 20 ms of the step in no span: unattributed
        covered(clock)
        time.sleep(0.02)

    res = _one_step(gap)
    assert res["metrics"]["breakdown"]["unattributed_share"] > 0.2
    with pytest.raises(AssertionError, match="phases add up to"):
        assert_breakdown_adds_up(res)

    def nested(clock):  # a forward span inside the backward one: counted twice
        covered(clock)
        with clock.phase("backward"):
            _timed(clock, "forward", 0.02)

    res = _one_step(nested)
    assert res["metrics"]["breakdown"]["unattributed_share"] < -0.2
    with pytest.raises(AssertionError, match="phases add up to"):
        assert_breakdown_adds_up(res)

    with pytest.raises(ValueError, match="'loss'"):
        _timed(PhaseClock(lambda: None), "loss", 0)
