"""The executors by name, and their command-line flags (``compare`` and ``train`` share them). An executor is one
module beside ``local_executor``, ``ray_executor`` and ``slurm_executor``, one line here, and its flags."""

from __future__ import annotations

import argparse
from typing import Any

from stratbench.core.errors import ConfigError
from stratbench.launching.executor import Executor
from stratbench.launching.local_executor import LocalExecutor
from stratbench.launching.ray_executor import RayExecutor
from stratbench.launching.slurm_executor import SlurmExecutor

EXECUTORS: dict[str, type[Executor]] = {cls.name: cls for cls in (LocalExecutor, RayExecutor, SlurmExecutor)}


def add_executor_arguments(parser: argparse.ArgumentParser, what: str = "each cell") -> None:
    group = parser.add_argument_group("where the processes run (docs/cluster.md)")
    group.add_argument("--executor", default="local", metavar="NAME",
                       help=f"where {what} runs: {', '.join(EXECUTORS)} (default local: this machine; ray: a "
                            "placement group per run on a Ray cluster, one launcher per node; slurm: a batch job "
                            "per run, one srun task per node)")  # fmt: skip
    group.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="--executor ray: the cluster, HOST:PORT of its head (default auto: $RAY_ADDRESS, else "
                            "a cluster started here with `ray start`, else a local Ray for this run)")  # fmt: skip
    group.add_argument(
        "--slurm-partition",
        default=None,
        metavar="NAME",
        help="--executor slurm: sbatch --partition (default: the cluster's default partition)",
    )
    group.add_argument(
        "--slurm-account", default=None, metavar="NAME", help="--executor slurm: sbatch --account"
    )
    group.add_argument("--slurm-time", default=None, metavar="TIME",
                       help="--executor slurm: sbatch --time, each job's time limit (MINUTES, HH:MM:SS, D-HH:MM; "
                            "default: the partition's); a job that reaches it is recorded 'timed out'")  # fmt: skip
    group.add_argument("--slurm-option", action="append", default=None, metavar="KEY=VALUE",
                       help="--executor slurm: one more sbatch option, --KEY=VALUE (KEY alone: a flag), e.g. "
                            "qos=high, constraint=a100, mem=64G, exclusive; repeatable")  # fmt: skip
    group.add_argument("--cancel-stale", action="store_const", const=True, default=None,
                       help="--executor ray/slurm: a job that an earlier, killed run of this output folder left "
                            "on the cluster is cancelled (and its cell run again) instead of adopted (waited for "
                            "as if this run had submitted it)")  # fmt: skip


def executor_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every executor's own flags from parsed arguments (None where not given), for ``make_executor``."""
    return {name: getattr(args, name, None) for cls in EXECUTORS.values() for name in cls.options}


def make_executor(name: str, max_concurrent: int = 0, **options: Any) -> Executor:
    """The executor ``name`` with its own options; an option given to an executor that has no such option (or
    an unknown name) is one line."""
    cls = EXECUTORS.get(name)
    if cls is None:
        raise ConfigError(f"--executor {name!r} is not one of: {', '.join(EXECUTORS)}")
    if max_concurrent < 0:
        raise ConfigError(
            f"--max-concurrent-cells must be >= 1 (0: the executor's default), got {max_concurrent}"
        )
    given = {k: v for k, v in options.items() if v is not None}
    foreign = sorted(set(given) - set(cls.options))
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        owners = [n for n, c in EXECUTORS.items() if set(foreign) <= set(c.options)]
        raise ConfigError(f"{flags} applies to --executor {' or '.join(owners) or '?'}, not {name}")
    return cls(max_concurrent, **given)
