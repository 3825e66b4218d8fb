"""stratbench bench-generate: a language model's generation speed token by token, with a key/value cache (eager and
torch.compile) and without one: time to first token, per-token latency p50/p90 and decode tokens/s of greedy and
sampled decoding at several prompt lengths, batch 1. How each case is timed: stratbench.inference.generation_bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from stratbench.checkpoints.checkpoint import add_trust_argument, trusted
from stratbench.commands.bench_infer import check_output, positive_ints
from stratbench.core.dist import resolve_device
from stratbench.core.errors import ConfigError, did_you_mean
from stratbench.inference.bench import random_model
from stratbench.inference.generation_bench import (
    DECODINGS,
    DEFAULT_PROMPT_LENGTHS,
    GEN_BACKENDS,
    GenerationBench,
    GenRow,
    GenSettings,
    prompt_lengths,
    write_csv,
)
from stratbench.inference.predictor import load_model
from stratbench.measuring.environment import cpu_name
from stratbench.models.hf import is_hf_name, load_config, max_positions, vocab_size_of
from stratbench.models.kv_cache import CACHED_KINDS, max_length
from stratbench.models.transformer import SIZES
from stratbench.models.zoo import check_model, is_language_model

NAME = "bench-generate"
HELP = (
    "a language model's generation speed with a KV cache (eager, torch.compile) and without: time to first token, "
    "per-token latency p50/p90, tokens/s of greedy and sampled decoding per prompt length"
)
ORDER = 64
RANDOM_SEQ_LEN = 128
"""The training window a random-weights model's metadata says (at most its max length); decoding is not bound to it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trust_argument(parser)
    src = parser.add_argument_group("model (a checkpoint, or a model with random weights)")
    src.add_argument(
        "--checkpoint", help="checkpoint file or sharded folder of a language model, of any method"
    )
    src.add_argument("--model", help=f"language model with random weights: {', '.join(SIZES)} or hf:FOLDER")
    parser.add_argument(
        "--prompt-lengths", type=positive_ints("prompt lengths"), default=None,
        help=f"comma-separated prompt lengths in tokens (default {','.join(map(str, DEFAULT_PROMPT_LENGTHS))}, each "
        "capped where the prompt and the new tokens would not fit the model's max length; given lengths must fit)",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)"
    )
    parser.add_argument(
        "--backends", default=",".join(GEN_BACKENDS),
        help=f"comma-separated subset of {', '.join(GEN_BACKENDS)} (default: all; eager and compiled use the KV "
        "cache, eager-no-cache runs the whole sequence for every token)",
    )  # fmt: skip
    parser.add_argument(
        "--decodings", default=",".join(DECODINGS), help=f"comma-separated subset of {', '.join(DECODINGS)}"
    )
    parser.add_argument(
        "--top-k", type=int, default=50, help="sampled decoding: the k most likely tokens (default 50)"
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampled decoding: temperature (default 1)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the prompt's random ids and of the sampling"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations per case (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per case (default 3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for PyTorch (default: all cores)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="device (default: cuda when present)",
    )
    parser.add_argument(
        "--output", help="CSV file for the results (one row per backend, decoding, prompt length)"
    )


def run(args: argparse.Namespace) -> int:
    with trusted(args.trust_checkpoint):
        backends, decodings = check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        threads, device = torch.get_num_threads(), resolve_device(args.device)
        model, name = _model(args, device)
        limit = max_length(model)
        if limit is None:
            raise ConfigError(f"bench-generate measures {CACHED_KINDS}; {name} is a {type(model).__name__}")
        lengths, note = prompt_lengths(args.prompt_lengths, limit, args.max_new_tokens, name)
        settings = GenSettings(tuple(lengths), args.max_new_tokens, tuple(decodings), args.top_k, args.temperature,
                               args.seed, args.warmup, args.repeats)  # fmt: skip
        where = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"{cpu_name()}, {threads} threads"
        )
        print(f"bench-generate: {name}, batch 1, {args.max_new_tokens} new tokens, prompts of random token ids; "
              f"on {device.type} ({where})", file=sys.stderr)  # fmt: skip
        if note:
            print(f"note: {note}", file=sys.stderr)
        rows = GenerationBench(model, name, device, settings, threads, on_row=_print_row).run(backends)
        _print_table(rows, name, device, threads, settings)
        if args.output:
            write_csv(rows, Path(args.output))
            print(f"wrote {Path(args.output)}", file=sys.stderr)
        return 0 if any(r.status == "ok" for r in rows) else 1


