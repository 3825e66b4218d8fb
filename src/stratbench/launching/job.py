"""One training job, as `stratbench train` and ``stratbench.train()`` run it: every check before any work, then
either stratbench's own launcher (torchrun, one process per device) or the loop in this process, and a failure
turned into one line (and a result.json that says why)."""

from __future__ import annotations

import contextlib
import errno
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratbench.checkpoints import checkpoint as ckpt
from stratbench.core.config import TrainConfig, dump_yaml
from stratbench.core.dist import needs_launch, read_env
from stratbench.core.errors import CheckpointError, ConfigError, StratbenchError, is_out_of_memory
from stratbench.core.files import remove_path, replace_path
from stratbench.core.lock import held_here, output_lock, remove_if_only_lock
from stratbench.core.tables import fmt_bytes
from stratbench.launching import launch
from stratbench.launching._torchrun import RENDEZVOUS_FAILED
from stratbench.launching.executor import Executor, Handle, Job, Outcome, Shape
from stratbench.launching.launch import MULTI_NODE_PORT, torchrun_error_path
from stratbench.launching.submissions import JOURNAL, Submissions, job_key
from stratbench.strategies.base import strategy_for_layout
from stratbench.training import engine


def run_job(cfg: TrainConfig, worker: bool = False) -> dict[str, Any] | None:
    """Train ``cfg`` and return its result (result.json's content); None on a launching node other than node 0,
    which writes no result. ``worker``: this process is one rank that stratbench's launcher started.

    Every check, and the set-up of the data, model, weights and method, comes before the first write into the
    output folder: input that is refused leaves an earlier run's folder byte-identical."""
    noted = launch.record_setup_error if worker else None  # the launcher says why, once
    try:
        engine.preflight(cfg)
        # The note on a fresh --resume comes once: from the launcher, or rank 0 under an external launcher.
        check_resume(cfg, quiet=worker and (not read_env(cfg.device).is_main or held_here(cfg.output)))
        check_memory(cfg)
    except Exception as exc:
        if noted is not None:
            noted(exc)
        raise
    if needs_launch(cfg):
        return _launch(cfg)
    # Started by an external launcher: global rank 0 takes the lock (unless our own launcher holds it).
    locking = not worker or (read_env(cfg.device).is_main and not held_here(cfg.output))
    with output_lock(cfg.output) if locking else contextlib.nullcontext():
        return _run_here(cfg, noted)


