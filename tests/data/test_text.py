"""Language-modelling data (stratbench.data.text): windows and their shifted targets, the stdlib corpus, nanoGPT
token files (never their pickles), tokenizer.json files, and the same global batches for one rank or two."""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stratbench.core.errors import ConfigError, DataError
from stratbench.data.datasets import train_loader
from stratbench.data.text import (
    DEFAULT_TEXT_BYTES,
    MAX_VOCAB,
    ByteCodec,
    FileTokens,
    TokenFile,
    TokenWindows,
    build_text_data,
    corpus_files,
    stdlib_root,
)


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


def write_bin(path: Path, tokens, dtype=np.uint16) -> np.ndarray:
    array = np.asarray(tokens, dtype=dtype)
    array.tofile(path)
    return array


# ------------------------------------------------------------------------------------------------
# windows


@pytest.mark.parametrize("make", [np.uint8, np.uint16, np.uint32, "tensor"])
def test_windows_are_shifted_by_one(make):
    raw = np.arange(23)
    tokens = torch.from_numpy(raw) if make == "tensor" else raw.astype(make)
    ds = TokenWindows(tokens, 5)
    assert len(ds) == (23 - 1) // 5 == 4
    for i in range(4):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    assert ds[-1][0].tolist() == ds[3][0].tolist()
    with pytest.raises(IndexError):
        ds[4]


@pytest.mark.parametrize(("n", "seq_len", "items"), [(21, 5, 4), (20, 5, 3), (6, 5, 1), (5, 5, 0), (1, 1, 0)])
def test_window_count(n, seq_len, items):
    assert len(TokenWindows(np.zeros(n, np.uint16), seq_len)) == items


def test_windows_refuse_bad_streams_and_lengths():
    with pytest.raises(ConfigError) as exc:
        TokenWindows(np.zeros(10, np.float32), 4)
    assert "float32" in one_line(exc) and "uint16" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        TokenWindows(np.zeros((2, 5), np.uint16), 4)
    assert "(2, 5)" in one_line(exc)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError) as exc:
            TokenWindows(np.zeros(10, np.uint16), bad)
        assert f"seq_len {bad!r}" in one_line(exc)


def test_file_backed_windows_pickle_as_a_file_name(tmp_path):
    """A spawned DataLoader worker receives the file's name and maps it again, not a copy of its tokens."""
    tokens = write_bin(tmp_path / "t.bin", np.arange(50_000) % 60_000)
    ds = TokenWindows(TokenFile(str(tmp_path / "t.bin"), "uint16", 100, 20_000), 64)
    blob = pickle.dumps(ds)
    assert len(blob) < 2_000
    again = pickle.loads(blob)
    assert len(again) == len(ds) == (20_000 - 1) // 64
    assert again[7][0].tolist() == tokens[100 + 7 * 64 : 100 + 8 * 64].tolist()


# ------------------------------------------------------------------------------------------------
# byte-level text


def test_byte_codec_round_trip():
    codec = ByteCodec()
    text = "def f(x):\n    return 'héllo ✓ 日本'  # ok\n"
    ids = codec.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert codec.decode(ids) == text
    assert codec.decode(torch.tensor(ids)) == text
    assert codec.decode(ids[:-3] + ids[-2:]).count("\ufffd") == 0  # ascii cut: still valid
    assert "\ufffd" in codec.decode(codec.encode("✓")[:2])  # a cut character decodes, replaced
    with pytest.raises(ConfigError) as exc:
        codec.decode([65, 300])
    assert "300" in one_line(exc)


@pytest.fixture(scope="module")
def stdlib_text():
    start = time.perf_counter()
    data = build_text_data("text", 256)
    return data, time.perf_counter() - start


def test_stdlib_corpus_is_found_and_builds_quickly(stdlib_text):
    data, seconds = stdlib_text
    files = corpus_files(stdlib_root(), (".py",))
    assert files == sorted(files) and "os.py" in files
    assert not any(part in {"test", "site-packages"} for f in files for part in f.split("/")[:-1])
    total = data.meta["n_tokens"]["train"] + data.meta["n_tokens"]["val"]
    assert total == data.meta["bytes"] <= DEFAULT_TEXT_BYTES
    assert data.vocab_size == 256 and data.meta["tokenizer"] == "bytes"
    assert len(data.train) == (data.meta["n_tokens"]["train"] - 1) // 256
    assert seconds < 5, (
        f"building the byte-level stdlib corpus took {seconds:.2f} s (the aim is well under 2 s)"
    )
    assert data.encode("import os") == list(b"import os")
    assert data.decode(data.train[0][0]).startswith(Path(stdlib_root(), files[0]).read_text()[:50])


