"""Every command of the README's "Quick tour" and "Projecting to a cluster", run as a new user runs it: the
``stratbench`` console script pip installed, from an empty folder of their own holding only the files the README
assumes (their modules, configs, data, images), in a clean environment (PATH, HOME and a locale; no PYTHONPATH, so
neither the repository nor the folder is on ``sys.path`` unless stratbench puts it there). Each line must exit 0,
or, where it needs a GPU, be refused in one line. The README tests once passed while two of these lines failed for
a user: the test runner had put the folder on ``sys.path``.

Long lines get the extra flags of ``readme_tour.FAST`` (a few steps each), printed with every failure; the
benchmark (``benchmarks/readme_tour.py``) runs them with fewer cuts and writes a report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from readme_tour import FAST, make_fixtures, plan_lines, run_line, tour_block, tour_commands  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_readme_command_works_as_written_from_a_users_folder(tmp_path):
    commands = tour_commands((REPO / "README.md").read_text())
    assert any(c.startswith("stratbench probe") for c in commands)  # the Projecting block is in
    lines = plan_lines(commands, FAST)
    env, _ = make_fixtures(tmp_path, commands, cifar=(40, 8))
    assert set(env) == {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR"}
    logs = tmp_path / "logs"
    logs.mkdir()
    bad = []
    for line in lines:
        run_line(line, tmp_path / "work", env, logs, timeout=600)
        if line.outcome != "pass" and not line.outcome.startswith("refused"):
            bad.append(f"line {line.n}: `{line.run_as}` -> {line.outcome} (exit {line.rc})\n  " + "\n  ".join(line.tail))
        if line.outcome.startswith("refused"):  # a GPU refusal is one line, no traceback
            text = (logs / f"{line.n:02d}.log").read_text()
            assert "Traceback" not in text and len(text.strip().splitlines()) <= 2, text
    assert not bad, "\n".join(bad)
    _python_section_runs(tmp_path / "work", env, logs)


def _python_section_runs(work: Path, env: dict[str, str], logs: Path) -> None:
    """The README's "From Python" block, as a script the user saved in their folder, run by the venv's python."""
    import subprocess

    lines = tour_block((REPO / "README.md").read_text(), "### From Python")
    (work / "nb.py").write_text("\n".join(lines) + "\n")
    python = str(Path(sys.executable).parent / "python")
    proc = subprocess.run([python, "nb.py"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    (logs / "python.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok" in proc.stdout and "GiB per device" in proc.stdout and "report.md" in proc.stdout
