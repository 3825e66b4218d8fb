"""What a report says besides its columns: the report itself (title, records, sources, command), what every cell
trained and on which machines, the section headings and how to read the table. ``markdown_page`` and
``html_page`` render it; ``report`` writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stratbench.measuring.records import CalibrationRecord, RunRecord, as_run_record


@dataclass
class Report:
    title: str
    records: list[RunRecord]
    """The rows, in table order (a record given as JSON is parsed)."""
    sources: list[str]
    description: str = ""
    command: str = ""
    hardware: str | None = None
    """The profile of the predicted-step column (a system name or probe file); None: the sweep's probe, else each
    record's device's."""
    calibration: list[CalibrationRecord] = field(default_factory=list)
    """The sweeps' calibration records (compare --calibrate), which the predicted-step column rests on."""
    started_from: str = ""
    """The model every cell started from, where the sweep trained it first (its ``pretrain`` run); '' otherwise."""

    def __post_init__(self) -> None:
        self.records = [as_run_record(rec) for rec in self.records]


def settings(records: list[RunRecord]) -> str:
    """One line naming what every cell trained (from the first record that ran)."""
    for rec in records:
        cfg = rec.config
        if cfg.get("model"):
            bits = [f"model {cfg['model']}" + (f" (width {cfg.get('width')})" if cfg.get("model") == "tinynet" else ""),
                    f"data {cfg.get('data')}" + (f" at {cfg['image_size']}x{cfg['image_size']}" if cfg.get("image_size") else ""),
                    f"{cfg.get('epochs')} epochs" + (f" (max {cfg['max_steps']} steps)" if cfg.get("max_steps") else ""),
                    f"optimizer {cfg.get('optimizer')} lr {cfg.get('lr')}", f"seed {cfg.get('seed')}"]  # fmt: skip
            return ", ".join(bits)
    return ""


WRAPPED_LIBRARIES = ("deepspeed", "accelerate")
"""The packages (not methods) whose versions a machine's line names: the libraries some methods wrap."""


def machines(records: list[RunRecord]) -> list[str]:
    """One line per machine: its name, torch, python, CUDA and the versions of the libraries methods wrap."""
    out: list[str] = []
    for rec in records:
        env = rec.environment
        pk = env.get("packages") or {}
        line = (f"{rec.machine.name}; torch {env.get('torch')}, python {env.get('python')}"
                + (f", CUDA {env['cuda']}" if env.get("cuda") and env.get("device_type") == "cuda" else "")
                + "".join(f", {k} {v}" for k, v in pk.items() if v and k in WRAPPED_LIBRARIES))  # fmt: skip
        if env and line not in out:
            out.append(line)
    return out


HOW_TO_READ = (
    "Each row is one run of the same model and data with one method and precision, in its own processes. "
    "`devices` is how many devices (GPUs, or CPU processes) share the global batch, with the method's device "
    "mesh where it splits more than the data (dp2 x tp2: 2 data-parallel groups of 2 tensor-parallel ranks); the global batch is the "
    "same for every row, so all rows train the same problem and their accuracies are comparable (the test suite "
    "checks that every data-parallel method trains the same model as single: loss curves over 20 steps within "
    "1e-9 relative in fp64, and within 1e-5 in fp32 against a single-device run with the same micro-batch "
    "shapes, which is how DeepSpeed, having no fp64 mode, is checked). "
    "Peak memory is per device (the largest rank), which is what decides whether a run fits. Train time and "
    "throughput exclude evaluation and checkpointing; the speed-up is throughput divided by the single fp32 "
    "row's. Sharded methods (ddp-zero, fsdp, deepspeed ZeRO) trade memory for communication: on one machine's "
    "CPU cores their extra communication usually costs time, on GPUs with fast links it buys memory."
)

WHAT_TO_USE = "What to use"
AT_A_GLANCE = "Completed cells at a glance"
NOT_COMPLETED = "Cells that did not complete"
ALL_MEASUREMENTS = "All measurements"
