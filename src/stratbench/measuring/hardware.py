"""Hardware profiles: GPUs, links and systems (nodes) as data, read from ``hardware.yaml`` in the package and
from user files (``--hardware FILE``), validated before any work with one-line errors.

This is the one source of truth for device peaks: ``stratbench.measuring.metrics`` takes its MFU peak table from here,
and ``stratbench.predicting.projection`` prices compute, communication and memory traffic with the same numbers. See the
header of ``hardware.yaml`` for what every field means and where every number comes from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError
from stratbench.measuring.comm import KINDS

BUILTIN = Path(__file__).with_name("hardware.yaml")
PUBLISHED = Path(__file__).with_name("published.yaml")
"""Published training throughputs (their ids are the evidence ``default_efficiency`` entries name)."""
PRECISION_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
FAMILIES = ("convnet", "transformer")
"""Model families with their own default efficiencies (``stratbench.models.family`` decides a model's)."""

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_NUM = r"([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|(?i:infinity|inf|nan)))"


class HardwareError(ConfigError):
    """A hardware profile that is missing a number or has a bad one (one line, naming file, entry and field)."""


def _number(text: Any, where: str, units: dict[str, float], example: str, zero_ok: bool = False) -> float:
    """'67 TFLOP/s' -> 6.7e13 for the given unit suffixes (each may take a decimal or binary prefix). A negative,
    infinite or NaN value is named as such, whether written as a YAML number or with a unit."""
    if isinstance(text, bool):
        raise HardwareError(f"{where}: {text!r} is not a number with a unit (write e.g. {example})")
    if isinstance(text, (int, float)):
        value = _in_range(float(text), text, where, zero_ok)
        if "" not in units:
            raise HardwareError(f"{where}: {text!r} needs a unit (write e.g. {example})")
        return value
    m = re.fullmatch(rf"\s*{_NUM}\s*([A-Za-z]*)(\S*)\s*", str(text))
    if not m:
        raise HardwareError(f"{where}: {text!r} is not a number with a unit (write e.g. {example})")
    value = _in_range(float(m.group(1)), text, where, zero_ok)
    unit = m.group(2) + m.group(3)
    scale = _unit_scale(unit, units)
    if scale is None:
        allowed = ", ".join(u for u in units if u) or "none"
        raise HardwareError(f"{where}: unknown unit in {text!r} (units: {allowed}; write e.g. {example})")
    return value * scale


def _in_range(value: float, text: Any, where: str, zero_ok: bool) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise HardwareError(
            f"{where}: {text!r} must be a {'non-negative' if zero_ok else 'positive'}, finite number"
        )
    return value


def _unit_scale(unit: str, units: dict[str, float]) -> float | None:
    """The factor of ``unit`` (a suffix of ``units`` after an optional decimal or binary prefix), or None."""
    for suffix, factor in units.items():
        if not unit.endswith(suffix) or (suffix == "" and unit):
            continue
        prefix = unit[: len(unit) - len(suffix)]
        if prefix in _PREFIX:
            return _PREFIX[prefix] * factor
        if prefix in _BIN:
            return _BIN[prefix] * factor
    return None


def flops(text: Any, where: str) -> float:
    return _number(text, where, {"FLOP/s": 1.0, "FLOPS": 1.0}, "67 TFLOP/s")


def nbytes(text: Any, where: str) -> float:
    return _number(text, where, {"B": 1.0}, "80 GB")


def bandwidth(text: Any, where: str) -> float:
    """Bytes per second from 'B/s' (bytes) or 'b/s' (bits) with a prefix: '3.35 TB/s', '400 Gb/s'."""
    return _number(text, where, {"B/s": 1.0, "b/s": 0.125}, "3.35 TB/s or 400 Gb/s")


def seconds(text: Any, where: str) -> float:
    return _number(text, where, {"us": 1e-6, "ms": 1e-3, "ns": 1e-9, "s": 1.0}, "5.7 us", zero_ok=True)


def fraction(value: Any, where: str, top: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= top:
        raise HardwareError(f"{where}: {value!r} must be a fraction between 0 and {top:g}")
    return float(value)


ROOFLINE_CLASSES = ("large_gemm", "small_gemm", "convolution", "depthwise_convolution", "attention", "elementwise",
                    "reduction", "batch_norm", "other")  # fmt: skip
"""The op classes of the roofline basis (``models.flops.OP_CLASSES``; here too: hardware imports no model)."""
LATER_CLASSES = {"batch_norm": "reduction"}
"""Classes added after profiles were written -> the class a profile without them prices them as."""


@dataclass(frozen=True)
class Roofline:
    """What the roofline basis of the projection knows of one GPU generation (hardware.yaml ``roofline``): per op
    class the achievable fraction of the peak and of the memory bandwidth, the GEMM tile the library picks, and
    a fixed cost per kernel launch; ``source`` says where the numbers come from."""

    generation: str
    fractions: dict[str, tuple[float, float]]
    """Op class -> (compute fraction of the dtype's peak, fraction of the memory bandwidth)."""
    tile: tuple[int, int] = (128, 128)
    launch: float = 0.0
    source: str = ""
    measured: bool = False
    """True where `stratbench calibrate-hw` measured the fractions on the device (a profile's ``measured_roofline``)."""
    by_precision: dict[str, dict[str, float]] = field(default_factory=dict)
    """Measured profiles: precision key -> op class -> compute fraction of that precision's peak, where it was
    measured in more than one precision (``compute_fraction``)."""

    def compute_fraction(self, op_class: str, key: str) -> float:
        """The compute fraction of ``op_class`` at the peak of precision ``key``: the one measured in ``key``
        where there is one, else the class's."""
        return self.by_precision.get(key, {}).get(op_class, self.fractions[op_class][0])


@dataclass(frozen=True)
class DefaultEfficiency:
    """A default compute efficiency for one (GPU, precision, model family) and the evidence behind it."""

    value: float
    source: str
    """In words: what set it, e.g. "median implied efficiency of 2 published 1-GPU figures (ids)"."""
    evidence: tuple[str, ...] = ()
    """published.yaml ids and project run files that set it (empty: an assumption)."""
    note: str = ""
    """Empty where the (GPU, precision, family) has its own evidence; else the fallback rule that gave it."""


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    match: str
    """Regular expression searched (case-insensitively) in the device name torch reports."""
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of peak a training step reaches, per precision key (defaults filled in)."""
    efficiency_source: dict[str, str] = field(default_factory=dict)
    """Precision key -> the user's hardware file that set its efficiency; a key not here has the default."""
    kind: str = "cuda"
    """cuda, or cpu for a profile `stratbench probe` measured on processes sharing a CPU."""
    like: str | None = None
    """The GPU whose evidence-based defaults this one borrows where it has none of its own (hardware.yaml)."""
    family_efficiency: dict[tuple[str, str], DefaultEfficiency] = field(default_factory=dict)
    """(family, precision key) -> the default efficiency and its evidence (resolved with the fallback rules)."""
    sms: int | None = None
    """Streaming multiprocessors: a GEMM's tiles run in waves of this many (the roofline basis)."""
    roofline: Roofline | None = None
    """The roofline fractions of the GPU's generation (its own ``generation``, else its ``like`` GPU's)."""

    def peak(self, key: str) -> float | None:
        return self.peak_flops.get(key)

    def default_efficiency(self, key: str, family: str | None) -> DefaultEfficiency:
        """The default efficiency of a ``family`` model in precision ``key``: the evidence-based default where
        the data has one (own or by the fallback rules), else the per-precision assumption, flagged."""
        found = self.family_efficiency.get((family or "", key))
        if found is not None:
            return found
        why = (
            f"no evidence for {family} {key}"
            if family
            else "model family unknown (neither convnet nor transformer)"
        )
        return DefaultEfficiency(
            self.efficiency[key],
            f"assumption: {self.efficiency[key]:.0%} for {key} (defaults.efficiency)",
            (),
            why,
        )

    def matches(self, device_name: str) -> bool:
        return re.search(self.match, device_name, flags=re.IGNORECASE) is not None


@dataclass(frozen=True)
class CollectiveFit:
    """A measured alpha-beta fit of one collective kind (from `stratbench probe`): a call on ``ranks`` ranks
    costs ``latency`` + wire bytes / ``bandwidth``."""

    latency: float
    bandwidth: float
    ranks: int
    loaded_latency: float | None = None
    """A small call's cost right after a compute burst on every rank (the probe's ``loaded_latency``): what a
    collective costs inside training, where it also waits for the peer's slower compute and, on a CPU, for a
    core; the projection prices each call's latency at it where it is given."""

    @property
    def call_latency(self) -> float:
        return max(self.latency, self.loaded_latency or 0.0)


@dataclass(frozen=True)
class Link:
    key: str
    bandwidth: float
    """Bytes/s per direction per device."""
    latency: float
    """Seconds per ring step (alpha)."""
    efficiency: float = 1.0
    """Fraction of ``bandwidth`` a collective library reaches."""
    collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    """Measured per-kind fits that replace the ring model's bandwidth and latency (probe profiles)."""

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class System:
    key: str
    gpu: Gpu
    gpus_per_node: int
    intra_node: Link
    inter_node: Link | None
    host: Link
    nics_per_node: int = 1
    host_memory_bandwidth: float = 0.0
    call_latency: float = 0.0
    overlap: float = 1.0
    """The share of what the bucket schedule could hide that is hidden (1 on a GPU: collectives on their own
    stream; below 1 where `stratbench probe` measured the processes' collectives and compute contending)."""
    overlap_source: str = "default"
    compute_share: float = 1.0
    """Fraction of the device's single-process peak each device gets when every device of a node runs (1 on
    GPUs; below 1 on a CPU whose cores the processes share, as measured by `stratbench probe`)."""
    thread_share: float | None = None
    """CPU profiles: the fraction of the all-core peak that one process with ``threads_per_process`` threads
    reaches when it runs alone (measured by `stratbench probe`); a calibration run with that many threads is
    counted against it instead of the ideal threads / cores."""
    threads_per_process: int | None = None
    host_cores: int = 0
    """CPU cores of one node's host (0: not given, no input-pipeline ceiling); each process's main thread holds
    one, the rest run the data loaders (``stratbench.predicting.projection``, input pipeline)."""
    step_time_cv: float = 0.0
    """Coefficient of variation of one process's micro-step time: the jitter the slowest of N processes adds at
    each synchronisation (stragglers; hardware.yaml ``defaults.step_time_cv``)."""
    source: str = "built-in"

    def inter_bandwidth_per_device(self) -> float:
        """The node's inter-node bandwidth shared by its devices (rail-aligned NICs: one per device)."""
        if self.inter_node is None:
            raise HardwareError(f"system {self.key!r} has no inter_node link: it cannot span several nodes")
        return self.inter_node.effective_bandwidth * self.nics_per_node / self.gpus_per_node


@dataclass(frozen=True)
class InputPipeline:
    """A data loader's host CPU time per sample (hardware.yaml ``input_pipelines``): where it is CPU-bound, one
    node's host feeds at most (host cores - its processes' main threads) / ``cpu_per_sample`` samples/s."""

    key: str
    cpu_per_sample: float
    """Seconds of one CPU core per training sample (decode and augmentation)."""
    source: str = ""


@dataclass
class Catalogue:
    gpus: dict[str, Gpu]
    links: dict[str, Link]
    systems: dict[str, System]
    default_efficiency: dict[str, float]
    default_overlap: float
    default_system: str | None = None
    default_step_time_cv: float = 0.0
    input_pipelines: dict[str, InputPipeline] = field(default_factory=dict)
    evidence: dict[tuple[str, str, str], DefaultEfficiency] = field(default_factory=dict)
    """(gpu key, family, precision key) -> the evidence-based default of hardware.yaml's ``default_efficiency``."""
    held_out: tuple[str, ...] = ()
    """published.yaml ids kept out of every default (the held-out check of benchmarks/projection_published.py)."""
    roofline: dict[str, Roofline] = field(default_factory=dict)
    """GPU generation -> its roofline fractions (hardware.yaml ``roofline``)."""

    def system(self, name: str) -> System:
        if name not in self.systems:
            raise HardwareError(
                f"unknown hardware {name!r}; choose one of: {', '.join(self.systems)} (or a YAML file)"
            )
        return self.systems[name]

    def input_pipeline(self, name: str) -> InputPipeline:
        if name not in self.input_pipelines:
            raise HardwareError(
                f"unknown input pipeline {name!r}; choose one of: {', '.join(self.input_pipelines) or 'none'}"
            )
        return self.input_pipelines[name]

    def gpu_for_device(self, device_name: str) -> Gpu | None:
        """The one GPU entry whose ``match`` finds ``device_name`` (None when none does)."""
        found = [g for g in self.gpus.values() if g.kind == "cuda" and g.matches(device_name)]
        return found[0] if found else None

    def ambiguous(self, device_name: str) -> list[str]:
        return [g.key for g in self.gpus.values() if g.kind == "cuda" and g.matches(device_name)]


_TOP = {"version", "defaults", "default_efficiency", "gpus", "links", "systems", "default_system",
        "input_pipelines", "roofline", "measured_roofline"}  # fmt: skip
_GPU_KEYS = {"name", "match", "peak_flops", "memory", "memory_bandwidth", "efficiency", "kind", "like", "sms",
             "generation"}  # fmt: skip
_ROOFLINE_KEYS = {"tile", "launch", "fractions", "source"}
_MEASURED_KEYS = _ROOFLINE_KEYS | {"device", "precision", "by_precision", "measured", "cases"}
MEASURED_MAX = 1.5
"""The largest measured fraction a profile takes: above the peak or bandwidth it was measured against (a CPU's
matmul peak from `probe`, a bandwidth under contention), within reason; beyond that the profile's numbers are wrong."""
_EVIDENCE_KEYS = {"gpu", "precision", "family", "value", "published", "runs", "how"}
_LINK_KEYS = {"bandwidth", "latency", "efficiency", "collectives"}
_SYS_KEYS = {"gpu", "gpus_per_node", "intra_node", "inter_node", "nics_per_node", "host", "host_memory_bandwidth",
             "call_latency", "overlap", "compute_share", "thread_share",
             "threads_per_process", "host_cores", "step_time_cv"}  # fmt: skip


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise HardwareError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(entry: dict[str, Any], allowed: set[str], required: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise HardwareError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    missing = sorted(required - set(entry))
    if missing:
        raise HardwareError(f"{where}: missing {missing[0]!r}")


def _parse_gpu(key: str, e: dict[str, Any], where: str, cat: Catalogue, user_file: str | None = None) -> Gpu:
    """One ``gpus`` entry; ``user_file``: the user's hardware file it comes from (None: the built-in one)."""
    defaults = cat.default_efficiency
    e = _mapping(e, where)
    _check_keys(e, _GPU_KEYS, {"name", "match", "peak_flops", "memory", "memory_bandwidth"}, where)
    try:
        re.compile(str(e["match"]))
    except re.error as exc:
        raise HardwareError(f"{where}.match: {e['match']!r} is not a regular expression ({exc})") from exc
    peaks = _mapping(e["peak_flops"], f"{where}.peak_flops")
    if not peaks:
        raise HardwareError(f"{where}.peak_flops: give at least one precision ({', '.join(PRECISION_KEYS)})")
    for k in list(peaks) + list(_mapping(e.get("efficiency", {}), f"{where}.efficiency")):
        if k not in PRECISION_KEYS:
            raise HardwareError(f"{where}: unknown precision {k!r}; allowed: {', '.join(PRECISION_KEYS)}")
    eff = dict(defaults)
    eff.update({k: fraction(v, f"{where}.efficiency.{k}") for k, v in e.get("efficiency", {}).items()})
    eff_source = {k: f"hardware file {user_file}" for k in e.get("efficiency", {})} if user_file else {}
    kind = e.get("kind", "cuda")
    if kind not in ("cuda", "cpu"):
        raise HardwareError(f"{where}.kind: {kind!r}; allowed: cuda, cpu")
    like = e.get("like")
    if like is not None and like not in cat.gpus:
        raise HardwareError(
            f"{where}.like: {like!r} is not a gpu defined before it; choose one of: {', '.join(cat.gpus)}"
        )
    peak_flops = {k: flops(v, f"{where}.peak_flops.{k}") for k, v in peaks.items()}
    generation = e.get("generation")
    if generation is not None and generation not in cat.roofline:
        allowed = ", ".join(cat.roofline) or "none"
        raise HardwareError(f"{where}.generation: {generation!r}; allowed: {allowed}")
    roofline = cat.roofline[generation] if generation else (cat.gpus[like].roofline if like else None)
    return Gpu(
        key=key,
        name=str(e["name"]),
        match=str(e["match"]),
        peak_flops=peak_flops,
        memory_bytes=nbytes(e["memory"], f"{where}.memory"),
        memory_bandwidth=bandwidth(e["memory_bandwidth"], f"{where}.memory_bandwidth"),
        efficiency=eff,
        efficiency_source=eff_source,
        kind=kind,
        like=like,
        family_efficiency=_family_defaults(key, peak_flops, like, cat),
        sms=_positive_int(e["sms"], f"{where}.sms") if "sms" in e else None,
        roofline=roofline,
    )


def _parse_roofline(key: str, e: Any, where: str, allowed: set[str] = _ROOFLINE_KEYS,
                    top: float = 1.0) -> Roofline:  # fmt: skip
    """One ``roofline`` entry: a GPU generation's fractions per op class (each at most ``top``), GEMM tile and
    launch cost."""
    e = _mapping(e, where)
    _check_keys(e, allowed, {"fractions"}, where)
    given = _mapping(e["fractions"], f"{where}.fractions")
    given = {**{c: given[was] for c, was in LATER_CLASSES.items() if was in given}, **given}
    missing = [c for c in ROOFLINE_CLASSES if c not in given]
    unknown = sorted(set(given) - set(ROOFLINE_CLASSES))
    if missing or unknown:
        bad = f"missing {missing[0]!r}" if missing else f"unknown class {unknown[0]!r}"
        raise HardwareError(f"{where}.fractions: {bad}; the classes are: {', '.join(ROOFLINE_CLASSES)}")
    fractions = {}
    for c in ROOFLINE_CLASSES:
        pair = _mapping(given[c], f"{where}.fractions.{c}")
        _check_keys(pair, {"compute", "bandwidth"}, {"compute", "bandwidth"}, f"{where}.fractions.{c}")
        fractions[c] = (fraction(pair["compute"], f"{where}.fractions.{c}.compute", top),
                        fraction(pair["bandwidth"], f"{where}.fractions.{c}.bandwidth", top))  # fmt: skip
    tile = e.get("tile", [128, 128])
    if not (isinstance(tile, list) and len(tile) == 2):
        raise HardwareError(f"{where}.tile: {tile!r} must be [rows, columns]")
    tile = (_positive_int(tile[0], f"{where}.tile"), _positive_int(tile[1], f"{where}.tile"))
    launch = seconds(e.get("launch", "0 us"), f"{where}.launch")
    return Roofline(key, fractions, tile, launch, str(e.get("source", "")))


def _parse_measured(key: str, e: Any, where: str, cat: Catalogue) -> None:
    """One ``measured_roofline`` entry (written by `stratbench calibrate-hw`): GPU ``key``'s fractions measured on
    the device (each above 0, at most ``MEASURED_MAX``), in ``precision`` and ``by_precision``; they replace the
    GPU's generation fractions, in ``cat.gpus`` and in every system of that GPU."""
    if key not in cat.gpus:
        raise HardwareError(f"{where}: {key!r} is not a gpu; choose one of: {', '.join(cat.gpus)}")
    base = _parse_roofline(key, e, where, _MEASURED_KEYS, MEASURED_MAX)
    zero = [c for c, pair in base.fractions.items() if 0 in pair]
    if zero:
        raise HardwareError(f"{where}.fractions.{zero[0]}: a measured fraction must be above 0")
    by_precision = {}
    for p, classes in _mapping(e.get("by_precision", {}) or {}, f"{where}.by_precision").items():
        if p not in PRECISION_KEYS:
            allowed = ", ".join(PRECISION_KEYS)
            raise HardwareError(f"{where}.by_precision: unknown precision {p!r}; allowed: {allowed}")
        w = f"{where}.by_precision.{p}"
        for c in _mapping(classes, w):
            if c not in ROOFLINE_CLASSES:
                classes_ = ", ".join(ROOFLINE_CLASSES)
                raise HardwareError(f"{w}: unknown class {c!r}; the classes are: {classes_}")
        by_precision[p] = {c: fraction(v, f"{w}.{c}", MEASURED_MAX) for c, v in classes.items()}
        zero = [c for c, v in by_precision[p].items() if v == 0]
        if zero:
            raise HardwareError(f"{w}.{zero[0]}: a measured fraction must be above 0")
    gpu = dataclasses.replace(cat.gpus[key], roofline=dataclasses.replace(
        base, generation=f"measured on {key}", measured=True, by_precision=by_precision))  # fmt: skip
    cat.gpus[key] = gpu
    for name, system in cat.systems.items():
        if system.gpu.key == key:
            cat.systems[name] = dataclasses.replace(system, gpu=gpu)


def _family_defaults(
    key: str, peaks: dict[str, float], like: str | None, cat: Catalogue
) -> dict[tuple[str, str], DefaultEfficiency]:
    """The evidence-based default of each (family, precision) of GPU ``key``, by the documented rules, in order:
    (1) its own evidence; (2) bf16 and fp16 share evidence where their peaks are equal (the same tensor cores);
    (3) the ``like`` GPU's default, said so. A (family, precision) none of them reaches has no entry here: the
    per-precision assumption, flagged (``Gpu.default_efficiency``)."""
    out: dict[tuple[str, str], DefaultEfficiency] = {}
    for family in FAMILIES:
        for p in peaks:
            own = cat.evidence.get((key, family, p))
            other = {"bf16": "fp16", "fp16": "bf16"}.get(p)
            twin = cat.evidence.get((key, family, other)) if other and peaks.get(other) == peaks[p] else None
            if own is not None:
                out[(family, p)] = own
            elif twin is not None:
                note = f"no {p} evidence for {family} on {key}: its {other} default (same tensor-core peak)"
                out[(family, p)] = dataclasses.replace(twin, note=note)
            elif like is not None and (family, p) in cat.gpus[like].family_efficiency:
                base = cat.gpus[like].family_efficiency[(family, p)]
                note = f"no evidence for {family} {p} on {key}: {like}'s default (gpus.{key}.like)"
                out[(family, p)] = dataclasses.replace(base, note=note)
    return out


def _parse_evidence(data: Any, where: str, cat: Catalogue) -> None:
    """hardware.yaml's ``default_efficiency``: ``held_out`` (published ids no default may use) and ``entries``,
    each a (gpu, precision, family) with its value, the evidence that set it (``published`` ids of
    published.yaml and/or project ``runs``) and ``how``."""
    data = _mapping(data, where)
    _check_keys(data, {"held_out", "entries"}, {"held_out", "entries"}, where)
    known = _published_ids()
    held = tuple(str(x) for x in data["held_out"] or ())
    for h in held:
        if h not in known:
            raise HardwareError(f"{where}.held_out: {h!r} is not an id of published.yaml")
    for i, e in enumerate(data["entries"] or ()):
        w = f"{where}.entries[{i}]"
        e = _mapping(e, w)
        _check_keys(e, _EVIDENCE_KEYS, {"gpu", "precision", "family", "value", "how"}, w)
        if e["precision"] not in PRECISION_KEYS or e["family"] not in FAMILIES:
            raise HardwareError(f"{w}: precision {e['precision']!r} / family {e['family']!r} is not one of "
                                f"{', '.join(PRECISION_KEYS)} / {', '.join(FAMILIES)}")  # fmt: skip
        published, runs = list(e.get("published") or ()), list(e.get("runs") or ())
        if not published and not runs:
            raise HardwareError(f"{w}: names no evidence (give published ids and/or project runs)")
        for pid in published:
            if pid not in known:
                raise HardwareError(f"{w}.published: {pid!r} is not an id of published.yaml")
            if pid in held:
                raise HardwareError(f"{w}.published: {pid!r} is held out (default_efficiency.held_out)")
        cat.evidence[(str(e["gpu"]), e["family"], e["precision"])] = DefaultEfficiency(
            fraction(e["value"], f"{w}.value"),
            f"{e['how']} ({', '.join(published + runs)})",
            tuple(published + runs),
        )
    cat.held_out = held


@functools.cache
def _published_ids() -> frozenset[str]:
    return frozenset(e["id"] for e in _read_yaml(PUBLISHED)["entries"])


def _parse_link(key: str, e: dict[str, Any], where: str) -> Link:
    e = _mapping(e, where)
    _check_keys(e, _LINK_KEYS, {"bandwidth", "latency"}, where)
    fits = {}

    for kind, fit in _mapping(e.get("collectives", {}), f"{where}.collectives").items():
        w = f"{where}.collectives.{kind}"
        if kind not in KINDS:
            raise HardwareError(f"{w}: unknown collective; allowed: {', '.join(KINDS)}")
        fit = _mapping(fit, w)
        _check_keys(
            fit, {"latency", "bandwidth", "ranks", "loaded_latency"}, {"latency", "bandwidth", "ranks"}, w
        )
        ranks = fit["ranks"]
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
            raise HardwareError(f"{w}.ranks: {ranks!r} must be an integer >= 2")
        loaded = fit.get("loaded_latency")
        fits[kind] = CollectiveFit(
            seconds(fit["latency"], f"{w}.latency"), bandwidth(fit["bandwidth"], f"{w}.bandwidth"), ranks,
            None if loaded is None else seconds(loaded, f"{w}.loaded_latency"),
        )  # fmt: skip
    return Link(
        key=key,
        bandwidth=bandwidth(e["bandwidth"], f"{where}.bandwidth"),
        latency=seconds(e["latency"], f"{where}.latency"),
        efficiency=fraction(e.get("efficiency", 1.0), f"{where}.efficiency"),
        collectives=fits,
    )


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HardwareError(f"{where}: {value!r} must be a positive integer")
    return value


def _parse_system(key: str, e: dict[str, Any], where: str, cat: Catalogue, source: str) -> System:
    e = _mapping(e, where)
    _check_keys(e, _SYS_KEYS, {"gpu", "gpus_per_node", "intra_node", "host"}, where)

    def ref(table: dict, name: Any, what: str) -> Any:
        if name not in table:
            noun = "gpu" if what == "gpu" else "link"
            raise HardwareError(f"{where}.{what}: unknown {noun} {name!r}; choose one of: {', '.join(table)}")
        return table[name]

    gpus_per_node = _positive_int(e["gpus_per_node"], f"{where}.gpus_per_node")
    inter = ref(cat.links, e["inter_node"], "inter_node") if e.get("inter_node") else None
    return System(
        key=key,
        gpu=ref(cat.gpus, e["gpu"], "gpu"),
        gpus_per_node=gpus_per_node,
        intra_node=ref(cat.links, e["intra_node"], "intra_node"),
        inter_node=inter,
        host=ref(cat.links, e["host"], "host"),
        nics_per_node=_positive_int(e.get("nics_per_node", 1), f"{where}.nics_per_node"),
        host_memory_bandwidth=bandwidth(e["host_memory_bandwidth"], f"{where}.host_memory_bandwidth")
        if "host_memory_bandwidth" in e
        else 0.0,
        call_latency=seconds(e["call_latency"], f"{where}.call_latency") if "call_latency" in e else 0.0,
        overlap=fraction(e.get("overlap", cat.default_overlap), f"{where}.overlap"),
        overlap_source="measured (probe)" if "overlap" in e else "default",
        compute_share=fraction(e.get("compute_share", 1.0), f"{where}.compute_share"),
        thread_share=fraction(e["thread_share"], f"{where}.thread_share") if "thread_share" in e else None,
        threads_per_process=_positive_int(e["threads_per_process"], f"{where}.threads_per_process")
        if "threads_per_process" in e
        else None,
        host_cores=_positive_int(e["host_cores"], f"{where}.host_cores") if "host_cores" in e else 0,
        step_time_cv=fraction(e.get("step_time_cv", cat.default_step_time_cv), f"{where}.step_time_cv"),
        source=source,
    )


def parse(data: Any, source: str, base: Catalogue | None = None) -> Catalogue:
    """A catalogue from one file's mapping, added to ``base`` (same keys replace base entries)."""
    where0 = f"hardware file {source}"
    data = _mapping(data, where0)
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise HardwareError(f"{where0}: unknown section {unknown[0]!r}; allowed: {', '.join(sorted(_TOP))}")
    defaults = _mapping(data.get("defaults", {}), f"{where0}: defaults")
    if base is None:
        eff_defaults = {
            k: fraction(v, f"{where0}: defaults.efficiency.{k}")
            for k, v in _mapping(defaults.get("efficiency", {}), f"{where0}: defaults.efficiency").items()
        }
        missing = [k for k in PRECISION_KEYS if k not in eff_defaults]
        if missing:
            raise HardwareError(f"{where0}: defaults.efficiency: missing {missing[0]!r}")
        if "overlap" not in defaults:
            raise HardwareError(f"{where0}: defaults: missing 'overlap'")
        overlap = fraction(defaults["overlap"], f"{where0}: defaults.overlap")
        cat = Catalogue({}, {}, {}, eff_defaults, overlap)
        cat.default_step_time_cv = fraction(
            defaults.get("step_time_cv", 0.0), f"{where0}: defaults.step_time_cv"
        )
        _parse_evidence(data.get("default_efficiency", {"held_out": [], "entries": []}),
                        f"{where0}: default_efficiency", cat)  # fmt: skip
    else:
        cat = Catalogue(
            dict(base.gpus),
            dict(base.links),
            dict(base.systems),
            dict(base.default_efficiency),
            base.default_overlap,
            evidence=dict(base.evidence),
            held_out=base.held_out,
            default_step_time_cv=base.default_step_time_cv,
            input_pipelines=dict(base.input_pipelines),
            roofline=dict(base.roofline),
        )
        if defaults or "default_efficiency" in data:
            raise HardwareError(
                f"{where0}: 'defaults' and 'default_efficiency' belong to the built-in file; set efficiency per gpu and "
                "overlap per system"
            )
    for key, e in _mapping(data.get("roofline", {}) or {}, f"{where0}: roofline").items():
        cat.roofline[key] = _parse_roofline(key, e, f"{where0}: roofline.{key}")
    for key, e in _mapping(data.get("gpus", {}) or {}, f"{where0}: gpus").items():
        user_file = None if base is None else source
        cat.gpus[key] = _parse_gpu(key, e, f"{where0}: gpus.{key}", cat, user_file)
    for key, e in _mapping(data.get("measured_roofline", {}) or {}, f"{where0}: measured_roofline").items():
        _parse_measured(key, e, f"{where0}: measured_roofline.{key}", cat)
    for key, e in _mapping(data.get("links", {}) or {}, f"{where0}: links").items():
        cat.links[key] = _parse_link(key, e, f"{where0}: links.{key}")
    for key, e in _mapping(data.get("input_pipelines", {}) or {}, f"{where0}: input_pipelines").items():
        w = f"{where0}: input_pipelines.{key}"
        _check_keys(_mapping(e, w), {"cpu_per_sample", "source"}, {"cpu_per_sample"}, w)
        cat.input_pipelines[key] = InputPipeline(
            key, seconds(e["cpu_per_sample"], f"{w}.cpu_per_sample"), str(e.get("source", ""))
        )
    for key, e in _mapping(data.get("systems", {}) or {}, f"{where0}: systems").items():
        cat.systems[key] = _parse_system(key, e, f"{where0}: systems.{key}", cat, source)
    default_system = data.get("default_system")
    if default_system is not None and default_system not in cat.systems:
        raise HardwareError(
            f"{where0}: default_system {default_system!r} is not one of its systems ({', '.join(cat.systems)})"
        )
    cat.default_system = default_system
    return cat


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise HardwareError(f"cannot read hardware file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise HardwareError(f"hardware file {path} is not text (byte {exc.start} is not UTF-8)") from exc
    except yaml.YAMLError as exc:
        raise HardwareError(f"hardware file {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc


@functools.cache
def builtin() -> Catalogue:
    return parse(_read_yaml(BUILTIN), BUILTIN.name)


def load(user_file: str | Path | None = None) -> Catalogue:
    """The built-in catalogue, extended by a user file when given."""
    if user_file is None:
        return builtin()
    path = Path(user_file)
    return parse(_read_yaml(path), str(path), builtin())


def resolve(spec: str) -> System:
    """``--hardware``: a built-in system name, a YAML file (its ``default_system``, or its only system), or
    ``FILE:SYSTEM``."""
    path, name = spec, ""
    if not Path(spec).is_file() and ":" in spec:
        path, _, name = spec.rpartition(":")
    if Path(path).is_file():
        data = _read_yaml(Path(path))
        cat = parse(data, path, builtin())
        own = list((data.get("systems") or {}) if isinstance(data, dict) else {})
        name = name or cat.default_system or (own[0] if len(own) == 1 else "")
        if not name:
            raise HardwareError(
                f"hardware file {path} defines {len(own)} systems: name one as {path}:SYSTEM or set default_system"
            )
        return cat.system(name)
    if Path(path).suffix in (".yaml", ".yml") or "/" in path:
        raise HardwareError(f"hardware file {path} does not exist")
    return builtin().system(spec)


def peak_flops_for_name(device_name: str, key: str) -> float | None:
    """Dense peak FLOP/s of the built-in GPU whose pattern matches this device name; None when unknown."""
    gpu = builtin().gpu_for_device(device_name)
    return gpu.peak(key) if gpu else None


def dump(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110)


def fmt_rate(value: float, unit: str) -> str:
    """6.7e13, 'FLOP/s' -> '67 TFLOP/s' (three significant digits) for writing profiles back."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"
