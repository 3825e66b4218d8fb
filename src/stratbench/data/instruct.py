"""Fine-tuning data as users have it: a JSONL file (``jsonl:PATH``), a Hugging Face data set from local files or
the local cache (``hf-dataset:PATH_OR_NAME``), or the instruction set stratbench writes from the standard
library's docstrings (``instruct-stdlib``).

Each record is one of three formats, told apart by its fields (or forced with ``--data-format``): plain text
(``text``), an instruction (Alpaca's ``instruction``/``input``/``output``, or ``prompt``/``response``) or a chat
(``messages``, rendered with the tokenizer's chat template). An example is its token ids and, per token, whether
the loss trains on it: the response only (an instruction's output, a chat's assistant turns), every token with
``--train-on-prompt`` or for plain text. Item i of a split is ``(x, y)`` as for text windows, with ``y = -100``
(cross-entropy's ``ignore_index``) where the loss does not train: on the prompt and on padding.

Batches are padded to their longest example (``collate``; x with the pad id, y with -100), or ``--pack`` places
whole examples one after another into windows of ``--seq-len`` tokens (greedy, in order; the rest of a window is
padding), so that every batch has the same shape. An example longer than ``seq_len + 1`` tokens is cut at its
end (the prompt and the start of the response are kept); one left with no trained token is dropped.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stratbench.core.errors import ConfigError, DataError
from stratbench.core.files import atomic_write
from stratbench.data.text import ByteCodec, Codec, HFCodec, check_seq_len, load_tokenizer

FT_SOURCES = ("jsonl:PATH", "hf-dataset:PATH_OR_NAME", "instruct-stdlib")
"""What ``--data`` takes for fine-tuning (``data.text.is_ft_data``)."""
FORMATS = ("auto", "text", "instruction", "chat")
IGNORE = -100
"""The target of a position the loss skips (``nn.CrossEntropyLoss``'s default ``ignore_index``)."""
HF_FILE_BUILDERS = {
    ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
}  # fmt: skip
FIELDS = {
    "text": "'text'",
    "instruction": "'instruction' and 'output' (optional 'input'), or 'prompt' and 'response'",
    "chat": "'messages' (a list of {'role', 'content'})",
}
ALPACA = (
    "Below is an instruction that describes a task{paired}. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)
"""The Alpaca prompt (Stanford Alpaca's two templates, with and without an input, in one)."""


# ------------------------------------------------------------------------------------------------
# records: reading them


@dataclass(frozen=True)
class Record:
    """One record and where it came from (``file:line`` of a JSONL file, ``row N`` of a data set)."""

    fields: dict
    where: str


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """The records of a JSONL file, read line by line with the standard library; blank lines are skipped, a line
    that is not a JSON object is one line naming ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"JSONL file {str(path)!r} does not exist")
    records = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}:{n}: a JSON {type(value).__name__}, not an object with fields")
            records.append(Record(value, f"{path}:{n}"))
    if not records:
        raise DataError(f"JSONL file {str(path)!r} holds no records")
    return records


def read_hf_dataset(spec: str, download: bool = False) -> list[Record]:
    """The rows of a Hugging Face data set: a local json/jsonl/parquet/csv/arrow file, a folder written by
    ``save_to_disk`` or holding such files, or a hub name from the local cache (fetched only with ``download``).
    A data set with splits gives its ``train`` split."""
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise ConfigError(f"data {spec!r} needs the datasets package: pip install 'stratbench[ft]'") from None
    name = spec.partition(":")[2]
    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = HF_FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise DataError(
                    f"data {spec!r}: a {path.suffix or 'suffix-less'} file; hf-dataset reads "
                    f"{', '.join(HF_FILE_BUILDERS)} files, a saved data set folder or a cached name"
                )
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        elif path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(path))
        else:
            with _hub_offline(datasets, not download):
                ds = datasets.load_dataset(str(path) if path.is_dir() else name)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ConnectionError, its own)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        hint = "" if download or path.exists() else "; not a local file or folder, and --download is off"
        raise DataError(f"data {spec!r} could not be loaded: {reason}{hint}") from None
    if isinstance(ds, dict):  # a DatasetDict
        if "train" not in ds:
            raise DataError(f"data {spec!r} has splits {', '.join(ds)} and no 'train' split")
        ds = ds["train"]
    # A data set's columns are the union of its records' fields: a field a record lacks reads as None.
    return [
        Record({k: v for k, v in row.items() if v is not None}, f"{name} row {i}") for i, row in enumerate(ds)
    ]


@contextmanager
def _hub_offline(datasets: Any, offline: bool) -> Iterator[None]:
    """The Hugging Face hub switched off for one load (the cache only: datasets' and huggingface_hub's offline
    flags, which they read from the environment at import), as the environment variable HF_HUB_OFFLINE would."""
    hub = importlib.import_module("huggingface_hub.constants")
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def read_records(spec: str, download: bool = False) -> list[Record]:
    """The records ``--data spec`` names (one of ``FT_SOURCES``)."""
    if spec == "instruct-stdlib":
        return [Record(r, f"instruct-stdlib {i}") for i, r in enumerate(stdlib_instructions())]
    if spec.startswith("jsonl:"):
        return read_jsonl(spec.partition(":")[2])
    if spec.startswith("hf-dataset:"):
        return read_hf_dataset(spec, download)
    raise ConfigError(f"unknown fine-tuning data {spec!r}; choose one of: {', '.join(FT_SOURCES)}")


# ------------------------------------------------------------------------------------------------
# records: their format


def detect_format(record: Record, forced: str = "auto") -> str:
    """The format of ``record``: ``forced`` unless ``auto``, else chat, instruction or text by its fields."""
    if forced not in FORMATS:
        raise ConfigError(f"unknown data_format {forced!r}; choose one of: {', '.join(FORMATS)}")
    if forced != "auto":
        return forced
    fields = record.fields
    if "messages" in fields:
        return "chat"
    if "instruction" in fields or "prompt" in fields:
        return "instruction"
    if "text" in fields:
        return "text"
    raise DataError(
        f"{record.where}: fields {', '.join(sorted(fields)) or '(none)'} are none of the formats: "
        + "; ".join(f"{k}: {v}" for k, v in FIELDS.items())
    )


def _string(record: Record, name: str, fmt: str, optional: bool = False) -> str:
    value = record.fields.get(name)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise DataError(
            f"{record.where}: field {name!r} is {got}; {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} record has "
            f"{FIELDS[fmt]} as strings"
        )
    return value


def instruction_parts(record: Record) -> tuple[str, str]:
    """(prompt, response) of an instruction record: Alpaca's template, or ``prompt`` and ``response`` as given."""
    if "prompt" in record.fields and "instruction" not in record.fields:
        return _string(record, "prompt", "instruction"), _string(record, "response", "instruction")
    instruction = _string(record, "instruction", "instruction")
    extra = _string(record, "input", "instruction", optional=True)
    prompt = ALPACA.format(
        paired=", paired with an input that provides further context" if extra else "",
        instruction=instruction,
        input=f"### Input:\n{extra}\n\n" if extra else "",
    )
    return prompt, _string(record, "output", "instruction")


def chat_messages(record: Record) -> list[dict]:
    """A chat record's messages, each a mapping with string ``role`` and ``content``."""
    messages = record.fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{record.where}: field 'messages' must be a non-empty list; a chat record has {FIELDS['chat']}"
        )
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{record.where}: message {i} must have string 'role' and 'content'")
    return messages


# ------------------------------------------------------------------------------------------------
# tokenising: an example is its ids and, per id, whether the loss trains on it


@dataclass
class Tokenizer:
    """The codec that encodes text, and the chat template where there is one (a ``transformers`` tokenizer with
    a ``chat_template``: ``render(messages, generation_prompt) -> str``), and the id padding is written with."""

    codec: Codec
    render: Callable[[list[dict], bool], str] | None = None
    pad_id: int = 0
    source: str = "bytes"


def encode_pieces(codec: Codec, pieces: Iterable[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Each (text, trained) piece encoded on its own and concatenated: the ids and, per id, ``trained``."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, train in pieces:
        piece = codec.encode(text) if text else []
        ids += piece
        trained += [train] * len(piece)
    return ids, trained


def chat_pieces(record: Record, render: Callable[[list[dict], bool], str]) -> list[tuple[str, bool]]:
    """A chat rendered with its template in pieces: the text each assistant turn adds is trained, the text before
    it (system, user turns, the template's generation prompt) is not. Each piece is the difference between the
    renderings of successive prefixes of the conversation, so the template must render a prefix as a prefix."""
    messages = chat_messages(record)
    pieces, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            ask = render(messages[:k], True)
            pieces.append((_after(ask, done, record), False))
            done = ask
        full = render(messages[: k + 1], False)
        pieces.append((_after(full, done, record), message["role"] == "assistant"))
        done = full
    return pieces


def _after(text: str, prefix: str, record: Record) -> str:
    if not text.startswith(prefix):
        raise DataError(
            f"{record.where}: the chat template renders this conversation's beginning differently once it goes on, "
            "so its assistant turns cannot be told apart; use a template that renders a prefix as a prefix"
        )
    return text[len(prefix) :]


def check_records(records: Sequence[Record], forced: str, tokenizer: Path | None) -> dict[str, int]:
    """Every record's format and fields, before any work (no tokenising): the count of each format, or one line
    naming the first bad record; a chat record where ``tokenizer`` (None: bytes) has no chat template too."""
    formats: dict[str, int] = {}
    for record in records:
        fmt = detect_format(record, forced)
        formats[fmt] = formats.get(fmt, 0) + 1
        if fmt == "text":
            _string(record, "text", "text")
        elif fmt == "instruction":
            instruction_parts(record)
        else:
            chat_messages(record)
            if tokenizer is None or not has_chat_template(tokenizer.parent):
                record_pieces(record, fmt, Tokenizer(ByteCodec(), source=str(tokenizer or "bytes")), False)
    return formats


def record_pieces(record: Record, fmt: str, tok: Tokenizer, train_on_prompt: bool) -> list[tuple[str, bool]]:
    """(text, trained) pieces of one record in ``fmt``."""
    if fmt == "text":
        return [(_string(record, "text", "text"), True)]
    if fmt == "instruction":
        prompt, response = instruction_parts(record)
        pieces = [(prompt, train_on_prompt), (response, True)]
    elif tok.render is None:
        raise DataError(
            f"{record.where}: a chat record needs a chat template and tokenizer {tok.source!r} has none; "
            "use a Hugging Face model folder (or a --tokenizer beside a tokenizer_config.json) with a chat_template"
        )
    else:
        pieces = chat_pieces(record, tok.render)
    return [(t, train or train_on_prompt) for t, train in pieces]


@dataclass
class Example:
    """One example's token ids and, per id, whether the loss trains on it (predicting it)."""

    ids: np.ndarray
    trained: np.ndarray

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): the ids but the last, and the next ids, with -100 where the next id is not trained."""
        ids = torch.from_numpy(self.ids.astype(np.int64))
        y = ids[1:].clone()
        y[~torch.from_numpy(self.trained[1:])] = IGNORE
        return ids[:-1], y


def build_examples(
    records: Sequence[Record],
    tok: Tokenizer,
    seq_len: int,
    forced: str = "auto",
    train_on_prompt: bool = False,
) -> tuple[list[Example], dict]:
    """Every record tokenised, cut to ``seq_len + 1`` ids (``seq_len`` predictions), and dropped where no trained
    prediction is left; with the counts of each format, cut and dropped examples. Bad records are one line."""
    seq_len = check_seq_len(seq_len)
    formats: dict[str, int] = {}
    examples, cut, dropped = [], 0, 0
    for record in records:
        fmt = detect_format(record, forced)
        formats[fmt] = formats.get(fmt, 0) + 1
        ids, trained = encode_pieces(tok.codec, record_pieces(record, fmt, tok, train_on_prompt))
        if len(ids) > seq_len + 1:
            ids, trained, cut = ids[: seq_len + 1], trained[: seq_len + 1], cut + 1
        if len(ids) < 2 or not any(trained[1:]):
            dropped += 1
            continue
        dtype = np.uint16 if tok.codec.vocab_size <= 2**16 else np.uint32
        examples.append(Example(np.asarray(ids, dtype=dtype), np.asarray(trained, dtype=bool)))
    return examples, {"formats": formats, "cut": cut, "dropped": dropped}


# ------------------------------------------------------------------------------------------------
# the data sets: padded per batch, or packed into windows


class Examples(Dataset):
    """One example per item, ``(x, y)`` of its own length; a loader pads each batch with ``collate``."""

    def __init__(self, examples: list[Example], pad_id: int) -> None:
        self.examples, self.pad_id = examples, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.examples[i].pair()

    def real_tokens(self) -> int:
        """Input tokens of every item, padding not counted."""
        return sum(len(e.ids) - 1 for e in self.examples)

    def collate(self, items: list[tuple]) -> tuple[torch.Tensor, ...]:
        """A batch padded to its longest item: x with the pad id, y with -100 (an evaluation item's further
        fields, e.g. its weight, are stacked)."""
        longest = max(len(item[0]) for item in items)
        out = []
        for k, fill in ((0, self.pad_id), (1, IGNORE)):
            column = torch.full((len(items), longest), fill, dtype=torch.int64)
            for row, item in enumerate(items):
                column[row, : len(item[k])] = item[k]
            out.append(column)
        return (*out, *(torch.stack([item[k] for item in items]) for k in range(2, len(items[0]))))


class PackedExamples(Dataset):
    """Whole examples placed one after another in windows of ``seq_len`` positions (greedy, in order: an example
    that does not fit in what is left of a window starts the next), the rest of a window padding; item i is the
    window's ``(x, y)``, every item the same shape. The loss mask stays per token; attention is not masked
    between the examples of a window (as in nanoGPT-style packing)."""

    def __init__(self, examples: list[Example], seq_len: int, pad_id: int) -> None:
        self.seq_len, self.pad_id = seq_len, pad_id
        self.windows: list[list[Example]] = []
        used = seq_len
        for e in examples:
            n = len(e.ids) - 1
            if used + n > seq_len:
                self.windows.append([])
                used = 0
            self.windows[-1].append(e)
            used += n
        self.tokens = sum(len(e.ids) - 1 for e in examples)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        y = torch.full((self.seq_len,), IGNORE, dtype=torch.int64)
        at = 0
        for e in self.windows[i]:
            ex, ey = e.pair()
            x[at : at + len(ex)], y[at : at + len(ey)] = ex, ey
            at += len(ex)
        return x, y

    def real_tokens(self) -> int:
        return self.tokens


# ------------------------------------------------------------------------------------------------
# what build_ft_data returns


@dataclass
class FtData:
    """Training and validation examples, their vocabulary, the codec, and the mean real (unpadded) tokens per
    training item: what tokens/s counts."""

    train: Examples | PackedExamples
    val: Examples | PackedExamples
    vocab_size: int
    seq_len: int
    tokens_per_sample: float
    meta: dict = field(default_factory=dict)
    codec: Codec = field(default_factory=ByteCodec, repr=False)


def split_examples(examples: list[Example], val_fraction: float, spec: str) -> tuple[list, list]:
    """The last ``val_fraction`` of the examples (at least one) for validation; at least one must be left each."""
    n_val = max(1, int(round(len(examples) * val_fraction)))
    if len(examples) - n_val < 1:
        raise DataError(
            f"data {spec!r} has {len(examples)} example(s) left after the length filter: need at least 2 "
            "(one for training, one for validation)"
        )
    return examples[:-n_val], examples[-n_val:]


def build_ft_data(
    spec: str,
    seq_len: int,
    tok: Tokenizer,
    *,
    data_format: str = "auto",
    train_on_prompt: bool = False,
    pack: bool = False,
    val_fraction: float = 0.1,
    vocab_size: int | None = None,
    download: bool = False,
) -> FtData:
    """The examples ``spec`` names, tokenised with ``tok``, split (the last ``val_fraction`` is validation) and
    padded per batch or packed into windows of ``seq_len``."""
    if data_format not in FORMATS:
        raise ConfigError(f"unknown data_format {data_format!r}; choose one of: {', '.join(FORMATS)}")
    records = read_records(spec, download)
    examples, info = build_examples(records, tok, seq_len, data_format, train_on_prompt)
    if not examples:
        raise DataError(
            f"data {spec!r}: no example left of {len(records)} after the length filter (seq_len {seq_len}: "
            f"{info['cut']} cut, {info['dropped']} without a response token left); raise --seq-len"
        )
    train_ex, val_ex = split_examples(examples, val_fraction, spec)
    vocab = vocab_size if vocab_size is not None else tok.codec.vocab_size
    if vocab < tok.codec.vocab_size:
        raise ConfigError(
            f"vocab_size {vocab} is smaller than the {tok.codec.vocab_size} tokens of {tok.source!r}"
        )
    if pack:
        train, val = (
            PackedExamples(train_ex, seq_len, tok.pad_id),
            PackedExamples(val_ex, seq_len, tok.pad_id),
        )
    else:
        train, val = Examples(train_ex, tok.pad_id), Examples(val_ex, tok.pad_id)
    meta = {
        "source": spec, "tokenizer": tok.source, **info, "examples": {"train": len(train_ex), "val": len(val_ex)},
        "batches": "packed into windows of seq_len" if pack else "padded to the longest in each batch",
        "train_on_prompt": train_on_prompt,
        "real_tokens": {"train": train.real_tokens(), "val": val.real_tokens()},
        "cut_rule": "an example longer than seq_len + 1 tokens keeps its first seq_len + 1",
        "split": f"the last {val_fraction:g} of the examples is validation",
    }  # fmt: skip
    return FtData(train, val, vocab, seq_len, train.real_tokens() / len(train), meta, tok.codec)


# ------------------------------------------------------------------------------------------------
# the tokenizer: the model's, a tokenizer.json, or bytes


def tokenizer_path(tokenizer_file: str | None, model_folder: Path | None) -> Path | None:
    """The tokenizer.json a run encodes with: ``tokenizer_file``, else the model folder's; None: bytes."""
    if tokenizer_file:
        return Path(tokenizer_file)
    if model_folder is not None and (model_folder / "tokenizer.json").is_file():
        return model_folder / "tokenizer.json"
    return None


def has_chat_template(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer_config.json has a chat_template (or a chat_template.jinja is there): read
    as JSON, without importing ``transformers``."""
    config = folder / "tokenizer_config.json"
    try:
        if config.is_file() and "chat_template" in json.loads(config.read_text()):
            return True
    except (OSError, ValueError):
        pass
    return (folder / "chat_template.jinja").is_file()


def hf_chat_tokenizer(folder: Path) -> Any | None:
    """A ``transformers`` tokenizer of ``folder`` where it has a chat template, else None."""
    if not has_chat_template(folder):
        return None
    transformers = importlib.import_module("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tokenizer if getattr(tokenizer, "chat_template", None) else None


def template_renderer(tokenizer: Any) -> Callable[[list[dict], bool], str]:
    """``render(messages, generation_prompt)``: the conversation as text through ``apply_chat_template``."""

    def render(messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    return render


def make_tokenizer(tokenizer_file: str | None, model_folder: Path | None) -> Tokenizer:
    """The run's tokenizer: ``tokenizer_file`` (a tokenizer.json), else the model folder's tokenizer.json, else
    bytes (the built-in models). Its chat template is the tokenizer_config.json beside it, where it has one;
    padding uses the tokenizer's pad token (else its end-of-text token, else id 0: padding is never trained)."""
    path = tokenizer_path(tokenizer_file, model_folder)
    if path is None:
        return Tokenizer(ByteCodec())
    codec: HFCodec = load_tokenizer(path)
    chat = hf_chat_tokenizer(path.parent)
    pad = getattr(chat, "pad_token_id", None) if chat is not None else None
    if pad is None:
        pad = next(
            (
                i
                for t in ("<pad>", "<|endoftext|>", "</s>")
                if (i := codec.tokenizer.token_to_id(t)) is not None
            ),
            0,
        )
    return Tokenizer(codec, template_renderer(chat) if chat is not None else None, int(pad), str(path))


# ------------------------------------------------------------------------------------------------
# instruct-stdlib: question/answer pairs from the installed standard library's docstrings

STDLIB_MODULES = (
    "base64", "bisect", "calendar", "collections", "copy", "csv", "datetime", "difflib", "fnmatch", "functools",
    "glob", "gzip", "hashlib", "heapq", "html", "inspect", "itertools", "json", "math", "operator", "os.path",
    "pathlib", "pprint", "random", "re", "shlex", "shutil", "statistics", "string", "struct", "tempfile",
    "textwrap", "time", "unicodedata", "urllib.parse", "uuid", "zlib",
)  # fmt: skip
"""The modules asked about: pure-Python or built into every CPython, none needing a device or the network."""
STDLIB_MAX_ANSWER = 400


def _first_paragraph(obj: Any) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) < 20 or len(para) > STDLIB_MAX_ANSWER or re.match(r"^\w+\(.*\)", para):
        return None  # too short to teach anything, too long for a small example, or a bare signature
    return para


def stdlib_instructions(limit: int = 400) -> list[dict]:
    """Up to ``limit`` records ``{"instruction": "What does json.dumps do?", "output": <the first paragraph of
    its docstring>}`` over ``STDLIB_MODULES``' public functions and classes, in a fixed order: the same list on
    every run of one Python installation, made offline in well under a second."""
    records = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) not in (module.__name__, None) and name != "os.path":
                continue  # re-exported from elsewhere: asked about where it is defined
            answer = _first_paragraph(obj)
            if answer:
                records.append({"instruction": f"What does {name}.{attr} do?", "output": answer})
                if len(records) >= limit:
                    return records
    return records


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> int:
    """``records`` as a JSONL file, one JSON object a line (sorted keys): the number written."""
    lines = [json.dumps(r, sort_keys=True, ensure_ascii=False) for r in records]
    atomic_write(Path(path), "".join(line + "\n" for line in lines))  # a killed write leaves no half file
    return len(lines)


if __name__ == "__main__":  # python -m stratbench.data.instruct OUT.jsonl: the shipped set as a file
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "instruct-stdlib.jsonl"
    print(f"{write_jsonl(stdlib_instructions(), out)} records written to {out}")
