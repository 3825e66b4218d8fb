"""stratbench export: a checkpoint (any method) -> one ONNX file with a dynamic batch axis (a language model:
``input_ids`` with dynamic batch and sequence axes), checked with onnx.checker and against PyTorch on random and
real inputs; or (``--format safetensors|state-dict``) a plain
weights file that any PyTorch user loads into the bare model without stratbench. A run of a Hugging Face model
(``--model hf:FOLDER``) also exports as a folder transformers loads (``--format hf``; a LoRA run's adapters folded
in with ``--merge-lora``), and a LoRA run's adapters alone as a folder peft loads (``--format peft``); each export
is read back and its logits compared with the checkpoint's. ``--quantize int8-dynamic|int8-static|fp16`` rewrites the
ONNX export with onnxruntime's quantisers (stratbench.inference.quantize): the file is checked and its parity
against PyTorch fp32 reported, not required."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from stratbench.checkpoints.checkpoint import add_trust_argument, trusted
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, DataError, StratbenchError, UnsupportedError
from stratbench.core.tables import fmt_bytes
from stratbench.inference.export import (
    adapter_difference,
    difference,
    format_for,
    hf_difference,
    merged,
    onnx_parity,
    reference_logits,
    reload_difference,
    write_adapter_folder,
    write_hf_folder,
    write_weights,
)
from stratbench.inference.onnx_export import (
    OrtModel,
    ParityError,
    ParityRow,
    allowed_diff,
    describe_signature,
    export_onnx,
    is_language,
)
from stratbench.inference.peft_format import ADAPTER, MERGED, check_output_folder
from stratbench.inference.predictor import LoadedModel, load_model
from stratbench.inference.quality import validation_batches
from stratbench.inference.quantize import QUANT_MODES, check_mode, missing_tool, quantize_onnx
from stratbench.models.hf import find_weights, is_hf_name, model_folder
from stratbench.models.transformer import Transformer

NAME = "export"
HELP = "export a checkpoint (any method) to ONNX, safetensors or a plain state dict, and check it against PyTorch"
ORDER = 62
FP32_ATOL = 1e-4
# fp16 weights and activations keep ~3 significant digits; logits of order 10 differ by ~1e-2 from fp32.
FP16_ATOL = 2e-2
EXPORT_FORMATS = ("onnx", "safetensors", "state-dict", "hf", "peft")
FOLDER_FORMATS = {"hf": MERGED, "peft": ADAPTER}
"""The formats written as a folder, and the kind of export folder each is (inference.peft_format)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint file or sharded folder, or a run folder"
    )
    parser.add_argument(
        "--output",
        required=True,
        help="file to write (ONNX: one file, weights included); --format hf|peft: a folder",
    )
    parser.add_argument(
        "--format", choices=EXPORT_FORMATS, default=None,
        help="onnx, safetensors (model.safetensors), state-dict (torch.save of the bare model's state dict), hf "
        "(a hf: model: a folder transformers' from_pretrained loads) or peft (a LoRA run of a hf: model: the "
        "adapters alone, a folder peft's PeftModel.from_pretrained loads); default: from the --output suffix "
        "(.safetensors, .pt/.pth/.bin, .onnx), else hf with --merge-lora on a hf: model, else onnx",
    )  # fmt: skip
    parser.add_argument(
        "--merge-lora", action="store_true",
        help="a LoRA run: fold the adapters into the weights (W + alpha/r B A) and export the bare model",
    )  # fmt: skip
    parser.add_argument(
        "--fp16", action="store_true", help="float16 weights and input (for GPUs); compared with fp32 PyTorch"
    )
    parser.add_argument(
        "--atol", type=float, default=None,
        help=f"largest allowed max abs difference of logits vs PyTorch, per unit of the largest |logit| when that "
        f"exceeds 1 (default {FP32_ATOL:g}, {FP16_ATOL:g} with --fp16)",
    )  # fmt: skip
    parser.add_argument(
        "--quantize", default=None, metavar="MODE",
        help=f"ONNX only: {' | '.join(QUANT_MODES)} - onnxruntime's quantize_dynamic (int8 weights), quantize_static "
        "(QDQ int8, calibrated on --calibration-batches validation batches of the checkpoint's data) or its fp16 "
        "converter (float32 input and output kept); parity vs PyTorch fp32 is reported, not required",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-batches", type=int, default=8,
        help="--quantize int8-static: validation batches (32 images or 8 token windows each) that set the "
        "activation ranges (default 8)",
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
        if args.format in (None, "onnx"):
            check_opset(args.opset)
        loaded = load_model(args.checkpoint, "cpu")
        fmt = check_format(args, loaded)
        calibration = calibration_for(args, loaded)
        print(f"model: {loaded.describe()}", file=sys.stderr)
        if args.merge_lora:
            loaded = merge_checked(loaded, atol)
        if fmt in FOLDER_FORMATS:
            return export_folder(args, fmt, atol, loaded)
        if fmt != "onnx":
            return export_weights(args, fmt, atol, loaded)
        if args.quantize:
            return export_quantized_onnx(args, loaded, calibration)
        return export_checked_onnx(args, atol, loaded)


def check_args(args: argparse.Namespace) -> float:
    """The tolerance (--atol or the precision's default); the other values checked before any work."""
    atol = args.atol if args.atol is not None else (FP16_ATOL if args.fp16 else FP32_ATOL)
    if not 0 < atol < float("inf"):
        raise ConfigError(f"--atol must be a positive number, got {atol}")
    if args.real_samples < 0:
        raise ConfigError(f"--real-samples must be >= 0, got {args.real_samples}")
    if args.quantize is not None:
        check_quantize(args)
    return atol


def check_quantize(args: argparse.Namespace) -> None:
    """--quantize: a known mode, whose tool is installed, that takes the other options: one line, before any
    work."""
    mode = check_mode(args.quantize)
    fmt = args.format or format_for(args.output)
    if fmt != "onnx":
        raise ConfigError(f"--quantize {mode} rewrites an ONNX export; --format {fmt} is not ONNX (use --format onnx "
                          "and an .onnx --output)")  # fmt: skip
    if args.fp16:
        raise ConfigError(f"--quantize {mode} converts the fp32 export; --fp16 exports fp16 weights through torch: "
                          "choose one")  # fmt: skip
    if args.atol is not None:
        raise ConfigError(f"--atol bounds an export's parity check; a --quantize {mode} file's parity is reported, "
                          "not bounded: drop --atol")  # fmt: skip
    if mode == "int8-static" and args.calibration_batches < 1:
        raise ConfigError(f"--quantize int8-static needs calibration data: --calibration-batches must be >= 1, got "
                          f"{args.calibration_batches}")  # fmt: skip
    if args.calibration_batches < 0:
        raise ConfigError(f"--calibration-batches must be >= 0, got {args.calibration_batches}")
    reason = missing_tool(mode)
    if reason:
        raise UnsupportedError(reason)


def default_format(output: str, merge_lora: bool, hf_model: bool) -> str:
    """The format of an export without --format: the --output suffix's, else a Hugging Face folder for a merged
    hf: model, else ONNX."""
    fmt = format_for(output)
    if fmt == "onnx" and merge_lora and hf_model and not output.lower().endswith(".onnx"):
        return "hf"
    return fmt


def check_format(args: argparse.Namespace, loaded: LoadedModel) -> str:
    """The export format, checked against what the checkpoint holds and where it goes: one line, before any
    write, for --merge-lora or --format peft on a run without LoRA, a folder format a model cannot take (saying
    what it writes instead), --images for a language model, and an --output that holds something else."""
    model, lora, hf = loaded.meta["model"], bool(loaded.meta.get("lora")), is_hf_name(loaded.meta["model"])
    fmt = args.format or default_format(args.output, args.merge_lora, hf)
    if args.merge_lora and not lora:
        raise ConfigError(
            f"--merge-lora: {args.checkpoint} was trained without LoRA (no --lora-rank), so there are no adapters to "
            "merge; export it without --merge-lora"
        )
    if fmt == "peft":
        check_peft(args, loaded)
    elif fmt == "hf" and not hf and not isinstance(loaded.model, Transformer):
        raise ConfigError(
            f"--format hf writes a folder transformers loads, for a run of a Hugging Face model (--model "
            f"hf:FOLDER) or of a built-in transformer (as a Llama); {model} is neither: export it as safetensors, "
            "state-dict or onnx (with --merge-lora for a LoRA run's merged weights)"
        )
    elif fmt == "hf" and lora and not args.merge_lora:
        raise ConfigError(
            f"--format hf: {args.checkpoint} is a LoRA run; add --merge-lora (the adapters folded into the "
            "weights) or use --format peft (the adapters alone)"
        )
    if fmt == "onnx" and args.images and is_language(loaded.meta):
        raise ConfigError(
            f"--images: {model} is a language model (it takes token ids); its real parity inputs are validation "
            "windows of its text (--real-samples)"
        )
    if fmt in FOLDER_FORMATS:
        check_output_folder(Path(args.output), FOLDER_FORMATS[fmt])
    elif Path(args.output).is_dir():
        raise ConfigError(f"--output {args.output} is a folder; name the file to write")
    return fmt


def check_peft(args: argparse.Namespace, loaded: LoadedModel) -> None:
    """--format peft: the adapters of a LoRA run of a Hugging Face model whose folder holds the base's weights,
    the run's starting point (peft loads adapters onto that base), not merged."""
    model = loaded.meta["model"]
    if not loaded.meta.get("lora"):
        raise ConfigError(
            f"--format peft writes LoRA adapters; {args.checkpoint} was trained without --lora-rank"
        )
    if args.merge_lora:
        raise ConfigError(
            "--format peft writes the adapters alone and --merge-lora folds them into the weights: choose one"
        )
    if not is_hf_name(model):
        raise ConfigError(
            f"--format peft: peft loads adapters onto a Hugging Face model (--model hf:FOLDER); {model} is "
            "stratbench's own: export its merged weights with --merge-lora (safetensors, state-dict or onnx)"
        )
    if loaded.config.get("init_from"):
        raise ConfigError(
            f"--format peft: the run started from --init-from {loaded.config['init_from']}, not from "
            f"{model}'s weights, so the adapters' base is not that folder; export with --merge-lora instead"
        )
    folder = model_folder(model)
    if find_weights(model, folder) is None:
        raise ConfigError(
            f"--format peft: {folder} holds no weights (the run's base was a random init from its config.json), so "
            "the adapters have no base to load onto; export with --merge-lora instead"
        )


def merge_checked(loaded: LoadedModel, atol: float) -> LoadedModel:
    """The checkpoint's model with its adapters merged (``merged``), its logits checked against the adapted
    model's on random inputs."""
    reference = reference_logits(loaded)
    loaded = merged(loaded)
    worst, scale = difference(loaded.model, reference, int(loaded.meta["num_classes"]))
    print(f"merged the LoRA adapters into the weights: max abs diff of logits {worst:.3g} (|logit| {scale:.3g})",
          file=sys.stderr)  # fmt: skip
    check_parity(worst, scale, atol, "the merged model")
    return loaded


def check_parity(worst: float, scale: float, atol: float, kept: str) -> None:
    if worst > allowed_diff(atol, scale):
        raise ParityError(f"parity check failed: max abs diff {worst:.3g} > {allowed_diff(atol, scale):.3g} "
                          f"(--atol {atol:g} x largest |logit| {scale:.3g}) ({kept} kept)")  # fmt: skip


def check_opset(opset: int | None) -> None:
    if opset is not None:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if not 7 <= opset <= newest:
            raise ConfigError(f"--opset must be between 7 and {newest} (this onnx's newest), got {opset}")


def export_checked_onnx(args: argparse.Namespace, atol: float, loaded: LoadedModel) -> int:
    """Export, then compare onnxruntime's logits with PyTorch's; a failed comparison keeps the file and raises."""
    device = resolve_device(args.device)
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


def print_parity(rows: list[ParityRow], session: OrtModel, atol: float | None) -> None:
    """The parity table; ``atol`` None (a quantised file): the differences reported, no tolerance column."""
    table = Table(title=f"parity: onnxruntime ({', '.join(session.providers)}) vs PyTorch fp32 (CPU)")
    bound = [] if atol is None else [f"<= {atol:g} x max(1, |logit|)"]
    for col in ("input", "shape", "max |logit|", "max abs diff", "same top-1", *bound):
        table.add_column(col)
    for r in rows:
        ok = [] if atol is None else ["yes" if r.ok(atol) else "NO"]
        table.add_row(r.name, "x".join(map(str, r.shape)), f"{r.scale:.3g}", f"{r.max_abs_diff:.3g}",
                      f"{r.same_argmax:.1%}", *ok)  # fmt: skip
    Console().print(table)


def calibration_for(args: argparse.Namespace, loaded: LoadedModel) -> list:
    """int8-static's calibration inputs: the first --calibration-batches validation batches of the checkpoint's
    data (numpy); where the data cannot be built here, one line before anything is written."""
    if args.quantize != "int8-static":
        return []
    try:
        batches = validation_batches(loaded, args.calibration_batches)
    except StratbenchError as exc:
        raise DataError(f"--quantize int8-static calibrates on the checkpoint's validation data, which is not "
                        f"available here ({exc}); use int8-dynamic or fp16, which need none") from None  # fmt: skip
    return [x.numpy() for x, _ in batches]


def export_quantized_onnx(args: argparse.Namespace, loaded: LoadedModel, calibration: list) -> int:
    """The fp32 export (in a temporary folder) rewritten as --quantize at --output, checked; its parity against
    PyTorch fp32 on random and real inputs printed (max abs diff, argmax agreement), not required."""
    with tempfile.TemporaryDirectory(prefix="stratbench-export-") as tmp:
        fp32 = export_onnx(loaded.model, loaded.meta, Path(tmp) / "model.onnx", opset=args.opset,
                           exporter=args.exporter, extra_metadata={"config": loaded.config})  # fmt: skip
        result = quantize_onnx(fp32.path, args.output, args.quantize, calibration)
    samples = (
        f", calibrated on {result.calibration_samples} validation samples"
        if result.calibration_samples
        else ""
    )
    print(
        f"wrote {result.path} ({fmt_bytes(result.size_bytes)}, {result.mode}: {result.size_bytes / fp32.size_bytes:.2f}x "
        f"the fp32 export's {fmt_bytes(fp32.size_bytes)}{samples}; {fp32.exporter} exporter, "
        f"{fp32.seconds + result.seconds:.1f} s); onnx.checker: ok"
    )
    print(f"inputs: {describe_signature(fp32.signature)}")
    session = OrtModel(result.path)
    rows, notes = onnx_parity(loaded, session, args.real_samples, args.images)
    print_parity(rows, session, None)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    worst = max(r.max_abs_diff for r in rows)
    agree = min(r.same_argmax for r in rows)
    print(f"parity (reported, not required): max abs diff {worst:.3g}, argmax agreement at least {agree:.1%}")
    return 0


def export_weights(args: argparse.Namespace, fmt: str, atol: float, loaded: LoadedModel) -> int:
    """The bare model's state dict (fp32, or fp16 with --fp16) as safetensors or a torch.save file, then read back
    with plain torch/safetensors into a freshly built model whose logits must match the checkpoint's."""
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
    check_parity(worst, scale, atol, str(out))
    return 0


def export_folder(args: argparse.Namespace, fmt: str, atol: float, loaded: LoadedModel) -> int:
    """A Hugging Face model folder (``hf``) or a PEFT adapter folder (``peft``), then loaded the way a user
    would (transformers' from_pretrained; peft's PeftModel.from_pretrained on the base) and its logits compared
    with the checkpoint's."""
    dtype = torch.float16 if args.fp16 else torch.float32
    out = Path(args.output)
    reference = reference_logits(loaded)
    if fmt == "hf":
        names = write_hf_folder(loaded, out, dtype)
        worst, scale = hf_difference(loaded, out, reference)
        reader = "transformers' AutoModelForCausalLM.from_pretrained"
    else:
        names = write_adapter_folder(loaded, out, dtype)
        worst, scale = adapter_difference(loaded, out, reference)
        reader = "peft's PeftModel.from_pretrained on the base"
    size = sum((out / n).stat().st_size for n in names)
    print(f"wrote {out}/ ({', '.join(names)}; {fmt_bytes(size)}, {str(dtype).split('.')[-1]})")
    print(f"loaded with {reader}: max abs diff of logits {worst:.3g} (tolerance {atol:g} x max(1, |logit| "
          f"{scale:.3g}))")  # fmt: skip
    check_parity(worst, scale, atol, str(out))
    return 0
