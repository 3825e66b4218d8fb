"""What each column of a report computes from one record: its raw value (report.csv) and its text (report.md,
report.html), with the footnote saying how it was measured or why it is n/a. ``columns`` binds each function to
its column; a function here writes ``row.raw[key]`` and ``row.text[key]`` for its column (and any raw value the
CSV reads beside it). Two columns need the whole sweep: the predicted step (the sweep's calibration or baseline
runs) and the comm ratio (the reference method's bytes); theirs are ``finish`` functions over every row.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stratbench.compare.calibration import basis_for
from stratbench.compare.rows import DASH, Footnotes, Row, is_baseline, is_baseline_run, is_comm_reference
from stratbench.core.tables import fmt_bytes
from stratbench.measuring.records import CalibrationRecord, RunRecord, number
from stratbench.models.zoo import describe_init
from stratbench.predicting.estimate import predict_peak_bytes
from stratbench.predicting.projection import (
    RecordPrediction,
    precision_key,
    predict_calibrated,
    predict_record,
)


@dataclass
class Context:
    """What a cell may need beyond its own record: the sweep's baselines and the predicted step's inputs."""

    baselines: dict[str, float] = field(default_factory=dict)
    """Machine name -> throughput of its completed `single` fp32 row (the speed-up's denominator)."""
    hardware: str | None = None
    """The profile the predicted step uses (None: the sweep's probe, else each record's device's)."""
    calibration: list[CalibrationRecord] = field(default_factory=list)
    """The sweeps' calibration records (compare --calibrate)."""
    predict: bool = True
    """False: no predicted step (the terminal table has no such column)."""


Fill = Callable[[RunRecord, Row, Footnotes, Context], None]
"""A column's cell: writes its raw value and text into the row, marking the footnotes it needs."""
Finish = Callable[[list[Row], Footnotes, Context], None]
"""A column's pass over every row once each row is filled (what needs the other rows)."""


def _mean(xs: list[Any]) -> float | None:
    """The mean of the values present (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` and ``suffix``, or n/a where it was not measured."""
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


# ------------------------------------------------------------------------------------------------
# the columns that name the cell: filled for every row, also one that did not complete


def init_of(rec: RunRecord) -> str | None:
    """imagenet (a torchvision ImageNet weights file), random, or the weights file's name; None when unknown."""
    return describe_init(rec.config.get("weights")) if rec.config else None


def devices_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """How many devices share the global batch, on how many nodes, with the method's mesh where it has one."""
    row.raw["devices"] = rec.devices
    row.text["devices"] = str(rec.devices) if rec.devices is not None else DASH
    if rec.node_count > 1:
        row.text["devices"] = f"{rec.devices} on {rec.node_count} nodes"
    if rec.layout:
        row.text["devices"] += f" ({rec.layout})"


def status_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """ok, or what stopped the cell, with its reason."""
    raw, text = row.raw, row.text
    raw["status"], raw["reason"] = rec.status, rec.reason
    text["reason"] = str(rec.reason) if rec.reason is not None else DASH
    raw["busy"] = rec.busy  # its times were taken on a busy machine (measuring.load)
    status = str(rec.status)
    text["status"] = (
        status if not raw["reason"] or status == "ok" else f"{status}: {' '.join(raw['reason'].split())}"
    )
    if status == "ok" and raw["reason"]:
        text["status"] = f"ok ({raw['reason']})"


# ------------------------------------------------------------------------------------------------
# the measures of a completed row


def peak_memory_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Peak memory per device: the max over ranks; a process that drives several GPUs (DataParallel) lists each."""
    peaks = [p for p in rec.metrics.peak_memory_bytes if p is not None]
    kind = rec.metrics.peak_memory_kind
    row.raw["peak_memory"] = max(peaks) if peaks else None
    row.raw["peak_memory_per_device"] = peaks
    row.raw["peak_memory_kind"] = kind
    if not peaks:
        row.text["peak_memory"] = "n/a" + notes.mark("n/a: the run recorded no memory peak")
        return
    shown = " / ".join(fmt_bytes(p) for p in peaks) if len(peaks) > rec.world else fmt_bytes(max(peaks))
    if kind == "cpu_peak_rss":
        shown += notes.mark(
            "on CPU the peak is the process's peak resident memory (RSS: weights, activations, optimizer "
            "state plus the Python runtime and libraries, ~0.3-0.5 GiB), the largest over the ranks; on a GPU "
            "it is torch.cuda.max_memory_allocated"
        )
    row.text["peak_memory"] = shown


def gpu_util_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """GPU utilisation mean / peak over the run (NVML), n/a with the reason where it could not be read."""
    utils = [u for u in rec.metrics.gpu_util_mean_pct if u is not None]
    upeaks = [u for u in rec.metrics.gpu_util_peak_pct if u is not None]
    raw, text = row.raw, row.text
    if utils:
        raw["gpu_util"] = _mean(utils)
        raw["gpu_util_peak"] = max(upeaks) if upeaks else None
        text["gpu_util"] = (
            f"{raw['gpu_util']:.0f}% / {raw['gpu_util_peak']:.0f}%" if upeaks else f"{raw['gpu_util']:.0f}%"
        )
        return
    raw["gpu_util"] = None
    why = "NVML (nvidia-ml-py) was not available" if rec.on_gpu else "no NVIDIA GPU on this machine"
    text["gpu_util"] = "n/a" + notes.mark(f"n/a: GPU utilisation is read from NVML: {why}")


def busy_mark(rec: RunRecord, notes: Footnotes) -> str:
    """The "machine was busy" mark the times and the speed-up carry ('' when it was not)."""
    if not rec.busy:
        return ""
    return notes.mark(
        "the machine was busy with other work while this cell ran (mean 1-minute load average above 1.5x its "
        "cores, or other processes took more than 25% of its cores' time; each cell's values are host_load_mean "
        "and host_others_share in report.csv): its times are inflated and its speed-up "
        "is not a property of the method, so What to use names no fastest from it, and the charts hatch it"
    )


def epoch_time_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Train time over the epochs evaluated (the mean recorded epoch time where there is none)."""
    m = rec.metrics
    epochs_done = number(m.evaluations[-1].get("epoch")) if m.evaluations else None
    epoch_time = m.train_time_s / epochs_done if m.train_time_s and epochs_done else _mean(m.epoch_time_s)
    row.raw["epoch_time"] = epoch_time
    row.text["epoch_time"] = _fmt(epoch_time, ".2f", " s") + busy_mark(rec, notes)


def train_time_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Seconds of training, evaluation and checkpoints excluded."""
    row.raw["train_time"] = rec.metrics.train_time_s
    row.text["train_time"] = _fmt(rec.metrics.train_time_s, ".2f", " s") + busy_mark(rec, notes)


def throughput_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Samples per second (global batch over the step time)."""
    row.raw["throughput"] = rec.metrics.throughput_samples_per_s
    row.text["throughput"] = _fmt(rec.metrics.throughput_samples_per_s, ".1f") + busy_mark(rec, notes)
    metrics = rec.fields.get("metrics")
    tokens = number(metrics.get("throughput_tokens_per_s")) if isinstance(metrics, dict) else None
    row.raw["throughput_tokens"] = tokens
    if tokens is not None:  # a language model: its samples are windows of tokens
        row.text["throughput"] += f" ({tokens:,.0f} tokens/s)"


def speedup_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Throughput over the single fp32 row's on the same machine."""
    tp, base = row.raw["throughput"], ctx.baselines.get(rec.machine.name)
    if tp and base:
        row.raw["speedup"] = tp / base
        row.text["speedup"] = (f"{row.raw['speedup']:.2f}x" + (" (baseline)" if is_baseline(rec) else "")
                               + busy_mark(rec, notes))  # fmt: skip
    else:
        row.raw["speedup"] = None
        row.text["speedup"] = "n/a" + notes.mark(
            "n/a: no completed single fp32 row on this machine to compare with"
        )


def alloc_peak_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The allocator peak (what the estimate predicts), measured: torch.cuda.max_memory_allocated on a GPU (the
    peak memory column itself), --measure-alloc's glibc reading on a CPU."""
    raw, text = row.raw, row.text
    allocs = [a for a in rec.metrics.cpu_alloc_peak_bytes if a]
    if raw["peak_memory_kind"] == "cuda_max_allocated" and raw["peak_memory"]:
        raw["alloc_peak"] = raw["peak_memory"]
        text["alloc_peak"] = fmt_bytes(raw["alloc_peak"]) + notes.mark(
            "allocator peak on a GPU: torch.cuda.max_memory_allocated, the same figure as the peak memory column"
        )
    elif allocs:
        raw["alloc_peak"] = max(allocs)
        imports = [b for b in rec.metrics.cpu_alloc_import_bytes if b]
        text["alloc_peak"] = fmt_bytes(raw["alloc_peak"]) + notes.mark(
            "allocator peak on a CPU: the bytes glibc's malloc handed out during step 2 (mallinfo2 after every op, "
            "above a baseline read before the model was built; --measure-alloc), the largest over the ranks: the "
            "quantity the estimate predicts, which process RSS hides under the runtime's ~0.4 GiB. Python modules "
            "the method imported after the baseline are measured apart and left out (report.csv: "
            "alloc_import_bytes; docs/memory.md)"
        )
        raw["alloc_imports"] = max(imports) if imports else 0
    else:
        raw["alloc_peak"] = None
        text["alloc_peak"] = "n/a" + notes.mark(
            "n/a: no allocator measurement (on a CPU it needs --measure-alloc, on by default in compare cells, "
            "and glibc's mallinfo2)"
        )


def predicted_peak_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """stratbench.predicting.estimate's peak for the cell's config, and its error against the measured allocator peak."""
    raw, text = row.raw, row.text
    pred = predict_peak(rec)
    raw["predicted"] = pred
    raw["prediction_error_pct"] = None
    if pred is None:
        text["predicted"] = "n/a" + notes.mark("n/a: the predictor gave no estimate for this cell")
    elif raw["alloc_peak"]:
        raw["prediction_error_pct"] = (pred - raw["alloc_peak"]) / raw["alloc_peak"] * 100
        text["predicted"] = f"{fmt_bytes(pred)} ({raw['prediction_error_pct']:+.0f}%)" + notes.mark(
            "predicted peak: stratbench.predicting.estimate for the cell's config, the busiest rank; error = predicted / "
            "allocator peak - 1"
        )
    else:
        text["predicted"] = fmt_bytes(pred) + notes.mark(
            "the prediction is of tensor memory; on CPU the measured peak is process RSS, so no error % is given"
        )


def predict_peak(rec: RunRecord) -> int | None:
    """The estimator's peak for this cell's config (None where it has none; it never raises)."""
    if not rec.config:
        return None
    return predict_peak_bytes(dict(rec.config), rec.world, "cuda" if rec.on_gpu else "cpu", rec.environment)


def mfu_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Model FLOPs utilisation, n/a with the reason where it would mislead (a CPU, an unknown GPU, no FLOPs)."""
    mfu = rec.metrics.mfu
    row.raw["mfu"] = mfu
    metrics = rec.fields.get("metrics") or {}
    if mfu is not None:
        given = metrics.get("peak_flops_source") == "--peak-tflops"
        row.text["mfu"] = f"{mfu * 100:.1f}%" + (notes.mark(
            "MFU against the peak FLOP/s per device given with --peak-tflops: the model's FLOPs per sample x "
            "samples/s, shared by every device the run occupies"
        ) if given else "")  # fmt: skip
    elif not rec.on_gpu:
        row.text["mfu"] = "n/a" + notes.mark(
            "n/a: MFU needs the peak FLOP/s of a known GPU; a CPU has none in the table (give one with "
            "--peak-tflops)"
        )
    elif not rec.metrics.flops_per_sample:
        row.text["mfu"] = "n/a" + notes.mark("n/a: FLOPs were not counted (--measure-flops false)")
    else:
        row.text["mfu"] = "n/a" + notes.mark(
            "n/a: no peak FLOP/s known for this GPU model (stratbench.measuring.metrics.PEAK_FLOPS)"
        )


def comm_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Measured MiB on the wire per rank and step (ring model over the measured payloads), and the largest
    error of the method's formula over its collective kinds."""
    raw, text = row.raw, row.text
    comm = rec.metrics.comm
    raw["comm"] = raw["comm_formula_error_pct"] = None
    if not comm or "wire_bytes_per_step" not in comm:
        text["comm"] = "n/a" + notes.mark("n/a: collectives were not recorded (--comm-volume false)")
        return
    raw["comm"] = comm["wire_bytes_per_step"]
    text["comm"] = f"{raw['comm'] / 2**20:.2f} MiB"
    errors = [
        abs(c["error_pct"]) for c in (comm.get("check") or {}).values() if c.get("error_pct") is not None
    ]
    if errors:
        raw["comm_formula_error_pct"] = max(errors)
        text["comm"] += f", formula {raw['comm_formula_error_pct']:.1f}%"
    text["comm"] += notes.mark(
        "comm / step: bytes each rank sends per optimizer step under the ring model, from every collective "
        "torch.profiler recorded in step 3 (docs/communication.md); x: its multiple of ddp's; formula: the "
        "largest error of the method's comm_model over its collective kinds"
    )
    if "inter_node_wire_bytes_per_step" in comm:
        text["comm"] += (
            f"; intra {comm['intra_node_wire_bytes_per_step'] / 2**20:.2f} MiB, "
            f"inter {comm['inter_node_wire_bytes_per_step'] / 2**20:.2f} MiB"
        ) + notes.mark(
            "intra, inter: of those bytes, the busiest rank's on calls whose process group sits on one node and on "
            "calls whose group spans nodes (all of such a call's bytes; docs/communication.md, \"Intra- and "
            "inter-node bytes\")"
        )


def not_compute_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The share of the step outside forward, backward and the optimizer (metrics.breakdown)."""
    share = number((rec.metrics.breakdown or {}).get("not_compute_share"))
    row.raw["not_compute"] = share
    if share is None:
        row.text["not_compute"] = "n/a" + notes.mark(
            "n/a: the step's phases were not timed (--breakdown false)"
        )
        return
    row.text["not_compute"] = f"{share * 100:.1f}%" + notes.mark(
        "not compute: the share of the step outside forward, backward and the optimizer step: waiting for the "
        "batch, bookkeeping, and any gap no phase covers (metrics.breakdown; each phase timed on its own "
        "clock reads; the chart chart_breakdown.png splits the step). Communication that DDP/FSDP overlap "
        "with backward counts in backward"
    )


def accuracy_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """Validation accuracy after the last epoch, in %; a language model's is next-token accuracy, and its
    validation perplexity follows it."""
    acc = rec.metrics.val_accuracy
    row.raw["val_accuracy"] = acc
    row.text["val_accuracy"] = _fmt(acc * 100 if acc is not None else None, ".2f", "%")
    metrics = rec.fields.get("metrics")
    ppl = number(metrics.get("val_perplexity")) if isinstance(metrics, dict) else None
    row.raw["val_perplexity"] = ppl
    if ppl is not None:
        row.text["val_accuracy"] += f" (perplexity {ppl:.2f})"


def loss_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The training loss of the last step."""
    row.raw["final_loss"] = rec.metrics.final_loss
    row.text["final_loss"] = _fmt(rec.metrics.final_loss, ".4f")


def trainable_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The parameters the run trained, of the model's (result.json's model_meta: LoRA trains its adapters only);
    n/a in a record from before they were recorded."""
    counts = rec.fields.get("parameters") or {}
    total, trainable = number(counts.get("total")), number(counts.get("trainable"))
    row.raw["parameters_total"] = int(total) if total is not None else None
    row.raw["trainable"] = int(trainable) if trainable is not None else None
    if total and trainable is not None:
        row.text["trainable"] = f"{int(trainable):,} of {int(total):,} ({trainable / total:.1%})"
    else:
        row.text["trainable"] = "n/a"


def _moe_of(rec: RunRecord) -> dict[str, Any]:
    """result.json's ``moe`` (an MoE run's parameters and routing); empty for a dense model."""
    moe = rec.fields.get("moe")
    return moe if isinstance(moe, dict) else {}


def moe_params_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """An MoE run's parameters used per token (the dense parts, the shared experts and top-k routed experts of each
    layer) of its total; blank for a dense model."""
    moe = _moe_of(rec)
    active, total = number(moe.get("active_parameters")), number(moe.get("total_parameters"))
    row.raw["moe_active"] = int(active) if active is not None else None
    row.raw["moe_total"] = int(total) if total is not None else None
    if not moe:
        row.text["moe_active"] = DASH
    else:
        row.text["moe_active"] = f"{active / 1e6:.2f}M of {total / 1e6:.2f}M" if active and total else "n/a"


def moe_balance_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """An MoE run's routing: the worst layer's load imbalance (assignments of the busiest expert / the mean over
    every trained micro-batch and rank; 1 is balanced) and the share of assignments dropped over the capacity."""
    moe = _moe_of(rec)
    imbalance, dropped = number(moe.get("load_imbalance")), number(moe.get("dropped_fraction"))
    row.raw["moe_imbalance"], row.raw["moe_dropped"] = imbalance, dropped
    if not moe:
        row.text["moe_balance"] = DASH
        return
    balance = f"{imbalance:.2f}x" if imbalance is not None else "n/a"
    row.text["moe_balance"] = f"{balance}, {dropped:.1%} dropped" if dropped else balance


MODEL_STATES = (("frozen", "frozen weights"), ("trainable", "trainable weights"), ("grads", "gradients"),
                ("optimizer", "optimizer state"))  # fmt: skip
"""The parts of a rank's model states the report splits (``model_states_cell``), in the order it shows them."""