def test_stdlib_corpus_is_deterministic(stdlib_text):
    first, _ = stdlib_text
    again = build_text_data("text", 256)

    def head_hash(data):
        return hashlib.sha256(np.asarray(data.train.tokens[: 2**20]).tobytes()).hexdigest()

    assert head_hash(first) == head_hash(again)
    assert first.meta["sha256"] == again.meta["sha256"]
    assert np.array_equal(np.asarray(first.val.tokens), np.asarray(again.val.tokens))


def test_text_split_has_no_overlap(stdlib_text):
    data, _ = stdlib_text
    stream = np.concatenate([data.train.tokens, data.val.tokens])
    assert len(stream) == data.meta["bytes"]
    at = len(data.train.tokens)
    assert len(data.val.tokens) == round(len(stream) * 0.1)
    # every window of a split lies inside it: train's last target is before `at`, val's windows start at `at`
    assert (len(data.train) * 256 + 1) <= at
    last_x, last_y = data.train[len(data.train) - 1]
    assert last_y.tolist() == stream[(len(data.train) - 1) * 256 + 1 : len(data.train) * 256 + 1].tolist()
    assert data.val[0][0].tolist() == stream[at : at + 256].tolist()


def test_text_from_a_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 20)
    (tmp_path / "b" / "c.md").write_text("# gamma ✓\n" * 10)
    (tmp_path / "d.py").write_text("print('delta')\n" * 10)
    (tmp_path / "e.json").write_text('{"skipped": true}')
    (tmp_path / ".hidden" / "f.txt").write_text("hidden")
    data = build_text_data("text", 8, data_dir=tmp_path, val_fraction=0.25)
    expected = b"".join((tmp_path / f).read_bytes() for f in ("a.txt", "b/c.md", "d.py"))
    assert np.concatenate([data.train.tokens, data.val.tokens]).tobytes() == expected
    assert data.meta["files"] == 3 and data.meta["last_file"] == "d.py"
    capped = build_text_data("text", 8, data_dir=tmp_path, text_bytes=100)
    assert capped.meta["bytes"] == 100 and capped.meta["files"] == 1
    with pytest.raises(DataError) as exc:
        build_text_data("text", 8, data_dir=tmp_path / "b" / "none")
    assert "none" in one_line(exc)


# ------------------------------------------------------------------------------------------------
# nanoGPT token files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_nanogpt_folder_loads(tmp_path, dtype):
    high = 50_000 if dtype == "uint16" else 100_000
    rng = np.random.default_rng(0)
    train = write_bin(tmp_path / "train.bin", rng.integers(0, high, 4_000), dtype)
    val = write_bin(tmp_path / "val.bin", rng.integers(0, high, 600), dtype)
    data = build_text_data(f"tokens:{tmp_path}", 32, token_dtype=dtype)
    assert data.vocab_size == max(int(train.max()), int(val.max())) + 1
    assert data.train.tokens.dtype == dtype and data.meta["files"][0].endswith("train.bin")
    assert len(data.train) == (4_000 - 1) // 32 and len(data.val) == (600 - 1) // 32
    assert data.train[3][1].tolist() == train[3 * 32 + 1 : 4 * 32 + 1].tolist()
    assert isinstance(data.train.tokens, FileTokens)  # read per window, never held whole nor memory-mapped
    given = build_text_data(f"tokens:{tmp_path}", 32, token_dtype=dtype, vocab_size=high + 7)
    assert given.vocab_size == high + 7 and given.meta["vocab_from"] == "given"
    ids = given.encode("1 2 3")
    assert ids == [1, 2, 3] and given.decode(ids) == "1 2 3"


