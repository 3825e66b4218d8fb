"""ONNX export with a dynamic batch axis, ``onnx.checker``, an onnxruntime session wrapper and the parity
check against PyTorch.

The exporter is torch's dynamo exporter (``torch.onnx.export(dynamo=True)``, needs onnxscript) with
``dynamic_shapes`` on the batch axis - without it onnxruntime rejects any other batch size - and
``external_data=False`` so a model under 2 GB is one self-contained file. If the dynamo exporter fails
the TorchScript exporter is tried (``dynamic_axes``), and the file records which one was used.
The model's meta (classes, preprocessing) is stored in the ONNX metadata, so an exported file is usable
without its checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stratbench.checkpoints.checkpoint import atomic_output
from stratbench.core.errors import CheckpointError, StratbenchError, UnsupportedError

META_PROP = "stratbench_meta"
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
PROTOBUF_LIMIT = 2 * 1024**3 - 1


class ParityError(StratbenchError):
    """The exported model's outputs differ from PyTorch's by more than the tolerance."""


@dataclass
class ExportResult:
    path: Path
    exporter: str
    dtype: str
    seconds: float
    size_bytes: int


def export_onnx(
    model: nn.Module,
    meta: dict[str, Any],
    output: str | Path,
    *,
    fp16: bool = False,
    opset: int | None = None,
    exporter: str = "auto",
    extra_metadata: dict[str, Any] | None = None,
) -> ExportResult:
    """Export ``model`` (eval mode, CPU) to one ONNX file with a dynamic batch axis, then ``onnx.checker``.

    ``fp16``: weights and input in float16 (for GPUs; onnxruntime's CPU provider lacks many fp16 kernels).
    ``exporter``: "dynamo", "torchscript", or "auto" (dynamo, falling back to torchscript on failure).
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise StratbenchError(f"unknown exporter {exporter!r}; choose one of: auto, dynamo, torchscript")
    if meta.get("seq_len"):
        raise StratbenchError(
            f"ONNX export of a language model ({meta.get('model')}) is not built yet; export it to .safetensors"
        )

    output = Path(output)
    if output.is_dir():
        raise StratbenchError(f"--output {output} is a folder; name the .onnx file to write")
    # Written under a temporary name, checked, then renamed: a failed export leaves an earlier file intact.
    with atomic_output(output, suffix=".onnx") as tmp:
        result = _export_checked(
            model, meta, tmp, fp16=fp16, opset=opset, exporter=exporter, extra_metadata=extra_metadata
        )
    return dataclasses.replace(result, path=output)


def _export_checked(model, meta, output: Path, *, fp16, opset, exporter, extra_metadata) -> ExportResult:
    import time

    import onnx

    dtype = torch.float16 if fp16 else torch.float32
    model = _copy_for_export(model, dtype)
    size = int(meta["image_size"])
    example = torch.randn(2, 3, size, size, dtype=dtype)
    t0 = time.perf_counter()
    errors: list[str] = []
    used = None
    for kind in ["dynamo", "torchscript"] if exporter == "auto" else [exporter]:
        try:
            _export(kind, model, example, output, opset)
            used = kind
            break
        except Exception as exc:  # exporter failures come as many types; the message is what matters
            errors.append(
                f"{kind}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            )
    if used is None:
        raise UnsupportedError(f"ONNX export of {meta['model']} failed ({'; '.join(errors)})")
    seconds = time.perf_counter() - t0
    proto = onnx.load(str(output))
    props = {
        META_PROP: json.dumps(
            meta
            | {"onnx_exporter": used, "onnx_dtype": str(dtype).removeprefix("torch.")}
            | (extra_metadata or {})
        )
    }
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(output))
    # full_check runs shape inference too; over the protobuf limit only the path-based check works.
    try:
        if output.stat().st_size < PROTOBUF_LIMIT:
            onnx.checker.check_model(proto, full_check=True)
        else:
            onnx.checker.check_model(str(output))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"the ONNX export of {meta['model']} failed onnx.checker ({first})") from None
    return ExportResult(output, used, str(dtype).removeprefix("torch."), seconds, output.stat().st_size)


