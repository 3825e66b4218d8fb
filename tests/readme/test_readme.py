"""Every command of the README's Quick tour, of the manual's Commands block (docs/usage.md) and of every other
page's code blocks under docs/ parses with stratbench's own CLI parser (no training), so that a documented line
with a renamed or removed flag, or a flag its method does not take, fails here. tests/readme/test_readme_tour.py
runs the README's lines for real, benchmarks/readme_tour.py the manual's too (benchmarks/readme_tour_cpu_*.md)."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from readme_tour import MANUAL, MANUAL_SECTIONS, doc_commands, tour_argv, tour_commands  # noqa: E402

from stratbench.cli import build_parser, normalise_flags  # noqa: E402

TOUR = tour_commands((REPO / "README.md").read_text())
COMMANDS = tour_commands(MANUAL.read_text(), MANUAL_SECTIONS)
PAGES = sorted((REPO / "docs").glob("*.md"))
ELSEWHERE = sorted({c for page in PAGES for c in doc_commands(page.read_text())} - set(COMMANDS) - set(TOUR))
"""Complete commands on the other pages (sketches with ``...`` are left out, doc_commands)."""


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def parse(parser, argv: list[str]):
    """What ``stratbench.cli.main`` does before running a command; an argparse error becomes an assertion."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(normalise_flags(argv))
        except SystemExit as exc:
            raise AssertionError(f"stratbench {' '.join(argv)}: {err.getvalue().strip() or exc}") from None


def test_the_tour_and_the_manual_are_read_from_their_pages():
    assert 8 <= len(TOUR) <= 15  # the README's tour is short; the manual has every command
    assert len(COMMANDS) >= 30 and len(ELSEWHERE) >= 30
    for commands in (TOUR, COMMANDS, ELSEWHERE):
        assert all(c.startswith("stratbench ") and "#" not in c and "\\" not in c for c in commands)
    estimate = [c for c in TOUR if c.startswith("stratbench estimate")]
    assert estimate and "--optimizer adamw" in estimate[0]  # the continuation line is joined
    assert not any("..." in c for c in ELSEWHERE)


def test_continuation_and_comments():
    readme = "\n".join(
        [
            "## Quick tour",
            "",
            "```bash",
            "stratbench train --a 1   # a comment",
            "stratbench estimate --b 2 \\",
            "    --c '#3'          # quoted # is not a comment",
            "",
            "```",
            "```bash",
            "stratbench not-in-the-tour",
            "```",
        ]
    )
    assert tour_commands(readme, ("## Quick tour",)) == ["stratbench train --a 1", "stratbench estimate --b 2 --c '#3'"]


DOCUMENTED = [*(("tour", c) for c in TOUR), *(("manual", c) for c in COMMANDS), *(("docs", c) for c in ELSEWHERE)]


@pytest.mark.parametrize(("page", "command"), DOCUMENTED, ids=[f"{p}-{i + 1}" for i, (p, _) in enumerate(DOCUMENTED)])
def test_documented_line_parses(parser, page, command):
    from stratbench.commands.train import strategy_options_from_args
    from stratbench.core.config import TrainConfig, collect_overrides, from_dict, validate

    argv = tour_argv(command)
    args = parse(parser, argv)
    assert args.command == argv[0]
    if args.command != "train" or args.config or args.accelerate_config:
        return  # a YAML file supplies the rest (it exists only in the user's folder)
    # A method's own flag given to another method, an unknown value, a bad number: one line before any work.
    strategy = args.strategy or TrainConfig.strategy
    options = strategy_options_from_args(args, strategy)
    values = collect_overrides(args, TrainConfig)
    for name in ("weights", "init_from"):  # files on the user's machine (the torch hub cache, their checkpoint)
        values.pop(name, None)
    validate(from_dict(TrainConfig, {**values, "strategy_options": options}))


def test_a_renamed_flag_fails(parser):
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        parse(parser, ["train", "--no-such-flag", "1"])
    from stratbench.commands.train import strategy_options_from_args
    from stratbench.core.errors import ConfigError

    args = parse(parser, ["train", "--strategy", "ddp", "--zero-stage", "3"])
    with pytest.raises(ConfigError, match="--zero-stage"):
        strategy_options_from_args(args, "ddp")


def _run_folder(path: str) -> str:
    """``runs/ddp/checkpoints/last`` -> ``runs/ddp``: the folder one run writes."""
    parts = Path(path).parts
    return str(Path(*parts[:2])) if parts[:1] == ("runs",) and len(parts) > 1 else path


@pytest.mark.parametrize("commands", [TOUR, COMMANDS], ids=["tour", "manual"])
def test_what_a_line_reads_an_earlier_line_wrote(parser, commands):
    """A checkpoint a tour line reads (``--checkpoint``, ``consolidate``'s input, ``--resume``) is the output of an
    earlier line, as a new user running the tour top to bottom has it (a train line without --output writes
    runs/train, which every such line overwrites)."""
    from stratbench.core.config import TrainConfig

    written: dict[str, int] = {}  # path -> the line that wrote it
    for n, command in enumerate(commands, 1):
        args = parse(parser, tour_argv(command))
        reads, writes = [], []
        if args.command == "train":
            out = args.output or TrainConfig.output
            if args.resume:
                reads.append(out)
            writes.append(out)
        elif args.command == "consolidate":
            reads.append(args.checkpoint)
            writes.append(args.output)
        elif args.command in ("evaluate", "predict", "export", "bench-infer"):
            reads.append(args.checkpoint)
            writes.append(getattr(args, "output", None))
        elif args.command == "compare":
            writes.append(args.output)
        for path in reads:
            assert _run_folder(path) in written, (
                f"line {n} `{command}` reads {path}, which no earlier line writes"
            )
        for path in writes:
            if path:
                written[_run_folder(path)] = n


def test_tour_lines_that_share_a_file_run_in_order_and_the_others_side_by_side():
    """The test runs the tour two lines at a time (readme_tour.run_lines): a line waits for every earlier line
    touching a file or folder it names (what it reads was written as the user's would be), no two lines write one
    place at once, and a line whose files are unknown waits for all before it."""
    import readme_tour as rt

    lines = rt.plan_lines(COMMANDS, rt.FAST)
    deps = rt.dependencies(lines)

    def n(prefix: str) -> int:
        return next(ln.n for ln in lines if ln.command.startswith(prefix))

    assert n("stratbench train --strategy fsdp") in deps[n("stratbench consolidate runs/fsdp")]
    assert n("stratbench consolidate") in deps[n("stratbench evaluate --checkpoint model.pt")]
    ddp = [ln.n for ln in lines if "--output runs/ddp" in ln.command]
    assert len(ddp) == 2 and set(ddp) <= deps[n("stratbench predict --checkpoint runs/ddp")]
    assert n("stratbench compare --preset quick --output runs/quick") in deps[n("stratbench report runs/quick")]
    plain = [ln.n for ln in lines if ln.command.startswith("stratbench train") and "--output" not in ln.command]
    assert all(set(plain[:i]) <= deps[m] for i, m in enumerate(plain))  # one after another in runs/train
    assert not deps[n("stratbench estimate")] and not deps[n("stratbench compare --preset quick --calibrate")]
    late = [rt.Line(1, "stratbench list"), rt.Line(2, "cp a b"), rt.Line(3, "stratbench list")]
    assert rt.dependencies(late) == {1: set(), 2: {1}, 3: {2}}