def test_vocabulary_is_the_max_token_of_both_splits(tmp_path):
    write_bin(tmp_path / "train.bin", [1, 2, 3, 4, 5, 6])
    write_bin(tmp_path / "val.bin", [7, 900, 8, 9])
    data = build_text_data("tokens", 3, data_dir=tmp_path)
    assert data.vocab_size == 901 and data.meta["vocab_from"] == "max token + 1"


def test_single_bin_is_split_without_overlap(tmp_path):
    stream = write_bin(tmp_path / "all.bin", np.arange(1_000))
    data = build_text_data(f"tokens:{tmp_path / 'all.bin'}", 16, val_fraction=0.1)
    at = 900
    train_tokens = {t for i in range(len(data.train)) for part in data.train[i] for t in part.tolist()}
    val_tokens = {t for i in range(len(data.val)) for part in data.val[i] for t in part.tolist()}
    assert max(train_tokens) < at <= min(val_tokens)  # the tokens are their own positions
    assert min(val_tokens) == at and len(data.val) == (100 - 1) // 16
    assert np.array_equal(np.concatenate([data.train.tokens, data.val.tokens]), stream)


def test_bad_token_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 'odd.bin'}", 1)
    assert "odd.bin" in one_line(exc) and "3 bytes" in str(exc.value) and "multiple of 2" in str(exc.value)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 'empty.bin'}", 1)
    assert "empty.bin" in one_line(exc) and "0 bytes" in str(exc.value)
    write_bin(tmp_path / "short.bin", np.arange(10))
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 'short.bin'}", 16)
    assert "short.bin" in one_line(exc) and "20 bytes" in str(exc.value) and "17 tokens" in str(exc.value)
    write_bin(tmp_path / "six.bin", np.arange(6), np.uint32)  # 24 bytes: whole uint32 tokens
    with pytest.raises(DataError) as exc:
        build_text_data(
            f"tokens:{tmp_path / 'six.bin'}", 1, token_dtype="uint32", val_fraction=0.5, vocab_size=4
        )
    assert "token 4 " in one_line(exc) and "six.bin" in str(exc.value) and "vocab_size 4" in str(exc.value)
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path}", 4)  # no train.bin
    assert "train.bin" in one_line(exc)
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 'missing'}", 4)
    assert "missing" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        build_text_data(f"tokens:{tmp_path / 'six.bin'}", 1, token_dtype="int8")
    assert "int8" in one_line(exc) and "uint32" in str(exc.value)


def test_meta_pkl_is_never_unpickled(tmp_path):
    """nanoGPT writes meta.pkl beside its .bin files: a pickle, which could run anything, so it is never read."""
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": Trap()}))
    pickle.loads((tmp_path / "meta.pkl").read_bytes())  # the trap works: loading it makes the marker
    assert marker.exists()
    marker.unlink()
    write_bin(tmp_path / "train.bin", np.arange(100) % 65)
    write_bin(tmp_path / "val.bin", np.arange(20) % 65)
    data = build_text_data(f"tokens:{tmp_path}", 8)
    assert not marker.exists()
    assert data.vocab_size == 65 and data.meta["tokenizer"] == "ids"


# ------------------------------------------------------------------------------------------------
# tokenizer.json


@pytest.fixture
def tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(
        ["def train(model, data):", "    return model(data)", "for x in data: print(x)"], trainer
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_tokenizer_json_encodes_the_text(tmp_path, tokenizer_json):
    path, tok = tokenizer_json
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["def train(model, data):\n    return model(data)\n" * 20, "for x in data: print(x) # ✓\n" * 20]
    (corpus / "a.py").write_text(texts[0])
    (corpus / "b.txt").write_text(texts[1])
    data = build_text_data("text", 8, data_dir=corpus, tokenizer=path)
    assert data.vocab_size == tok.get_vocab_size() and data.meta["tokenizer"] == str(path)
    expected = [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids]
    assert np.concatenate([data.train.tokens, data.val.tokens]).tolist() == expected
    assert len(expected) < sum(len(t.encode()) for t in texts)  # merges learned: fewer tokens than bytes
    prompt = "def train(model):  # héllo"
    assert data.decode(data.encode(prompt)) == prompt
    assert data.decode(data.train[0][0]) == tok.decode(data.train[0][0].tolist())
    with pytest.raises(ConfigError) as exc:
        build_text_data("text", 8, data_dir=corpus, tokenizer=path, vocab_size=10)
    assert "vocab_size 10" in one_line(exc) and str(path) in str(exc.value)


def test_tokenizer_json_with_token_files(tmp_path, tokenizer_json):
    path, tok = tokenizer_json
    ids = tok.encode("for x in data: print(x)\n" * 30).ids
    write_bin(tmp_path / "train.bin", ids)
    write_bin(tmp_path / "val.bin", ids[:40])
    data = build_text_data(f"tokens:{tmp_path}", 8, tokenizer=path)
    assert data.vocab_size == tok.get_vocab_size() and data.meta["vocab_from"] == "tokenizer"
    assert data.decode(data.train[0][0]) == tok.decode(ids[:8])
    write_bin(tmp_path / "val.bin", [*ids[:40], tok.get_vocab_size()])
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path}", 8, tokenizer=path)
    assert f"token {tok.get_vocab_size()} " in one_line(exc) and "val.bin" in str(exc.value)


