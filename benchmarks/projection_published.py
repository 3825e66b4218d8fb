"""Held-out check of the step-time projection against published training throughputs no one here made
(src/stratbench/measuring/published.yaml, each number with its source). Three tables, markdown:

* **scaling**: each multi-GPU entry predicted from its own 1-GPU figure only (the same source and setup, calibrated
  as `--calibrate` would a result.json of that run), or, where the source has no 1-GPU figure, anchored on its
  smallest multi-GPU figure (the efficiency that reproduces it); published vs predicted with the error;
* **the defaults**: every evidence-based default of hardware.yaml (``default_efficiency``) recomputed from the
  evidence it names; the script fails where the data drifts from its evidence by more than 0.001;
* **single GPU, default efficiency**: every 1-GPU figure against the projection with hardware.yaml's default
  efficiency for its GPU, precision and model family (no calibration) and with the old per-precision constant, the
  efficiency the figure implies, and its role: a figure that *sets* a default, or one *held out* from all of them
  (the errors are summarised separately);
* **float8** (issue 46): every float8 figure (torchtitan's, precision fp8: bf16-mixed with ``--float8 tensorwise``)
  against the projection with hardware.yaml's defaults alone (the fp8 default for the converted Linears, the bf16 one
  for the rest), the one that sets the fp8 default and the held-out ones apart;
* **multi-node sharded** (issue 45; the entries marked ``check: multi-node``): HSDP, ZeRO-3 and ZeRO++ figures,
  each predicted from its own anchor only (the ZeRO++ blog's bars, all at 384 GPUs: the same model and micro-batch's
  ZeRO-3 figure at the highest bandwidth), published vs predicted with the error, the rows that miss and the ones
  stratbench cannot express (n/a with the reason) included. A row whose method option this stratbench lacks (fsdp's
  ``replicate``, deepspeed's ``zero_hpz`` / ``zero_quantized_weights`` / ``zero_quantized_gradients`` before issue
  45's merge) is n/a with the option named.

    PYTHONPATH=src python benchmarks/projection_published.py

Nothing is measured on this machine: the inputs are the published numbers, the models' counted FLOPs and shapes
(transformers through benchmarks/published_models.py) and the hardware profiles (built-in, and
benchmarks/published_hardware.yaml for DGX-1). Which figures set defaults is hardware.yaml's ``default_efficiency``
(ResNet-50 and BERT-large pre-training; ResNeXt-101 and SQuAD held out); the multi-GPU rows are calibrated on their
own figures and use no default.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import statistics
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError
from stratbench.core.torchvision_compat import guard_torchvision_import
from stratbench.measuring.hardware import HardwareError, System, builtin, resolve
from stratbench.measuring.records import RunRecord
from stratbench.predicting.projection import (
    Calibration,
    Calibrations,
    MethodProjection,
    calibrate,
    precision_key,
    project,
)
from stratbench.strategies.base import get_strategy

HERE = Path(__file__).resolve().parent
HARDWARE = HERE / "published_hardware.yaml"
"""Systems the published runs used that hardware.yaml lacks (DGX-1 V100)."""

UNITS = ("img/s", "sequences/s", "tokens/s per GPU", "TFLOPs per GPU")
"""Units published.yaml may use: samples per second over all GPUs, tokens per second per GPU, or TFLOPs per GPU as
Megatron-DeepSpeed counts them (``published_models.megatron_flops_per_sequence``)."""

PRECISIONS = {"fp32": ("fp32", False), "tf32": ("fp32", True), "amp-fp16": ("fp16-mixed", False),
              "bf16": ("bf16-mixed", False), "fp8": ("bf16-mixed", False)}  # fmt: skip
"""published.yaml's precision -> (stratbench precision, tf32). fp8 is torchtitan's float8 recipe: bf16-mixed with
the Linears in float8 (``FLOAT8``)."""
FLOAT8 = {"fp8": "tensorwise"}
"""published.yaml's precision -> stratbench's --float8 recipe (torchtitan's default: one scale per tensor)."""

MODELS = {"resnet50": "resnet50", "resnext101-32x4d": "published_models:resnext101_32x4d",
          "bert-large": "published_models:bert_large_s{seq_len}",
          "bert-large-squad": "published_models:bert_large_squad", "llama3-8b": "llama-8b",
          "mpt-7b": "published_models:mpt_7b_s2048", "mpt-13b": "published_models:mpt_13b_s2048",
          "gpt-18b": "published_models:gpt_18b_s512", "gpt-49b": None, "gpt-91b": None, "gpt-138b": None,
          "llama2-7b": None, "llama2-13b": None, "llama2-34b": None, "llama2-70b": None,
          "efficientnet-b0": "published_models:efficientnet_b0", "efficientnet-b4": "published_models:efficientnet_b4",
          "efficientnet-widese-b0": None, "efficientnet-widese-b4": None,
          "se-resnext101-32x4d": "published_models:se_resnext101_32x4d"}  # fmt: skip
"""published.yaml's model -> stratbench --model (a builder in benchmarks/published_models.py where stratbench has none;
None: a model its source names without a shape these tools could read, in not_projectable entries only). Llama 3 8B
is the built-in ``llama-8b`` on synthetic tokens (``TOKEN_MODELS``), as `stratbench estimate --model llama-8b` runs
it: fsdp wraps each of its 32 decoder blocks."""

TOKEN_MODELS = {"llama-8b": 128256}
"""Built-in language models (text data) -> their vocabulary: an entry of one is projected on synthetic tokens of its
``seq_len`` (``--data synthetic-tokens --seq-len --vocab-size``), not on images of a stand-in's."""

MULTI_NODE = "multi-node"
"""An entry's ``check`` for the multi-node sharded table (issue 45) instead of the scaling table."""

OPTIMIZERS = {"convnet": "sgd", "transformer": "adamw"}
"""SGD with momentum (ResNet-50); LAMB, BertAdam and AdamW keep two states per parameter, as adamw does."""

DEVICE_NAMES = {"a100-sxm": "NVIDIA A100-SXM4-80GB", "v100-sxm2": "Tesla V100-SXM2-32GB",
                "h100-sxm": "NVIDIA H100 80GB HBM3", "h200-sxm": "NVIDIA H200"}  # fmt: skip
"""A torch.cuda device name per GPU profile, for the result.json a published 1-GPU figure is turned into."""

REQUIRED = ("id", "model", "family", "framework", "method", "gpu", "system", "precision", "batch_per_gpu", "gpus",
            "nodes", "throughput", "unit", "source")  # fmt: skip
SOURCE_FIELDS = ("repo", "path", "table", "row")


def load_published(path: Path | None = None) -> list[dict[str, Any]]:
    """The entries of published.yaml (the packaged file unless ``path``)."""
    if path is None:
        text = resources.files("stratbench.measuring").joinpath("published.yaml").read_text()
    else:
        text = path.read_text()
    return yaml.safe_load(text)["entries"]


def check_entry(e: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one entry of ``entries`` (an empty list: nothing)."""
    ids = {x["id"] for x in entries}
    anchors = {x.get("anchor") for x in entries}
    bad = [f"no {k}" for k in REQUIRED if e.get(k) in (None, "")]
    src = e.get("source") or {}
    bad += [f"source has no {k}" for k in SOURCE_FIELDS if not src.get(k)]
    if e.get("unit") not in UNITS:
        bad.append(f"unknown unit {e.get('unit')!r} (known: {', '.join(UNITS)})")
    if e.get("input_pipeline") and e["input_pipeline"] not in builtin().input_pipelines:
        bad.append(f"unknown input_pipeline {e['input_pipeline']!r} (hardware.yaml input_pipelines)")
    if e.get("family") not in OPTIMIZERS:
        bad.append(f"unknown family {e.get('family')!r}")
    if e.get("model") not in MODELS:
        bad.append(f"unknown model {e.get('model')!r}")
    elif MODELS[e["model"]] is None and not e.get("not_projectable"):
        bad.append(f"model {e['model']!r} has no shape here: the entry must be not_projectable")
    if e.get("check") not in (None, MULTI_NODE):
        bad.append(f"unknown check {e['check']!r} (known: {MULTI_NODE})")
    if e.get("unit") == "TFLOPs per GPU" and not e.get("not_projectable") and not _megatron_builder(e):
        bad.append("TFLOPs per GPU needs a model with a Megatron FLOP count (published_models.GPT_SHAPES)")
    for ref in ("baseline", "anchor", "float8_base"):
        if e.get(ref) and e[ref] not in ids:
            bad.append(f"{ref} {e[ref]!r} is no entry's id")
    if (e.get("gpus", 0) > 1 and not (e.get("baseline") or e.get("anchor")) and e.get("id") not in anchors
            and not e.get("not_projectable")):  # fmt: skip
        bad.append(
            "a multi-GPU entry needs a baseline (its 1-GPU entry) or an anchor, or is another's anchor"
        )
    return bad


def samples_per_step(e: dict[str, Any]) -> int:
    """Samples (images, sequences) one GPU processes per optimizer step."""
    return int(e["batch_per_gpu"]) * int(e.get("accumulation", 1))


def _megatron_builder(e: dict[str, Any]) -> str | None:
    """The published_models builder whose Megatron FLOP count converts entry ``e``'s TFLOPs (None: none)."""
    model = MODELS.get(e.get("model") or "")
    name = model.split(":", 1)[1] if model and model.startswith("published_models:") else ""
    return name if name in _published_models().GPT_SHAPES else None


def _published_models() -> Any:
    """benchmarks/published_models.py (the transformers' builders and FLOP counts), importable from here."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    guard_torchvision_import()  # it imports torchvision, which a CPU torch cannot import unaided
    return importlib.import_module("published_models")


def _per_sample(e: dict[str, Any]) -> float:
    """What one sample per second over all GPUs is in entry ``e``'s unit."""
    if e["unit"] == "tokens/s per GPU":
        return e["seq_len"] / e["gpus"]
    if e["unit"] == "TFLOPs per GPU":
        return _published_models().megatron_flops_per_sequence(_megatron_builder(e)) / e["gpus"] / 1e12
    return 1.0


def samples_per_s(e: dict[str, Any], value: float | None = None) -> float:
    """The entry's throughput (or ``value`` in its unit) as samples per second over all its GPUs."""
    v = float(e["throughput"] if value is None else value)
    return v / _per_sample(e)


def in_unit(e: dict[str, Any], samples: float) -> float:
    """Samples per second over all GPUs in the entry's unit."""
    return samples * _per_sample(e)


def config(e: dict[str, Any], strategy: str | None = None, gpus: int | None = None) -> TrainConfig:
    """The stratbench run of entry ``e`` on ``gpus`` devices (default: its own) with ``strategy`` (its method)."""
    if e["precision"] not in PRECISIONS:
        raise ConfigError(f"precision {e['precision']!r} has no stratbench equivalent")
    if not e.get("torchvision") and MODELS[e["model"]] is None:
        raise ConfigError(f"model {e['model']!r} has no shape in benchmarks/published_models.py")
    precision, tf32 = PRECISIONS[e["precision"]]
    gpus = gpus or e["gpus"]
    strategy = strategy or e["method"]
    options = dict(e.get("strategy_options") or {}) if strategy == e["method"] else {}
    # a torchvision classifier (timm's table): the stratbench --model name a user gives it
    model = e.get("torchvision") or MODELS[e["model"]].format(seq_len=e.get("seq_len"))
    if model in TOKEN_MODELS:  # a built-in language model, on text data as a user runs it
        data = {"data": "synthetic-tokens", "seq_len": e["seq_len"], "vocab_size": TOKEN_MODELS[model]}
    else:  # a benchmark builder's token model reads its tokens from an image of 3 x side x side values
        side = e.get("image_size") or math.ceil(math.sqrt(e["seq_len"] / 3))
        data = {"data": "synthetic", "image_size": side, "num_classes": 1000}
    cfg = TrainConfig(
        model=model, **data, precision=precision, tf32=tf32,
        batch_size=samples_per_step(e) * gpus, grad_accum=int(e.get("accumulation", 1)),
        optimizer=e.get("optimizer") or OPTIMIZERS[e["family"]], strategy=strategy, strategy_options=options,
        activation_checkpointing=bool(e.get("activation_checkpointing")), float8=FLOAT8.get(e["precision"], "none"),
    )  # fmt: skip
    # the multi-node rows' methods place groups by node (ZeRO++'s qgZ, HSDP's shard group): say how many
    return cfg.replace(nnodes=e["nodes"]) if e.get("check") == MULTI_NODE and gpus == e["gpus"] else cfg


def system_of(e: dict[str, Any]) -> System:
    """The hardware profile entry ``e`` is projected on."""
    try:
        return resolve(e["system"])
    except HardwareError:  # not built in: the benchmark's own file
        return resolve(f"{HARDWARE}:{e['system']}")


def calibration_from(base: dict[str, Any], system: System) -> Calibrations:
    """What `--calibrate` makes of the 1-GPU run ``base`` describes: its step = samples per step / throughput."""
    cfg = config(base, "single", 1)
    result = {
        "status": "ok", "world_size": 1, "config": cfg.to_dict(),
        "environment": {"device_type": "cuda", "gpus": [DEVICE_NAMES[system.gpu.key]]},
        "metrics": {"step_time_median_s": samples_per_step(base) / samples_per_s(base)},
    }  # fmt: skip
    return calibrate(
        [RunRecord.from_dict(result)], system, [f"{base['id']} ({base['throughput']:g} {base['unit']})"]
    )


def anchored_calibration(anchor: dict[str, Any], system: System) -> Calibrations:
    """The efficiency with which the projection reproduces the multi-GPU figure ``anchor`` (bisection: throughput
    grows with efficiency), for a source with no 1-GPU figure. A float8 figure solves for the fp8 efficiency (its
    converted Linears' products); the rest is priced at the efficiency that reproduces its ``float8_base`` (the same
    source's figure without float8) where it names one, else at hardware.yaml's default."""
    cfg = config(anchor)
    key = "fp8" if cfg.float8 != "none" else precision_key(cfg.precision, cfg.tf32)
    rest = float8_base_calibration(anchor, system)
    target = samples_per_s(anchor)

    def throughput(eff: float) -> float:
        cal = rest | {key: Calibration(eff, key, device=system.gpu.key, source=f"anchored on {anchor['id']}")}
        p = _project(anchor, cfg, system, cal)
        return p.throughput or 0.0

    lo, hi = 1e-4, 1.0
    if throughput(hi) < target:
        raise ConfigError(f"no efficiency up to 1 reproduces {anchor['id']}")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if throughput(mid) < target else (lo, mid)
    eff = math.sqrt(lo * hi)
    return rest | {
        key: Calibration(eff, key, device=system.gpu.key, source=f"anchored on {anchor['id']} ({eff:.1%})")
    }


def float8_base_calibration(e: dict[str, Any], system: System) -> Calibrations:
    """The calibration that prices a float8 figure's unconverted part: the one reproducing its ``float8_base`` (the
    same source's figure without float8); empty where it names none (the default then)."""
    if not e.get("float8_base"):
        return {}
    base = {x["id"]: x for x in load_published()}[e["float8_base"]]
    return anchored_calibration(base, system)


def _project(
    e: dict[str, Any], cfg: TrainConfig, system: System, cal: Calibrations | None
) -> MethodProjection:
    """``cfg`` on entry ``e``'s nodes and GPUs per node, with its CPU data loader where it names one (no memory
    estimate: fit is not what is checked)."""
    pipeline = builtin().input_pipeline(e["input_pipeline"]) if e.get("input_pipeline") else None
    return project(cfg, system, nodes=e["nodes"], gpus_per_node=e["gpus"] // e["nodes"], calibration=cal,
                   memory=False, input_pipeline=pipeline)  # fmt: skip


@dataclass
class Prediction:
    """One multi-GPU entry: published and predicted throughput in its unit, or why there is no prediction."""

    entry: dict[str, Any]
    basis: str
    published: float
    predicted: float | None = None
    reason: str = ""
    efficiency: float | None = None
    projection: MethodProjection | None = None

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.published - 1


def predict(e: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> Prediction:
    """Entry ``e`` predicted from its own 1-GPU figure (``baseline``) or anchored on ``anchor``; n/a with the reason
    where stratbench cannot express the setup."""
    ref = by_id.get(e.get("baseline") or e.get("anchor") or "")
    basis = (f"1 GPU: {ref['throughput']:g}" if e.get("baseline") else f"{ref['gpus']} GPUs: {ref['throughput']:g}"
             ) if ref else "-"  # fmt: skip
    out = Prediction(e, basis, float(e["throughput"]))
    if e.get("not_projectable"):
        out.reason = e["not_projectable"]
        return out
    if why := unknown_options(e):
        out.reason = why
        return out
    try:
        system = system_of(e)
        # the anchor on its own system (the ZeRO++ blog's anchor has more NICs per node than the rows it predicts)
        basis = calibration_from(ref, system) if e.get("baseline") else None
        cal = basis or anchored_calibration(ref, system_of(ref))
        p = _project(e, config(e), system, cal)
    except ConfigError as exc:
        out.reason = str(exc)
        return out
    if p.status != "ok" or not p.throughput:
        out.reason = p.reason or p.status
        return out
    out.predicted, out.efficiency, out.projection = in_unit(e, p.throughput), p.efficiency, p
    return out


def unknown_options(e: dict[str, Any]) -> str | None:
    """Why this stratbench cannot take entry ``e``'s strategy options (issue 45's HSDP ``replicate`` and ZeRO++
    options before they are merged), in one line; None where it takes them."""
    options = dict(e.get("strategy_options") or {})
    known = {f.name for f in dataclasses.fields(get_strategy(e["method"]).Options)}
    if unknown := sorted(set(options) - known):
        return (f"{e['method']} here has no option {', '.join(unknown)} (issue 45's HSDP / ZeRO++ options: rerun "
                "after they are merged)")  # fmt: skip
    try:
        get_strategy(e["method"]).parse_options(options)
    except ConfigError as exc:
        return str(exc)
    return None


def single_default(e: dict[str, Any]) -> tuple[float | None, float | None, float | None, str]:
    """(the default efficiency's projection of 1-GPU entry ``e`` in its unit, the projection with the old
    per-precision constant (defaults.efficiency, before issue 33), the efficiency the published figure implies,
    why none)."""
    try:
        system = system_of(e)
        cfg = config(e, "single", 1)
        p = _project(e, cfg, system, None)
        key = precision_key(cfg.precision, cfg.tf32)
        old = Calibration(
            builtin().default_efficiency[key], key, device=system.gpu.key, source="old constant"
        )
        q = _project(e, cfg, system, {key: old})
        implied = calibration_from(e, system)
    except ConfigError as exc:
        return None, None, None, str(exc)
    if p.status != "ok" or not p.throughput:
        return None, None, None, p.reason or p.status
    return (
        in_unit(e, p.throughput),
        in_unit(e, q.throughput or 0.0),
        next(iter(implied.values())).efficiency,
        "",
    )


@functools.cache
def _float8_bases() -> dict[str, str | None]:
    """Each entry's id -> its ``float8_base`` (None: none)."""
    return {x["id"]: x.get("float8_base") for x in load_published()}


def sets(e: dict[str, Any]) -> list[str]:
    """The defaults of hardware.yaml's default_efficiency entry ``e`` sets, "GPU precision family" each (a float8
    default's ``float8_base`` prices its unconverted part: it sets that default too, said so); empty: none."""
    bases = _float8_bases()
    out = []
    for (gpu, family, key), d in sorted(builtin().evidence.items()):
        if e["id"] in d.evidence:
            out.append(f"{gpu} {key} {family}")
        elif e["id"] in {bases.get(ev) for ev in d.evidence}:
            out.append(f"{gpu} {key} {family} (its unconverted part)")
    return out


def role(e: dict[str, Any]) -> str:
    """What entry ``e`` is to the defaults: "sets" (an evidence of hardware.yaml's default_efficiency, or a float8
    evidence's base), "held out" (listed there as such) or "neither"."""
    if sets(e):
        return "sets"
    return "held out" if e["id"] in builtin().held_out else "neither"


def check_defaults(entries: list[dict[str, Any]]) -> list[str]:
    """Recompute every evidence-based default of hardware.yaml from its evidence (median implied efficiency of
    its published figures, an anchored multi-GPU figure, or the project's run); a line per default, and
    SystemExit where the data drifts from its evidence by more than 0.001."""
    by_id = {e["id"]: e for e in entries}
    lines, bad = [], []
    for (gpu, family, key), d in sorted(builtin().evidence.items()):
        values = []
        for ev in d.evidence:
            if ev in by_id:
                e = by_id[ev]
                system = system_of(e)
                cal = calibration_from(e, system) if e["gpus"] == 1 else anchored_calibration(e, system)
            else:  # the project's own run
                run = RunRecord.from_dict(json.loads((HERE.parent / ev).read_text()))
                cal = calibrate([run], resolve(gpu), [ev])
            values.append(cal[key].efficiency)
        derived = statistics.median(values)
        ok = abs(derived - d.value) <= 0.001
        bad += [] if ok else [f"{gpu} {key} {family}: data {d.value} vs evidence {derived:.4f}"]
        lines.append(f"| {gpu} | {key} | {family} | {d.value:.1%} | {derived:.2%} | {d.source} |")
    if bad:
        raise SystemExit(f"hardware.yaml default_efficiency drifts from its evidence: {bad}")
    return lines


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _summary(label: str, errors: list[float], goal: float | None = None) -> str:
    """One line: count, median absolute and worst error, signed mean, and how many are within ``goal``."""
    if not errors:
        return f"{label}: no entries"
    worst = max(errors, key=abs)
    line = (f"{label}: {len(errors)} entries, median absolute error {statistics.median(map(abs, errors)):.1%}, "
            f"worst {worst:+.1%}, mean (signed) {statistics.fmean(errors):+.1%}, "
            f"over-predicted {sum(x > 0 for x in errors)} of {len(errors)}")  # fmt: skip
    if goal is not None:
        line += (
            f"; within issue 33's goal of {goal:.0%}: {sum(abs(x) <= goal for x in errors)} of {len(errors)}"
        )
    return line


def scaling_table(entries: list[dict[str, Any]]) -> list[Prediction]:
    """Print the multi-GPU table; returns its rows."""
    by_id = {e["id"]: e for e in entries}
    rows = [predict(e, by_id) for e in entries
            if e["gpus"] > 1 and (e.get("baseline") or e.get("anchor")) and e.get("check") != MULTI_NODE]  # fmt: skip
    print("| entry | model | GPU | precision | GPUs (nodes) | method | basis | published | predicted | error |"
          " published scaling vs basis | predicted scaling | calibrated efficiency |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = r.entry
        ref = by_id.get(e.get("baseline") or e.get("anchor") or "")
        pub_s = pred_s = "-"
        if ref is not None:
            one = samples_per_s(ref) / ref["gpus"] * e["gpus"]  # the basis' rate per GPU on every GPU
            pub_s = f"{samples_per_s(e) / one:.1%}"
            pred_s = "-" if r.predicted is None else f"{samples_per_s(e, r.predicted) / one:.1%}"
        pred = f"{r.predicted:,.0f}" if r.predicted is not None else f"n/a: {r.reason}"
        print(f"| {e['id']} | {e['model']}{' s' + str(e['seq_len']) if e.get('seq_len') else ''} | {e['gpu']} | "
              f"{e['precision']} | {e['gpus']} ({e['nodes']}) | {e['method']} | {r.basis} | "
              f"{e['throughput']:,g} {e['unit']} | {pred} | {_pct(r.error)} | {pub_s} | {pred_s} | "
              f"{'-' if r.efficiency is None else f'{r.efficiency:.1%}'} |")  # fmt: skip
    return rows


def single_table(entries: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Print the 1-GPU table (the evidence-based default and the old constant vs published); returns the errors
    per role (sets / held out / neither) and basis (new / old)."""
    print("| entry | role | model | GPU | precision | batch/GPU | published | default projection | error | "
          "old constant's error | implied efficiency | default efficiency | default's basis |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, dict[str, list[float]]] = {}
    for e in entries:
        if e["gpus"] != 1:
            continue
        if e.get("not_projectable"):
            print(f"| {e['id']} | {role(e)} | {e['model']} | {e['gpu']} | {e['precision']} | {samples_per_step(e)} | "
                  f"{e['throughput']:,g} {e['unit']} | n/a: {e['not_projectable']} | n/a | n/a | - | - | - |")  # fmt: skip
            continue
        pred, old, implied, why = single_default(e)
        err = None if pred is None else pred / e["throughput"] - 1
        old_err = None if old is None else old / e["throughput"] - 1
        r = role(e)
        if err is not None and old_err is not None:
            errors.setdefault(r, {"new": [], "old": []})
            errors[r]["new"].append(err)
            errors[r]["old"].append(old_err)
        cfg = config(e, "single", 1)
        p = _project(e, cfg, system_of(e), None)
        basis = "; ".join(x for x in (p.model_family or "no family", p.efficiency_note) if x)
        print(f"| {e['id']} | {r} | {e['model']}{' s' + str(e['seq_len']) if e.get('seq_len') else ''} | "
              f"{e['gpu']} | {e['precision']} | {samples_per_step(e)} | {e['throughput']:,g} {e['unit']} | "
              f"{f'{pred:,.0f}' if pred is not None else 'n/a: ' + why} | {_pct(err)} | {_pct(old_err)} | "
              f"{'-' if implied is None else f'{implied:.1%}'} | "
              f"{'-' if p.efficiency is None else f'{p.efficiency:.1%}'} | {basis} |")  # fmt: skip
    return errors


def float8_table(entries: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Print every float8 figure (precision fp8) against the projection with hardware.yaml's defaults only (no
    calibration: the fp8 default for the converted Linears, the bf16 default for the rest); returns the errors per
    role (sets / held out / neither)."""
    print("| entry | role | GPU | GPUs (nodes) | published | default projection | error | float8 share of the FLOPs "
          "| fp8 efficiency | rest (bf16) efficiency | step: compute / comm (exposed) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {}
    for e in (x for x in entries if x["precision"] == "fp8"):
        p = _project(e, config(e), system_of(e), None)
        r, pred = role(e), None if p.status != "ok" or not p.throughput else in_unit(e, p.throughput)
        err = None if pred is None else pred / e["throughput"] - 1
        if err is not None:
            errors.setdefault(r, []).append(err)
        f8 = p.float8 or {}
        step = "-" if pred is None else f"{p.step_s:.2f} s: {p.compute_s:.2f} / {p.comm_s:.2f}"
        step += "" if pred is None else f" ({p.comm_exposed_s * 1e3:.0f} ms)"
        print(f"| {e['id']} | {r} | {e['gpu']} | {e['gpus']} ({e['nodes']}) | {e['throughput']:,g} {e['unit']} | "
              f"{f'{pred:,.0f}' if pred is not None else 'n/a: ' + p.reason} | {_pct(err)} | "
              f"{f8.get('flops_share', 0):.1%} | {f8.get('efficiency', 0):.1%} | "
              f"{'-' if p.efficiency is None else f'{p.efficiency:.1%}'} | {step} |")  # fmt: skip
    return errors


def method_label(e: dict[str, Any]) -> str:
    """The entry's method and options, short: "deepspeed z3 + hpZ 16 + qwZ + qgZ", "fsdp replicate 16"."""
    o = dict(e.get("strategy_options") or {})
    parts = [e["method"]] + ([f"z{o.pop('zero_stage')}"] if "zero_stage" in o else [])
    short = {"zero_hpz": "hpZ {}", "zero_quantized_weights": "qwZ", "zero_quantized_gradients": "qgZ",
             "replicate": "replicate {}"}  # fmt: skip
    extra = [short.get(k, f"{k}={{}}").format(v) for k, v in o.items() if v not in (False, None)]
    return " ".join(parts) + "".join(f" + {x}" for x in extra)


def multi_node_table(entries: list[dict[str, Any]]) -> list[Prediction]:
    """Print the multi-node sharded table (``check: multi-node``): each entry predicted from its anchor only, the
    anchors themselves listed as such; returns the predicted rows."""
    by_id = {e["id"]: e for e in entries}
    print("| entry | model | method | GPUs (nodes) | interconnect | basis | published | predicted | error | "
          "predicted step: compute / comm exposed (dominant) | calibrated efficiency |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for e in (x for x in entries if x.get("check") == MULTI_NODE):
        if e.get("anchor"):
            r = predict(e, by_id)
            rows.append(r)
            basis, err = f"anchor {e['anchor']}", _pct(r.error)
            pred = f"{r.predicted:,.1f}" if r.predicted is not None else f"n/a: {r.reason}"
        else:
            r, basis, err = None, "itself (an anchor)", "-"
            pred = f"n/a: {e['not_projectable']}" if e.get("not_projectable") else "(calibrated on it)"
        step = "-"
        if r is not None and r.projection is not None:
            p = r.projection
            step = f"{p.step_s:.2f} s: {p.compute_s:.2f} / {p.comm_exposed_s:.2f} ({p.dominant})"
        print(f"| {e['id']} | {e['model']} | {method_label(e)} | {e['gpus']} ({e['nodes']}) | {e['interconnect']} | "
              f"{basis} | {e['throughput']:,g} {e['unit']} | {pred} | {err} | {step} | "
              f"{'-' if r is None or r.efficiency is None else f'{r.efficiency:.1%}'} |")  # fmt: skip
    return rows


def multi_node_summary(rows: list[Prediction]) -> list[str]:
    """Summary lines of the multi-node table: per method, and the n/a rows."""
    ok = [r for r in rows if r.error is not None]
    out = []
    for label in sorted({method_label(r.entry) for r in ok}):
        out.append(_summary(label, [r.error for r in ok if method_label(r.entry) == label]))
    na = [r for r in rows if r.error is None]
    why = "not projectable, or an option this stratbench lacks"
    out.append(f"n/a: {len(na)} of {len(rows)} predicted rows ({why})")
    return out


def main() -> None:
    sys.path.insert(0, str(HERE))  # published_models, the transformers' builders
    entries = load_published()
    problems = {e["id"]: check_entry(e, entries) for e in entries}
    if any(problems.values()):
        raise SystemExit(f"published.yaml: {[(k, v) for k, v in problems.items() if v]}")
    multi = sum(e.get("check") == MULTI_NODE for e in entries)
    print(f"## Multi-GPU: predicted from each entry's own 1-GPU figure ({len(entries)} entries in published.yaml, "
          f"{multi} of them in the multi-node sharded table at the end)")  # fmt: skip
    print()
    rows = scaling_table(entries)
    print()
    ok = [r for r in rows if r.error is not None]
    print("- " + _summary("8 GPUs (one node)", [r.error for r in ok if r.entry["gpus"] == 8], 0.10))
    print("- " + _summary("16-32 GPUs", [r.error for r in ok if 8 < r.entry["gpus"] < 64]))
    print("- " + _summary(">= 64 GPUs", [r.error for r in ok if r.entry["gpus"] >= 64], 0.15))
    print(f"- n/a: {len(rows) - len(ok)} of {len(rows)}")
    print()
    print("## The defaults and their evidence (hardware.yaml default_efficiency, recomputed here)")
    print()
    print("| GPU | precision | family | default | recomputed from the evidence | source |")
    print("|---|---|---|---|---|---|")
    print("\n".join(check_defaults(entries)))
    print()
    print("## One GPU: hardware.yaml's default efficiency vs each published 1-GPU figure")
    print()
    print("role: *sets* = a figure a default is set from; *held out* = kept out of every default (ResNeXt-101 and "
          "SQuAD: another model of the same family on the same GPU and precision); *neither*: see published.yaml. "
          "Old constant = the per-precision default before issue 33 (fp32 50%, tf32/bf16/fp16 40%).")  # fmt: skip
    print()
    errors = single_table(entries)
    print()
    for r in ("sets", "held out", "neither"):
        for basis, label in (("new", "evidence-based default"), ("old", "old per-precision constant")):
            if r in errors:
                print("- " + _summary(f"{r}, {label}", errors[r][basis]))
    print()
    print("## float8: hardware.yaml's fp8 default vs each published float8 figure (no calibration)")
    print()
    print("The converted Linears' products at the GPU's fp8 peak x the fp8 default, the rest at the bf16 default "
          "(no torch.compile: the projection does not model it; every float8 figure here ran with it). fsdp gathers "
          "bf16 parameters here; the H200 runs gathered float8 ones (half the bytes), hidden under compute either "
          "way (the exposed column).")  # fmt: skip
    print()
    float8_errors = float8_table(entries)
    print()
    for r, errs in float8_errors.items():
        print("- " + _summary(f"float8, {r}", errs))
    print()
    print("## Multi-node sharded: HSDP, ZeRO-3, ZeRO++ (issue 45), each predicted from its anchor only")
    print()
    rows = multi_node_table(entries)
    print()
    for line in multi_node_summary(rows):
        print("- " + line)


if __name__ == "__main__":
    main()