def model_states_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The model states of the rank holding most of them, split: frozen and trainable weights, gradients, optimizer
    state (with DeepSpeed's fp32 master partitions), as each rank measured its own tensors (result.json's
    sharding); n/a where the run recorded no trainable split."""
    parts = model_state_parts(rec)
    for key, _ in MODEL_STATES:
        row.raw[f"states_{key}"] = parts.get(key)
    if not parts:
        row.raw["model_states"] = None
        row.text["model_states"] = "n/a"
        return
    row.raw["model_states"] = sum(parts.values())
    row.text["model_states"] = " / ".join(fmt_bytes(parts[key]) for key, _ in MODEL_STATES)


def model_state_parts(rec: RunRecord) -> dict[str, int]:
    """Frozen weights, trainable weights, gradients and optimizer state (+ master copies) of the rank whose
    model states are largest; empty where the record has no ``trainable_param_bytes``."""
    sh = rec.sharding
    ranks = len(sh.get("trainable_param_bytes") or [])
    if not ranks:
        return {}

    def at(key: str, i: int) -> int:
        values = sh.get(key) or []
        return int(values[i] or 0) if i < len(values) else 0

    per_rank = [{"frozen": at("param_bytes", i) - at("trainable_param_bytes", i),
                 "trainable": at("trainable_param_bytes", i), "grads": at("grad_bytes", i),
                 "optimizer": at("optimizer_state_bytes", i) + at("master_param_bytes", i)}
                for i in range(ranks)]  # fmt: skip
    return max(per_rank, key=lambda parts: sum(parts.values()))


def step_time_cell(rec: RunRecord, row: Row, notes: Footnotes, ctx: Context) -> None:
    """The measured median step, which the predicted step is set against (its text: the sweep's pass,
    ``predicted_step_finish``)."""
    row.raw["step_time"] = rec.metrics.step_time_median_s


# ------------------------------------------------------------------------------------------------
# what needs the whole sweep


def _calibration_key(rec: RunRecord) -> tuple[str, str, str]:
    """Machine, precision and model: a GPU row's prediction is calibrated on the baseline run sharing them."""
    return (
        rec.machine.name,
        precision_key(str(rec.precision), bool(rec.config.get("tf32"))),
        str(rec.model_name),
    )


