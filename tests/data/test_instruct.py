"""Fine-tuning data (data.instruct): JSONL / Hugging Face data sets, the three formats, the response-only loss
mask, padding and packing, the masked loss, the shipped stdlib instruction set, and the one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import cli, run_stratbench
from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError, DataError
from stratbench.data.datasets import check_data
from stratbench.data.instruct import (
    IGNORE,
    Examples,
    PackedExamples,
    Record,
    Tokenizer,
    build_examples,
    build_ft_data,
    chat_pieces,
    detect_format,
    make_tokenizer,
    read_hf_dataset,
    read_jsonl,
    stdlib_instructions,
    write_jsonl,
)
from stratbench.data.text import ByteCodec
from stratbench.training.losses import MaskedTokenCrossEntropy, per_sample_eval

BYTES = Tokenizer(ByteCodec())


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_exact_label_mask_prompt_masked_and_train_on_prompt() -> None:
    """prompt 'ab' + response 'cd' (bytes): x = a b c, y = -100 c d; with --train-on-prompt y = b c d."""
    rec = Record({"prompt": "ab", "response": "cd"}, "t:1")
    (ex,), _ = build_examples([rec], BYTES, 16)
    x, y = ex.pair()
    assert x.tolist() == [97, 98, 99] and y.tolist() == [IGNORE, 99, 100]
    (ex,), _ = build_examples([rec], BYTES, 16, train_on_prompt=True)
    assert ex.pair()[1].tolist() == [98, 99, 100]
    (ex,), _ = build_examples([Record({"text": "xyz"}, "t:2")], BYTES, 16)  # plain text: every token trained
    assert ex.pair()[1].tolist() == [121, 122]


def test_formats_alpaca_and_refusals(tmp_path: Path) -> None:
    assert detect_format(Record({"messages": []}, "w")) == "chat"
    assert detect_format(Record({"instruction": "i", "output": "o"}, "w")) == "instruction"
    assert detect_format(Record({"text": "t", "x": 1}, "w")) == "text"
    assert detect_format(Record({"text": "t"}, "w"), "instruction") == "instruction"
    with pytest.raises(DataError, match=r"^w: fields a, b are none of the formats"):
        detect_format(Record({"a": 1, "b": 2}, "w"))
    with pytest.raises(ConfigError, match="unknown data_format 'chatty'; choose one of: auto, text"):
        detect_format(Record({"text": "t"}, "w"), "chatty")
    (ex,), _ = build_examples([Record({"instruction": "Add", "input": "1 2", "output": "3"}, "w")], BYTES, 512)
    text = bytes(ex.ids.tolist()).decode()
    assert "### Instruction:\nAdd\n\n### Input:\n1 2\n\n### Response:\n3" in text and text.endswith("3")
    assert ex.trained.tolist() == [False] * (len(text) - 1) + [True]
    bad = _jsonl(tmp_path / "bad.jsonl", '{"text": "ok"}', "", '{"text": "ok"', "[1]")
    with pytest.raises(DataError, match=rf"^{bad}:3: not JSON \(Expecting ',' delimiter"):
        read_jsonl(bad)
    missing = [Record({"instruction": "x"}, "f.jsonl:7")]
    with pytest.raises(DataError, match=r"^f.jsonl:7: field 'output' is missing; an instruction record has "):
        build_examples(missing, BYTES, 64)
    chat = [Record({"messages": [{"role": "user", "content": "hi"}]}, "c.jsonl:1")]
    with pytest.raises(DataError, match=r"^c.jsonl:1: a chat record needs a chat template and tokenizer 'bytes'"):
        build_examples(chat, BYTES, 64)


def test_cut_drop_and_no_example_left(tmp_path: Path) -> None:
    """Longer than seq_len + 1: cut at the end; nothing trained left: dropped; none left at all: one line."""
    recs = [Record({"prompt": "p" * 3, "response": "r" * 10}, "a"), Record({"prompt": "p" * 9, "response": "r"}, "b")]
    examples, info = build_examples(recs, BYTES, 6)
    assert [len(e.ids) for e in examples] == [7] and info == {"formats": {"instruction": 2}, "cut": 2, "dropped": 1}
    path = _jsonl(tmp_path / "long.jsonl", *[json.dumps({"prompt": "p" * 20, "response": "r"})] * 3)
    with pytest.raises(DataError, match=r"no example left of 3 after the length filter \(seq_len 8: 3 cut, 3 "):
        build_ft_data(f"jsonl:{path}", 8, BYTES)


def test_padding_and_packing_keep_the_mask_per_token() -> None:
    recs = [Record({"prompt": "a", "response": "bc"}, "1"), Record({"prompt": "de", "response": "fghi"}, "2")]
    examples, _ = build_examples(recs, BYTES, 32)
    padded = Examples(examples, pad_id=0)
    x, y = padded.collate([padded[0], padded[1]])
    assert x.tolist() == [[97, 98, 0, 0, 0], [100, 101, 102, 103, 104]]
    assert y.tolist() == [[98, 99, IGNORE, IGNORE, IGNORE], [IGNORE, 102, 103, 104, 105]]
    assert padded.real_tokens() == 7  # 2 + 5 inputs, padding not counted
    packed = PackedExamples(examples * 3, seq_len=8, pad_id=0)
    assert len(packed) == 3 and packed.real_tokens() == 21  # 2 + 5 fit in 8; an example never straddles windows
    x, y = packed[0]
    assert x.tolist() == [97, 98, 100, 101, 102, 103, 104, 0]
    assert y.tolist() == [98, 99, IGNORE, 102, 103, 104, 105, IGNORE]


def test_masked_loss_is_the_mean_over_response_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[IGNORE, 1, 2, IGNORE], [3, IGNORE, IGNORE, 4]])
    loss = MaskedTokenCrossEntropy()(logits, targets)
    logp = torch.log_softmax(logits.detach(), -1)
    picked = [-logp[b, t, targets[b, t]].item() for b in range(2) for t in range(4) if targets[b, t] != IGNORE]
    assert loss.item() == pytest.approx(sum(picked) / 4, rel=1e-12)
    per_sample, _ = per_sample_eval(logits.detach(), targets)
    assert per_sample.tolist() == pytest.approx([sum(picked[:2]) / 2, sum(picked[2:]) / 2], rel=1e-12)
    none = MaskedTokenCrossEntropy()(logits, torch.full((2, 4), IGNORE))  # all masked: 0, not 0/0
    none.backward()
    assert none.item() == 0 and math.isfinite(logits.grad.abs().sum().item())


def test_chat_pieces_train_on_assistant_turns_only() -> None:
    def render(messages: list[dict], generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}." for m in messages) + ("<assistant>" if generation_prompt else "")

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pieces = chat_pieces(Record({"messages": msgs}, "c"), render)
    assert pieces == [("<user>hi.", False), ("<assistant>", False), ("yo.", True)]


def test_chat_template_of_a_tokenizer_folder(tmp_path: Path) -> None:
    """A tokenizer.json with a tokenizer_config.json's chat_template beside it (transformers' tokenizer)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "hi", "yo"]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    config = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tk = make_tokenizer(str(tmp_path / "tokenizer.json"), None)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (ex,), _ = build_examples([Record({"messages": msgs}, "c")], tk, 16)
    assert ex.ids.tolist() == [2, 5, 4, 3, 6, 4]  # <|user|> hi <|end|> <|assistant|> yo <|end|>
    assert ex.pair()[1].tolist() == [IGNORE, IGNORE, IGNORE, 6, 4]
    (tmp_path / "tokenizer_config.json").unlink()  # a tokenizer.json alone has no template: one line
    with pytest.raises(DataError, match="a chat record needs a chat template and tokenizer '.*tokenizer.json' has"):
        build_examples([Record({"messages": msgs}, "c")], make_tokenizer(str(tmp_path / "tokenizer.json"), None), 16)


