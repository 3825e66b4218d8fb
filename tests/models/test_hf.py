"""Hugging Face ``transformers`` causal LMs as ``--model hf:PATH_OR_NAME`` (stratbench.models.hf): a tiny Llama
config folder trains under single, ddp and fsdp (fp64: the same loss curve within conftest.RTOL), its FLOPs per
token are the 6N + attention formula, its checkpoint evaluates and generates; safetensors weights in the folder
are loaded, a name in the Hugging Face cache resolves offline; remote code, a name not in the cache, a window
longer than the model's positions and a vocabulary larger than the model's are refused in one line."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import RTOL, assert_curves_match, cli, fails, train
from stratbench.core.errors import ConfigError
from stratbench.models.hf import INDEX_FILE, canonical_name, import_transformers, quiet_transformers
from stratbench.models.zoo import build_model, check_model, residual_block_types

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the hf extra: pip install 'stratbench[hf]')",
)

SEQ = 32
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}  # fmt: skip
"""~37k parameters; vocab 320 > the 256 bytes of --data text, so the logits the loss sees are the head's first 256."""
GPT2 = {
    "model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip
"""GPT-2's head is tied to its embedding (one Parameter that FSDP's root unit holds) and its linears are Conv1D.
Dropout off: GPT-2's default 0.1 draws other masks on each rank than on one process, and the curves part by ~1e-3."""


def write_config(folder, base: dict = LLAMA, **changes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(base | changes))
    return f"hf:{folder}"


def lm(model: str) -> list[str]:
    return [
        "--model", model, "--data", "text", "--seq-len", str(SEQ), "--batch-size", "8", "--epochs", "1",
        "--max-steps", "6", "--optimizer", "adamw", "--lr", "0.01", "--eval-samples", "16", "--progress", "false",
        "--timing-warmup-steps", "1",
    ]  # fmt: skip


FP64 = ["--precision", "fp64", "--measure-flops", "false"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def llama(root) -> str:
    return write_config(root / "tiny-llama")


@pytest.fixture(scope="module")
def single(root, llama) -> dict:
    """`single` fp32 with its FLOPs counted on the meta device."""
    return train(root / "single", "--strategy", "single", *lm(llama))


@pytest.fixture(scope="module")
def reference64(root, llama):
    """The fp64 reference of each architecture, trained once."""
    models = {"llama": llama, "gpt2": write_config(root / "tiny-gpt2", GPT2)}
    runs: dict[str, dict] = {}

    def reference(arch: str) -> tuple[str, dict]:
        if arch not in runs:
            runs[arch] = train(root / f"reference64-{arch}", "--strategy", "single", *lm(models[arch]), *FP64)
        return models[arch], runs[arch]

    return reference


def test_a_config_folder_trains_with_the_flops_of_the_formula(single, llama):
    from stratbench.models.hf import flops_per_token

    m = single["metrics"]
    assert single["status"] == "ok" and single["model_meta"]["vocab_size"] == 256
    model = build_model(llama, 256, seq_len=SEQ)
    assert {t.__name__ for t in residual_block_types(model)} == {"LlamaDecoderLayer"}
    assert model(torch.zeros(2, SEQ, dtype=torch.long)).shape == (2, SEQ, 256)  # the data's vocabulary
    assert m["flops_per_token"] == pytest.approx(flops_per_token(model, SEQ), rel=0.01)
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    curve = m["loss_curve"]
    assert curve[-1] < 0.9 * curve[0], curve


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize(
    "arch, method",
    [
        ("llama", ["--strategy", "ddp"]),
        ("llama", ["--strategy", "fsdp", "--activation-checkpointing"]),
        ("gpt2", ["--strategy", "fsdp"]),
    ],
    ids=["llama-ddp", "llama-fsdp+ac", "gpt2-fsdp"],
)
def test_ddp_and_fsdp_train_the_model_single_trains(root, reference64, arch, method):
    model, reference = reference64(arch)
    res = train(root / f"{arch}-{method[1]}", *method, *lm(model), *FP64, nproc=2)
    assert res["status"] == "ok" and res["world_size"] == 2
    ref = reference["metrics"]["loss_curve"]
    assert ref[-1] < 0.9 * ref[0], "the reference must train, or equal curves prove nothing"
    assert_curves_match(res["metrics"]["loss_curve"], ref, RTOL)


def test_the_checkpoint_evaluates_and_generates(root, single):
    last = root / "single" / "checkpoints" / "last"
    out = json.loads(cli("evaluate", "--checkpoint", last, "--eval-samples", "16", "--json"))
    assert out["val_loss"] == pytest.approx(single["metrics"]["val_loss"], rel=1e-6)  # the same 16 windows
    assert out["val_perplexity"] == pytest.approx(math.exp(out["val_loss"]))
    got = json.loads(
        cli("predict", "--checkpoint", last, "--prompt", "def ", "--max-new-tokens", "8", "--json")
    )
    assert len(got["ids"]) == 8 and all(0 <= i < 256 for i in got["ids"])


def test_a_name_in_the_hugging_face_cache_resolves_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    write_config(snapshot)
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    model = build_model("hf:acme/tiny-llama", 256, seq_len=SEQ)
    assert model.hf.config.hidden_size == 32
    assert canonical_name("hf:acme/tiny-llama") == "hf:acme/tiny-llama"  # a hub name is kept as given
    monkeypatch.chdir(tmp_path / "models--acme--tiny-llama" / "snapshots")
    assert (
        canonical_name("hf:./0123abcd") == f"hf:{snapshot}"
    )  # a folder, absolute: checkpoints rebuild anywhere


def test_bad_models_are_refused_in_one_line_with_nothing_written(tmp_path, capsys, monkeypatch, llama):
    out = tmp_path / "out"
    remote = write_config(tmp_path / "remote", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    err = fails(capsys, "train", *lm(remote), "--output", out)
    assert "needs remote code (config.json has auto_map: AutoModelForCausalLM)" in err and "llama" in err
    unknown = write_config(tmp_path / "unknown", model_type="my-own-llm")
    err = fails(capsys, "train", *lm(unknown), "--output", out)
    assert "model_type 'my-own-llm' is not a causal LM that transformers" in err and "gpt2, " in err
    err = fails(capsys, "train", *lm("hf:stratbench-tests/no-such-model-3f9a"), "--output", out)
    assert "is not in the Hugging Face cache" in err and "pass --download to fetch it" in err
    err = fails(capsys, "train", *lm(llama), "--seq-len", "128", "--output", out)
    assert "--seq-len 128 is longer than" in err and "max_position_embeddings of 64 tokens" in err
    err = fails(capsys, "train", *lm(llama), "--data", "digits", "--output", out)
    assert "is a language model: train it on text data" in err
    (tmp_path / "empty").mkdir()
    err = fails(capsys, "train", *lm(f"hf:{tmp_path / 'empty'}"), "--output", out)
    assert "has no config.json" in err
    err = fails(
        capsys, "train", *lm(llama), "--data", "synthetic-tokens", "--vocab-size", "512", "--output", out
    )
    assert "vocabulary of 512 tokens is larger than" in err and "vocab_size 320" in err
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    err = fails(capsys, "train", *lm(llama), "--tokenizer", tmp_path / "tokenizer.json", "--output", out)
    assert "vocabulary of 400 tokens is larger than" in err and "vocab_size 320" in err
    assert not out.exists()
    with pytest.raises(ConfigError, match="vocabulary of 512 tokens is larger than .* vocab_size 320"):
        build_model(llama, 512, seq_len=SEQ)  # a tokenizer's vocabulary, known when the data is built
    check_model(llama, True, 64)  # the longest window its positions allow
    monkeypatch.setitem(sys.modules, "transformers", None)  # the hf extra not installed: an ImportError
    with pytest.raises(ConfigError, match=r"need the transformers package: pip install 'stratbench\[hf\]'"):
        check_model(llama, True, SEQ)


# ------------------------------------------------------------------------------------------------
# weights: every layout save_pretrained writes is loaded whole, anything else is one line


@pytest.fixture(scope="module")
def pretrained(root):
    """A tiny Llama saved with save_pretrained from seed 1 (a run's random init, from seed 0, differs), as
    one model.safetensors, and its state dict."""
    transformers = import_transformers()  # torchvision first, as stratbench imports it (see core.torchvision_compat)
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    )
    with quiet_transformers():
        saved.save_pretrained(root / "pretrained")
    return root / "pretrained", saved


def copy_of(pretrained, folder, **save) -> Path:
    """The pretrained model saved into ``folder`` again (``save``: save_pretrained's options), quietly (its
    progress bar would be on the stderr a refusal is read from)."""
    with quiet_transformers():
        pretrained[1].save_pretrained(folder, **save)
    return folder


def assert_loaded(folder, saved) -> None:
    torch.manual_seed(2)  # a random init would differ
    model = build_model(f"hf:{folder}", 256, seq_len=SEQ)
    for key, value in saved.state_dict().items():
        assert torch.equal(model.hf.state_dict()[key], value), key


def test_every_safetensors_layout_is_loaded(tmp_path, pretrained):
    """One file, shards with their index, shards whose index is gone (many, or the one shard of a save whose
    files were renamed): before, the last two trained from a random init without a word."""
    assert_loaded(copy_of(pretrained, tmp_path / "single"), pretrained[1])
    indexed = copy_of(pretrained, tmp_path / "indexed", max_shard_size="40KB")
    assert len(list(indexed.glob("model-*-of-*.safetensors"))) > 1 and (indexed / INDEX_FILE).is_file()
    assert_loaded(indexed, pretrained[1])
    unindexed = copy_of(pretrained, tmp_path / "unindexed", max_shard_size="40KB")
    (unindexed / INDEX_FILE).unlink()
    assert_loaded(unindexed, pretrained[1])
    assert sorted(p.name for p in unindexed.iterdir()) == sorted(p.name for p in indexed.iterdir() if p.name != INDEX_FILE)
    one = copy_of(pretrained, tmp_path / "one-shard")
    (one / "model.safetensors").rename(one / "model-00001-of-00001.safetensors")
    assert_loaded(one, pretrained[1])
    transformers = import_transformers()
    torch.manual_seed(1)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"}))
    tied = copy_of((None, gpt2), tmp_path / "gpt2", max_shard_size="40KB")
    (tied / INDEX_FILE).unlink()  # the tied head is saved once (as the embedding) and is not a missing key
    assert_loaded(tied, gpt2)


def renamed_keys(folder: Path, rename) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({rename(k): v for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def test_weights_that_do_not_load_whole_are_refused_in_one_line(tmp_path, capsys, pretrained):
    """Keys missing or unexpected (a model.safetensors of another layout: before, transformers' MISSING table
    and a random init, exit 0), a shape that differs, a shard missing, a pickle, safetensors of no known layout."""
    out = tmp_path / "out"
    other = copy_of(pretrained, tmp_path / "other-names")
    renamed_keys(other, lambda k: k.replace("model.layers.", "transformer.h."))
    err = fails(capsys, "train", *lm(f"hf:{other}"), "--output", out)
    assert f"the weights in {other} do not fit its config.json: keys 18 missing (" in err
    assert "model.layers.0.input_layernorm.weight, " in err and "and 15 more); 18 unexpected (transformer.h.0." in err
    head = copy_of(pretrained, tmp_path / "no-head")
    renamed_keys(head, lambda k: "extra.weight" if k == "lm_head.weight" else k)
    err = fails(capsys, "train", *lm(f"hf:{head}"), "--output", out)
    assert "keys 1 missing (lm_head.weight); 1 unexpected (extra.weight)" in err
    wider = copy_of(pretrained, tmp_path / "wider")
    (wider / "config.json").write_text(json.dumps(json.loads((wider / "config.json").read_text()) | {"vocab_size": 384}))
    err = fails(capsys, "train", *lm(f"hf:{wider}"), "--output", out)
    assert "2 of another shape (lm_head.weight (320, 32) vs (384, 32), model.embed_tokens.weight (320, 32) vs" in err
    gap = copy_of(pretrained, tmp_path / "gap", max_shard_size="40KB")
    (gap / INDEX_FILE).unlink()
    shards = sorted(gap.glob("model-*.safetensors"))
    shards[1].unlink()
    err = fails(capsys, "train", *lm(f"hf:{gap}"), "--output", out)
    assert f"has {len(shards) - 1} of the {len(shards)} shards of its weights; missing: {shards[1].name}" in err
    indexed = copy_of(pretrained, tmp_path / "indexed", max_shard_size="40KB")
    next(indexed.glob("model-00002-*.safetensors")).unlink()
    err = fails(capsys, "train", *lm(f"hf:{indexed}"), "--output", out)
    assert f"{INDEX_FILE} names 1 shard(s) that are not in {indexed}: model-00002-of-" in err
    pickled = copy_of(pretrained, tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")  # the name is enough: never unpickled
    err = fails(capsys, "train", *lm(f"hf:{pickled}"), "--output", out)
    assert "holds pytorch_model.bin, a pickle, and no safetensors weights" in err
    consolidated = copy_of(pretrained, tmp_path / "consolidated")
    (consolidated / "model.safetensors").rename(consolidated / "consolidated.safetensors")
    err = fails(capsys, "train", *lm(f"hf:{consolidated}"), "--output", out)
    assert "holds consolidated.safetensors, which is not a layout of a model's weights" in err


# ------------------------------------------------------------------------------------------------
# a causal LM only: the config says it is a decoder, and a later token does not move an earlier logit

BERT = {
    "model_type": "bert", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": 64,
}  # fmt: skip


def test_a_model_that_is_no_decoder_is_refused(tmp_path, capsys):
    """BERT is in transformers' causal-LM table, but without "is_decoder": true each token sees the next one
    (before: it trained, exit 0, on a loss that measures copying)."""
    bert = write_config(tmp_path / "bert", BERT)
    err = fails(capsys, "train", *lm(bert), "--output", tmp_path / "out")
    assert "model_type 'bert' is not a decoder (an encoder unless config.json sets \"is_decoder\": true)" in err
    assert "stratbench trains causal LMs: a decoder model_type (llama, mistral, qwen2, gpt2, ...)" in err
    assert not (tmp_path / "out").exists()
    gemma = write_config(
        tmp_path / "gemma", {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 64, "use_bidirectional_attention": True},
    )  # fmt: skip
    err = fails(capsys, "train", *lm(gemma), "--output", tmp_path / "out")
    assert "model_type 'gemma3_text' is not a decoder (config.json sets use_bidirectional_attention)" in err
    decoder = build_model(write_config(tmp_path / "bert-decoder", BERT, is_decoder=True), 256, seq_len=SEQ)
    assert decoder.hf.config.is_decoder  # built, and through the causality check


def test_causality_is_checked_on_the_built_model(tmp_path, capsys, monkeypatch):
    """What the config does not say, a few tokens do: with the config check out of the way, BERT is refused
    by the check on the built model, before training."""
    import stratbench.models.hf as hf

    transformers = import_transformers()
    config = {k: v for k, v in BERT.items() if k != "model_type"}
    for is_decoder in (False, True):
        model = hf.HFCausalLM(transformers.BertLMHeadModel(transformers.BertConfig(**config, is_decoder=is_decoder)), 256)
        if is_decoder:
            hf.check_causal("bert", model, 64)
        else:
            with pytest.raises(ConfigError, match=r"changing tokens 4..7 of 8 changed the logits of tokens 0..3"):
                hf.check_causal("bert", model, 64)
    monkeypatch.setattr(hf, "_bidirectional", lambda model_type, config: None)
    capsys.readouterr()  # transformers' own warnings about the models built above are not the command's output
    err = fails(capsys, "train", *lm(write_config(tmp_path / "bert", BERT)), "--output", tmp_path / "out")
    assert "is not causal: changing tokens 4..7 of 8 changed the logits of tokens 0..3 (by up to " in err
    assert "model_type 'bert' attends to later tokens here" in err


# ------------------------------------------------------------------------------------------------
# memory, vocabulary, window


def test_parameters_are_counted_on_the_meta_device(tmp_path, llama):
    """parameter_count builds nothing real: it equals the built model's count (GPT-2's tied head counted once)."""
    from stratbench.models.hf import parameter_count

    gpt2 = write_config(tmp_path / "gpt2", GPT2)
    for name in (llama, gpt2):
        built = build_model(name, 256, seq_len=SEQ).hf
        assert parameter_count(name) == sum(p.numel() for p in built.parameters())


def test_a_model_larger_than_this_hosts_memory_is_refused_before_it_is_built(tmp_path, capsys):
    """hidden_size 65536 x 64 layers: 4.4e12 parameters, 16 TiB in fp32 (before: RSS climbed until killed)."""
    import psutil

    huge = write_config(
        tmp_path / "huge", LLAMA, hidden_size=65536, intermediate_size=262144, num_hidden_layers=64,
        num_attention_heads=512, num_key_value_heads=512,
    )  # fmt: skip
    rss = psutil.Process().memory_info().rss
    err = fails(capsys, "train", *lm(huge), "--output", tmp_path / "out")
    assert "has 4,398,096,908,288 parameters: building it in fp32 takes 16.00 TiB, more than the " in err
    assert "GiB of memory available on this host" in err
    assert psutil.Process().memory_info().rss - rss < 2**30


def test_a_token_beyond_the_models_vocabulary_is_refused(tmp_path, capsys, llama):
    """A token file's ids are checked against the model's vocabulary (320) before the model is built."""
    tokens = np.random.default_rng(0).integers(0, 320, 5_000).astype(np.uint16)
    tokens[4_321] = 60_000
    tokens.tofile(tmp_path / "ids.bin")
    args = [*lm(llama), "--data", f"tokens:{tmp_path / 'ids.bin'}", "--output", tmp_path / "out"]
    err = fails(capsys, "train", *args)
    assert f"token 60000 at position 4321 of '{tmp_path / 'ids.bin'}' is outside {llama}'s vocabulary 0..319" in err


def test_the_default_window_follows_the_models_positions(tmp_path, llama):
    """--data text's default 256-token windows on a model of 64 positions: 64-token windows (before: refused,
    though nothing was asked); an explicit --seq-len too long stays refused (above)."""
    from stratbench.core.config import TrainConfig, from_dict

    assert from_dict(TrainConfig, {"model": llama}).seq_len == 64
    assert from_dict(TrainConfig, {"model": llama, "seq_len": 16}).seq_len == 16
    assert from_dict(TrainConfig, {"model": write_config(tmp_path / "long", LLAMA, max_position_embeddings=4096)}).seq_len == 256
    res = train(
        tmp_path / "run", "--model", llama, "--data", "text", "--batch-size", "2", "--max-steps", "1",
        "--eval-samples", "2", "--progress", "false",
    )  # fmt: skip
    assert res["status"] == "ok" and res["model_meta"]["seq_len"] == 64