UNCALIBRATED_CPU = (
    "n/a (predicted step): uncalibrated. On a CPU the projection needs this machine's probe and calibration runs "
    "made with the threads of a cell's process before the cells (`stratbench compare --calibrate`, the same "
    "command otherwise: it resumes and adds them); calibrated instead on the sweep's own all-core single run with "
    "another machine's probe, this column was 35-80% off (docs/projection.md)"
)


def predicted_step_finish(rows: list[Row], notes: Footnotes, ctx: Context) -> None:
    """Beside each measured median step, what stratbench.predicting.projection predicts for it on the machine it ran on.
    Where the sweep calibrated itself (compare --calibrate) from its calibration runs and probe profile, made
    for that cell before it ran; otherwise on a GPU from the device's profile, calibrated on the sweep's own
    `single` run of the same machine, precision and model; on a CPU not at all (docs/projection.md)."""
    if not ctx.predict:
        return
    singles: dict[tuple[str, str, str], RunRecord] = {}
    for r in rows:
        if r.rec.ok and is_baseline_run(r.rec) and r.rec.metrics.step_time_median_s:
            singles.setdefault(_calibration_key(r.rec), r.rec)
    for r in rows:
        r.raw["predicted_step"] = r.raw["step_error_pct"] = None
        r.raw["step_time"] = r.rec.metrics.step_time_median_s
        if r.raw["status"] != "ok" or r.raw.get("unreadable"):
            r.text["predicted_step"] = r.text.get("speedup", DASH)
            continue
        _predicted_step_cell(r, notes, ctx.hardware, ctx.calibration, singles)


