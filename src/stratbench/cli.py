"""``stratbench`` command line. Each module in ``stratbench.commands`` is one sub-command (NAME, HELP,
``add_arguments(parser)``, ``run(args) -> int``); this file only discovers them and turns stratbench's own
errors into one clear line and a non-zero exit."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import stratbench.commands as pkg
from stratbench import __version__
from stratbench.core import cli_help
from stratbench.core.errors import StratbenchError


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors (a bad type, a missing or unknown flag) are one line, like stratbench's own: the
    command, the message and where to look, without the usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        """A command with --help-all gets the short help by topic; others argparse's."""
        return cli_help.format_help(self, full=False) if cli_help.has_topics(self) else super().format_help()

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, with an unrecognised flag reported by the sub-command that got it, with the closest of
        its flags (Python 3.11's argparse has no suggest_on_error)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
            owner = command.choices.get(getattr(parsed, command.dest, None)) if command else None
            owner = owner or self
            owner.error(
                f"unrecognized arguments: {' '.join(extras)}{cli_help.unknown_flags_hint(owner, extras)}"
            )
        return parsed


def build_parser() -> argparse.ArgumentParser:

    parser = OneLineParser(
        prog="stratbench",
        description="Train one model under every training method and compare them side by side. "
        "Every flag is also accepted with underscores (--batch_size, --deepspeed_config).",
    )
    parser.add_argument("--version", action="version", version=f"stratbench {__version__}")
    # `deepspeed -m stratbench train ...` inserts --local_rank=N right after the module name, before the
    # sub-command; the rank is read from LOCAL_RANK, so accept and ignore it here too.
    parser.add_argument(
        "--local_rank", "--local-rank", dest="_launcher_local_rank", default=None, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules = [
        importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)
    ]
    for module in sorted(modules, key=lambda m: getattr(m, "ORDER", 50)):
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def normalise_flags(argv: list[str]) -> list[str]:
    """``--batch_size 8`` -> ``--batch-size 8``: every flag also in underscore spelling, as torchrun and
    accelerate accept (the source writes ``--deepspeed_config``). Only option names change, never values, and
    nothing after a bare ``--``."""
    out: list[str] = []
    for i, tok in enumerate(argv):
        if tok == "--":
            return out + argv[i:]
        if tok.startswith("--") and "_" in tok.partition("=")[0]:
            name, eq, value = tok.partition("=")
            tok = "--" + name[2:].replace("_", "-") + eq + value
        out.append(tok)
    return out


def say(line: str) -> None:
    """One line on stderr in one write, its newline included: print() writes the text and the newline apart, and
    a worker that torchrun stops between the two leaves the next process's log line glued to its own."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # reads the strategy registry, plug-ins included
    except StratbenchError as exc:
        say(f"stratbench: error: {exc}")
        return exc.exit_code
    args = parser.parse_args(normalise_flags(sys.argv[1:] if argv is None else list(argv)))
    try:
        return int(args._run(args) or 0)
    except StratbenchError as exc:
        say(f"stratbench {args.command}: error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        say(f"stratbench {args.command}: interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