def test_stdlib_instructions_deterministic_and_round_trip(tmp_path: Path) -> None:
    records = stdlib_instructions()
    assert records == stdlib_instructions() and 200 <= len(records) <= 400
    assert {"instruction": "What does json.dumps do?"}.items() <= next(
        r for r in records if r["instruction"] == "What does json.dumps do?"
    ).items()
    assert write_jsonl(records, tmp_path / "s.jsonl") == len(records)
    assert [r.fields for r in read_jsonl(tmp_path / "s.jsonl")] == records
    data = build_ft_data("instruct-stdlib", 256, BYTES)
    assert data.meta["formats"] == {"instruction": len(records)} and data.tokens_per_sample < 256


def test_hf_dataset_from_a_local_file_and_offline_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))  # not the user's cache
    path = _jsonl(tmp_path / "d.json", json.dumps({"prompt": "a", "response": "b"}), json.dumps({"text": "xy"}))
    assert [r.fields for r in read_hf_dataset(f"hf-dataset:{path}")] == [{"prompt": "a", "response": "b"}, {"text": "xy"}]
    with pytest.raises(DataError, match=r"^data 'hf-dataset:nobody/nothing-here' could not be loaded: .*--download is off"):
        read_hf_dataset("hf-dataset:nobody/nothing-here")