def _predicted_step_cell(r: Row, notes: Footnotes, hardware: str | None, calibration: list[CalibrationRecord],
                         singles: dict[tuple[str, str, str], RunRecord]) -> None:  # fmt: skip
    """One completed row's prediction: from the calibration runs made for it, else (on a GPU) from its device's
    profile and the sweep's own baseline run; n/a with the reason where there is none."""
    basis = basis_for(r.rec, calibration) if calibration else None
    if basis is not None and basis.problem:
        r.text["predicted_step"] = "n/a" + notes.mark(f"n/a (predicted step): {basis.problem}")
    elif basis is not None:
        pred = predict_calibrated(
            r.rec, basis.runs, basis.profile or "", hardware, [str(c.id) for c in basis.runs]
        )
        _show_prediction(r, pred, _calibrated_note(hardware, basis.nproc), notes)
    elif not r.rec.on_gpu:
        r.text["predicted_step"] = "n/a" + notes.mark(UNCALIBRATED_CPU)
    else:
        cal = singles.get(_calibration_key(r.rec))
        pred = predict_record(r.rec, cal, hardware)
        _show_prediction(r, pred, _profile_note(pred), notes, calibration_row=cal is r.rec)


def _calibrated_note(hardware: str | None, nproc: int | None) -> str:
    """The footnote of a step predicted from the sweep's own calibration runs."""
    where = (f"the {hardware} profile given with --hardware" if hardware else
             f"this machine's probe profile (`stratbench probe --nproc {nproc}`, calibration/probe-w{nproc}/probe.yaml)")  # fmt: skip
    return (
        f"predicted step: stratbench.predicting.projection on {where}, calibrated by this sweep's calibration runs "
        "(compare --calibrate; calibration.jsonl): `single` at the per-process and the global batch with the "
        "threads of a cell's process, and each method once on one process for its own overhead per step "
        "(report.csv: predicted_step_basis). No measurement of the row itself enters its prediction; "
        "error = predicted / measured median step - 1 (docs/projection.md)"
    )


