"""Every command of the README's "Quick tour" and "Projecting to a cluster", then its "From Python" block, run as
a new user runs them: the ``stratbench`` console script pip installed (and the venv's ``python``), from an empty
folder of their own holding only the files the README assumes (their modules, configs, data, images), in a clean
environment (PATH, HOME and a locale; no PYTHONPATH, so neither the repository nor the folder is on ``sys.path``
unless stratbench puts it there). Each line must exit 0, or, where it needs a GPU, be refused in one line. The
README tests once passed while two of these lines failed for a user: the test runner had put the folder on
``sys.path``.

Long lines get the extra flags of ``readme_tour.FAST`` (a few steps each), shown with every failure; the
benchmark (``benchmarks/readme_tour.py``) runs them with fewer cuts and writes a report. The tour runs in the
background from the start of the session (tests/conftest.py), and this test waits for it."""

from __future__ import annotations

import pytest

from conftest import start_readme_tour


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_every_readme_command_works_as_written_from_a_users_folder():
    tour = start_readme_tour()
    tour.join(timeout=2000)
    assert not tour.is_alive(), "the README tour did not finish within 2000 s"
    assert tour.error is None, tour.error
    assert set(tour.env) == {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR"}
    assert any(line.command.startswith("stratbench probe") for line in tour.lines)  # the Projecting block is in
    assert tour.lines[-1].command == "python nb.py"  # the From Python block is in
    bad = [
        f"line {line.n}: `{line.run_as}` -> {line.outcome} (exit {line.rc})\n  " + "\n  ".join(line.tail)
        for line in tour.lines
        if line.outcome != "pass" and not line.outcome.startswith("refused")
    ]
    assert not bad, "\n".join(bad)
    python = (tour.logs / f"{tour.lines[-1].n:02d}.log").read_text()
    assert "ok" in python and "GiB per device" in python and "report.md" in python, python[-3000:]
    for line in tour.lines:
        if line.outcome.startswith("refused"):  # a GPU refusal is one line, no traceback
            text = (tour.logs / f"{line.n:02d}.log").read_text()
            assert "Traceback" not in text and len(text.strip().splitlines()) <= 2, text
