"""Every command of the README's "Quick tour", then its "From Python" block, run as a new user runs them: the
``stratbench`` console script pip installed (and the venv's ``python``), from an empty folder of their own holding
only the files the README assumes (their modules and data), in a clean environment (PATH, HOME and a locale; no
PYTHONPATH, so neither the repository nor the folder is on ``sys.path`` unless stratbench puts it there), two lines
at a time where they share no file (a line that reads what another writes waits for it). Each line must exit 0,
or, where it needs a GPU, be refused in one line. The README tests once passed while two of these lines failed for
a user: the test runner had put the folder on ``sys.path``.

The manual's Commands block (docs/usage.md) is parsed and validated line by line in tests/readme/test_readme.py;
two of its lines whose work no other test runs from a user's folder run here too (``MANUAL_LINES``: ``compare
--repeats`` and ``compare --calibrate``, whose calibration runs ``stratbench probe`` first), and what they write is
checked. The manual's other lines are
the end-to-end tests of their own features (2D/3D: tests/strategies/test_fsdp_tp.py and test_pipeline_tp.py; Ray
and SLURM: tests/compare/; the presets: tests/compare/).

Long lines get the extra flags of ``readme_tour.FAST`` (a few steps each; the From Python block ``PYTHON_FAST``),
shown with every failure; the benchmark (``benchmarks/readme_tour.py``, ``--doc docs/usage.md`` for the manual)
runs them with fewer cuts and writes a report."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from conftest import REPO
from stratbench.compare.calibration import CALIBRATION
from stratbench.compare.runner import load_records
from stratbench.measuring import hardware

sys.path.insert(0, str(REPO / "benchmarks"))

from readme_tour import MANUAL, Tour, flag_value, tour_argv  # noqa: E402

MANUAL_LINES = ("stratbench compare --preset quick --repeats", "stratbench compare --preset quick --calibrate")
"""The manual's lines this file runs (the module docstring says why these)."""


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> Tour:
    t = Tour(tmp_path_factory.mktemp("readme-tour"))
    t.run()
    return t


@pytest.fixture(scope="module")
def manual(tmp_path_factory) -> Tour:
    t = Tour(tmp_path_factory.mktemp("manual-lines"), MANUAL, only=MANUAL_LINES)
    assert len(t.lines) == len(MANUAL_LINES), [ln.command for ln in t.lines]  # each is still in the manual
    t.run()
    return t