def _profile_note(pred: RecordPrediction) -> str:
    """The footnote of a GPU row's step predicted from its device's profile."""
    return (
        f"predicted step: stratbench.predicting.projection on the {pred.system} profile, "
        + ("calibrated on this sweep's single run of the same precision" if pred.calibrated
           else "at the profile's default efficiency for the model's family, uncalibrated (no single run of this "
                "precision in the sweep; report.csv: predicted_step_basis names the default's evidence)")
        + "; error = predicted / measured median step - 1 (docs/projection.md)"
    )  # fmt: skip


def _show_prediction(
    r: Row, pred: RecordPrediction, note: str, notes: Footnotes, calibration_row: bool = False
) -> None:
    """The predicted step and its error against the measured median step (none for the row the prediction was
    calibrated on), or n/a with the projection's reason."""
    r.raw["predicted_dominant"] = pred.dominant
    r.raw["predicted_basis"] = pred.basis
    if pred.step_s is None:
        r.text["predicted_step"] = "n/a" + notes.mark(f"n/a (predicted step): {pred.reason}")
        return
    r.raw["predicted_step"] = pred.step_s
    measured = r.raw["step_time"]
    text = f"{pred.step_s * 1e3:.1f} ms"
    if calibration_row:
        text += " (calibration)"
    elif measured:
        r.raw["step_error_pct"] = (pred.step_s / measured - 1) * 100
        text += f" ({r.raw['step_error_pct']:+.0f}%)"
    r.text["predicted_step"] = text + notes.mark(note)