def test_a_json_that_is_not_a_tokenizer_is_refused(tmp_path):
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "gpt2", "n_layer": 12}')
    with pytest.raises(DataError) as exc:
        build_text_data("text", 8, tokenizer=bad)
    assert "config.json" in one_line(exc) and "tokenizer.json" in str(exc.value)
    with pytest.raises(DataError) as exc:
        build_text_data("text", 8, tokenizer=tmp_path / "absent.json")
    assert "absent.json" in one_line(exc)


def test_missing_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    with pytest.raises(ConfigError) as exc:
        build_text_data("text", 8, tokenizer=tmp_path / "tokenizer.json")
    assert "pip install tokenizers" in one_line(exc)


# ------------------------------------------------------------------------------------------------
# synthetic tokens and bad options


def test_synthetic_tokens_are_seeded():
    a = build_text_data("synthetic-tokens", 16, synthetic_tokens=5_000, seed=3)
    b = build_text_data("synthetic-tokens", 16, synthetic_tokens=5_000, seed=3)
    c = build_text_data("synthetic-tokens", 16, synthetic_tokens=5_000, seed=4)
    assert np.array_equal(a.train.tokens, b.train.tokens) and not np.array_equal(
        a.train.tokens, c.train.tokens
    )
    assert a.meta["n_tokens"] == {"train": 5_000, "val": 500} and a.vocab_size == 256
    big = build_text_data("synthetic-tokens", 16, synthetic_tokens=5_000, vocab_size=70_000)
    assert big.train.tokens.dtype == np.uint32 and int(big.train.tokens.max()) < 70_000
    assert big.decode(big.encode("5 69999")) == "5 69999"


def test_bad_options_are_one_line():
    with pytest.raises(ConfigError) as exc:
        build_text_data("shakespeare", 8)
    assert all(s in one_line(exc) for s in ("'shakespeare'", "text", "tokens:PATH", "synthetic-tokens"))
    with pytest.raises(ConfigError) as exc:
        build_text_data("synthetic-tokens", 0)
    assert "seq_len 0" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        build_text_data("synthetic-tokens", 5_000, synthetic_tokens=4_000)
    assert "seq_len 5000" in one_line(exc) and "train" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        build_text_data("text", 8, text_bytes=1_000, val_fraction=1.0)
    assert "val_fraction 1.0" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        build_text_data("text", 64, text_bytes=1_000, val_fraction=0.01)
    assert "val split" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        build_text_data("text", 8, text_bytes=1_000, vocab_size=100)
    assert "vocab_size 100" in one_line(exc) and "256" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        build_text_data("tokens", 8)
    assert "tokens:PATH" in one_line(exc)


# ------------------------------------------------------------------------------------------------
# the samplers every method uses


