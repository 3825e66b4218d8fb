"""Quantised and half-precision models for inference: an exported fp32 ONNX file rewritten by onnxruntime's tools
(``export --quantize``, bench-infer's onnxruntime int8 / fp16 rows), and torchao's int8 configs on a PyTorch copy
(bench-infer's torchao rows).

- ``int8-dynamic``: ``quantize_dynamic`` - QInt8 weights, activations quantised per batch at run time
  (``MatMulInteger`` / ``ConvInteger``); no calibration.
- ``int8-static``: ``quantize_static`` in the QDQ format - QInt8 weights and activations, whose ranges come from
  calibration batches (real inputs of the checkpoint's validation set); the compute ops (Conv, MatMul, Gemm,
  Gather) only, so that shape arithmetic (Reshape of an initializer) stays float.
- ``fp16``: onnxruntime's float16 converter (``onnxruntime.transformers.float16``), float32 input and output kept
  so that the file takes what the fp32 one takes; its graph topologically sorted again (the converter appends
  the casts it inserts out of order, which onnx.checker rejects).

The rewritten file drops the dynamo exporter's per-node debug metadata (name scopes, stack traces: 0.36 MB of
gpt-tiny's 7.9 MB file), keeps the stratbench metadata with ``onnx_quantization`` added, and is checked with
onnx.checker like any export.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from stratbench.core.errors import ConfigError, UnsupportedError, did_you_mean
from stratbench.core.files import atomic_output
from stratbench.core.optim import import_torchao
from stratbench.inference.onnx_export import META_PROP, save_checked

QUANT_MODES = ("int8-dynamic", "int8-static", "fp16")
STATIC_OPS = ["Conv", "MatMul", "Gemm", "Gather"]
TORCHAO_CONFIGS = {
    "int8-weight": "Int8WeightOnlyConfig",
    "int8-dynamic": "Int8DynamicActivationInt8WeightConfig",
}
"""torchao's configs by the kind bench-infer names them: int8 weights only, or int8 weights and per-token dynamic
int8 activations."""


def check_mode(mode: str) -> str:
    """``mode`` if it is a quantisation mode, else one line naming it and the allowed ones."""
    if mode not in QUANT_MODES:
        raise ConfigError(
            f"unknown --quantize mode {mode!r}{did_you_mean(mode, QUANT_MODES)}; choose one of: {', '.join(QUANT_MODES)}"
        )
    return mode


def missing_tool(mode: str) -> str | None:
    """Why ``mode`` cannot run here (None: it can): the fp16 converter ships with onnxruntime's ``transformers``
    tools, the int8 quantisers with ``onnxruntime.quantization``."""
    module = "onnxruntime.transformers.float16" if mode == "fp16" else "onnxruntime.quantization"
    try:
        __import__(module)
    except ImportError as exc:
        return (
            f"--quantize {mode} needs {module} ({type(exc).__name__}: {str(exc)[:120]}); reinstall onnxruntime "
            "(a stratbench dependency) or, for fp16, install onnxconverter-common"
        )
    return None


@dataclass
class QuantResult:
    path: Path
    mode: str
    size_bytes: int
    seconds: float
    calibration_samples: int = 0


class _Batches:
    """onnxruntime's ``CalibrationDataReader``: one {input name: batch} per ``get_next`` call, then None."""

    def __init__(self, name: str, batches: Sequence[np.ndarray]) -> None:
        self._feeds = iter([{name: b} for b in batches])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """onnxruntime's quantisers log a root-logger warning advising pre-processing on every call."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def quantize_onnx(source: str | Path, output: str | Path, mode: str,
                  calibration: Sequence[np.ndarray] | None = None) -> QuantResult:  # fmt: skip
    """Rewrite the fp32 ONNX file ``source`` as ``mode`` at ``output`` (written under a temporary name, checked,
    then renamed). ``calibration``: the input batches int8-static's activation ranges come from (required)."""
    check_mode(mode)
    if mode == "int8-static" and not calibration:
        raise ConfigError(
            "--quantize int8-static needs calibration batches (validation inputs); none were given"
        )
    reason = missing_tool(mode)
    if reason:
        raise UnsupportedError(reason)
    output = Path(output)
    batches = list(calibration or []) if mode == "int8-static" else []
    samples = sum(len(b) for b in batches)
    t0 = time.perf_counter()
    with atomic_output(output, suffix=".onnx") as tmp, _quiet():
        _rewrite(Path(source), tmp, mode, batches)
        _finish(tmp, mode, samples)
    return QuantResult(output, mode, output.stat().st_size, time.perf_counter() - t0, samples)


def _rewrite(source: Path, out: Path, mode: str, calibration: Sequence[np.ndarray]) -> None:
    import onnx

    if mode == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16
        from onnxruntime.transformers.onnx_model import OnnxModel

        half = OnnxModel(convert_float_to_float16(onnx.load(str(source)), keep_io_types=True))
        half.topological_sort()
        onnx.save(half.model, str(out))
        return
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if mode == "int8-dynamic":
        quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8)
        return
    name = onnx.load(str(source), load_external_data=False).graph.input[0].name
    quantize_static(str(source), str(out), _Batches(name, calibration), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=STATIC_OPS)  # fmt: skip


def _finish(path: Path, mode: str, samples: int) -> None:
    """The file's node debug metadata dropped, its stratbench metadata naming the quantisation, onnx.checker."""
    import onnx

    proto = onnx.load(str(path))
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for prop in proto.metadata_props:
        if prop.key == META_PROP:
            meta = json.loads(prop.value)
            meta["onnx_quantization"] = mode
            if samples:
                meta["onnx_calibration_samples"] = samples
            prop.value = json.dumps(meta)
    save_checked(proto, path, f"the {mode} ONNX file")


def torchao_reason() -> str | None:
    """Why torchao's int8 rows cannot run here (None: they can)."""
    if import_torchao("torchao.quantization") is None:
        return "torchao is not installed (the lean extra: pip install 'stratbench[lean]')"
    return None


def torchao_int8(model: nn.Module, kind: str) -> nn.Module:
    """A copy of ``model`` (CPU, eval) whose Linear layers torchao's ``quantize_`` made int8 (``kind``: a key of
    ``TORCHAO_CONFIGS``); other layers (convolutions, norms) stay float32."""
    quant: Any = import_torchao("torchao.quantization")
    m = copy.deepcopy(model).cpu().float().eval()
    quant.quantize_(m, getattr(quant, TORCHAO_CONFIGS[kind])())
    return m