def _copy_for_export(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    import copy

    m = copy.deepcopy(model).cpu().eval()
    return m.to(dtype)


def _export(kind: str, model: nn.Module, example: torch.Tensor, output: Path, opset: int | None) -> None:
    kwargs: dict[str, Any] = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME]}
    if opset is not None:
        kwargs["opset_version"] = opset
    # The exporters print progress lines and warnings; the command prints its own summary instead.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "dynamo":
            batch = torch.export.Dim("batch", min=1, max=65536)
            torch.onnx.export(
                model,
                (example,),
                str(output),
                dynamo=True,
                dynamic_shapes=({0: batch},),
                external_data=False,
                verbose=False,
                **kwargs,
            )
        else:
            torch.onnx.export(
                model,
                (example,),
                str(output),
                dynamo=False,
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                **kwargs,
            )


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The stratbench meta stored in an exported file (classes, preprocessing), or {} for a foreign file."""
    import onnx

    if not Path(path).is_file():
        raise CheckpointError(f"ONNX file not found: {path}")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # garbage bytes: protobuf's DecodeError, and others
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable ONNX model ({first})") from None
    for prop in proto.metadata_props:
        if prop.key == META_PROP:
            try:
                return json.loads(prop.value)
            except ValueError:
                raise CheckpointError(f"{path}: its stratbench metadata is not valid JSON") from None
    return {}


class OrtModel:
    """An onnxruntime session on CPU (or CUDA): float32 numpy batch in, float32 logits out."""

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None) -> None:
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"ONNX file not found: {path}")
        available = ort.get_available_providers()
        if device == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise UnsupportedError(
                    f"onnxruntime has no CUDA provider here (available: {', '.join(available)}); install onnxruntime-gpu"
                )
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # errors only: the CPU provider warns about every fp16 fallback
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"onnxruntime cannot load {path}: {first}") from None
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.input_dtype = np.float16 if "float16" in inp.type else np.float32
        self.providers = self.session.get_providers()

    def run(self, x: np.ndarray) -> np.ndarray:
        out = self.session.run(None, {self.input_name: np.ascontiguousarray(x, dtype=self.input_dtype)})[0]
        return out.astype(np.float32, copy=False)


@dataclass
class ParityRow:
    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    same_argmax: float  # fraction of samples whose top class agrees
    scale: float = 1.0
    """max(1, largest |logit| of PyTorch's): the tolerance scales with it, as float rounding does."""

    def ok(self, atol: float) -> bool:
        return self.max_abs_diff <= allowed_diff(atol, self.scale)


def allowed_diff(atol: float, scale: float) -> float:
    """The largest logit difference ``atol`` allows at logits up to ``scale`` in magnitude: float32 rounds
    relative to the size of a value, so an untrained or sharply trained model with logits of ~100 differs
    100x more than one with logits of ~1 (``atol`` is the bound at unit scale)."""
    return atol * max(1.0, scale)


def parity(
    model: nn.Module, session: OrtModel, inputs: Sequence[tuple[str, torch.Tensor]]
) -> list[ParityRow]:
    """Max abs difference of logits between PyTorch fp32 (CPU) and onnxruntime on each named input batch, and the
    logits' scale that the tolerance is relative to."""
    model = model.cpu().eval()
    rows = []
    with torch.inference_mode():
        for name, x in inputs:
            ref = model(x.float()).float()
            got = torch.from_numpy(session.run(x.numpy()))
            diff = (ref - got).abs().max().item() if ref.numel() else 0.0
            agree = (ref.argmax(1) == got.argmax(1)).double().mean().item()
            scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
            rows.append(ParityRow(name, tuple(x.shape), diff, agree, scale))
    return rows


def random_inputs(
    image_size: int, batch_sizes: Sequence[int] = (1, 7), seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Random normal batches of different sizes (the second size exercises the dynamic batch axis)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (f"random batch {b}", torch.randn(b, 3, image_size, image_size, generator=g)) for b in batch_sizes
    ]
