"""Language-modelling data: windows of a token stream, from real text that every machine has offline (the Python
standard library's sources, or a folder of text files), from nanoGPT-style pre-tokenised ``.bin`` files, or from
a seeded random stream for pure-throughput benchmarks.

Item i of a split is ``(x, y)``: ``seq_len`` tokens and the same tokens shifted by one (nanoGPT's targets), in
non-overlapping windows. The data sets are map-style, so the samplers every method uses (``DistributedSampler``:
rank r of N takes ``perm[r::N]``) split them unchanged, and one global batch is the same windows for any number of
ranks. Nothing here unpickles a file, and nothing is cached: byte-level text needs no tokenising, and a tokenised
stream would have to be stored next to files the user owns. Token files are read with ``os.pread``, not mapped into
memory: a file cut short while a run reads it is then a short read and one line, where a memory map's read past its
new end kills the process with SIGBUS (exit 135, nothing said).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from stratbench.core.config import RANGES
from stratbench.core.errors import ConfigError, DataError

TEXT_SOURCES = ("text", "tokens:PATH", "synthetic-tokens")
DEFAULT_TEXT_BYTES = 8 * 2**20
"""The stdlib corpus's byte budget: 8 MiB of Python 3.11's 11.6 MiB of non-test sources, read in well under 1 s."""
DEFAULT_SYNTHETIC_TOKENS = 2**20
TEXT_SUFFIXES = (".txt", ".md", ".py")
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
"""Folders left out of a corpus: CPython's test suites (files in odd encodings, generated data) and installed
third-party packages, which differ from machine to machine; hidden folders (``.git``, ``.venv``) are skipped too."""
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_WINDOW_DTYPES = (np.uint8, np.uint16, np.uint32, np.int64)
_SCAN_CHUNK = 2**24  # tokens per numpy pass over a file: 32 MiB of uint16, so a scan never holds a whole file
MAX_VOCAB = int(RANGES["vocab_size"][1])
"""The largest vocabulary stratbench builds a model for (``--vocab-size``'s range): a token file whose largest id
is beyond it is refused before its model (an embedding of 4e9 rows, say) is built."""


# ------------------------------------------------------------------------------------------------
# the data set


@dataclass(frozen=True)
class TokenFile:
    """``count`` tokens of ``dtype`` from token ``start`` of a raw binary file: what a ``TokenWindows`` re-opens
    as a memory map after pickling (a spawned DataLoader worker), instead of receiving a copy of the file."""

    path: str
    dtype: str
    start: int = 0
    count: int | None = None

    def open(self) -> FileTokens:
        return FileTokens(self)


class TokenFileChanged(DataError):
    """A token file cut short (or rewritten shorter) while a run reads it. Raised in a DataLoader worker, torch
    re-raises it with the worker's whole traceback as its message: the one line it was raised with is kept."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().splitlines()[-1].partition(": ")[2] or message
        super().__init__(message)


class FileTokens:
    """The tokens of a ``TokenFile`` as a read-only 1-D array: ``len``, ``dtype``, an index or a slice (step 1)
    read from the file with ``os.pread`` each time, ``np.asarray`` reads them all. A read that finds fewer bytes
    than the run started with is one line (``TokenFileChanged``); a memory map would die of SIGBUS instead.
    Pickles as its ``TokenFile`` (a DataLoader worker opens the file again, it is not sent a copy)."""

    def __init__(self, file: TokenFile) -> None:
        self.file = file
        self.dtype = np.dtype(file.dtype)
        self._fd = os.open(file.path, os.O_RDONLY)
        self.bytes_at_start = os.fstat(self._fd).st_size
        total = self.bytes_at_start // self.dtype.itemsize - file.start
        self.count = file.count if file.count is not None else total

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            if step != 1:
                raise IndexError("token files are read in contiguous slices (step 1)")
            return self._read(start, max(stop - start, 0))
        index = int(key) + (self.count if int(key) < 0 else 0)
        if not 0 <= index < self.count:
            raise IndexError(f"token {key} out of range for {self.count} tokens")
        return self._read(index, 1)[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        tokens = self._read(0, self.count)
        return tokens if dtype is None else tokens.astype(dtype)

    def _read(self, first: int, n: int) -> np.ndarray:
        """Tokens ``first .. first + n - 1`` of this stream, or one line if the file no longer holds them."""
        itemsize = self.dtype.itemsize
        offset, size = (self.file.start + first) * itemsize, n * itemsize
        parts, got = [], 0
        while got < size:
            part = os.pread(self._fd, size - got, offset + got)
            if not part:
                now = os.fstat(self._fd).st_size
                raise TokenFileChanged(
                    f"token file {self.file.path!r} changed during the run: it has {now} bytes now, "
                    f"{self.bytes_at_start} when the run started, and tokens {self.file.start + first}..{self.file.start + first + n - 1} "
                    f"(bytes {offset}..{offset + size - 1}) are gone; let whatever writes it finish, then run again"
                )
            parts.append(part)
            got += len(part)
        return np.frombuffer(b"".join(parts), dtype=self.dtype)

    def __reduce__(self) -> tuple[Any, tuple[TokenFile]]:
        return FileTokens, (self.file,)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class TokenWindows(Dataset):
    """Non-overlapping windows of a 1-D token stream: item i is ``x = tokens[i*T : i*T+T]`` and
    ``y = tokens[i*T+1 : i*T+T+1]`` as int64 tensors, ``(len(tokens) - 1) // T`` items. Tokens stay in their
    storage (uint8/uint16/uint32; a file's are read per window, ``FileTokens``) and only one window is converted
    per item. A file-backed stream pickles as its file's name, not its contents."""

    def __init__(self, tokens: np.ndarray | torch.Tensor | TokenFile, seq_len: int) -> None:
        self.seq_len = check_seq_len(seq_len)
        self.file = tokens if isinstance(tokens, TokenFile) else None
        self.tokens = tokens.open() if isinstance(tokens, TokenFile) else _token_array(tokens)

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = (i % n) * self.seq_len
        chunk = torch.from_numpy(np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def _token_array(tokens: Any) -> np.ndarray:
    """A 1-D numpy view of ``tokens`` (a CPU tensor shares its memory); int64 is accepted for tensors built in
    memory, other dtypes are refused because a float or signed stream is not token ids."""
    array = tokens.numpy() if torch.is_tensor(tokens) else np.asanyarray(tokens)  # a memmap stays one
    if array.ndim != 1 or not any(array.dtype == d for d in _WINDOW_DTYPES):
        raise ConfigError(
            f"token stream of dtype {array.dtype} and shape {tuple(array.shape)}: need a 1-D stream of "
            "uint8, uint16, uint32 or int64"
        )
    return array


def is_text_data(spec: str) -> bool:
    """Whether ``--data spec`` names text for a language model (one of ``TEXT_SOURCES``, or fine-tuning data:
    ``is_ft_data``), not images or a user's builder."""
    return spec in ("text", "tokens", "synthetic-tokens") or spec.startswith("tokens:") or is_ft_data(spec)


def is_ft_data(spec: str) -> bool:
    """Whether ``--data spec`` names fine-tuning examples (``data.instruct``: jsonl:PATH, hf-dataset:PATH_OR_NAME,
    instruct-stdlib) rather than windows of a token stream."""
    return spec == "instruct-stdlib" or spec.startswith(("jsonl:", "hf-dataset:"))


def token_path(spec: str, data_dir: str | os.PathLike | None) -> str:
    """The PATH of ``tokens:PATH`` (a bare ``tokens`` reads ``data_dir``); empty where neither names one."""
    return spec.partition(":")[2] or (str(data_dir) if data_dir is not None else "")


TEXT_EVAL_SAMPLES = 256
"""Validation windows a text run evaluates on unless told otherwise (``--eval-samples``): a fixed estimate of the
validation loss, as nanoGPT's ``eval_iters`` batches, rather than a pass over 20% of the corpus at every epoch."""


def check_seq_len(seq_len: int) -> int:
    return _whole(seq_len, "seq_len", "tokens")


def _whole(value: Any, name: str, unit: str) -> int:
    """``value`` as a positive int, or one line naming the option and its value."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"{name} {value!r} must be a whole number of {unit}, at least 1")
    return int(value)


# ------------------------------------------------------------------------------------------------
# text <-> token ids


class Codec(Protocol):
    vocab_size: int
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _ids_list(ids: Iterable[int] | torch.Tensor | np.ndarray) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


class ByteCodec:
    """UTF-8 bytes as tokens (vocabulary 256): any string encodes; a window that cuts a character in two decodes
    with U+FFFD in its place rather than failing."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        values = _ids_list(ids)
        bad = next((i for i in values if not 0 <= i < 256), None)
        if bad is not None:
            raise ConfigError(f"token {bad} is not a byte: byte-level text has tokens 0..255")
        return bytes(values).decode("utf-8", errors="replace")


class IdCodec:
    """Token files without a tokenizer: text is the ids written in decimal, separated by spaces, so that a prompt
    can still be given (nanoGPT's meta.pkl, which holds its character table, is a pickle and is never read)."""

    name = "ids"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ConfigError(
                f"text {text[:40]!r}: this data has no tokenizer, so text is token ids separated by spaces "
                "(or pass a tokenizer.json)"
            ) from None
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ConfigError(f"token {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in _ids_list(ids))


class HFCodec:
    """A Hugging Face ``tokenizers`` tokenizer; no special tokens are added, so encoding text and concatenating
    the pieces gives the same stream as the training data."""

    def __init__(self, tokenizer: Any, path: str) -> None:
        self.tokenizer, self.name = tokenizer, path
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(_ids_list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | os.PathLike) -> HFCodec:
    """A ``tokenizer.json`` read with ``tokenizers.Tokenizer.from_file`` (an optional package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"tokenizer {str(path)!r} needs the tokenizers package: pip install tokenizers"
        ) from None
    if not Path(path).is_file():
        raise DataError(f"tokenizer file {str(path)!r} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for any file it cannot parse
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{str(path)!r} is not a Hugging Face tokenizer.json ({reason})") from None
    return HFCodec(tokenizer, str(path))


# ------------------------------------------------------------------------------------------------
# what build_text_data returns


@dataclass
class TextData:
    """Training and validation windows, their vocabulary, and the codec that turns a prompt into ids and
    generated ids back into text."""

    train: TokenWindows
    val: TokenWindows
    vocab_size: int
    seq_len: int
    meta: dict = field(default_factory=dict)
    codec: Codec = field(default_factory=ByteCodec, repr=False)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.codec.decode(ids)


def build_text_data(
    spec: str,
    seq_len: int,
    *,
    data_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    synthetic_tokens: int = DEFAULT_SYNTHETIC_TOKENS,
    vocab_size: int | None = None,
    token_dtype: str = "uint16",
    text_bytes: int | None = None,
    max_vocab: int = MAX_VOCAB,
    max_vocab_of: str = "the largest vocabulary stratbench builds",
) -> TextData:
    """The data named by ``spec`` (one of ``TEXT_SOURCES``) in windows of ``seq_len`` tokens.

    ``text``: the stdlib's sources (or every .txt/.md/.py file under ``data_dir``), ``text_bytes`` of them at most
    (default 8 MiB of the stdlib, all of a folder), byte-level or encoded with ``tokenizer``. ``tokens:PATH``: a
    folder with nanoGPT's train.bin and val.bin, or one .bin file, of ``token_dtype``. ``synthetic-tokens``:
    ``synthetic_tokens`` random tokens from ``seed``. Where one stream is split, its last ``val_fraction`` is
    validation. ``vocab_size`` defaults to the tokenizer's (256 for bytes, max token + 1 for files); a token file
    without one must hold no token of ``max_vocab`` or more (``max_vocab_of``: whose vocabulary that is, e.g. a
    Hugging Face model's), or the first such token is one line naming it and where it is."""
    seq_len = check_seq_len(seq_len)
    vocab_size = None if vocab_size is None else _whole(vocab_size, "vocab_size", "tokens")
    if spec == "text":
        return _text(seq_len, data_dir, tokenizer, val_fraction, vocab_size, text_bytes)
    if spec == "tokens" or spec.startswith("tokens:"):
        path = token_path(spec, data_dir)
        if not path:
            raise ConfigError(
                "data 'tokens' needs a path: tokens:PATH (a folder with train.bin and val.bin, or a .bin)"
            )
        limit = (_whole(max_vocab, "max_vocab", "tokens"), max_vocab_of)
        return _token_files(Path(path), seq_len, tokenizer, val_fraction, vocab_size, token_dtype, limit)
    if spec == "synthetic-tokens":
        if tokenizer is not None:
            raise ConfigError(
                "a tokenizer applies to data 'text' and 'tokens:PATH', not to 'synthetic-tokens'"
            )
        return _synthetic(seq_len, synthetic_tokens, vocab_size or 256, seed)
    raise ConfigError(f"unknown text data {spec!r}; choose one of: {', '.join(TEXT_SOURCES)}")


def _split_at(n_tokens: int, val_fraction: float) -> int:
    """Where validation starts: the last ``val_fraction`` of the stream, contiguous, so that no window holds
    tokens of both splits."""
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, int | float)
        or not 0 < val_fraction < 1
    ):
        raise ConfigError(f"val_fraction {val_fraction!r} must be between 0 and 1 (exclusive)")
    return n_tokens - int(round(n_tokens * val_fraction))


def _windows(train: Any, val: Any, seq_len: int, source: str) -> tuple[TokenWindows, TokenWindows]:
    """Both splits as windows; a split too short for one window is a seq_len (or val_fraction) to change."""
    pair = TokenWindows(train, seq_len), TokenWindows(val, seq_len)
    for name, windows in zip(("train", "val"), pair, strict=True):
        if len(windows) == 0:
            raise ConfigError(
                f"seq_len {seq_len} is too long for the {name} split of {source} ({len(windows.tokens)} tokens): "
                f"one window needs {seq_len + 1} tokens; lower seq_len"
                + (" or raise val_fraction" if name == "val" else "")
            )
    return pair


def _meta(source: str, train: TokenWindows, val: TokenWindows, codec: Codec, **extra: Any) -> dict:
    return {
        "source": source,
        "n_tokens": {"train": len(train.tokens), "val": len(val.tokens)},
        "windows": {"train": len(train), "val": len(val)},
        "tokenizer": codec.name,
        **extra,
    }


def _vocab(given: int | None, codec: Codec | None) -> int | None:
    """The vocabulary: ``given`` (at least the codec's, e.g. nanoGPT's 50304 over GPT-2's 50257) or the codec's;
    None when only the tokens can tell."""
    if codec is None:
        return given
    if given is not None and given < codec.vocab_size:
        what = "byte-level text" if codec.name == "bytes" else f"tokenizer {codec.name!r}"
        raise ConfigError(f"vocab_size {given} is smaller than the {codec.vocab_size} tokens of {what}")
    return given if given is not None else codec.vocab_size


# ------------------------------------------------------------------------------------------------
# text: the stdlib's sources or a folder of text files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, suffixes: tuple[str, ...]) -> list[str]:
    """Relative POSIX paths of the files under ``root`` with one of ``suffixes``, sorted, outside
    ``SKIPPED_DIRS`` and hidden folders: the same list, in the same order, on every run of a machine."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if n.endswith(suffixes)]
    return sorted(found)


def read_corpus(root: Path, files: list[str], budget: int | None) -> tuple[list[bytes], list[str]]:
    """The files' bytes in order, up to ``budget`` bytes in all (the last piece cut to fit): the pieces and the
    files they came from."""
    pieces: list[bytes] = []
    used: list[str] = []
    total = 0
    for rel in files:
        if budget is not None and total >= budget:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError as exc:
            raise DataError(
                f"text file {str(root / rel)!r} could not be read: {exc.strerror or exc}"
            ) from None
        piece = data if budget is None else data[: budget - total]
        pieces.append(piece)
        used.append(rel)
        total += len(piece)
    return pieces, used


def _corpus(data_dir: str | os.PathLike | None, text_bytes: int | None) -> tuple[list[bytes], dict]:
    """The corpus's pieces and what to record of it: the stdlib's .py files (``text_bytes``, default 8 MiB) or
    every .txt/.md/.py file under ``data_dir`` (all of them unless ``text_bytes`` is given)."""
    text_bytes = None if text_bytes is None else _whole(text_bytes, "text_bytes", "bytes")
    if data_dir is None:
        root, suffixes, budget = stdlib_root(), (".py",), text_bytes or DEFAULT_TEXT_BYTES
        corpus = f"Python {platform.python_version()} standard library"
    else:
        root, suffixes, budget = Path(data_dir), TEXT_SUFFIXES, text_bytes
        corpus = "folder"
        if not root.is_dir():
            raise DataError(f"text data dir {str(root)!r} does not exist or is not a folder")
    files = corpus_files(root, suffixes)
    if not files:
        raise DataError(f"no {', '.join('*' + s for s in suffixes)} files under {str(root)!r}")
    pieces, used = read_corpus(root, files, budget)
    n_bytes = sum(len(p) for p in pieces)
    info = {
        "corpus": corpus,
        "root": str(root),
        "files": len(used),
        "first_file": used[0],
        "last_file": used[-1],
    }
    return pieces, {**info, "bytes": n_bytes, "byte_budget": budget}


def _text(
    seq_len: int,
    data_dir: Any,
    tokenizer: Any,
    val_fraction: float,
    vocab_size: int | None,
    text_bytes: int | None,
) -> TextData:
    """Byte-level text (the bytes are the tokens, no copy) or the text encoded with a tokenizer.json."""
    codec: Codec = load_tokenizer(tokenizer) if tokenizer is not None else ByteCodec()
    pieces, info = _corpus(data_dir, text_bytes)
    if isinstance(codec, HFCodec):
        stream = _encode_pieces(codec, pieces)
    else:
        stream = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    vocab = _vocab(vocab_size, codec)
    at = _split_at(len(stream), val_fraction)
    train, val = _windows(stream[:at], stream[at:], seq_len, f"the text in {info['root']}")
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    split = f"the last {val_fraction:g} of the token stream is validation"
    meta = _meta("text", train, val, codec, **info, sha256=sha.hexdigest(), split=split)
    return TextData(train, val, vocab, seq_len, meta, codec)


def _encode_pieces(codec: HFCodec, pieces: list[bytes]) -> np.ndarray:
    """Each file encoded on its own (``encode_batch`` runs them on all cores), then concatenated; a character cut
    by the byte budget decodes to U+FFFD."""
    texts = [p.decode("utf-8", errors="replace") for p in pieces]
    dtype = np.uint16 if codec.vocab_size <= 2**16 else np.uint32
    encodings = codec.tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=dtype) for e in encodings])


# ------------------------------------------------------------------------------------------------
# tokens:PATH: nanoGPT's pre-tokenised .bin files


def _token_files(
    path: Path,
    seq_len: int,
    tokenizer: Any,
    val_fraction: float,
    vocab_size: int | None,
    token_dtype: str,
    limit: tuple[int, str],
) -> TextData:
    """A folder's train.bin and val.bin, or one .bin split by ``val_fraction``. nanoGPT's meta.pkl beside them is
    a pickle and is never read: the vocabulary comes from ``vocab_size``, the tokenizer, or the tokens (below
    ``limit``: the largest vocabulary the model can take, and whose it is)."""
    if token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"token_dtype {token_dtype!r} is not one of: {', '.join(TOKEN_DTYPES)}")
    codec = load_tokenizer(tokenizer) if tokenizer is not None else None
    train, val, info = _token_splits(path, token_dtype, seq_len, val_fraction)
    given = _vocab(vocab_size, codec)
    if given is None:
        top = max(_scan_tokens(w, limit[0], limit[1]) for w in (train, val))
        vocab, vocab_from = top + 1, "max token + 1"
    else:
        for windows in (train, val):
            _scan_tokens(windows, given, "the vocabulary", find_max=False)
        vocab, vocab_from = given, "given" if vocab_size is not None else "tokenizer"
    codec = codec or IdCodec(vocab)
    meta = _meta("tokens", train, val, codec, **info, token_dtype=token_dtype, vocab_from=vocab_from)
    return TextData(train, val, vocab, seq_len, meta, codec)


def _token_splits(
    path: Path, token_dtype: str, seq_len: int, val_fraction: float
) -> tuple[TokenWindows, TokenWindows, dict]:
    """Training and validation windows over memory maps of the files, and how they were split."""
    if path.is_dir():
        names = ("train.bin", "val.bin")
        train_file, val_file = (_token_file(path / name, token_dtype, seq_len) for name in names)
        train, val = _windows(train_file, val_file, seq_len, str(path))
        return train, val, {"files": [str(path / n) for n in names], "split": "train.bin and val.bin"}
    if not path.exists():
        raise DataError(
            f"token data {str(path)!r} does not exist: need a folder with train.bin and val.bin, or a .bin file"
        )
    whole = _token_file(path, token_dtype, seq_len)
    at = _split_at(whole.count, val_fraction)
    halves = (
        TokenFile(whole.path, token_dtype, 0, at),
        TokenFile(whole.path, token_dtype, at, whole.count - at),
    )
    train, val = _windows(*halves, seq_len, str(path))
    return (
        train,
        val,
        {"files": [str(path)], "split": f"the last {val_fraction:g} of {path.name} is validation"},
    )


def _token_file(path: Path, token_dtype: str, seq_len: int) -> TokenFile:
    """A .bin file of whole ``token_dtype`` tokens holding at least one window, or one line saying what is wrong."""
    if path.suffix != ".bin":
        raise DataError(
            f"token file {str(path)!r} is not a .bin file (raw {token_dtype} tokens, as nanoGPT writes)"
        )
    if not path.is_file():
        raise DataError(f"token file {str(path)!r} does not exist")
    size, itemsize = path.stat().st_size, np.dtype(token_dtype).itemsize
    if size == 0 or size % itemsize:
        raise DataError(
            f"token file {str(path)!r} has {size} bytes: need a non-empty multiple of {itemsize} "
            f"({token_dtype} tokens; token_dtype is one of {', '.join(TOKEN_DTYPES)})"
        )
    if size // itemsize < seq_len + 1:
        raise DataError(
            f"token file {str(path)!r} has {size // itemsize} {token_dtype} tokens ({size} bytes): one window of "
            f"seq_len {seq_len} needs {seq_len + 1} tokens ({(seq_len + 1) * itemsize} bytes)"
        )
    return TokenFile(str(path), token_dtype, 0, size // itemsize)


def _scan_tokens(windows: TokenWindows, vocab: int, whose: str, find_max: bool = True) -> int:
    """The largest token of a file-backed split, read in chunks of ``_SCAN_CHUNK``; the first token of ``vocab``
    or more is one line naming the token, where it is, the file and whose vocabulary it is outside. Without
    ``find_max``, a file whose dtype holds no token outside ``vocab`` is not read (``vocab - 1`` returned)."""
    tokens, top = windows.tokens, 0
    if not find_max and vocab >= np.iinfo(tokens.dtype).max + 1:
        return vocab - 1
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
        chunk_max = int(chunk.max())
        if chunk_max >= vocab:
            at = start + int(np.argmax(chunk >= vocab))
            offset = windows.file.start if windows.file else 0
            where = windows.file.path if windows.file else "the stream"
            hint = f"; was it written as {tokens.dtype} tokens for this model?" if find_max else ""
            raise DataError(
                f"token {int(tokens[at])} at position {offset + at} of {where!r} is outside {whose} "
                f"0..{vocab - 1} (vocab_size {vocab}){hint}"
            )
        top = max(top, chunk_max)
    return top


# ------------------------------------------------------------------------------------------------
# synthetic-tokens


def _synthetic(seq_len: int, n_tokens: int, vocab_size: int, seed: int) -> TextData:
    """``n_tokens`` uniform random training tokens and a tenth as many (at least one window) for validation,
    from ``seed``: for throughput, where what the model learns does not matter."""
    n_tokens = _whole(n_tokens, "synthetic_tokens", "tokens")
    if vocab_size > 2**32:
        raise ConfigError(f"vocab_size {vocab_size} is larger than uint32 tokens allow (2**32)")
    n_val = max(n_tokens // 10, seq_len + 1)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    stream = np.random.default_rng(seed).integers(0, vocab_size, n_tokens + n_val, dtype=dtype)
    train, val = _windows(stream[:n_tokens], stream[n_tokens:], seq_len, f"{n_tokens} synthetic tokens")
    codec: Codec = ByteCodec() if vocab_size == 256 else IdCodec(vocab_size)
    meta = _meta(
        "synthetic-tokens", train, val, codec, seed=seed, split="a tenth as many tokens for validation"
    )
    return TextData(train, val, vocab_size, seq_len, meta, codec)
