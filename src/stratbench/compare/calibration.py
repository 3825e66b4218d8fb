"""`compare --calibrate`: what a sweep measures before its cells, so that the report's predicted step of each
multi-process cell is a prediction made on this machine before that cell was measured (docs/projection.md).

For the sweep's runnable multi-process cells it plans, and the runner runs before any cell:

* ``stratbench probe --nproc N`` for each world size N of those cells: this machine's collectives, compute
  share, thread share and overlap, as a hardware profile (``calibration/probe-wN/probe.yaml``);
* ``single`` at the cells' per-process batch and at their global batch, per precision, each with the threads a
  cell's process gets (``launch.threads_per_process``; 1 on 2 cores with 2 processes): the achieved efficiency
  and the fixed overhead per step (``projection.calibrate_one``);
* each method (strategy and options) once on one process at the per-process batch, per precision: its own host
  work per step (FSDP's hooks, ZeRO-3's fetches: ``Calibration.method_overhead_s``). Pipelines are left out
  (``projection.method_run_refused``: on one process a pipeline is one stage, not the method).

Train runs are capped at ``CALIBRATION_STEPS`` steps: they need a median step time, not a trained model. Their
records go to ``calibration.jsonl``, not ``results.jsonl`` (they are not rows of the table), each naming the
cells it calibrates (``calibration.for``); a rerun keeps what finished, like the cells. The report predicts a
cell from the runs made for it (``basis_for``): where one of them failed or was refused, the predicted column
says so instead of showing a number.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratbench.compare.matrix import Cell, Matrix, Plan, plan_cell
from stratbench.compare.runner import (
    FINISHED,
    RESULTS,
    Display,
    Interrupted,
    append_record,
    check_records,
    last_error_line,
    load_records,
    local_environment,
    machine_of,
)
from stratbench.core.config import TrainConfig, from_dict
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError
from stratbench.launching.launch import threads_per_process
from stratbench.measuring.hardware import resolve
from stratbench.measuring.records import (
    CALIBRATION_KINDS,
    CalibrationRecord,
    RecordError,
    RunRecord,
    calibration_problem,
    record_problem,
)
from stratbench.predicting.projection import method_run_refused
from stratbench.strategies.base import all_strategies, baseline_name, get_strategy

if TYPE_CHECKING:
    from stratbench.compare.runner import Display, SweepRunner

CALIBRATION = "calibration.jsonl"
CAL_DIR = "calibration"
CALIBRATION_STEPS = 30
"""Steps of each calibration train run (or the cell's own max_steps when smaller); 3 are warm-up by default."""
PROBE_SIZES_CPU = "1KiB,16KiB,128KiB,1MiB,4MiB"
"""Probe payloads on a CPU (the quick preset's gradients are < 1 MiB; gloo at 32 MiB costs seconds per size)."""
KINDS = CALIBRATION_KINDS
"""What a calibration run measures: this machine's links (probe), the baseline method's efficiency and fixed
overhead (single, after the baseline's name: the kind calibration.jsonl records), one method's own overhead."""
PROBE, SINGLE, METHOD = KINDS
# Cell options that each calibration run sets itself.
_OWN = ("batch_size", "grad_accum", "max_steps")


@dataclass(frozen=True)
class CalibrationRun:
    """One run of the calibration: a `single` or one-process method run (``cell``), or the probe."""

    kind: str
    """probe, single (efficiency and fixed overhead) or method (one method's own overhead on one process)."""
    cell: Cell | None = None
    threads: int | None = None
    """OMP_NUM_THREADS of a train run: the threads a cell's process gets."""
    nproc: int = 1
    """The probe's processes (the cells' world size)."""
    device: str = "cpu"
    sizes: str = ""
    for_cells: tuple[str, ...] = ()
    """Ids of the cells whose prediction rests on this run."""
    status: str | None = None
    """None: run it; skipped/failed: the run cannot be made here (``reason``), recorded as such."""
    reason: str = ""

    @property
    def id(self) -> str:
        if self.kind == "probe":
            return f"probe-w{self.nproc}"
        assert self.cell is not None
        return f"{self.cell.id}_t{self.threads}"

    @property
    def what(self) -> str:
        """One line for the terminal and the report: what the run measures."""
        if self.kind == "probe":
            return f"calibration: stratbench probe --nproc {self.nproc}"
        assert self.cell is not None
        return (f"calibration: {self.cell.name} {self.cell.precision} x1, batch {self.cell.batch_size}, "
                f"{self.threads} thread{'s' if self.threads != 1 else ''}")  # fmt: skip


@dataclass
class CalibrationPlan:
    runs: list[CalibrationRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Cells or methods left out of the calibration, and why."""


def _common(cell: Cell) -> dict[str, Any]:
    """The cell's options other than those each calibration run sets itself (batch, accumulation, steps)."""
    return {k: v for k, v in cell.config.items() if k not in _OWN}


def _multi_process(cell: Cell) -> bool:
    cls = all_strategies().get(cell.method)
    return cell.world_size > 1 and cls is not None and cls.needs_process_group


def plan_calibration(
    matrix: Matrix, plans: list[Plan], *, threads: int | None = None, max_steps: int = CALIBRATION_STEPS,
    probe_sizes: str | None = None, allow_slow: bool = False,
) -> CalibrationPlan:  # fmt: skip
    """The calibration runs for the runnable multi-process cells of ``plans`` (see the module docstring).
    ``threads``: the calibration runs' thread count (default: what a cell's process gets here)."""
    runnable = [p.cell for p in plans if p.status is None]
    multi = [c for c in runnable if _multi_process(c)]
    if not multi:
        return CalibrationPlan(notes=["no runnable multi-process cell: nothing to calibrate"])
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    needs = _Needs()
    for cell in multi:
        needs.add(cell, threads or threads_per_process(cell.world_size), max_steps)
    # The sweep's own one-process baseline cells are predicted from the same runs (and the first probe's peak).
    for cell in runnable:
        if cell.world_size == 1 and cell.method == baseline_name():
            needs.serve(cell)
    return needs.plan(matrix, probe_sizes, allow_slow)


def _group_key(cell: Cell, threads: int) -> str:
    """The baseline runs a cell needs, as a key: its precision, threads and options other than the batch."""
    return json.dumps([cell.precision, threads, _common(cell)], sort_keys=True, default=str)


@dataclass
class _Needs:
    """What the multi-process cells of a sweep need calibrated, gathered cell by cell (``plan_calibration``)."""

    runs: dict[str, tuple[CalibrationRun, set[str]]] = field(default_factory=dict)
    """Run id -> the run and the ids of the cells it serves."""
    refused: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> the cells whose method has no one-process run."""
    probes: dict[int, set[str]] = field(default_factory=dict)
    """World size -> the cells its probe serves."""
    groups: dict[str, tuple[Cell, int, int, set[int], set[str]]] = field(default_factory=dict)
    """Baseline runs per precision, options and threads (``_group_key``): a cell, threads, steps, every batch
    those cells need, the cells they serve."""
    device: str = "cpu"

    def add(self, cell: Cell, threads: int, max_steps: int) -> None:
        """The probe of ``cell``'s world size, the baseline at its per-process and global batch, and its method
        on one process at the per-process batch (unless the method refuses: ``method_run_refused``)."""
        cfg = from_dict(TrainConfig, cell.train_config("unused"), where=f"cell {cell.id}")
        self.device = resolve_device(cfg.device).type
        dp = get_strategy(cell.method).data_parallel_size(cfg, cell.world_size)
        per_process = max(1, cell.batch_size // max(1, dp))
        steps = min(max_steps, int(cell.config.get("max_steps") or max_steps))
        self.probes.setdefault(cell.world_size, set()).add(cell.id)
        group = self.groups.setdefault(_group_key(cell, threads), (cell, threads, steps, set(), set()))
        group[3].update({per_process, cell.batch_size})
        group[4].add(cell.id)
        why = method_run_refused(cell.method)
        if why:
            self.refused.setdefault(why, []).append(f"{cell.name} {cell.precision}")
            return
        accum = {"grad_accum": cell.config["grad_accum"]} if "grad_accum" in cell.config else {}
        one = Cell(cell.method, cell.precision, 1, {**_common(cell), **accum, "batch_size": per_process, "max_steps": steps},
                   dict(cell.options), cell.label)  # fmt: skip
        run = CalibrationRun(METHOD, one, threads)
        self.runs.setdefault(run.id, (run, set()))[1].add(cell.id)

    def serve(self, cell: Cell) -> None:
        """A one-process baseline cell is predicted from the baseline runs of its group and the first probe."""
        for key, group in self.groups.items():
            if key == _group_key(cell, group[1]):
                group[4].add(cell.id)
                self.probes[min(self.probes)].add(cell.id)

    def plan(self, matrix: Matrix, probe_sizes: str | None, allow_slow: bool) -> CalibrationPlan:
        """The runs, probes first, each planned as a cell would be (what would refuse it here refuses it now)."""
        for cell, t, steps, batches, served in self.groups.values():
            for batch in sorted(batches):
                config = {**_common(cell), "batch_size": batch, "max_steps": steps}
                run = CalibrationRun(SINGLE, Cell(baseline_name(), cell.precision, 1, config), t)
                self.runs.setdefault(run.id, (run, set()))[1].update(served)
        notes = [f"{', '.join(names)}: no one-process run ({why}); predicted without a method overhead"
                 for why, names in self.refused.items()]  # fmt: skip
        sizes = probe_sizes or (PROBE_SIZES_CPU if self.device == "cpu" else "")
        out = [CalibrationRun(PROBE, nproc=n, device=self.device, sizes=sizes, for_cells=tuple(sorted(ids)))
               for n, ids in sorted(self.probes.items())]  # fmt: skip
        order = {k: i for i, k in enumerate(KINDS)}
        for run, served in sorted(self.runs.values(), key=lambda x: order[x[0].kind]):
            p = plan_cell(run.cell, matrix, allow_slow)
            out.append(CalibrationRun(run.kind, run.cell, run.threads, for_cells=tuple(sorted(served)),
                                      status=p.status, reason=p.reason))  # fmt: skip
        return CalibrationPlan(out, notes)


# ------------------------------------------------------------------------------------------------
# running


def _record(run: CalibrationRun) -> dict[str, Any]:
    """The fields every calibration record has beside what the run produced."""
    return {"kind": run.kind, "for": list(run.for_cells), "threads": run.threads, "nproc": run.nproc,
            "what": run.what, **({"profile": f"{CAL_DIR}/{run.id}/probe.yaml"} if run.kind == "probe" else {})}  # fmt: skip


def run_calibration(runner: SweepRunner, runs: list[CalibrationRun]) -> dict[str, dict[str, Any]]:
    """Run the calibration runs not already finished into ``runner.out/calibration/``, one fresh process tree
    each under the sweep's time limit, and append each outcome to calibration.jsonl; a run kept from an earlier
    sweep that now serves more cells is recorded again with them. Ctrl-C raises ``Interrupted``."""

    out = runner.out
    records = load_records(out, CALIBRATION)
    display = Display(len(runs), runner.console)
    keep = ("ok",) if runner.retry else FINISHED
    env = local_environment(1)
    try:
        for n, run in enumerate(runs, 1):
            old = records.get(run.id)
            if run.status is None and old and old.get("status") in keep:
                served = sorted(set(old["calibration"]["for"]) | set(run.for_cells))
                if served != old["calibration"]["for"]:
                    old = {**old, "calibration": {**old["calibration"], "for": served}}
                    append_record(out, old, CALIBRATION)
                    records[run.id] = old
                display.skip_only()
                runner.console.print(f"  [dim]done before[/dim] {run.what}: {old['status']}", highlight=False,
                                     soft_wrap=True)  # fmt: skip
                continue
            if run.status is not None:
                rec = {"id": run.id, "status": run.status, "reason": run.reason, "machine": machine_of(env),
                       "environment": env, "calibration": _record(run)}  # fmt: skip
                append_record(out, rec, CALIBRATION)
                records[run.id] = rec
                display.end(run.what, run.status, run.reason, None, ran=False)
                continue
            display.begin(
                n, run.what, f"{CAL_DIR}/{run.id}/{'probe' if run.kind == 'probe' else 'train'}.log"
            )
            rec = (
                _run_probe(runner, run, display) if run.kind == "probe" else _run_train(runner, run, display)
            )
            append_record(out, rec, CALIBRATION)
            records[run.id] = rec
            display.end(run.what, rec["status"], rec["reason"], rec["elapsed_s"], ran=True)
    except KeyboardInterrupt:
        raise Interrupted("stopped between calibration runs") from None
    finally:
        display.close()
    return records


def _run_train(runner: SweepRunner, run: CalibrationRun, display: Display) -> dict[str, Any]:
    assert run.cell is not None
    rec = runner.run_cell(run.cell, display, run_dir=runner.out / CAL_DIR / run.id,
                          env={"OMP_NUM_THREADS": str(run.threads)})  # fmt: skip
    rec["id"] = run.id
    rec["calibration"] = _record(run)
    return rec


def probe_command(run: CalibrationRun, profile: Path) -> list[str]:
    """`stratbench probe` of the run's processes, writing the profile to ``profile``."""
    return [sys.executable, "-m", "stratbench", "probe", "--nproc", str(run.nproc), "--device", run.device,
            "--output", str(profile)] + (["--sizes", run.sizes] if run.sizes else [])  # fmt: skip


def _run_probe(runner: SweepRunner, run: CalibrationRun, display: Display) -> dict[str, Any]:
    run_dir = runner.out / CAL_DIR / run.id
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    profile, log = run_dir / "probe.yaml", run_dir / "probe.log"
    cmd = probe_command(run, profile)
    code, elapsed, timed_out, loads = runner.run_process(cmd, log, display, f"stopped while running {run.id}")
    status, reason = "ok", ""
    if timed_out:
        status, reason = (
            "timeout",
            f"did not finish within the {runner.timeout_s:.0f} s limit; its processes were killed",
        )
    elif code != 0 or not profile.exists():
        status, reason = (
            "failed",
            last_error_line(log) or f"exited with code {code} without writing {profile.name}",
        )
    else:
        try:
            resolve(str(profile))
        except ConfigError as exc:
            status, reason = "failed", f"the profile it wrote does not load: {exc}"
    env = local_environment(run.nproc)
    return {"id": run.id, "status": status, "reason": reason, "machine": machine_of(env), "environment": env,
            "calibration": _record(run), "elapsed_s": elapsed, "returncode": code,
            "cell_dir": str(run_dir), "log": str(log), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host_load_mean": sum(loads) / len(loads) if loads else None}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the report's side


def load_calibration_records(folder: str | Path) -> list[CalibrationRecord]:
    """The latest record of each calibration run of a sweep folder, parsed once, its probe profile's path made
    absolute (``CalibrationRecord.profile_path``), so that a report merging several folders finds each one's
    files. A line that is no calibration record is left out (``check_results_file`` names it)."""
    folder = Path(folder)
    out = []
    for rec in load_records(folder, CALIBRATION).values():
        try:
            parsed = CalibrationRecord.from_dict(rec)
        except RecordError:
            continue
        if parsed.profile:
            parsed = dataclasses.replace(parsed, profile_path=str((folder / parsed.profile).resolve()))
        out.append(parsed)
    return out


@dataclass
class Basis:
    """What a cell's prediction rests on: the probe profile and the ok calibration train runs made for it, or
    ``problem``: why there is no prediction (a run failed, was refused, or is missing)."""

    profile: str | None = None
    nproc: int | None = None
    runs: list[RunRecord] = field(default_factory=list)
    problem: str = ""


def _failed(c: CalibrationRecord) -> str:
    why = " ".join((c.run.reason or "no reason recorded").split())
    return f"its calibration run ({c.what or c.run.id}) is {c.run.status}: {why}"


def basis_for(rec: RunRecord, calibration: list[CalibrationRecord]) -> Basis | None:
    """The calibration runs of ``rec``'s machine made for it (``calibration.for`` names its id); None when none
    was (the sweep did not calibrate, or not this cell)."""
    host = rec.machine.hostname
    mine = [c for c in calibration if rec.id in c.for_cells and c.run.machine.hostname == host]
    if not mine:
        return None
    basis = Basis()
    probes, singles, methods = ([c for c in mine if c.kind == kind] for kind in KINDS)
    failed = [c for c in mine if not c.run.ok]
    if failed:
        basis.problem = _failed(failed[0]) + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
        return basis
    if not probes:
        basis.problem = "no probe of this machine was made for it (rerun with --calibrate)"
        return basis
    profile = probes[0].profile_path
    if not profile or not Path(profile).is_file():
        basis.problem = f"the probe profile {profile or probes[0].profile or '(no path recorded)'} is missing"
        return basis
    if not singles:
        basis.problem = "no `single` calibration run was made for it (rerun with --calibrate)"
        return basis
    own_run = rec.world > 1 and rec.method != baseline_name() and not method_run_refused(str(rec.method))
    if own_run and not methods:
        basis.problem = f"no one-process calibration run of {rec.name} was made for it"
        return basis
    basis.profile, basis.nproc = profile, int(probes[0].nproc or 0)
    basis.runs = [c.run for c in singles + methods]
    return basis


def check_results_file(folder: Path) -> None:
    """One line naming the first bad line of FOLDER/results.jsonl or of its calibration runs' calibration.jsonl
    (binary, not a JSON record of its kind, or a field of the wrong type: ``records.record_problem``). A last line cut short (no newline: a sweep killed while appending
    it) is skipped, as the reader does, with a note naming it; its run counts as not recorded, and the next
    append drops it (``runner.append_record``)."""
    check_records(folder / RESULTS, lambda r: record_problem(r) if "id" in r else "not a cell record (no 'id')")
    check_records(folder / CALIBRATION, calibration_problem)