def _launch(cfg: TrainConfig) -> dict[str, Any] | None:
    """stratbench's own launcher: torchrun on this node, its config and the workers' notes in a folder of this
    launcher's own, ``OUTPUT/.launch-*`` (removed when it ends; its name in every command line of the run tells
    the run's processes); one lock per run, taken by the launcher (node 0 across nodes: the output may be a
    shared folder)."""
    with output_lock(cfg.output) if cfg.node_rank == 0 else contextlib.nullcontext():
        out = Path(cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        earlier = _stamps(out)
        with tempfile.TemporaryDirectory(prefix=".launch-", dir=out) as scratch:
            try:
                code = launch.launch(cfg, Path(scratch))
            except launch.StoppedBySignal as stop:
                record_stop(cfg, stop, earlier)
                raise
            if code != 0:
                raise_failed(cfg, code, earlier, Path(scratch))
        if cfg.node_rank != 0:
            return None
        if _stamps(out).get("result.json") in (None, earlier.get("result.json")):
            raise StratbenchError(f"the workers exited without writing {out / 'result.json'}")
        return json.loads((out / "result.json").read_text())


STAGING = ".staging-train"
"""``train --executor``'s folder inside the output folder for the nodes' config and logs and the submission journal
(one name, so that a rerun after a killed launcher finds the job it left)."""
RUN_FILES = ("result.json", "config.yaml")
"""The files that tell whether a launched run wrote into its output folder (config.yaml: training started)."""


def _stamps(out: Path) -> dict[str, tuple[int, int, int]]:
    """Identity of each of RUN_FILES that exists (inode, modification time, size): every writer swaps a new file
    in, so a file this run wrote has another stamp than the one an earlier run left."""
    found = {}
    for name in RUN_FILES:
        with contextlib.suppress(OSError):
            st = (out / name).stat()
            found[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return found


def run_job_on(executor: Executor, cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` through ``executor`` (``stratbench train --executor ray``): stratbench's own launcher on each
    of ``cfg.nnodes`` nodes with ``cfg.nproc`` processes, node 0's output followed here; returns result.json's
    content. Ctrl-C or SIGTERM cancels the run on every node. The output folder must be one the nodes share.

    The nodes read their config, and write their logs (and the executor its files), in a staging folder inside
    the output folder (``.staging-train``); the logs join the output folder once the run wrote there (or it held
    no earlier run), and a run refused on the nodes leaves an earlier run's folder as it was. A job of an earlier,
    killed run into the same folder that the cluster still has is adopted (followed to its end, its staging folder
    kept) or, with --cancel-stale, cancelled first (``launching.submissions``: the journal is in the staging
    folder too)."""
    engine.preflight(cfg)
    shape = Shape(cfg.nnodes, cfg.nproc, cfg.nproc if cfg.device == "cuda" else 0)
    executor.check([shape])
    out = Path(cfg.output).resolve()
    created = not out.exists()
    staging = out / STAGING
    config = staging / "config.yaml"
    cmd = [sys.executable, "-m", "stratbench", "train", "--config", str(config), "--nproc", str(cfg.nproc)]
    job = Job(out.name, tuple(cmd), staging / "train.log", shape, key=job_key(out, "train"))
    submissions = Submissions(out, executor, journal=staging / JOURNAL)
    adopted = submissions.reconcile({job.key: job}).get(job.key)
    earlier = _stamps(out)
    if adopted is None:  # nothing of an earlier run left on the cluster: a fresh staging folder for this run
        remove_path(staging)
        staging.mkdir(parents=True)
        dump_yaml(cfg.replace(output=str(out)), config)
    else:  # the adopted job's result.json, whenever it writes it, is this run's
        earlier.pop("result.json", None)
    try:
        print(f"training on {executor.where()}: {shape}; node 0's log: {job.log} (then {out / 'train.log'})",
              file=sys.stderr, flush=True)  # fmt: skip
        outcome = _follow(executor, job, lambda: adopted or submissions.submit(job))
        submissions.ended(job, "ok" if outcome.returncode == 0 else "failed")
        logged = _error_line(job.log)
    finally:
        _settle(out, staging, earlier, created)
    result = None
    if _stamps(out).get("result.json") not in (None, earlier.get("result.json")):  # this run's
        with contextlib.suppress(OSError, ValueError):
            result = json.loads((out / "result.json").read_text())
    if outcome.returncode == 0 and isinstance(result, dict) and result.get("status") == "ok":
        return result
    why = outcome.reason or (result or {}).get("reason") or logged or f"exit code {outcome.returncode}"
    raise StratbenchError(f"training on {executor.where()} failed: {why}")


def _settle(out: Path, staging: Path, earlier: dict[str, Any], created: bool) -> None:
    """The staging folder's logs become the output folder's once the run wrote there (or it held no earlier
    result to keep); the staging folder goes, and so does an output folder this run created and left empty."""
    now = _stamps(out)
    if any(now.get(name) != earlier.get(name) for name in now) or "result.json" not in earlier:
        for entry in staging.iterdir():
            if entry.name not in ("config.yaml", JOURNAL):
                replace_path(entry, out / entry.name)
    remove_path(staging)
    if created:
        remove_if_only_lock(out)


def _follow(executor: Executor, job: Job, start: Callable[[], Handle]) -> Outcome:
    """Start ``job`` (``start``: submit it, or the handle on an adopted one) and wait for it, copying node 0's log
    to stderr as it grows; Ctrl-C or SIGTERM cancels it."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    handle = start()
    seen = 0
    try:
        while (outcome := executor.poll(handle)) is None:
            time.sleep(0.5)
            with contextlib.suppress(OSError), open(job.log, "rb") as fh:
                fh.seek(seen)
                chunk = fh.read()
                seen += len(chunk)
                sys.stderr.write(chunk.decode("utf-8", "replace"))
                sys.stderr.flush()
        return outcome
    except KeyboardInterrupt:
        executor.cancel(handle)
        raise StratbenchError(f"stopped: the run on {executor.where()} was cancelled on every node") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        executor.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _error_line(log: Path) -> str:
    """stratbench's own one-line error in a log, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    mine = [ln for ln in lines if ln.startswith("stratbench train: error:")]
    return (mine or lines or [""])[-1][:400]


def _run_here(cfg: TrainConfig, noted: engine.SetupError | None = None) -> dict[str, Any]:
    """The loop in this process; a full disk and an out-of-memory error become one line. ``noted`` hears of an
    error before the run wrote anything (as the user would read it)."""
    try:
        return engine.run(cfg, None if noted is None else lambda exc: noted(_explained(cfg, exc)))
    except (OSError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError too
        explained = _explained(cfg, exc)
        if explained is exc:
            raise
        raise explained from None


def _explained(cfg: TrainConfig, exc: Exception) -> Exception:
    """A full disk or an out-of-memory error as one line; any other exception as it is."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        # A full disk or a folder that became read-only while saving: the previous checkpoint is intact
        # (every writer swaps a complete new one in); result.json says "failed" with this reason.
        return StratbenchError(f"cannot write {exc.filename or cfg.output}: {exc.strerror}")
    if isinstance(exc, RuntimeError) and is_out_of_memory(exc):
        text = str(exc)
        # result.json says "oom" with the reason (the engine wrote it, once training started); the user gets one line.
        first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
        return StratbenchError(
            f"out of memory ({first}); lower --batch-size or --image-size (see `stratbench estimate`)"
        )
    return exc


RESUME_KEYS = ("model", "width", "norm", "cifar_stem", "moe_top_k", "capacity_factor", "optimizer")
INIT_KEYS = ("model", "width", "norm", "cifar_stem")
RESUME_NOTE_KEYS = ("precision", "batch_size", "grad_accum", "lr")
"""A resume may change these (e.g. continue a bf16-mixed run in fp32 on another machine), but then the rest of the
run is not the run that was saved: a note names each change."""


def check_resume(cfg: TrainConfig, quiet: bool = False) -> None:
    """Before any work: a checkpoint to resume from (or start from) must fit this run's model and optimizer,
    and ``--resume`` with nothing to resume says that it starts fresh (``--resume must`` refuses)."""
    checks = []
    if cfg.resume or cfg.resume_from:
        path = ckpt.resolve_resume(cfg.output, cfg.resume_from)
        if path is None:
            if cfg.resume == "must":
                raise CheckpointError(
                    f"--resume must: nothing to resume in {Path(cfg.output) / 'checkpoints'}"
                )
            if not quiet:
                print(
                    f"note: --resume: no checkpoint in {ckpt.last_checkpoint(Path(cfg.output))} yet; starting fresh",
                    file=sys.stderr,
                )
        else:
            checks.append((path, RESUME_KEYS, "resume from"))
    if cfg.init_from:
        checks.append((Path(cfg.init_from), INIT_KEYS, "start from"))
    mine = cfg.to_dict()
    for path, keys, verb in checks:
        meta = ckpt.read_meta(path)
        owner = strategy_for_layout(meta.get("layout"))
        if owner is not None:  # a method's own layout it cannot load (deepspeed's nvme offload): refused now
            owner.check_checkpoint(path, meta)
        saved = meta.get("config") or {}
        differ = [k for k in keys if k in saved and saved[k] != mine[k]]
        if differ:
            was = ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in differ)
            now = ", ".join(f"--{k.replace('_', '-')} {mine[k]}" for k in differ)
            raise CheckpointError(f"cannot {verb} {path}: it was saved with {was}; this run has {now}")
        changed = [
            k for k in RESUME_NOTE_KEYS if verb == "resume from" and k in saved and saved[k] != mine[k]
        ]
        if changed and not quiet:
            what = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {mine[k]}" for k in changed)
            print(f"note: resuming {path} with {what}: the rest of the run differs from the run that was saved",
                  file=sys.stderr)  # fmt: skip


def check_memory(cfg: TrainConfig) -> None:
    """Refuse a batch whose input and first activation alone exceed the free memory of this machine (CPU),
    rather than start and be killed."""
    import psutil

    if cfg.device == "cuda" or cfg.image_size is None:
        return
    micro = max(1, cfg.batch_size // (cfg.nproc * cfg.grad_accum))
    need = micro * (3 + cfg.width) * cfg.image_size**2 * 4 * cfg.nproc
    free = psutil.virtual_memory().available
    if need > free:
        raise ConfigError(
            f"--image-size {cfg.image_size} with --batch-size {cfg.batch_size} needs more than {fmt_bytes(need)} for "
            f"one batch's input and first activation; {fmt_bytes(free)} is free (see `stratbench estimate`)"
        )


PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker",
    "Broken pipe",
    "NCCL communicator was aborted",
)
"""What a surviving rank's error says when another rank died (gloo, NCCL)."""


def raise_failed(
    cfg: TrainConfig, code: int, earlier: dict[str, Any] | None = None, scratch: Path | None = None
) -> None:
    """One line for a launched run that failed. A worker's set-up error (noted in ``scratch`` before anything was
    written) is raised as it is. When no worker wrote result.json (a rank was killed and torchrun stopped the
    others), the launcher writes it (status "failed" and the reason), unless it would replace an earlier run's
    result while this run never started training. ``earlier``: ``_stamps`` of the folder before the launch."""
    out = Path(cfg.output)
    path = out / "result.json"
    earlier = earlier or {}
    now = _stamps(out)
    started = "config.yaml" in now and now["config.yaml"] != earlier.get("config.yaml")  # rank 0 wrote it
    may_write = cfg.node_rank == 0 and (started or "result.json" not in earlier)
    if scratch is not None:
        noted = launch.read_setup_error(scratch)
        if noted is not None:
            raise launch.setup_error(noted)
        rendezvous = torchrun_error_path(scratch)
        if code == RENDEZVOUS_FAILED and rendezvous.exists():
            _raise_rendezvous(cfg, code, rendezvous.read_text().strip(), may_write)
    res = None
    if "result.json" in now and now["result.json"] != earlier.get("result.json"):  # written by this run
        with contextlib.suppress(OSError, ValueError):
            res = json.loads(path.read_text())
    if isinstance(res, dict) and res.get("status") not in (None, "ok", "running"):
        seen = str(res.get("reason", ""))
        if any(marker in seen for marker in PEER_LOST):
            # A surviving rank only saw its peer vanish; the cause is the worker that exited or was killed.
            seen = f"a worker exited or was killed during training; torchrun stopped the others (rank 0 saw: {seen})"
            if cfg.node_rank == 0:
                res["reason"] = seen
                ckpt.atomic_write(path, json.dumps(res, indent=2, default=str))
        reason = f": {seen}"
    else:
        if started:
            why = "a worker exited or was killed during training; torchrun stopped the others"
        else:
            why = (
                "a worker exited or was killed before training started (or a rendezvous did not complete "
                f"within --dist-timeout-s {cfg.dist_timeout_s})"
            )
        reason = f": {why}"
        if may_write:
            ckpt.atomic_write(path, json.dumps(_launcher_record(cfg, why, code), indent=2, default=str))
    raise StratbenchError(
        f"training failed (torchrun exit code {code}; a worker exited or was killed){reason} - see the log above"
    )


def record_stop(cfg: TrainConfig, stop: StratbenchError, earlier: dict[str, Any]) -> None:
    """result.json of a run whose launcher was stopped by a signal, where no worker wrote one (they die of the
    SIGTERM torchrun forwards, whatever the method): status "failed", the signal as the reason; as for any
    launched failure, not over an earlier run's result while this run never started training."""
    out = Path(cfg.output)
    now = _stamps(out)
    if now.get("result.json") not in (None, earlier.get("result.json")):
        return  # a worker wrote this run's
    started = "config.yaml" in now and now["config.yaml"] != earlier.get("config.yaml")
    if cfg.node_rank == 0 and (started or "result.json" not in earlier):
        record = {**_launcher_record(cfg, str(stop), stop.exit_code), "reason": str(stop)}
        with contextlib.suppress(OSError):  # a full or read-only disk: the one line still says it
            ckpt.atomic_write(out / "result.json", json.dumps(record, indent=2, default=str))


def _raise_rendezvous(cfg: TrainConfig, code: int, detail: str, may_write: bool) -> None:
    """The one line of a rendezvous that did not complete (and its record, where ``may_write``)."""
    port = cfg.master_port or (MULTI_NODE_PORT if cfg.nnodes > 1 else None)  # torchrun_command's
    where = cfg.rdzv_endpoint or (f"{cfg.master_addr}:{port}" if port else cfg.master_addr)
    why = (f"the rendezvous of --nnodes {cfg.nnodes} (node {cfg.node_rank}, {where}) did not complete within "
           f"--dist-timeout-s {cfg.dist_timeout_s}: {detail}")  # fmt: skip
    if may_write:
        ckpt.atomic_write(
            Path(cfg.output) / "result.json", json.dumps(_launcher_record(cfg, why, code), indent=2, default=str)
        )
    raise StratbenchError(f"training did not start: {why}")


def _launcher_record(cfg: TrainConfig, why: str, code: int) -> dict[str, Any]:
    """result.json of a launched run whose workers wrote none (killed, or never started)."""
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
