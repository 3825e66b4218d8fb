"""Help that can be read: a command's flags shown by topic, a short ``--help`` (the common flags of each topic)
and a ``--help-all`` (every flag), options that belong to one owner (a method's) shown under it, and "did you
mean" for a mistyped flag. The parser still accepts every flag; only what the help prints changes.

A command marks its flags: ``hide_in_short(action)`` for a flag only ``--help-all`` shows, ``set_owners(action,
{owner: help})`` for a flag whose meaning is its owner's (``train``'s method options, under each method). It adds
``--help-all`` (``HelpAll``) and, with owners, ``--help-method`` (``HelpOwner``); the CLI's parser formats its
``-h`` with ``format_help(parser, full=False)`` where ``--help-all`` is present."""

from __future__ import annotations

import argparse
import copy
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence

from stratbench.core.errors import did_you_mean

_SHORT = "_stratbench_hidden_in_short"
_OWNERS = "_stratbench_owners"


def hide_in_short(action: argparse.Action) -> argparse.Action:
    """Leave ``action`` out of the short ``--help`` (``--help-all`` shows it)."""
    setattr(action, _SHORT, True)
    return action


def set_owners(action: argparse.Action, helps: dict[str, str]) -> argparse.Action:
    """``action`` means what its owner says (``{owner: help}``): the full help lists it under each owner."""
    setattr(action, _OWNERS, dict(helps))
    return action


def owners_of(action: argparse.Action) -> dict[str, str]:
    return getattr(action, _OWNERS, {})


def has_topics(parser: argparse.ArgumentParser) -> bool:
    """Whether ``parser`` has a ``--help-all`` (then ``-h`` is the short, topic help)."""
    return any(isinstance(a, HelpAll) for a in parser._actions)


def _shown(actions: Iterable[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help is not argparse.SUPPRESS]


def _usage(parser: argparse.ArgumentParser) -> str:
    """A one-line usage: the help flags and OPTION ... (the full list of 100+ flags is what --help-all is for)."""
    parts = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, HelpAll, HelpOwner)):
            parts.append(a.option_strings[0] + (f" {a.metavar}" if a.nargs != 0 else ""))
    positionals = [a.metavar or a.dest for a in _shown(parser._actions) if not a.option_strings]
    return f"%(prog)s [{' | '.join(parts)}] [OPTION ...] {' '.join(positionals)}".rstrip()


class Formatter(argparse.HelpFormatter):
    """argparse's, without breaking lines at hyphens: `synthetic-tokens` and `--data-dir` stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in self._split_lines(text, width - len(indent)))


def format_help(parser: argparse.ArgumentParser, *, full: bool) -> str:
    """The help by topic (each argument group): every flag (``full``) or those not hidden in the short help, a
    group's owned flags under each owner (``full``) or named by a line (short)."""
    fmt = Formatter(parser.prog)
    fmt.add_usage(_usage(parser), [], [])
    fmt.add_text(parser.description)
    helper = _owner_helper(parser)
    for group in parser._action_groups:
        actions = _shown(group._group_actions)
        plain = [a for a in actions if not owners_of(a)]
        owned = [a for a in actions if owners_of(a)]
        brief = plain if full else [a for a in plain if not getattr(a, _SHORT, False)]
        if not brief and not owned:
            continue
        fmt.start_section(group.title)
        fmt.add_text(group.description)
        fmt.add_arguments(brief)
        if full:
            for owner in sorted({o for a in owned for o in owners_of(a)}):
                _owner_section(fmt, parser, owner)
        tail = [f"... and {len(plain) - len(brief)} more (--help-all)"] if len(brief) < len(plain) else []
        if owned and helper and not full:
            tail.append(f"each {helper.what}'s own options: {helper.option_strings[0]} {helper.metavar}")
        fmt.add_text("; ".join(tail) or None)
        fmt.end_section()
    one = (
        f"`{parser.prog} {helper.option_strings[0]} {helper.example}` shows one {helper.what}'s options"
        if helper
        else ""
    )
    if not full:
        fmt.add_text(f"`{parser.prog} --help-all` shows every flag" + (f"; {one}." if one else "."))
    elif one:
        fmt.add_text(f"{one}.")
    return fmt.format_help()


def _owner_helper(parser: argparse.ArgumentParser) -> HelpOwner | None:
    return next((a for a in parser._actions if isinstance(a, HelpOwner)), None)


def _owner_section(fmt: argparse.HelpFormatter, parser: argparse.ArgumentParser, owner: str) -> None:
    """One owner's flags, each with the owner's own help (a flag several owners share reads as each means it)."""
    helper = _owner_helper(parser)
    mine = []
    for a in _shown(parser._actions):
        text = owners_of(a).get(owner)
        if text is not None:
            shown = copy.copy(a)
            shown.help = text
            mine.append(shown)
    fmt.start_section(f"with {helper.owner_flag} {owner}" if helper else owner)
    fmt.add_arguments(mine)
    if not mine:
        fmt.add_text(f"{owner} has no options of its own.")
    fmt.end_section()


def format_owner(parser: argparse.ArgumentParser, owner: str, description: str) -> str:
    """One owner's flags (``--help-method fsdp``), after a line saying what the owner is."""
    fmt = Formatter(parser.prog)
    fmt.add_text(description)
    _owner_section(fmt, parser, owner)
    return fmt.format_help()


class HelpAll(argparse.Action):
    """``--help-all``: every flag, by topic, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        kwargs.setdefault("help", "show every flag, by topic, and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        sys.stdout.write(format_help(parser, full=True))
        parser.exit()


class HelpOwner(argparse.Action):
    """``--help-method NAME``: one owner's flags (with ``describe(name)`` first), then exit; a name that is not
    an owner is one line with the closest names."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        *,
        names: Callable[[], Iterable[str]],
        describe: Callable[[str], str],
        owner_flag: str,
        example: str,
        **kwargs,
    ) -> None:
        super().__init__(option_strings, dest, nargs=None, default=argparse.SUPPRESS, **kwargs)
        self.names, self.describe, self.owner_flag, self.example = names, describe, owner_flag, example
        self.what = (self.metavar or "name").lower()

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        names = sorted(self.names())
        if values not in names:
            parser.error(
                f"{option_string}: unknown {self.what} {values!r}{did_you_mean(values, names)}; "
                f"choose one of: {', '.join(names)}"
            )
        sys.stdout.write(format_owner(parser, values, self.describe(values)))
        parser.exit()


def unknown_flags_hint(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """ " (did you mean '--x'?)" for the unrecognised flags among ``extras`` that are close to one ``parser``
    takes; with several, each named: " (--a: did you mean '--x'?; --b: ...)". '' where none is close."""
    known = [s for a in _shown(parser._actions) for s in a.option_strings if s.startswith("--")]
    flags = [tok.partition("=")[0] for tok in extras if tok.startswith("--")]
    hints = [(f, did_you_mean(f, known)) for f in flags]
    hints = [(f, h) for f, h in hints if h]
    if len(flags) == 1 and hints:
        return hints[0][1]
    return " (" + "; ".join(f"{f}: {h.strip(' ()')}" for f, h in hints) + ")" if hints else ""
