"""stratbench train: one run of one method; starts its own processes through torchrun when --nproc > 1."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from stratbench.config import TrainConfig, add_dataclass_arguments, collect_overrides, from_dict, load_yaml
from stratbench.errors import ConfigError

NAME = "train"
HELP = "train one model with one method and precision; writes OUTPUT/result.json"
ORDER = 10
_OPT_PREFIX = "strategy_opt__"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE, one flag per TrainConfig field, and one flag per strategy option."""
    parser.add_argument("--config", help="YAML file of options; flags given on the command line override it")
    parser.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="an accelerate YAML (what `accelerate config` writes, e.g. the source's default_FSDP.yml): its method, "
        "precision, processes and plugin knobs; flags given on the command line override it",
    )
    add_dataclass_arguments(parser, TrainConfig)
    add_strategy_option_arguments(parser)
    # The deepspeed launcher appends --local_rank=N; the rank is read from LOCAL_RANK instead.
    parser.add_argument(
        "--local_rank", "--local-rank", dest="_local_rank", default=None, help=argparse.SUPPRESS
    )


def add_strategy_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per strategy option field (from every registered strategy's ``Options``); a field two strategies
    share gets one flag whose help gives each strategy's own description."""
    from stratbench.config import _base_type, field_docs
    from stratbench.strategies.base import iter_option_fields

    group = parser.add_argument_group("strategy options (each applies to the strategies named in its help)")
    fields: dict[str, dataclasses.Field] = {}
    docs: dict[str, dict[str, list[str]]] = {}  # field -> its description -> the strategies that give it
    for cls, f in iter_option_fields():
        fields.setdefault(f.name, f)
        doc = field_docs(cls.Options).get(f.name, "")
        docs.setdefault(f.name, {}).setdefault(doc, []).append(cls.name)
    for name, f in sorted(fields.items()):
        flag = "--" + name.replace("_", "-")
        help_text = " ".join(f"[{', '.join(owners)}] {doc}" for doc, owners in docs[name].items()).replace(
            "%", "%%"
        )
        if _base_type(f.type) is bool:
            group.add_argument(
                flag,
                dest=_OPT_PREFIX + name,
                nargs="?",
                const="true",
                default=None,
                metavar="BOOL",
                help=help_text,
            )
        else:
            group.add_argument(
                flag, dest=_OPT_PREFIX + name, default=None, metavar=name.upper(), help=help_text
            )


def strategy_options_from_args(
    args: argparse.Namespace, strategy: str, *, strict: bool = True
) -> dict[str, Any]:
    """The strategy-option flags given on the command line that belong to ``strategy``. ``strict``: a flag of
    another strategy is an error naming the allowed ones (``estimate --strategy all`` passes each its own)."""
    from stratbench.strategies.base import get_strategy

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
        raise ConfigError(f"{flags} do(es) not apply to strategy {strategy!r}; its options: {allowed}")
    return {k: v for k, v in given.items() if k in own}


def resolve_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (if any) < command-line flags. Strategy options are checked against the chosen strategy."""

    data: dict[str, Any] = dict(base or {})
    if getattr(args, "config", None):
        data.update(load_yaml(args.config))
    if getattr(args, "accelerate_config", None):
        from stratbench.strategies.accelerate import read_accelerate_config

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
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from stratbench import checkpoint as ckpt

    cfg = resolve_config(args)
    with ckpt.trusted(cfg.trust_checkpoint):
        return _run(cfg)


def _run(cfg) -> int:
    import contextlib
    import errno
    import time

    from stratbench import engine, launch
    from stratbench.dist import die_with_parent, launched_by_launcher, read_env
    from stratbench.errors import StratbenchError, is_out_of_memory
    from stratbench.lock import held_here, output_lock
    from stratbench.report_table import print_result

    worker = launched_by_launcher()
    if worker:
        die_with_parent()  # a killed launcher or torchrun agent must not leave this worker training on
    engine.preflight(cfg)
    # The note on a fresh --resume comes once: from the launcher, or rank 0 under an external launcher.
    check_builder(cfg.model)
    check_resume(cfg, quiet=worker and (not read_env(cfg.device).is_main or held_here(cfg.output)))
    check_memory(cfg)
    if launch.needs_launch(cfg):
        # One lock per run, taken by the launcher (node 0 across nodes: the output may be a shared folder).
        started_at = time.time() - 1.0  # file times may be coarser than time.time()
        with output_lock(cfg.output) if cfg.node_rank == 0 else contextlib.nullcontext():
            code = launch.launch(cfg)
        if code != 0:
            raise_failed(cfg, code, started_at)
        if cfg.node_rank == 0:
            print_result(cfg.output)
        return 0
    # Started by an external launcher: global rank 0 takes the lock (unless our own launcher holds it).
    locking = not worker or (read_env(cfg.device).is_main and not held_here(cfg.output))
    with output_lock(cfg.output) if locking else contextlib.nullcontext():
        try:
            result = engine.run(cfg)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
                raise
            # A full disk or a folder that became read-only while saving: the previous checkpoint is intact
            # (every writer swaps a complete new one in); result.json says "failed" with this reason.
            raise StratbenchError(f"cannot write {exc.filename or cfg.output}: {exc.strerror}") from None
        except RuntimeError as exc:  # torch.OutOfMemoryError is one too
            if not is_out_of_memory(exc):
                raise
            text = str(exc)
            # result.json says "oom" with the reason (the engine wrote it); the user gets one line.
            first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
            raise StratbenchError(
                f"out of memory ({first}); lower --batch-size or --image-size (see `stratbench estimate`)"
            ) from None
    if not worker:
        if read_env(cfg.device).is_main:
            print_result(cfg.output, result)
        return 0
    # A worker whose run finished: the result and checkpoints are written and the process group is torn
    # down. Skip the interpreter's teardown, where a library thread (seen with DeepSpeed over gloo: "terminate
    # called without an active exception") can abort a successful worker and fail the whole run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


RESUME_KEYS = ("model", "width", "norm", "cifar_stem", "optimizer")
INIT_KEYS = ("model", "width", "norm", "cifar_stem")
RESUME_NOTE_KEYS = ("precision", "batch_size", "grad_accum", "lr")
"""A resume may change these (e.g. continue a bf16-mixed run in fp32 on another machine), but then the rest of the
run is not the run that was saved: a note names each change."""


def check_resume(cfg: TrainConfig, quiet: bool = False) -> None:
    """Before any work: a checkpoint to resume from (or start from) must fit this run's model and optimizer,
    and ``--resume`` with nothing to resume says that it starts fresh (``--resume must`` refuses)."""
    from pathlib import Path

    from stratbench import checkpoint as ckpt
    from stratbench.errors import CheckpointError

    checks = []
    if cfg.resume or cfg.resume_from:
        path = ckpt.resolve_resume(cfg.output, cfg.resume_from)
        if path is None:
            if cfg.resume == "must":
                raise CheckpointError(f"--resume must: nothing to resume in {Path(cfg.output) / 'checkpoints'}")
            if not quiet:
                print(f"note: --resume: no checkpoint in {ckpt.last_checkpoint(Path(cfg.output))} yet; starting fresh", file=sys.stderr)
        else:
            checks.append((path, RESUME_KEYS, "resume from"))
    if cfg.init_from:
        checks.append((Path(cfg.init_from), INIT_KEYS, "start from"))
    mine = cfg.to_dict()
    for path, keys, verb in checks:
        meta = ckpt.read_meta(path)
        if meta.get("layout") == "deepspeed":  # an nvme-offload checkpoint: refused before any process starts
            from stratbench.strategies.deepspeed import DS_TAG, _refuse_nvme_checkpoint

            _refuse_nvme_checkpoint(path, ckpt.check_tag(path, meta.get("deepspeed_tag", DS_TAG)))
        saved = meta.get("config") or {}
        differ = [k for k in keys if k in saved and saved[k] != mine[k]]
        if differ:
            was = ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in differ)
            now = ", ".join(f"--{k.replace('_', '-')} {mine[k]}" for k in differ)
            raise CheckpointError(f"cannot {verb} {path}: it was saved with {was}; this run has {now}")
        changed = [k for k in RESUME_NOTE_KEYS if verb == "resume from" and k in saved and saved[k] != mine[k]]
        if changed and not quiet:
            what = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {mine[k]}" for k in changed)
            print(f"note: resuming {path} with {what}: the rest of the run differs from the run that was saved",
                  file=sys.stderr)  # fmt: skip


def check_builder(spec: str) -> None:
    """A user builder ('pkg.module:function') must take ``num_classes=``: checked from its signature before
    any work (``--model os:system`` is refused here, not called)."""
    if ":" not in spec:
        return
    import importlib
    import inspect

    from torch import nn

    from stratbench.errors import ConfigError

    module_name, _, attr = spec.partition(":")
    try:
        builder = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"model {spec!r}: cannot import {attr!r} from {module_name!r} ({exc})") from None
    if not callable(builder) or (isinstance(builder, type) and not issubclass(builder, nn.Module)):
        raise ConfigError(f"model {spec!r} is not a model builder (a function returning an nn.Module)")
    try:
        inspect.signature(builder).bind(num_classes=10)
    except TypeError as exc:
        raise ConfigError(f"model {spec!r} is not a model builder: it does not take num_classes= ({exc})") from None
    except ValueError:
        pass  # no signature to read (some C functions): the call itself is checked


def check_memory(cfg: TrainConfig) -> None:
    """Refuse a batch whose input and first activation alone exceed the free memory of this machine (CPU),
    rather than start and be killed."""
    import psutil

    from stratbench.errors import ConfigError

    if cfg.device == "cuda" or cfg.image_size is None:
        return
    micro = max(1, cfg.batch_size // (cfg.nproc * cfg.grad_accum))
    need = micro * (3 + cfg.width) * cfg.image_size**2 * 4 * cfg.nproc
    free = psutil.virtual_memory().available
    if need > free:
        from stratbench.report_table import fmt_bytes

        raise ConfigError(
            f"--image-size {cfg.image_size} with --batch-size {cfg.batch_size} needs more than {fmt_bytes(need)} for "
            f"one batch's input and first activation; {fmt_bytes(free)} is free (see `stratbench estimate`)"
        )


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe", "NCCL communicator was aborted")
"""What a surviving rank's error says when another rank died (gloo, NCCL)."""


def raise_failed(cfg: TrainConfig, code: int, started_at: float = 0.0) -> None:
    """One line for a launched run that failed. When no worker wrote result.json (a rank was killed and
    torchrun stopped the others), the launcher writes it: status "failed" and the reason."""
    import json
    from pathlib import Path

    from stratbench._torchrun import RENDEZVOUS_FAILED
    from stratbench.checkpoint import atomic_write
    from stratbench.errors import StratbenchError
    from stratbench.launch import MULTI_NODE_PORT, torchrun_error_path

    out = Path(cfg.output)
    path = out / "result.json"
    rendezvous = torchrun_error_path(cfg)
    if code == RENDEZVOUS_FAILED and rendezvous.exists():
        detail = rendezvous.read_text().strip()
        rendezvous.unlink()
        port = cfg.master_port or (MULTI_NODE_PORT if cfg.nnodes > 1 else None)  # torchrun_command's
        where = cfg.rdzv_endpoint or (f"{cfg.master_addr}:{port}" if port else cfg.master_addr)
        why = (f"the rendezvous of --nnodes {cfg.nnodes} (node {cfg.node_rank}, {where}) did not complete within "
               f"--dist-timeout-s {cfg.dist_timeout_s}: {detail}")  # fmt: skip
        if cfg.node_rank == 0:
            atomic_write(path, json.dumps(_launcher_record(cfg, why, code), indent=2, default=str))
        raise StratbenchError(f"training did not start: {why}")
    res = None
    if path.exists():
        try:
            res = json.loads(path.read_text())
        except ValueError:
            res = None
    if isinstance(res, dict) and res.get("status") not in (None, "ok", "running"):
        seen = str(res.get("reason", ""))
        if any(marker in seen for marker in PEER_LOST):
            # A surviving rank only saw its peer vanish; the cause is the worker that exited or was killed.
            seen = f"a worker exited or was killed during training; torchrun stopped the others (rank 0 saw: {seen})"
            if cfg.node_rank == 0:
                res["reason"] = seen
                atomic_write(path, json.dumps(res, indent=2, default=str))
        reason = f": {seen}"
    else:
        config = out / "config.yaml"  # written by rank 0 when training starts
        started = config.exists() and config.stat().st_mtime >= started_at
        if started:
            why = "a worker exited or was killed during training; torchrun stopped the others"
        else:
            why = (
                "a worker exited or was killed before training started (or a rendezvous did not complete "
                f"within --dist-timeout-s {cfg.dist_timeout_s})"
            )
        reason = f": {why}"
        if cfg.node_rank == 0:
            atomic_write(path, json.dumps(_launcher_record(cfg, why, code), indent=2, default=str))
    raise StratbenchError(
        f"training failed (torchrun exit code {code}; a worker exited or was killed){reason} - see the log above"
    )


def _launcher_record(cfg: TrainConfig, why: str, code: int) -> dict[str, Any]:
    """result.json of a launched run whose workers wrote none (killed, or never started)."""
    import time

    return {
        "status": "failed",
        "reason": f"{why} (torchrun exit code {code})",
        "strategy": cfg.strategy,
        "precision": cfg.precision,
        "model": cfg.model,
        "data": cfg.data,
        "world_size": cfg.nproc * cfg.nnodes,
        "config": cfg.to_dict(),
        "written_by": "launcher",
        "written_at": time.time(),
        "metrics": {},
    }
