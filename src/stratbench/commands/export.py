"""stratbench export: a checkpoint (any method) -> one ONNX file with a dynamic batch axis (a language model:
``input_ids`` with dynamic batch and sequence axes), checked with onnx.checker and against PyTorch on random and
real inputs; or (``--format safetensors|state-dict``) a plain
weights file that any PyTorch user loads into the bare model without stratbench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from stratbench.checkpoints.checkpoint import add_trust_argument, trusted
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError
from stratbench.core.tables import fmt_bytes
from stratbench.inference.export import format_for, onnx_parity, reload_difference, write_weights
from stratbench.inference.onnx_export import (
    OrtModel,
    ParityError,
    ParityRow,
    allowed_diff,
    describe_signature,
    export_onnx,
    is_language,
)
from stratbench.inference.predictor import load_model

NAME = "export"
HELP = "export a checkpoint (any method) to ONNX, safetensors or a plain state dict, and check it against PyTorch"
ORDER = 62
FP32_ATOL = 1e-4
# fp16 weights and activations keep ~3 significant digits; logits of order 10 differ by ~1e-2 from fp32.
FP16_ATOL = 2e-2
EXPORT_FORMATS = ("onnx", "safetensors", "state-dict")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or sharded folder")
    parser.add_argument("--output", required=True, help="file to write (ONNX: one file, weights included)")
    parser.add_argument(
        "--format", choices=EXPORT_FORMATS, default=None,
        help="onnx, safetensors (model.safetensors) or state-dict (torch.save of the bare model's state dict); "
        "default: from the --output suffix (.safetensors, .pt/.pth/.bin), else onnx",
    )  # fmt: skip
    parser.add_argument(
        "--fp16", action="store_true", help="float16 weights and input (for GPUs); compared with fp32 PyTorch"
    )
    parser.add_argument(
        "--atol", type=float, default=None,
        help=f"largest allowed max abs difference of logits vs PyTorch, per unit of the largest |logit| when that "
        f"exceeds 1 (default {FP32_ATOL:g}, {FP16_ATOL:g} with --fp16)",
    )  # fmt: skip
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    parser.add_argument(
        "--exporter", default="auto", choices=("auto", "dynamo", "torchscript"),
        help="torch.onnx exporter; auto = dynamo, falling back to TorchScript if it fails",
    )  # fmt: skip
    parser.add_argument(
        "--real-samples", type=int, default=64,
        help="validation samples (a language model: token windows) used as real parity inputs",
    )  # fmt: skip
    parser.add_argument(
        "--images", nargs="*", default=[], help="image files or folders to use as extra real parity inputs"
    )
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="onnxruntime device for the check"
    )


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        atol = check_args(args)
        fmt = args.format or format_for(args.output)
        if fmt != "onnx":
            return export_weights(args, fmt, atol)
        check_opset(args.opset)
        return export_checked_onnx(args, atol)


def check_args(args: argparse.Namespace) -> float:
    """The tolerance (--atol or the precision's default); the other values checked before any work."""
    atol = args.atol if args.atol is not None else (FP16_ATOL if args.fp16 else FP32_ATOL)
    if not 0 < atol < float("inf"):
        raise ConfigError(f"--atol must be a positive number, got {atol}")
    if args.real_samples < 0:
        raise ConfigError(f"--real-samples must be >= 0, got {args.real_samples}")
    if Path(args.output).is_dir():
        raise ConfigError(f"--output {args.output} is a folder; name the file to write")
    return atol


def check_opset(opset: int | None) -> None:
    if opset is not None:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if not 7 <= opset <= newest:
            raise ConfigError(f"--opset must be between 7 and {newest} (this onnx's newest), got {opset}")


def export_checked_onnx(args: argparse.Namespace, atol: float) -> int:
    """Export, then compare onnxruntime's logits with PyTorch's; a failed comparison keeps the file and raises."""
    device = resolve_device(args.device)
    loaded = load_model(args.checkpoint, "cpu")
    if args.images and is_language(loaded.meta):
        raise ConfigError(
            f"--images: {loaded.meta['model']} is a language model (it takes token ids); its real parity inputs "
            "are validation windows of its text (--real-samples)"
        )
    print(f"model: {loaded.describe()}", file=sys.stderr)
    result = export_onnx(
        loaded.model, loaded.meta, args.output, fp16=args.fp16, opset=args.opset, exporter=args.exporter,
        extra_metadata={"config": loaded.config},
    )  # fmt: skip
    print(
        f"wrote {result.path} ({fmt_bytes(result.size_bytes)}, {result.dtype}, {result.exporter} exporter, "
        f"{result.seconds:.1f} s); onnx.checker: ok"
    )
    print(f"inputs: {describe_signature(result.signature)}")
    session = OrtModel(result.path, device="cuda" if device.type == "cuda" else "cpu")
    rows, notes = onnx_parity(loaded, session, args.real_samples, args.images)
    print_parity(rows, session, atol)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    worst = max(rows, key=lambda r: r.max_abs_diff / allowed_diff(atol, r.scale))
    print(f"max abs diff {worst.max_abs_diff:.3g} (tolerance {atol:g} x max(1, |logit| {worst.scale:.3g}))")
    if not worst.ok(atol):
        raise ParityError(
            f"parity check failed: max abs diff {worst.max_abs_diff:.3g} > {allowed_diff(atol, worst.scale):.3g} "
            f"(--atol {atol:g} x largest |logit| {worst.scale:.3g}) ({result.path} kept for inspection)"
        )
    return 0


def print_parity(rows: list[ParityRow], session: OrtModel, atol: float) -> None:
    table = Table(title=f"parity: onnxruntime ({', '.join(session.providers)}) vs PyTorch fp32 (CPU)")
    for col in (
        "input",
        "shape",
        "max |logit|",
        "max abs diff",
        "same top-1",
        f"<= {atol:g} x max(1, |logit|)",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.name,
            "x".join(map(str, r.shape)),
            f"{r.scale:.3g}",
            f"{r.max_abs_diff:.3g}",
            f"{r.same_argmax:.1%}",
            "yes" if r.ok(atol) else "NO",
        )
    Console().print(table)


def export_weights(args: argparse.Namespace, fmt: str, atol: float) -> int:
    """The bare model's state dict (fp32, or fp16 with --fp16) as safetensors or a torch.save file, then read back
    with plain torch/safetensors into a freshly built model whose logits must match the checkpoint's."""
    loaded = load_model(args.checkpoint, "cpu")
    print(f"model: {loaded.describe()}", file=sys.stderr)
    dtype = torch.float16 if args.fp16 else torch.float32
    out = Path(args.output)
    count = write_weights(loaded, out, fmt, dtype)
    print(
        f"wrote {out} ({fmt_bytes(out.stat().st_size)}, {fmt}, {count} tensors, {str(dtype).split('.')[-1]})"
    )
    worst, scale = reload_difference(loaded, out, fmt)
    print(f"reloaded with plain {'safetensors' if fmt == 'safetensors' else 'torch.load'} into a fresh "
          f"{loaded.meta['model']}: max abs diff of logits {worst:.3g} (tolerance {atol:g} x max(1, |logit| "
          f"{scale:.3g}))")  # fmt: skip
    if worst > allowed_diff(atol, scale):
        raise ParityError(f"parity check failed: max abs diff {worst:.3g} > {allowed_diff(atol, scale):.3g} "
                          f"(--atol {atol:g} x largest |logit| {scale:.3g}) ({out} kept)")  # fmt: skip
    return 0
