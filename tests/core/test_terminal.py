"""Output for an 80-120 column terminal or a CI log: tables that fit the width with every method name whole, and
training progress as plain lines (no carriage returns) where stderr is not a terminal."""

from __future__ import annotations

import io
import json
import re

import pytest

from conftest import TINY, run_stratbench
from stratbench.cli import main
from stratbench.strategies.base import all_strategies

TINY_MODEL = ["--model", "tinynet", "--image-size", "32", "--num-classes", "10", "--batch-size", "32"]
COMMANDS = {
    "list": ["list", "--check"],
    "estimate": ["estimate", *TINY_MODEL, "--strategy", "all", "--world-size", "4", "--device-memory", "4GiB"],
    "max-batch": ["estimate", *TINY_MODEL, "--strategy", "all", "--world-size", "4", "--max-batch",
                  "--device-memory", "600MiB"],
    "time": ["estimate", *TINY_MODEL, "--strategy", "all", "--gpus-per-node", "4", "--time"],
}  # fmt: skip


def _output(capsys, argv: list[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _assert_names_whole(text: str) -> None:
    """Every registered method appears as a whole word (not "deep…", not folded over two lines)."""
    assert "…" not in text
    for name in all_strategies():
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} not whole in:\n{text}"


@pytest.mark.parametrize("columns", ["80", "100", "120", None])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_tables_fit_the_width_with_names_whole(capsys, monkeypatch, command, columns):
    """stdout is not a terminal here (captured), as in a pipe or a CI log: COLUMNS if set, else 120."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    out = _output(capsys, COMMANDS[command])
    width = int(columns or 120)
    longest = max(out.splitlines(), key=len)
    assert len(longest) <= width, f"{len(longest)} > {width} columns:\n{out}"
    _assert_names_whole(out)
    assert "--wide" in out  # says how to see every column


def test_wide_shows_every_column(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _output(capsys, [*COMMANDS["estimate"], "--wide"])
    for header in ("params", "grads", "optimizer", "master", "buckets", "gathered", "fwd/bwd working",
                   "peak allocated", "total per device"):  # fmt: skip
        assert header in out, header
    assert max(map(len, out.splitlines())) > 80  # wider than the terminal, on purpose
    _assert_names_whole(out)
    out = _output(capsys, [*COMMANDS["time"], "--wide"])
    for header in ("speed-up", "compute", "comm (exposed)", "offload", "dominant", "memory/device"):
        assert header in out, header
    out = _output(capsys, ["list", "--wide"])
    for header in ("needs", "launcher", "options", "--zero-stage"):
        assert header in out, header


def test_json_is_the_same_with_wide(capsys):
    args = ["estimate", *TINY_MODEL, "--strategy", "all", "--world-size", "2", "--json"]
    assert json.loads(_output(capsys, args)) == json.loads(_output(capsys, [*args, "--wide"]))


def test_a_row_without_numbers_is_its_name_and_the_reason(capsys, monkeypatch):
    """An n/a row (a method whose estimate or projection cannot be made) is the method's name with "n/a (k)"
    under it and the reason in note k under the table: no column grows for it, the table still fits, and a long
    reason is not wrapped 13 lines deep in the method column."""
    from rich.console import Console

    from stratbench.commands.estimate import MEMORY_DROP, memory_table
    from stratbench.core.tables import fit_table

    results = json.loads(_output(capsys, [*COMMANDS["estimate"][:-2], "--json"]))["results"]
    why = "the model has fewer blocks than the 4 pipeline stages asked for; use --pp 2 or a deeper model"
    results.append({"strategy": "pipeline", "estimate": None, "na": why})
    for width in (80, 100, 120):
        console = Console(width=width, file=io.StringIO())
        table, _ = fit_table(console, lambda drop: memory_table(results, "tinynet", 4 << 30, False, 4, False, drop),
                             MEMORY_DROP)  # fmt: skip
        console.print(table)
        out = console.file.getvalue()
        assert max(map(len, out.splitlines())) <= width, out
        _assert_names_whole(out)
        said = " ".join(out.split())  # the note wraps at the table's width
        assert "(2) pipeline: n/a: the model has fewer blocks than the 4 pipeline stages" in said, out
        assert "deeper model" in said and said.count("n/a: the model has") == 1 and "│ n/a (2)" in out, out


# ---- progress on a terminal and off it -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_line_progress_every_tenth_or_every_10_s_and_the_last_step():
    from stratbench.core.progress import LineProgress

    out, clock = io.StringIO(), Clock()
    bar = LineProgress(total=100, initial=0, desc="ddp/fp32", stream=out, clock=clock)
    for step in range(1, 101):
        clock.t += 0.5 if step != 33 else 11.0  # step 33 comes after a 10 s gap: a line of its own
        bar.set_postfix({"loss": f"{1 / step:.4f}"}, refresh=False)
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    steps = [int(re.search(r"step (\d+)/100", ln).group(1)) for ln in lines]
    assert steps == [10, 20, 30, 33, 43, 53, 63, 73, 83, 93, 100], lines
    assert lines[-1].startswith("train ddp/fp32: step 100/100 (100%), loss 0.0100, ") and "eta 0s" in lines[-1]
    assert "\r" not in out.getvalue()


def test_line_progress_ends_with_the_step_it_stopped_at():
    """A run that stops before ``total`` (its epochs end first) still ends with a line for its last step."""
    from stratbench.core.progress import LineProgress, fmt_eta

    out, clock = io.StringIO(), Clock()
    bar = LineProgress(total=50, initial=20, desc="single/fp32", stream=out, clock=clock)  # resumed at 20
    for _ in range(7):
        clock.t += 1.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [re.search(r"step (\d+)/50", ln).group(1) for ln in lines] == ["25", "27"]
    assert "1 step/s, eta 23s" in lines[-1]  # the rate counts this run's steps, not the resumed ones
    assert (fmt_eta(45), fmt_eta(87), fmt_eta(7380)) == ("45s", "1m27s", "2h03m")


def test_progress_bar_is_tqdm_only_on_a_terminal():
    from stratbench.core.progress import LineProgress, NullProgress, progress_bar

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_bar(False, 10, 0, "x", Tty()), NullProgress)
    assert isinstance(progress_bar(True, 10, 0, "x", io.StringIO()), LineProgress)
    bar = progress_bar(True, 10, 0, "x", Tty())
    assert type(bar).__module__.startswith("tqdm")
    bar.close()


def test_training_progress_on_a_pipe_is_plain_lines():
    """`stratbench train --progress true` with stderr to a pipe (a CI log): several whole lines with rising step
    numbers, ending with the last step, and no carriage return."""
    args = list(TINY)
    args[args.index("--progress") + 1] = "true"
    args[args.index("--max-steps") + 1] = "10"
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        proc = run_stratbench("train", "--output", out, *args, timeout=120)
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    steps = [int(m) for m in re.findall(r"^train single/fp32: step (\d+)/10 \(\d+%\), .*step/s, eta ", proc.stderr,
                                        re.MULTILINE)]  # fmt: skip
    assert len(steps) >= 3 and steps == sorted(set(steps)) and steps[-1] == 10, proc.stderr