def _failures(tour: Tour) -> list[str]:
    bad = [
        f"line {line.n}: `{line.run_as}` -> {line.outcome} (exit {line.rc})\n  " + "\n  ".join(line.tail)
        for line in tour.lines
        if line.outcome != "pass" and not line.outcome.startswith("refused")
    ]
    for line in tour.lines:
        if line.outcome.startswith("refused"):  # a GPU refusal is one line, no traceback
            text = (tour.logs / f"{line.n:02d}.log").read_text()
            assert "Traceback" not in text and len(text.strip().splitlines()) <= 2, text
    return bad


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_every_readme_command_works_as_written_from_a_users_folder(tour):
    # one thread per line (Tour.run: two lines at once on 2 cores)
    assert set(tour.env) == {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS"}
    assert tour.lines[-1].command == "python nb.py"  # the From Python block is in
    bad = _failures(tour)
    assert not bad, "\n".join(bad)
    python = (tour.logs / f"{tour.lines[-1].n:02d}.log").read_text()
    assert "ok" in python and "GiB per device" in python and "report.md" in python, python[-3000:]


def _line(tour: Tour, command: str):
    return next(ln for ln in tour.lines if ln.command.startswith(command))


def _written_by(tour: Tour, command: str, flag: str) -> Path:
    line = _line(tour, command)
    assert line.outcome == "pass", f"`{line.run_as}`: {line.outcome}"
    return tour.work / flag_value(tour_argv(line.run_as), flag)


@pytest.mark.slow
def test_the_probe_profile_loads_with_every_kind_fitted_and_loaded(manual):
    """`stratbench probe --nproc 2` on gloo, as `compare --calibrate` runs it first (the manual's `probe` line is
    parsed in test_readme.py): every kind fitted, the loaded latency measured for each (a call after a compute
    burst costs at least the idle call), the profile usable by --hardware."""
    assert not _failures(manual), _failures(manual)
    out = _written_by(manual, "stratbench compare --preset quick --calibrate", "--output")
    probe = next(r for r in load_records(out, CALIBRATION).values() if r["calibration"]["kind"] == "probe")
    system = hardware.resolve(str(out / probe["calibration"]["profile"]))
    assert set(system.intra_node.collectives) >= {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    for kind, fit in system.intra_node.collectives.items():
        assert fit.loaded_latency is not None and fit.loaded_latency >= fit.latency > 0, kind


@pytest.mark.slow
def test_compare_repeats_records_every_run_and_reports_their_median(manual):
    """`compare --repeats 3` (one cell, single fp32, 3 steps, 3 times): each repeat announced, the record holds
    the 3 runs' values and the report their median and spread."""
    command = "stratbench compare --preset quick --repeats 3"
    out = _written_by(manual, command, "--output")
    (rec,) = load_records(out).values()
    assert rec["status"] == "ok" and rec["repeats"]["n"] == 3
    # 3 steps, all warm-up: no throughput, but each run's time
    assert len(rec["repeats"]["metrics"]["train_time_s"]["values"]) == 3
    assert "repeat 3/3" in (manual.logs / f"{_line(manual, command).n:02d}.log").read_text()
    assert "median of 3 runs" in (out / "report.md").read_text()


@pytest.mark.slow
def test_compare_calibrate_predicts_the_ddp_row_from_its_calibration(manual):
    """`compare --calibrate` (the ddp fp32 cell, 2 processes, 6 steps): the probe, single at both batches and ddp
    on one process ran before the cell, all ok, and the report's ddp row is predicted from them."""
    out = _written_by(manual, "stratbench compare --preset quick --calibrate", "--output")
    cal = load_records(out, CALIBRATION)
    assert sorted(r["calibration"]["kind"] for r in cal.values()) == ["method", "probe", "single", "single"]
    assert all(r["status"] == "ok" for r in cal.values()), {k: r["reason"] for k, r in cal.items()}
    rows = {r["method"]: r for r in csv.DictReader((out / "report.csv").open())}
    assert float(rows["ddp"]["predicted_step_s"]) > 0 and "ddp: " in rows["ddp"]["predicted_step_basis"]


@pytest.mark.slow
def test_compare_on_the_user_s_own_model_and_data_without_a_preset(tour):
    """The tour's `compare --model mynet:build --data mydata:build --methods single,ddp,fsdp,deepspeed`: a plain
    CNN with no repeated blocks (fsdp's default --wrap auto wraps it by size and says so in the cell's log), every
    cell ok, the report titled with the user's model and its Setup line saying what ran; the memory estimate
    traces the user's 12 x 12 images of 2 classes (not a default 32 x 32 of 10: the column was n/a)."""
    out = _written_by(tour, "stratbench compare --model mynet:build", "--output")
    records = load_records(out).values()
    assert sorted((r["method"], r["status"]) for r in records) == [
        ("ddp", "ok"), ("deepspeed", "ok"), ("fsdp", "ok"), ("single", "ok")]  # fmt: skip
    report = (out / "report.md").read_text()
    assert report.startswith("# stratbench compare: mynet:build\n"), report[:200]
    assert "mynet:build on mydata:build, 2 epochs, global batch 64; single, ddp, fsdp, deepspeed at fp32" in report
    fsdp_log = next(out.glob("cells/fsdp_*/train.log")).read_text()
    assert "FSDP units: the root only, the whole model in one unit (--wrap auto: Sequential declares no" in fsdp_log
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert all(row["predicted_peak_bytes"] not in ("", "n/a") for row in rows), rows
