"""stratbench train: one run of one method; starts its own processes through torchrun when --nproc > 1."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from stratbench.checkpoints import checkpoint as ckpt
from stratbench.core.cli_help import HelpAll, HelpOwner, hide_in_short, set_owners
from stratbench.core.config import (
    HELP_TOPICS,
    SHORT_HELP_FIELDS,
    TrainConfig,
    add_dataclass_arguments,
    base_type,
    collect_overrides,
    field_docs,
    from_dict,
    help_topic,
    load_yaml,
)
from stratbench.core.dist import die_with_parent, launched_by_launcher, read_env
from stratbench.core.errors import ConfigError, StratbenchError
from stratbench.core.tables import print_result
from stratbench.launching.executors import add_executor_arguments, executor_options, make_executor
from stratbench.launching.job import run_job, run_job_on
from stratbench.launching.launch import setup_error_recorded
from stratbench.strategies.base import all_strategies, get_strategy, iter_option_fields
from stratbench.strategies.parallel.accelerate_config import read_accelerate_config

NAME = "train"
HELP = "train one model with one method and precision; writes OUTPUT/result.json"
ORDER = 10
_OPT_PREFIX = "strategy_opt__"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE, --accelerate-config FILE, one flag per TrainConfig field and one per strategy option, in
    help topics (HELP_TOPICS: an argument group each); the short --help shows SHORT_HELP_FIELDS' flags."""
    groups = {topic: parser.add_argument_group(topic) for topic in HELP_TOPICS}

    def group_of(name: str):
        topic = help_topic(name)
        if topic not in groups:
            groups[topic] = parser.add_argument_group(topic)
        return groups[topic]

    groups["run, output & checkpoints"].add_argument(
        "--config", help="YAML file of options; flags given on the command line override it"
    )
    add_dataclass_arguments(parser, TrainConfig, group_of=group_of)
    method = groups["method & its options"]
    hide_in_short(method.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="an accelerate YAML (what `accelerate config` writes, e.g. the source's default_FSDP.yml): its method, "
        "precision, processes and plugin knobs; flags given on the command line override it",
    ))  # fmt: skip
    for action in parser._actions:
        if action.dest in TrainConfig.__dataclass_fields__ and action.dest not in SHORT_HELP_FIELDS:
            hide_in_short(action)
        if action.dest == "strategy":
            action.help = (
                f"Training method: {', '.join(sorted(all_strategies()))} (`stratbench list` says what each is; "
                f"--help-method METHOD shows its options). (default: {TrainConfig.strategy})"
            )
    add_strategy_option_arguments(parser, method)
    # The deepspeed launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead.
    parser.add_argument(
        "--local_rank", "--local-rank", dest="_local_rank", default=None, help=argparse.SUPPRESS
    )


def add_help_arguments(parser: argparse.ArgumentParser) -> None:
    """--help-all (every flag, by topic) and --help-method METHOD (one method's options). One flag on the
    command that takes the options, rather than a `stratbench methods` command beside `stratbench list`: the
    options are train's (and estimate's) flags, and their help belongs with the parser that reads them."""
    parser.add_argument("--help-all", action=HelpAll)
    parser.add_argument(
        "--help-method",
        action=HelpOwner,
        metavar="METHOD",
        names=all_strategies,
        describe=lambda name: f"--strategy {name}: {all_strategies()[name].description}",
        owner_flag="--strategy",
        example="fsdp",
        help="show one method's own options (e.g. --help-method fsdp) and exit",
    )


def add_strategy_option_arguments(parser: argparse.ArgumentParser, group=None) -> None:
    """One flag per strategy option field (from every registered strategy's ``Options``), in ``group`` (default:
    a group of its own); a field two strategies share gets one flag, shown under each method with that method's
    description (the help's owners) and, in a plain parser's help, with every method's."""

    if group is None:
        group = parser.add_argument_group("method options")
    fields: dict[str, dataclasses.Field] = {}
    docs: dict[str, dict[str, list[str]]] = {}  # field -> its description -> the strategies that give it
    for cls, f in iter_option_fields():
        fields.setdefault(f.name, f)
        doc = field_docs(cls.Options).get(f.name, "")
        docs.setdefault(f.name, {}).setdefault(doc, []).append(cls.name)
    for name, f in sorted(fields.items()):
        flag = "--" + name.replace("_", "-")
        # owners by name, so the help does not follow which method file happens to import which
        by_owner = sorted(docs[name].items(), key=lambda item: sorted(item[1]))
        help_text = " ".join(f"[{', '.join(sorted(owners))}] {doc}" for doc, owners in by_owner).replace("%", "%%")
        if base_type(f.type) is bool:
            action = group.add_argument(
                flag,
                dest=_OPT_PREFIX + name,
                nargs="?",
                const="true",
                default=None,
                metavar="BOOL",
                help=help_text,
            )
        else:
            action = group.add_argument(
                flag, dest=_OPT_PREFIX + name, default=None, metavar=name.upper(), help=help_text
            )
        set_owners(action, {o: doc.replace("%", "%%") for doc, owners in by_owner for o in owners})


