"""Generation speed of a language model, token by token: the measuring loop of ``stratbench bench-generate``.

Per backend (``eager``: the key/value cache of ``models.kv_cache``; ``compiled``: the same under ``torch.compile``;
``eager-no-cache``: the model's forward over the whole sequence for every token), prompt length and decoding
(greedy; sampled: top-k with a temperature, seeded), one prompt of random token ids (the same for every backend)
is continued by ``max_new_tokens`` tokens at batch 1, ``warmup`` times untimed and ``repeats`` times timed.

Per case: time to first token (the prompt read, the first token picked; the median over the repeats), each later
token's latency (its step and pick; p50 and p90 over all repeats' tokens), and decode tokens/s (the later tokens
over their summed time: the prompt's time is the first token's). A compiled backend is compiled once, before its
cases, on the first prompt (its prefill and single-token graphs, dynamic shapes), and that time is its ``compile_s``;
a recompile a later length needs falls in that case's warm-up. Greedy rows say whether their tokens are those of
the first backend measured (the reference, usually ``eager``).
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from stratbench.checkpoints.checkpoint import atomic_write
from stratbench.core.errors import ConfigError
from stratbench.core.user_code import one_line
from stratbench.inference.generate import Decoded, Sampling, decode
from stratbench.inference.predictor import percentile
from stratbench.models.kv_cache import Decoder, decoder_for

GEN_BACKENDS = ("eager", "compiled", "eager-no-cache")
DECODINGS = ("greedy", "sampled")
DEFAULT_PROMPT_LENGTHS = (128, 512, 2048)
CSV_FIELDS = (
    "model", "backend", "cache", "decoding", "device", "threads", "prompt_len", "new_tokens", "status", "repeats",
    "ttft_ms", "p50_ms", "p90_ms", "tokens_per_s", "compile_s", "same_as_reference", "reason",
)  # fmt: skip


@dataclass(frozen=True)
class GenSettings:
    """What each case generates and how often."""

    prompt_lengths: tuple[int, ...]
    max_new_tokens: int = 64
    decodings: tuple[str, ...] = DECODINGS
    top_k: int = 50
    """The sampled decoding's top-k (greedy is top-k 1)."""
    temperature: float = 1.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 3

    def sampling(self, decoding: str) -> Sampling:
        top_k = 1 if decoding == "greedy" else self.top_k
        return Sampling(self.max_new_tokens, top_k, self.temperature, self.seed).check()


@dataclass
class GenRow:
    model: str
    backend: str
    decoding: str
    prompt_len: int
    new_tokens: int
    device: str = "cpu"
    threads: int | None = None
    status: str = "ok"
    repeats: int = 0
    ttft_ms: float | None = None
    p50_ms: float | None = None
    """Per-token latency after the first token (its step through the model and its pick)."""
    p90_ms: float | None = None
    tokens_per_s: float | None = None
    """Decode tokens/s: the tokens after the first over their summed time."""
    compile_s: float | None = None
    same_as_reference: bool | None = None
    """Greedy rows: whether the tokens are the reference backend's (None: sampled, or the reference itself)."""
    reason: str = ""
    ids: list[int] = field(default_factory=list, repr=False)

    @property
    def cache(self) -> str:
        return "none" if self.backend.endswith("no-cache") else "kv"

    def summarise(self, runs: list[Decoded]) -> None:
        steps = [s for run in runs for s in run.step_s]
        self.repeats, self.ids = len(runs), runs[0].ids
        self.ttft_ms = percentile([run.first_s * 1e3 for run in runs], 50)
        if steps:
            ms = [s * 1e3 for s in steps]
            self.p50_ms, self.p90_ms = percentile(ms, 50), percentile(ms, 90)
            self.tokens_per_s = len(steps) / sum(steps)


