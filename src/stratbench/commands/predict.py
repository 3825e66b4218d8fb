"""stratbench predict: top-k classes for image files or folders, from any method's checkpoint (or an ONNX file)."""

from __future__ import annotations

import argparse
import json
import sys

from stratbench.checkpoints.checkpoint import add_trust_argument, trusted
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, DataError
from stratbench.inference.generate import Sampling, codec_for, generate
from stratbench.inference.predictor import (
    add_backend_arguments,
    collect_images,
    load_model,
    open_model,
    predict_files,
)

NAME = "predict"
HELP = "top-k classes with probabilities for images or folders of images, from a checkpoint of any method"
ORDER = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    parser.add_argument(
        "images", nargs="*", metavar="IMAGE_OR_DIR", help="image files and/or folders (searched recursively)"
    )
    parser.add_argument(
        "--prompt", help="a language model: the text to continue (generated text on stdout)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="--prompt: tokens to generate")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="--prompt: sampling temperature (with --top-k > 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="--prompt: seed of the sampling")
    parser.add_argument(
        "--checkpoint",
        help="checkpoint file or sharded folder (e.g. runs/x/checkpoints/last), a run folder (its last checkpoint), "
        "or a folder `export --merge-lora` / `--format peft` wrote",
    )
    parser.add_argument(
        "--top-k", type=int, default=None,
        help="classes to show per image (default 5); --prompt: sample from the k most likely tokens (default 1: "
        "greedy; 0: all)",
    )  # fmt: skip
    add_backend_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass")
    parser.add_argument(
        "--json", action="store_true", help="print the predictions as one JSON document on stdout"
    )


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.prompt is not None:
        return _generate(args)
    args.top_k = 5 if args.top_k is None else args.top_k
    if args.top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {args.top_k}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    # The checkpoint is checked first: a bad checkpoint is one error, whatever the images are.
    with open_model(args.checkpoint, args.backend, args.onnx, args.device) as opened:
        if opened.meta.get("seq_len"):
            raise ConfigError("this checkpoint is a language model: give --prompt TEXT to continue")
        if not args.json:
            print(f"model: {opened.description}", file=sys.stderr)
        files, problems = collect_images(args.images)
        predictions, bad = predict_files(files, opened.meta, opened.runner, args.top_k, args.batch_size)
        problems.extend(bad)
    if args.json:
        doc = {
            "predictions": [p.to_dict() for p in predictions],
            "errors": [{"path": str(p.path), "reason": p.reason} for p in problems],
        }
        print(json.dumps(doc, indent=2))
    else:
        for p in predictions:
            print(f"{p.path}: " + ", ".join(f"{name} ({prob:.1%})" for name, prob in p.top))
    for p in problems:
        print(f"stratbench predict: error: {p.line()}", file=sys.stderr)
    if not predictions and not problems:
        raise DataError("no images given")
    if problems:
        if predictions:
            print(
                f"stratbench predict: {len(predictions)} image(s) predicted, {len(problems)} input(s) failed",
                file=sys.stderr,
            )
        return 2
    return 0


def _generate(args: argparse.Namespace) -> int:
    """``--prompt``: the continuation a language model's checkpoint generates, on stdout."""
    if args.images:
        raise ConfigError("--prompt continues text with a language model; it takes no images")
    if args.backend != "torch":
        raise ConfigError("--prompt runs on --backend torch only")
    sampling = Sampling(args.max_new_tokens, 1 if args.top_k is None else args.top_k, args.temperature, args.seed)
    sampling.check()
    if args.checkpoint is None:
        raise ConfigError("--checkpoint is required")
    loaded = load_model(args.checkpoint, resolve_device(args.device))
    if not loaded.meta.get("seq_len"):
        raise ConfigError(f"--prompt needs a language model; {loaded.meta['model']} classifies images")
    print(f"model: {loaded.describe()}", file=sys.stderr)
    codec = codec_for(loaded.meta)
    ids = generate(loaded.model, codec.encode(args.prompt), int(loaded.meta["seq_len"]), sampling)
    text = codec.decode(ids)
    print(json.dumps({"prompt": args.prompt, "generated": text, "ids": ids}) if args.json else args.prompt + text)
    return 0
