"""stratbench evaluate: accuracy and loss of a checkpoint (any method) on a data set's validation split."""

from __future__ import annotations

import argparse
import json
import sys
import time

from stratbench.checkpoints.checkpoint import add_trust_argument, trusted
from stratbench.core.errors import ConfigError
from stratbench.data.datasets import DATASETS, eval_subset
from stratbench.inference.predictor import (
    add_backend_arguments,
    evaluate,
    open_model,
    train_config_for,
    validation_set,
)
from stratbench.training.losses import perplexity

NAME = "evaluate"
HELP = "accuracy and loss of a checkpoint (any method, or an ONNX export) on a data set's validation split"
ORDER = 61


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    parser.add_argument(
        "--checkpoint",
        help="checkpoint file or sharded folder (e.g. runs/x/checkpoints/last), a run folder (its last checkpoint), "
        "or a folder `export --merge-lora` / `--format peft` wrote",
    )
    parser.add_argument(
        "--data", choices=DATASETS, help="data set (default: the one the checkpoint was trained on)"
    )
    parser.add_argument(
        "--data-dir", help="folder of the data set (default: the checkpoint's, when --data is not changed)"
    )
    add_backend_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per forward pass")
    parser.add_argument(
        "--eval-samples", type=int, default=None,
        help="the first N validation samples (default: all of an image set, 256 windows of text, as training)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.eval_samples is not None and args.eval_samples < 1:
        raise ConfigError(f"--eval-samples must be at least 1, got {args.eval_samples}")
    with open_model(args.checkpoint, args.backend, args.onnx, args.device) as opened:
        cfg = train_config_for(opened.config, opened.meta, data=args.data, data_dir=args.data_dir)
        cfg.eval_samples = args.eval_samples
        bundle = validation_set(cfg, opened.meta)
        t0 = time.perf_counter()
        result = evaluate(opened.runner, eval_subset(cfg, bundle), args.batch_size)
        seconds = time.perf_counter() - t0
    result |= {"data": cfg.data, "backend": args.backend, "seconds": seconds}
    if bundle.is_text:  # a language model: next-token accuracy, and the perplexity it is compared by
        result["val_perplexity"] = perplexity(result["val_loss"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"model: {opened.description}", file=sys.stderr)
        ppl = f"  perplexity {result['val_perplexity']:.3f}" if "val_perplexity" in result else ""
        print(
            f"{cfg.data} validation ({result['val_samples']} samples, {args.backend}): "
            f"accuracy {result['val_accuracy']:.4f}  loss {result['val_loss']:.6f}{ppl}  ({seconds:.2f} s)"
        )
    return 0