def comm_ratio_finish(rows: list[Row], notes: Footnotes, ctx: Context) -> None:
    """Each row's measured bytes on the wire per step as a multiple of the reference method's (``ddp``; same
    machine and precision)."""
    reference = {
        (r.rec.machine.name, r.raw["precision"]): r.raw["comm"]
        for r in rows
        if is_comm_reference(r.rec) and r.raw.get("comm")
    }
    for r in rows:
        base = reference.get((r.rec.machine.name, r.raw["precision"]))
        if r.raw.get("comm") is not None and base:
            r.raw["comm_vs_ddp"] = r.raw["comm"] / base
            r.text["comm"] = r.text["comm"].replace(" MiB", f" MiB ({r.raw['comm_vs_ddp']:.2f}x)", 1)


# ------------------------------------------------------------------------------------------------
# a cell run N times (compare --repeats)


@dataclass(frozen=True)
class Spread:
    """How a column shows the smallest and largest of a cell's repeated runs: the measure in the record's
    ``repeats``, the cell's text of a value, the bracket's text of a value."""

    measure: str
    cell: Callable[[Any], str]
    short: Callable[[Any], str]


def add_spread(rec: RunRecord, row: Row, notes: Footnotes, spreads: list[tuple[str, Spread]]) -> None:
    """A cell run N times (compare --repeats): its values are medians; show the smallest and largest run."""
    raw, text = row.raw, row.text
    n = int(rec.repeats.get("n") or 1)
    raw["repeats"] = n
    if n < 2:
        return
    mark = notes.mark(
        f"median of {n} runs of the cell (compare --repeats {n}); the smallest-largest run in brackets "
        "(in the HTML table below the value; none: every run gave the same value)"
    )
    for col, spread in spreads:
        s = (rec.repeats.get("metrics") or {}).get(spread.measure)
        if not s or raw.get(col) is None:
            continue
        cell = spread.cell
        raw[f"{col}_min"], raw[f"{col}_max"] = s["min"], s["max"]
        old = cell(raw[col])
        raw[col] = s["median"]  # peak memory: the median over runs of each run's largest rank
        rest = text[col][len(old) :] if text[col].startswith(old) else ""  # footnote marks after the value
        lo, hi = spread.short(s["min"]), spread.short(s["max"])
        text[col] = f"{cell(s['median'])}" + (f" ({lo}–{hi})" if lo != hi else "") + f"{rest}{mark}"
        if lo != hi:  # the HTML table shows the range on a second line of the cell
            text[f"{col}__main"], text[f"{col}__spread"] = f"{cell(s['median'])}{rest}{mark}", f"{lo}–{hi}"
