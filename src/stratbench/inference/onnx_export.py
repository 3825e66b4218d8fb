"""ONNX export with dynamic axes, ``onnx.checker``, an onnxruntime session wrapper and the parity check
against PyTorch.

The exporter is torch's dynamo exporter (``torch.onnx.export(dynamo=True)``, needs onnxscript) with
``dynamic_shapes`` on the batch axis (and, for a language model, the sequence axis up to the model's context) -
without it onnxruntime rejects any other size - and ``external_data=False`` so a model under 2 GB is one
self-contained file. If the dynamo exporter fails the TorchScript exporter is tried (``dynamic_axes``), and the
file records which one was used (the built-in transformers export through dynamo only: TorchScript has no
``aten::rms_norm``). The model's meta (classes, preprocessing; a language model's window, context and codec) and
its inputs and outputs are stored in the ONNX metadata, so an exported file is usable without its checkpoint.
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
TOKENS_NAME = "input_ids"
OUTPUT_NAME = "logits"
MAX_BATCH = 65536
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
    signature: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The file's inputs and outputs (``signature_of``), as stored in its metadata."""


def is_language(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint's meta is a language model's (it records the token window it was trained on)."""
    return bool(meta.get("seq_len"))


def context_length(model: nn.Module, meta: dict[str, Any]) -> int:
    """The longest token sequence a language model takes: its ``max_seq_len`` (the built-in transformers), else
    the window it was trained on (a user's model: nothing says it takes more)."""
    return int(getattr(model, "max_seq_len", 0) or meta["seq_len"])


def codec_note(meta: dict[str, Any]) -> str:
    """How text becomes the token ids a language model takes (the codec its training data used)."""
    if meta.get("tokenizer"):
        return f"the Hugging Face tokenizer {meta['tokenizer']} (encode without special tokens)"
    if meta.get("codec", "bytes") == "bytes" and int(meta["num_classes"]) == 256:
        return "UTF-8 bytes of the text, one id (0..255) per byte"
    return f"token ids 0..{int(meta['num_classes']) - 1} as in the training data's token files (no tokenizer)"


def signature_of(model: nn.Module, meta: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The exported model's input and output: names, element types and axes (a name is a dynamic axis), stored in
    its metadata so that a user knows what to feed it; a language model's also says its codec."""
    out_type = str(dtype).removeprefix("torch.")
    if not is_language(meta):
        size = int(meta["image_size"])
        return {
            "inputs": [{"name": INPUT_NAME, "dtype": out_type, "shape": ["batch", 3, size, size]}],
            "outputs": [
                {"name": OUTPUT_NAME, "dtype": out_type, "shape": ["batch", int(meta["num_classes"])]}
            ],
        }
    return {
        "inputs": [{"name": TOKENS_NAME, "dtype": "int64", "shape": ["batch", "seq"],
                    "seq_max": context_length(model, meta)}],
        "outputs": [{"name": OUTPUT_NAME, "dtype": out_type, "shape": ["batch", "seq", int(meta["num_classes"])]}],
        "tokens": codec_note(meta),
    }  # fmt: skip


def describe_signature(sig: dict[str, Any]) -> str:
    """One line: ``input_ids int64 [batch, seq <= 256] -> logits float32 [batch, seq, 256]``."""

    def one(t: dict[str, Any]) -> str:
        dims = [f"{d} <= {t['seq_max']}" if d == "seq" and "seq_max" in t else str(d) for d in t["shape"]]
        return f"{t['name']} {t['dtype']} [{', '.join(dims)}]"

    line = f"{one(sig['inputs'][0])} -> {one(sig['outputs'][0])}"
    return line + (f"; tokens: {sig['tokens']}" if "tokens" in sig else "")


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
    """Export ``model`` (eval mode, CPU) to one ONNX file with a dynamic batch axis (and sequence axis, for a
    language model), then ``onnx.checker``.

    ``fp16``: weights and input in float16 (for GPUs; onnxruntime's CPU provider lacks many fp16 kernels).
    ``exporter``: "dynamo", "torchscript", or "auto" (dynamo, falling back to torchscript on failure).
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise StratbenchError(f"unknown exporter {exporter!r}; choose one of: auto, dynamo, torchscript")
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
    sig = signature_of(model, meta, dtype)
    t0 = time.perf_counter()
    errors: list[str] = []
    used = None
    for kind in ["dynamo", "torchscript"] if exporter == "auto" else [exporter]:
        try:
            _export(kind, model, _example(sig, meta, dtype), output, opset, sig)
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
            | {"onnx_exporter": used, "onnx_dtype": str(dtype).removeprefix("torch."), "onnx_io": sig}
            | (extra_metadata or {})
        )
    }
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    save_checked(proto, output, f"the ONNX export of {meta['model']}")
    return ExportResult(output, used, str(dtype).removeprefix("torch."), seconds, output.stat().st_size, sig)


def save_checked(proto: Any, path: Path, what: str) -> None:
    """Write ``proto`` to ``path`` and run ``onnx.checker`` on it; a failed check is one line naming ``what``.
    full_check runs shape inference too; over the protobuf limit only the path-based check works."""
    import onnx

    onnx.save(proto, str(path))
    try:
        if path.stat().st_size < PROTOBUF_LIMIT:
            onnx.checker.check_model(proto, full_check=True)
        else:
            onnx.checker.check_model(str(path))
    except Exception as exc:  # the checker raises ValidationError and others
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"{what} failed onnx.checker ({first})") from None


def _copy_for_export(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    import copy

    m = copy.deepcopy(model).cpu().eval()
    return m.to(dtype)


def _example(sig: dict[str, Any], meta: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The input the exporter traces: 2 samples (a size of 1 would be specialised, not kept dynamic); a language
    model's are 16 tokens (fewer when its context is shorter)."""
    if not is_language(meta):
        size = int(meta["image_size"])
        return torch.randn(2, 3, size, size, dtype=dtype)
    seq = min(16, int(sig["inputs"][0]["seq_max"]))
    return torch.randint(0, int(meta["num_classes"]), (2, seq), generator=torch.Generator().manual_seed(0))


def _dynamic_axes(sig: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Input axis -> (name, largest size) of each dynamic axis: the batch, and a language model's sequence."""
    spec = sig["inputs"][0]
    return {i: (d, MAX_BATCH if d == "batch" else int(spec["seq_max"]))
            for i, d in enumerate(spec["shape"]) if isinstance(d, str)}  # fmt: skip


def _export(kind: str, model: nn.Module, example: torch.Tensor, output: Path, opset: int | None,
            sig: dict[str, Any]) -> None:  # fmt: skip
    in_name = sig["inputs"][0]["name"]
    kwargs: dict[str, Any] = {"input_names": [in_name], "output_names": [OUTPUT_NAME]}
    if opset is not None:
        kwargs["opset_version"] = opset
    dynamic = _dynamic_axes(sig)
    # The exporters print progress lines and warnings; the command prints its own summary instead.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "dynamo":
            dims = {i: torch.export.Dim(name, min=1, max=top) for i, (name, top) in dynamic.items()}
            torch.onnx.export(model, (example,), str(output), dynamo=True, dynamic_shapes=(dims,),
                              external_data=False, verbose=False, **kwargs)  # fmt: skip
        else:
            # the output's leading axes are the input's (batch; a language model's sequence too)
            axes = {i: name for i, (name, _) in dynamic.items()}
            torch.onnx.export(model, (example,), str(output), dynamo=False,
                              dynamic_axes={in_name: axes, OUTPUT_NAME: axes}, **kwargs)  # fmt: skip


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
    """An onnxruntime session on CPU (or CUDA; or TensorRT, falling back to CUDA): a numpy batch in (pixels, or a language model's int64 token ids;
    cast to the file's input type), float32 logits out."""

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None) -> None:
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"ONNX file not found: {path}")
        available = ort.get_available_providers()
        needed = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}.get(device)
        if needed and needed not in available:
            raise UnsupportedError(
                f"onnxruntime has no {needed} here (available: {', '.join(available)}); install onnxruntime-gpu"
            )
        providers: list = ["CPUExecutionProvider"]
        if device in ("cuda", "tensorrt"):
            providers.insert(0, "CUDAExecutionProvider")
        if device == "tensorrt":  # TensorRT first, fp16 kernels allowed; what it cannot take falls to CUDA
            providers.insert(0, ("TensorrtExecutionProvider", {"trt_fp16_enable": True}))
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
        types = {"tensor(int64)": np.int64, "tensor(float16)": np.float16}
        self.input_dtype = types.get(inp.type, np.float32)
        self.providers = self.session.get_providers()

    def run(self, x: np.ndarray) -> np.ndarray:
        out = self.session.run(None, {self.input_name: np.ascontiguousarray(x, dtype=self.input_dtype)})[0]
        return out.astype(np.float32, copy=False)


@dataclass
class ParityRow:
    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    same_argmax: float  # fraction of samples (a language model: of positions) whose top class agrees
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
            ref = model(x.float() if x.is_floating_point() else x).float()
            got = torch.from_numpy(session.run(x.numpy()))
            diff = (ref - got).abs().max().item() if ref.numel() else 0.0
            agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
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


def random_tokens(
    vocab_size: int, shapes: Sequence[tuple[int, int]], seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Seeded random token ids of each (batch, seq) shape: several of both exercise the two dynamic axes."""
    g = torch.Generator().manual_seed(seed)
    return [(f"random tokens {b}x{t}", torch.randint(0, vocab_size, (b, t), generator=g)) for b, t in shapes]