def test_refusals_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="JSONL file 'nope.jsonl' does not exist"):
        check_data(TrainConfig(model="gpt-tiny", data="jsonl:nope.jsonl"))
    with pytest.raises(ConfigError, match="unknown data_format 'x'; choose one of: auto, text, instruction, chat"):
        check_data(TrainConfig(model="gpt-tiny", data="instruct-stdlib", data_format="x"))
    chat = _jsonl(tmp_path / "chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(DataError, match=rf"^{chat}:1: a chat record needs a chat template and tokenizer 'bytes'"):
        check_data(TrainConfig(model="gpt-tiny", data=f"jsonl:{chat}"))  # the preflight: before any process starts
    bad = _jsonl(tmp_path / "bad.jsonl", '{"text": "ok"}', "{nope")
    with pytest.raises(AssertionError, match=rf"{bad}:2: not JSON"):
        cli("train", "--model", "gpt-tiny", "--data", f"jsonl:{bad}", "--output", tmp_path / "out", "--max-steps", "1")
    assert not (tmp_path / "out").exists()


def test_train_on_jsonl_counts_unpadded_tokens(tmp_path: Path) -> None:
    """The CLI from an empty folder: result.json's tokens per sample are the training examples' real tokens."""
    lines = [json.dumps({"prompt": "q" * n, "response": "a" * (n + 3)}) for n in (2, 9, 4, 40, 7)]
    _jsonl(tmp_path / "ft.jsonl", *lines)
    run_stratbench(
        "train", "--model", "gpt-tiny", "--data", "jsonl:ft.jsonl", "--max-steps", "2", "--batch-size", "2",
        "--seq-len", "64", "--val-fraction", "0.2", "--timing-warmup-steps", "0", "--progress", "false",
        "--output", "out", cwd=tmp_path,
    )  # fmt: skip
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    metrics, data = result["metrics"], result["data_meta"]
    assert data["examples"] == {"train": 4, "val": 1} and data["cut"] == 1 and data["dropped"] == 0  # 40 + 43 > 65 tokens
    train_inputs = [2 * n + 3 - 1 for n in (2, 9, 4)] + [64]  # prompt + response - 1 inputs (cut: seq_len)
    assert metrics["tokens_per_sample"] == pytest.approx(sum(train_inputs) / 4)
    assert metrics["throughput_tokens_per_s"] == pytest.approx(
        metrics["throughput_samples_per_s"] * sum(train_inputs) / 4
    )
    assert metrics["evaluations"][-1]["val_tokens"] == 7 + 3  # the response only