def prompt_lengths(
    requested: list[int] | None, max_len: int, new_tokens: int, name: str
) -> tuple[list[int], str | None]:
    """The prompt lengths to measure and a note on what was capped: defaults (``requested`` None) capped at what
    fits with ``new_tokens`` in ``max_len`` positions; a requested length that does not fit is refused in one line."""
    room = max_len - new_tokens
    if room < 1:
        raise ConfigError(
            f"--max-new-tokens {new_tokens} leaves no room for a prompt in {name}'s max length of {max_len} "
            f"tokens; choose --max-new-tokens at most {max_len - 1}"
        )
    if requested is not None:
        too_long = [n for n in requested if n > room]
        if too_long:
            raise ConfigError(
                f"--prompt-lengths {too_long[0]}: with --max-new-tokens {new_tokens}, {name}'s max length of "
                f"{max_len} tokens leaves room for prompts of at most {room} tokens; choose lengths up to {room}"
            )
        return list(dict.fromkeys(requested)), None
    capped = [n for n in DEFAULT_PROMPT_LENGTHS if n > room]
    lengths = list(dict.fromkeys(min(n, room) for n in DEFAULT_PROMPT_LENGTHS))
    if not capped:
        return lengths, None
    return lengths, (
        f"prompt lengths {', '.join(map(str, capped))} capped at {room}: {name}'s max length is {max_len} tokens "
        f"and {new_tokens} new tokens must fit"
    )


class GenerationBench:
    """The cases of one model on one device; ``on_row`` sees each row as it is measured."""

    def __init__(
        self, model: nn.Module, name: str, device: torch.device, settings: GenSettings, threads: int,
        on_row: Callable[[GenRow], None] = lambda row: None,
    ) -> None:  # fmt: skip
        self.model, self.name, self.device, self.settings = model, name, device, settings
        self.threads, self.on_row = threads, on_row
        gen = torch.Generator().manual_seed(settings.seed)
        vocab = int(model.vocab_size)
        longest = max(settings.prompt_lengths)
        self.prompt = torch.randint(0, vocab, (1, longest), generator=gen).to(device)
        self.rows: list[GenRow] = []

    def run(self, backends: list[str]) -> list[GenRow]:
        for backend in backends:
            self.backend(backend)
        return self.rows

    def backend(self, backend: str) -> None:
        """Every case of ``backend``, or a row per case saying why it could not run."""
        compile_s = None
        try:
            decoder = decoder_for(
                self.model, cache=backend != "eager-no-cache", compiled=backend == "compiled"
            )
            if backend == "compiled":
                begin = time.perf_counter()
                decode(decoder, self.prompt_of(self.settings.prompt_lengths[0]), Sampling(2))
                compile_s = time.perf_counter() - begin
        except Exception as exc:
            self.failed(backend, one_line(exc))
            return
        for length in self.settings.prompt_lengths:
            for decoding in self.settings.decodings:
                row = self.new_row(backend, decoding, length)
                row.compile_s = compile_s
                try:
                    self.case(decoder, row)
                except Exception as exc:
                    row.status, row.reason = "failed", one_line(exc)
                self.add(row)

    def case(self, decoder: Decoder, row: GenRow) -> None:
        sampling = self.settings.sampling(row.decoding)
        prompt = self.prompt_of(row.prompt_len)
        for _ in range(self.settings.warmup):
            decode(decoder, prompt, sampling)
        row.summarise([decode(decoder, prompt, sampling) for _ in range(self.settings.repeats)])
        reference = next(
            (r for r in self.rows if r.status == "ok" and (r.decoding, r.prompt_len) == (row.decoding, row.prompt_len)),
            None,
        )  # fmt: skip
        if row.decoding == "greedy" and reference is not None:
            row.same_as_reference = reference.ids == row.ids

    def prompt_of(self, length: int) -> torch.Tensor:
        return self.prompt[:, :length]

    def new_row(self, backend: str, decoding: str, length: int) -> GenRow:
        return GenRow(self.name, backend, decoding, length, self.settings.max_new_tokens, self.device.type,
                      self.threads)  # fmt: skip

    def failed(self, backend: str, reason: str) -> None:
        for length in self.settings.prompt_lengths:
            for decoding in self.settings.decodings:
                row = self.new_row(backend, decoding, length)
                row.status, row.reason = "failed", reason
                self.add(row)

    def add(self, row: GenRow) -> None:
        self.rows.append(row)
        self.on_row(row)


def write_csv(rows: list[GenRow], out: Path) -> None:
    """One line per row (floats with 4 decimals, missing values empty), written atomically."""
    with io.StringIO(newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            d = asdict(r) | {"cache": r.cache}
            writer.writerow({k: "" if d[k] is None else (f"{d[k]:.4f}" if isinstance(d[k], float) else d[k])
                             for k in CSV_FIELDS})  # fmt: skip
        atomic_write(out, fh.getvalue())
