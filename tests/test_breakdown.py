"""The step's phase breakdown (--breakdown) and per-rank profiler traces (--profile) on one process; the
2-process runs of test_ddp check the breakdown on every rank (conftest.assert_breakdown_adds_up)."""

from __future__ import annotations

import json

from conftest import TINY, assert_breakdown_adds_up, run_stratbench, train


def test_phases_add_up_and_traces_name_them(tmp_path):
    out = tmp_path / "run"
    res = train(
        out, *TINY, "--max-steps", "8", "--timing-warmup-steps", "2", "--breakdown", "true", "--profile", "2"
    )
    b = assert_breakdown_adds_up(res)
    assert set(b["share"]) == {"data", "forward", "backward", "optimizer", "other"}
    assert abs(sum(b["share"].values()) - 1) < 1e-9
    assert 0 <= b["not_compute_share"] < 1
    # 8 steps: 2 of warm-up and 2 traced are kept out of the step-time statistics and of the breakdown.
    assert res["metrics"]["measured_steps"] == 4 == b["per_rank_s"][0]["measured_steps"]
    trace = json.loads((out / "traces" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"phase:data", "phase:forward", "phase:backward", "phase:optimizer"} <= names
    assert not list((out / "traces").glob("*.tmp*"))


def test_bad_profile_value_is_refused_before_any_work(tmp_path):
    proc = run_stratbench(
        "train", "--output", str(tmp_path / "x"), *TINY, "--profile", "-1", check=False, timeout=60
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "profile" in err[0] and "-1" in err[0], proc.stderr
    assert not (tmp_path / "x" / "result.json").exists()
