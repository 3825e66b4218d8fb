"""Help that can be read: `train --help` is short and by topic, `--help-all` lists every flag the parser takes,
`--help-method` one method's options, every --data form, method and precision is named, and a mistyped name or
flag gets one line with the closest ones. In process: argparse's help and errors exit through SystemExit."""

from __future__ import annotations

import argparse
import re

import pytest

from conftest import fails
from stratbench.cli import build_parser, main
from stratbench.core.config import HELP_TOPICS, TrainConfig, help_topic
from stratbench.core.precision import SPECS
from stratbench.data.datasets import DATASETS
from stratbench.data.instruct import FT_SOURCES
from stratbench.data.text import TEXT_SOURCES
from stratbench.strategies.base import all_strategies

DATA_FORMS = (*DATASETS, *TEXT_SOURCES, *FT_SOURCES, "package.module:function")


def help_of(capsys, *argv: str) -> str:
    """What ``stratbench ARGV`` prints on stdout before it exits 0."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


def flat(text: str) -> str:
    return " ".join(text.split())


def names(text: str, name: str) -> bool:
    """Whether ``name`` stands in ``text`` as a word of its own (``--lr`` is not in ``--lr-schedule``)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def command_parser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_short_help_is_short_by_topic_and_points_to_the_rest(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    out = help_of(capsys, "train", "--help")
    assert len(out.splitlines()) < 150, len(out.splitlines())
    assert "--help-all" in out and "--help-method fsdp" in out
    for topic in HELP_TOPICS:
        assert f"\n{topic}:\n" in out, topic
    assert not names(out, "--zero-stage") and not names(out, "--mlflow-experiment")  # only --help-all's


@pytest.mark.parametrize("command", ["train", "estimate"])
def test_help_all_lists_every_flag_the_parser_takes(capsys, command):
    out = help_of(capsys, command, "--help-all")
    flags = {
        s
        for a in command_parser(command)._actions
        if a.help is not argparse.SUPPRESS
        for s in a.option_strings
    }
    assert len(flags) > 40
    assert not [f for f in sorted(flags) if not names(out, f)]
    if command == "train":
        for topic in HELP_TOPICS:
            assert f"\n{topic}:\n" in out, topic


def test_every_config_field_has_a_topic():
    untopical = [
        f
        for f in TrainConfig.__dataclass_fields__
        if f != "strategy_options" and help_topic(f) not in HELP_TOPICS
    ]
    assert not untopical, f"add these TrainConfig fields to core.config.HELP_TOPICS: {untopical}"


def test_every_data_form_method_and_precision_is_named(capsys):
    out = flat(help_of(capsys, "train", "--help"))
    data = out[out.index("--data DATA") : out.index("--data-dir DATA_DIR")]
    assert not [form for form in DATA_FORMS if form not in data]
    strategy = out[out.index("--strategy STRATEGY") :]
    assert not [m for m in all_strategies() if not names(strategy, m)]
    precision = out[out.index("--precision PRECISION") :]
    assert not [p for p in SPECS if not names(precision, p)]


def test_help_method_shows_that_methods_options(capsys):
    out = help_of(capsys, "train", "--help-method", "fsdp")
    assert "--strategy fsdp" in out and names(out, "--sharding") and names(out, "--replicate")
    assert not names(out, "--zero-stage") and not names(out, "--bucket-cap-mb")  # deepspeed's, ddp's


@pytest.mark.parametrize(
    ("flag", "typo", "meant"),
    [
        ("--strategy", "fdsp", "fsdp"),
        ("--precision", "bf16-mixd", "bf16-mixed"),
        ("--data", "cifr10", "cifar10"),
    ],
)
def test_a_mistyped_name_gets_the_closest(capsys, tmp_path, flag, typo, meant):
    err = fails(capsys, "train", "--output", str(tmp_path / "run"), flag, typo)
    assert f"(did you mean '{meant}'" in err and repr(typo) in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["train", "--batchsize", "8"], "'--batch-size'"),
        (["train", "--strategi=ddp"], "'--strategy'"),
        (["train", "--help-method", "fdsp"], "'fsdp'"),
    ],
)
def test_a_mistyped_flag_gets_the_closest(capsys, argv, meant):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("stratbench train: error:") and f"did you mean {meant}" in err, err