def _model(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model (a checkpoint's, or random weights, seed 0) in eval mode on ``device``, and its name."""
    if args.model:
        if is_hf_name(args.model):
            vocab, limit = vocab_size_of(args.model), max_positions(load_config(args.model))
        else:
            vocab, limit = SIZES[args.model].vocab_size, SIZES[args.model].max_seq_len
        model, _ = random_model(args.model, vocab, 0, 16, min(RANDOM_SEQ_LEN, limit or RANDOM_SEQ_LEN))
        return model.to(device).eval(), args.model
    loaded = load_model(args.checkpoint, device)
    if not loaded.meta.get("seq_len"):
        raise ConfigError(f"bench-generate needs a language model; {loaded.meta['model']} classifies images")
    print(f"model: {loaded.describe()}", file=sys.stderr)
    return loaded.model.eval(), str(loaded.meta["model"])


def _subset(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        bad = unknown[0] if unknown else text
        raise ConfigError(
            f"{flag}: unknown value {bad!r}{did_you_mean(bad, allowed)}; choose from: {', '.join(allowed)}"
        )
    return chosen


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The backends and decodings to measure; every value checked first, one line for the first bad one."""
    backends = _subset("--backends", args.backends, GEN_BACKENDS)
    decodings = _subset("--decodings", args.decodings, DECODINGS)
    if args.checkpoint and args.model:
        raise ConfigError("give --checkpoint or --model, not both")
    if not args.checkpoint and not args.model:
        raise ConfigError(
            f"give --checkpoint CKPT, or --model NAME (random weights): {', '.join(SIZES)} or hf:FOLDER"
        )
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--warmup", args.warmup, 0),
                             ("--repeats", args.repeats, 1), ("--top-k", args.top_k, 0)):  # fmt: skip
        if not low <= value <= 1_000_000:
            raise ConfigError(f"{flag} must be between {low} and 1000000, got {value}")
    if not 0 < args.temperature < float("inf"):
        raise ConfigError(f"--temperature must be a positive number, got {args.temperature}")
    if args.threads is not None and not 1 <= args.threads <= 4096:
        raise ConfigError(f"--threads must be between 1 and 4096, got {args.threads}")
    if args.output:
        check_output(Path(args.output))
    if args.model:
        check_model(args.model)  # a known name, or an hf: folder that resolves
        if not is_language_model(args.model):
            raise ConfigError(
                f"bench-generate needs a language model: {', '.join(SIZES)} or hf:FOLDER; {args.model} is not one"
            )
    return backends, decodings


def _print_row(r: GenRow) -> None:
    if r.status != "ok":
        print(
            f"  {r.backend:<15} {r.decoding:<8} prompt {r.prompt_len:<5} {r.status}: {r.reason}",
            file=sys.stderr,
        )
        return
    print(f"  {r.backend:<15} {r.decoding:<8} prompt {r.prompt_len:<5} first token {r.ttft_ms:8.2f} ms  per token "
          f"p50 {r.p50_ms:7.2f} ms  {r.tokens_per_s:8.1f} tokens/s", file=sys.stderr, flush=True)  # fmt: skip


def _print_table(rows: list[GenRow], name: str, device: torch.device, threads: int, s: GenSettings) -> None:
    table = Table(
        title=f"generation: {name}, {device.type}, {threads} threads, batch 1, {s.max_new_tokens} new tokens"
    )
    for col in ("backend", "cache", "decoding", "prompt", "first token ms", "p50 ms/token", "p90 ms/token",
                "tokens/s", "compile s", "same tokens", "note"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("backend", "cache", "decoding", "note") else "right")

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else f"{x:{spec}}"

    for r in rows:
        same = {None: "-", True: "yes", False: "NO"}[r.same_as_reference]
        table.add_row(r.backend, r.cache, r.decoding, str(r.prompt_len), f(r.ttft_ms), f(r.p50_ms), f(r.p90_ms),
                      f(r.tokens_per_s, ".1f"), f(r.compile_s, ".1f"), same,
                      "" if r.status == "ok" else f"{r.status}: {r.reason}")  # fmt: skip
    Console(width=220).print(table)
    reference = next((r.backend for r in rows if r.status == "ok"), None)
    print(f"note: {s.warmup} untimed and {s.repeats} timed generations per case; first token = prompt read + first "
          f"pick (median), per-token latency and tokens/s over the later tokens; sampled: top-k {s.top_k}, "
          f"temperature {s.temperature:g}, seed {s.seed}; same tokens: greedy tokens equal to {reference}'s",
          file=sys.stderr)  # fmt: skip