def test_two_ranks_see_one_ranks_global_batches():
    """DistributedSampler over windows: ranks 0 and 1 of 2 (4 windows each) together take the 8 windows of each
    global batch one rank takes, so losses compare across methods as they do for images."""
    data = build_text_data("synthetic-tokens", 16, synthetic_tokens=16 * 64 + 1)
    global_batch, seed = 8, 5
    one, _ = train_loader(data.train, global_batch, 0, 1, seed, 0, False)
    ranks = [train_loader(data.train, global_batch // 2, r, 2, seed, 0, False)[0] for r in (0, 1)]
    steps = 0
    for (x1, y1), (xa, ya), (xb, yb) in zip(one, *ranks, strict=True):
        assert sorted(map(tuple, torch.cat([xa, xb]).tolist())) == sorted(map(tuple, x1.tolist()))
        assert sorted(map(tuple, torch.cat([ya, yb]).tolist())) == sorted(map(tuple, y1.tolist()))
        steps += 1
    assert steps == len(data.train) // global_batch == 8


# ------------------------------------------------------------------------------------------------
# a token file that changes under a run, a token no model can take


def test_a_token_file_cut_short_is_one_line_not_sigbus(tmp_path):
    """Windows read after the file was truncated: one line naming the file and both sizes, in this process and
    from a DataLoader worker (torch re-raises a worker's error with its whole traceback as the message); a
    memory map would have died of SIGBUS."""
    write_bin(tmp_path / "t.bin", np.arange(4_000) % 300)
    data = build_text_data(f"tokens:{tmp_path / 't.bin'}", 16)
    assert data.train[200][0].tolist() == list(range(3200 % 300, 3200 % 300 + 16))
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(1000)
    assert data.train[10][0].tolist() == list(range(160, 176))  # what is still there reads as before
    with pytest.raises(DataError) as exc:
        data.train[200]
    assert f"token file '{tmp_path / 't.bin'}' changed during the run: it has 1000 bytes now, 8000 when" in one_line(exc)
    loader = torch.utils.data.DataLoader(data.train, batch_size=4, sampler=[200, 201, 202, 203], num_workers=1)
    with pytest.raises(DataError) as exc:
        next(iter(loader))
    assert one_line(exc).startswith(f"token file '{tmp_path / 't.bin'}' changed during the run: it has 1000 bytes")


def test_a_run_whose_token_file_is_truncated_stops_with_one_line(tmp_path):
    """The real CLI, a run reading a token file that is cut to 1000 bytes after its first steps: exit 2, one line,
    result.json says why (before: SIGBUS, exit 135 in a shell, no message, no result)."""
    import subprocess
    import sys

    write_bin(tmp_path / "t.bin", np.random.default_rng(0).integers(0, 256, 1_000_000))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "stratbench", "train", "--model", "gpt-tiny", "--data", f"tokens:{tmp_path / 't.bin'}",
           "--seq-len", "16", "--batch-size", "8", "--max-steps", "100000", "--progress", "false", "--output", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            rows = (out / "metrics.csv").read_text().count("\n") if (out / "metrics.csv").is_file() else 0
            if rows > 3:  # the header and a few steps
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        with open(tmp_path / "t.bin", "r+b") as f:
            f.truncate(1000)
        err = proc.communicate(timeout=120)[1].strip()
    finally:
        proc.kill()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, (proc.returncode, err)
    assert f"token file '{tmp_path / 't.bin'}' changed during the run: it has 1000 bytes now, 2000000 when" in err
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "failed" and "changed during the run" in result["reason"]


def test_a_token_beyond_any_vocabulary_is_one_line(tmp_path):
    """A uint32 file holding 4e9 (say, read with the wrong dtype): before, its max + 1 became the vocabulary and a
    4e9-row embedding failed as "out of memory ... lower --batch-size"."""
    tokens = write_bin(tmp_path / "t.bin", np.arange(5_000) % 300, np.uint32)
    tokens[1234] = 4_000_000_000
    tokens.tofile(tmp_path / "t.bin")
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 't.bin'}", 16, token_dtype="uint32")
    assert (
        f"token 4000000000 at position 1234 of '{tmp_path / 't.bin'}' is outside the largest vocabulary stratbench "
        f"builds 0..{MAX_VOCAB - 1}" in one_line(exc)
    )
    with pytest.raises(DataError) as exc:
        build_text_data(f"tokens:{tmp_path / 't.bin'}", 16, token_dtype="uint32", max_vocab=320, max_vocab_of="its")
    assert "token 4000000000 at position 1234 of" in one_line(exc) and "outside its 0..319" in str(exc.value)
    tokens[1234] = 7
    tokens.tofile(tmp_path / "t.bin")
    assert build_text_data(f"tokens:{tmp_path / 't.bin'}", 16, token_dtype="uint32").vocab_size == 300
