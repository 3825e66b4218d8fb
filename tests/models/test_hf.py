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

import pytest
import torch

from conftest import RTOL, assert_curves_match, cli, fails, train
from stratbench.core.errors import ConfigError
from stratbench.models.hf import canonical_name, import_transformers
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


def test_safetensors_in_the_folder_are_loaded(tmp_path):
    transformers = (
        import_transformers()
    )  # torchvision first, as stratbench imports it (see core.torchvision_compat)
    torch.manual_seed(1)
    saved = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    )
    saved.save_pretrained(tmp_path / "pretrained")
    torch.manual_seed(2)  # a random init would differ
    model = build_model(f"hf:{tmp_path / 'pretrained'}", 256, seq_len=SEQ)
    for key, value in saved.state_dict().items():
        assert torch.equal(model.hf.state_dict()[key], value), key


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
