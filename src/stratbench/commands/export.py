"""stratbench export: a checkpoint (any method) -> one ONNX file with a dynamic batch axis, checked with
onnx.checker and against PyTorch on random and real inputs; or (``--format safetensors|state-dict``) a plain
weights file that any PyTorch user loads into the bare model without stratbench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "export"
HELP = "export a checkpoint (any method) to ONNX, safetensors or a plain state dict, and check it against PyTorch"
ORDER = 62
FP32_ATOL = 1e-4
# fp16 weights and activations keep ~3 significant digits; logits of order 10 differ by ~1e-2 from fp32.
FP16_ATOL = 2e-2
EXPORT_FORMATS = ("onnx", "safetensors", "state-dict")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stratbench.checkpoints.checkpoint import add_trust_argument

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

    from stratbench.core.errors import StratbenchError
    from stratbench.inference.predictor import (
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
    from stratbench.checkpoints.checkpoint import trusted

    with trusted(args.trust_checkpoint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from stratbench.core.dist import resolve_device
    from stratbench.core.errors import ConfigError
    from stratbench.core.tables import fmt_bytes
    from stratbench.inference.onnx_export import (
        OrtModel,
        ParityError,
        allowed_diff,
        export_onnx,
        parity,
        random_inputs,
    )
    from stratbench.inference.predictor import load_model

    atol = args.atol if args.atol is not None else (FP16_ATOL if args.fp16 else FP32_ATOL)
    if not 0 < atol < float("inf"):
        raise ConfigError(f"--atol must be a positive number, got {atol}")
    if args.real_samples < 0:
        raise ConfigError(f"--real-samples must be >= 0, got {args.real_samples}")
    if Path(args.output).is_dir():
        raise ConfigError(f"--output {args.output} is a folder; name the file to write")
    fmt = args.format or format_for(args.output)
    if fmt != "onnx":
        return export_weights(args, fmt, atol)
    if args.opset is not None:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if not 7 <= args.opset <= newest:
            raise ConfigError(f"--opset must be between 7 and {newest} (this onnx's newest), got {args.opset}")
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
    for col in ("input", "shape", "max |logit|", "max abs diff", "same top-1", f"<= {atol:g} x max(1, |logit|)"):
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


# ------------------------------------------------------------------------------------------------
# plain weight files (--format safetensors | state-dict)


def format_for(output: str) -> str:
    """The export format an output file name implies: .safetensors, .pt/.pth/.bin (state dict), else ONNX."""
    suffix = output.lower().rsplit(".", 1)[-1] if "." in output else ""
    return {"safetensors": "safetensors", "pt": "state-dict", "pth": "state-dict", "bin": "state-dict"}.get(suffix, "onnx")


def export_weights(args: argparse.Namespace, fmt: str, atol: float) -> int:
    """The bare model's state dict (no wrapper prefixes, fp32 or with --fp16 fp16) as safetensors or a torch.save
    file, written atomically, then read back with plain torch/safetensors into a freshly built model whose logits
    must match the checkpoint's."""
    import json
    import os
    from pathlib import Path

    import torch

    from stratbench.core.tables import fmt_bytes
    from stratbench.inference.onnx_export import ParityError, allowed_diff, random_inputs
    from stratbench.inference.predictor import build_from_meta, load_model

    loaded = load_model(args.checkpoint, "cpu")
    print(f"model: {loaded.describe()}", file=sys.stderr)
    dtype = torch.float16 if args.fp16 else torch.float32
    # safetensors refuses tensors that share memory; clone so each tensor owns its storage
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().clone()
             for k, v in loaded.model.state_dict().items()}  # fmt: skip
    meta = {k: loaded.meta[k] for k in ("model", "num_classes", "image_size", "class_names", "mean", "std", "width",
                                        "norm", "cifar_stem") if k in loaded.meta}  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"format": "pt", "stratbench": json.dumps(meta, default=str)})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({fmt_bytes(out.stat().st_size)}, {fmt}, {len(state)} tensors, {str(dtype).split('.')[-1]})")
    # Read it back the way a user without stratbench would, into a fresh model of the same architecture.
    if fmt == "safetensors":
        from safetensors.torch import load_file

        reread = load_file(str(out))
    else:
        reread = torch.load(out, map_location="cpu", weights_only=True)
    fresh = build_from_meta(loaded.meta).eval()
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in reread.items()}, strict=True)
    worst, scale = 0.0, 1.0
    with torch.no_grad():
        for _, x in random_inputs(int(loaded.meta["image_size"])):
            ref = loaded.model(x)
            worst, scale = max(worst, (fresh(x) - ref).abs().max().item()), max(scale, ref.abs().max().item())
    print(f"reloaded with plain {'safetensors' if fmt == 'safetensors' else 'torch.load'} into a fresh "
          f"{loaded.meta['model']}: max abs diff of logits {worst:.3g} (tolerance {atol:g} x max(1, |logit| "
          f"{scale:.3g}))")  # fmt: skip
    if worst > allowed_diff(atol, scale):
        raise ParityError(f"parity check failed: max abs diff {worst:.3g} > {allowed_diff(atol, scale):.3g} "
                          f"(--atol {atol:g} x largest |logit| {scale:.3g}) ({out} kept)")  # fmt: skip
    return 0