def strategy_options_from_args(
    args: argparse.Namespace, strategy: str, *, strict: bool = True
) -> dict[str, Any]:
    """The strategy-option flags given on the command line that belong to ``strategy``. ``strict``: a flag of
    another strategy is an error naming the allowed ones (``estimate --strategy all`` passes each its own)."""

    given = {
        k[len(_OPT_PREFIX) :]: v for k, v in vars(args).items() if k.startswith(_OPT_PREFIX) and v is not None
    }
    if not given:
        return {}
    own = {f.name for f in dataclasses.fields(get_strategy(strategy).Options)}
    foreign = sorted(set(given) - own)
    if foreign and strict:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        allowed = ", ".join("--" + k.replace("_", "-") for k in sorted(own)) or "none"
        owners = ", ".join(sorted({cls.name for cls, f in iter_option_fields() if f.name in foreign}))
        verb, of = ("does", "an option") if len(foreign) == 1 else ("do", "options")
        raise ConfigError(
            f"{flags} {verb} not apply to strategy {strategy!r} ({of} of {owners}); its options: {allowed}"
        )
    return {k: v for k, v in given.items() if k in own}


def resolve_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (if any) < command-line flags. Strategy options are checked against the chosen strategy."""

    data: dict[str, Any] = dict(base or {})
    if getattr(args, "config", None):
        data.update(load_yaml(args.config))
    if getattr(args, "accelerate_config", None):

        accel = read_accelerate_config(args.accelerate_config)
        accel["strategy_options"] = {**(data.get("strategy_options") or {}), **accel["strategy_options"]}
        data.update(accel)
    data.update(collect_overrides(args, TrainConfig))
    opts = dict(data.pop("strategy_options", None) or {})
    opts.update(strategy_options_from_args(args, data.get("strategy", TrainConfig.strategy)))
    data["strategy_options"] = opts
    cfg = from_dict(TrainConfig, data)
    # A torchelastic restart resumes from the last checkpoint.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        cfg = cfg.replace(resume=True)
    return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_help_arguments(parser)
    add_config_arguments(parser)
    before = len(parser._actions)
    add_executor_arguments(parser, "the run")
    for action in parser._actions[before:]:
        if "--executor" not in action.option_strings:
            hide_in_short(action)


def run(args: argparse.Namespace) -> int:

    cfg = resolve_config(args)
    options = executor_options(args)
    if args.executor != "local" or any(v is not None for v in options.values()):
        executor = make_executor(args.executor, **options)
        if not executor.runs_here:
            # --nnodes nodes, --nproc processes on each: the executor places them and starts each node's launcher
            with ckpt.trusted(cfg.trust_checkpoint):
                print_result(cfg.output, run_job_on(executor, cfg))
            return 0
    with ckpt.trusted(cfg.trust_checkpoint):
        return _run(cfg)


def _run(cfg) -> int:
    """One run as the CLI does it: the job (launched or in this process), its result printed by the main process;
    a launched worker then leaves without the interpreter's teardown."""

    worker = launched_by_launcher()
    if worker:
        die_with_parent()  # a killed launcher or torchrun agent must not leave this worker training on
    try:
        result = run_job(cfg, worker=worker)
    except StratbenchError as exc:
        if worker and setup_error_recorded():
            # Noted for stratbench's launcher, which says it once for every rank: this rank leaves quietly.
            sys.stderr.flush()
            os._exit(exc.exit_code)
        raise
    if result is not None and not worker and read_env(cfg.device).is_main:
        print_result(cfg.output, result)
    if not worker:
        return 0
    # A worker whose run finished: the result and checkpoints are written and the process group is torn
    # down. Skip the interpreter's teardown, where a library thread (seen with DeepSpeed over gloo: "terminate
    # called without an active exception") can abort a successful worker and fail the whole run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
