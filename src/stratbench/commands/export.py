"""stratbench export: a checkpoint (any method) -> one ONNX file with a dynamic batch axis, checked with
onnx.checker and against PyTorch on random and real inputs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "export"
HELP = "export a checkpoint (any method) to ONNX (dynamic batch), check it and compare it with PyTorch"
ORDER = 62
FP32_ATOL = 1e-4
# fp16 weights and activations keep ~3 significant digits; logits of order 10 differ by ~1e-2 from fp32.
FP16_ATOL = 2e-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stratbench.checkpoint import add_trust_argument

    add_trust_argument(parser)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or sharded folder")
    parser.add_argument("--output", required=True, help="ONNX file to write (one file; weights included)")
    parser.add_argument(
        "--fp16", action="store_true", help="float16 weights and input (for GPUs); compared with fp32 PyTorch"
    )
    parser.add_argument(
        "--atol", type=float, default=None,
        help=f"largest allowed max abs difference of logits vs PyTorch (default {FP32_ATOL:g}, {FP16_ATOL:g} with --fp16)",
    )  # fmt: skip
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    parser.add_argument(
        "--exporter", default="auto", choices=("auto", "dynamo", "torchscript"),
        help="torch.onnx exporter; auto = dynamo, falling back to TorchScript if it fails",
    )  # fmt: skip
    parser.add_argument(
        "--real-samples", type=int, default=64, help="validation samples used as real parity inputs"
    )
    parser.add_argument(
        "--images", nargs="*", default=[], help="image files or folders to use as extra real parity inputs"
    )
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="onnxruntime device for the check"
    )


def _real_inputs(loaded, n: int, image_paths: list[str]):
    """(name, batch) pairs of real inputs: validation samples of the training data, plus given images."""
    import torch

    from stratbench.errors import StratbenchError
    from stratbench.inference import (
        ImageProblem,
        collect_images,
        load_image,
        train_config_for,
        validation_set,
    )

    inputs, notes = [], []
    if n > 0:
        try:
            bundle = validation_set(train_config_for(loaded.config, loaded.meta), loaded.meta)
            count = min(n, len(bundle.val))
            xs = torch.stack([bundle.val[i][0] for i in range(count)])
            inputs.append((f"{bundle_name(loaded)} validation x{count}", xs))
        except StratbenchError as exc:
            notes.append(f"validation samples skipped ({exc})")
    if image_paths:
        files, problems = collect_images(image_paths)
        tensors = []
        for f in files:
            try:
                tensors.append(load_image(f, loaded.meta))
            except StratbenchError as exc:
                problems.append(ImageProblem(f, str(exc)))
        for p in problems:
            notes.append(f"image input skipped: {p.line()}")
        if tensors:
            inputs.append((f"images x{len(tensors)}", torch.stack(tensors)))
    return inputs, notes


def bundle_name(loaded) -> str:
    return str(loaded.config.get("data") or loaded.meta.get("data") or "data")


def run(args: argparse.Namespace) -> int:
    from stratbench.checkpoint import trusted

    with trusted(args.trust_checkpoint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from stratbench.dist import resolve_device
    from stratbench.errors import ConfigError
    from stratbench.inference import load_model
    from stratbench.onnx_export import OrtModel, ParityError, export_onnx, parity, random_inputs
    from stratbench.report_table import fmt_bytes

    atol = args.atol if args.atol is not None else (FP16_ATOL if args.fp16 else FP32_ATOL)
    if not 0 < atol < float("inf"):
        raise ConfigError(f"--atol must be a positive number, got {atol}")
    if args.real_samples < 0:
        raise ConfigError(f"--real-samples must be >= 0, got {args.real_samples}")
    if args.opset is not None:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if not 7 <= args.opset <= newest:
            raise ConfigError(f"--opset must be between 7 and {newest} (this onnx's newest), got {args.opset}")
    if Path(args.output).is_dir():
        raise ConfigError(f"--output {args.output} is a folder; name the .onnx file to write")
    device = resolve_device(args.device)
    loaded = load_model(args.checkpoint, "cpu")
    print(f"model: {loaded.describe()}", file=sys.stderr)
    result = export_onnx(
        loaded.model, loaded.meta, args.output, fp16=args.fp16, opset=args.opset, exporter=args.exporter,
        extra_metadata={"config": loaded.config},
    )  # fmt: skip
    print(
        f"wrote {result.path} ({fmt_bytes(result.size_bytes)}, {result.dtype}, {result.exporter} exporter, "
        f"{result.seconds:.1f} s); onnx.checker: ok"
    )
    session = OrtModel(result.path, device="cuda" if device.type == "cuda" else "cpu")
    real, notes = _real_inputs(loaded, args.real_samples, args.images)
    rows = parity(loaded.model, session, random_inputs(int(loaded.meta["image_size"])) + real)
    table = Table(title=f"parity: onnxruntime ({', '.join(session.providers)}) vs PyTorch fp32 (CPU)")
    for col in ("input", "shape", "max abs diff", "same top-1", f"<= {atol:g}"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.name,
            "x".join(map(str, r.shape)),
            f"{r.max_abs_diff:.3g}",
            f"{r.same_argmax:.1%}",
            "yes" if r.max_abs_diff <= atol else "NO",
        )
    Console().print(table)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    worst = max(r.max_abs_diff for r in rows)
    print(f"max abs diff {worst:.3g} (tolerance {atol:g})")
    if worst > atol:
        raise ParityError(
            f"parity check failed: max abs diff {worst:.3g} > tolerance {atol:g} ({result.path} kept for inspection)"
        )
    return 0
