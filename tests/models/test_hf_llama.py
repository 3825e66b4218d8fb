"""A Hugging Face Llama folder as the start of a built-in transformer (stratbench.models.hf_llama, ``--init-from
hf:FOLDER``): a tiny ``LlamaForCausalLM`` saved with save_pretrained gives the built-in model of its shape the same
logits (q/k rows permuted between the two rotary layouts; grouped-query heads; tied and untied heads; sharded
files), a built-in model written as a Hugging Face folder loads in transformers with the same logits, a folder
whose config.json or keys do not fit is refused in one line before any work, and `stratbench train --init-from
hf:FOLDER` starts from the folder's weights."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import fails, run_stratbench
from stratbench.checkpoints import checkpoint as ckpt
from stratbench.core.errors import ConfigError
from stratbench.models import hf_llama
from stratbench.models.hf import import_transformers, quiet_transformers
from stratbench.models.transformer import RopeScaling, Transformer, TransformerConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the hf extra: pip install 'stratbench[hf]')",
)

TINY = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "vocab_size": 300, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
}  # fmt: skip
"""Grouped-query (2 kv heads for 4 query heads): k's rows are permuted per kv head, q's per query head."""
GPT_TINY = TINY | {
    "hidden_size": 192, "num_hidden_layers": 4, "num_key_value_heads": 4, "intermediate_size": 512,
    "vocab_size": 256, "tie_word_embeddings": False, "max_position_embeddings": 256,
}  # fmt: skip
"""The built-in gpt-tiny's shape (1.9M parameters), for the CLI run."""


def save_llama(folder, seed: int = 1, shard: str | None = None, **config):
    """A random ``LlamaForCausalLM`` of ``TINY`` with ``config`` changed, saved with save_pretrained (in shards of
    ``shard`` bytes where given); the folder as ``hf:FOLDER`` and the model."""
    transformers = import_transformers()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | config))).eval()
    with quiet_transformers():
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return f"hf:{folder}", model


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
"""Llama 3.1's scaling at a tiny context: head size 8 has wavelengths 6, 63, 628 and 6283 positions, one kept
(< 16), one blended, two divided by the factor (> 64)."""


@pytest.mark.parametrize("tied", [False, True], ids=["untied-sharded", "tied-llama3-rope"])
def test_hf_llama_gives_the_builtin_model_its_logits(tmp_path, tied):
    extra = {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 128}
    value, hf_model = save_llama(tmp_path / "llama", **(extra if tied else {}), shard=None if tied else "20KB")
    if not tied:
        assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()  # read shard by shard
    own = Transformer(hf_llama.shape_of(hf_llama.read_config(value), max_seq_len=64))
    own.load_state_dict(hf_llama.builtin_state(value))  # strict: every parameter filled, every key used
    tokens = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(own, tokens), logits_of(hf_model, tokens), atol=1e-5, rtol=1e-5)
    assert (own.output.weight is own.tok_embeddings.weight) is tied
    assert (own.config.rope_scaling is not None) is tied


def test_builtin_model_written_as_hf_folder_loads_in_transformers(tmp_path):
    torch.manual_seed(3)
    cfg = TransformerConfig(
        vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=128, init="llama",
        rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=64),
    )  # fmt: skip
    own = Transformer(cfg).eval()
    hf_llama.save_hf_folder(own, tmp_path / "out")
    with quiet_transformers():
        loaded = import_transformers().LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not [k for k in loaded.state_dict() if k.startswith("hf.")]
    tokens = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(loaded, tokens), logits_of(own, tokens), atol=1e-5, rtol=1e-5)
    back = hf_llama.builtin_state(f"hf:{tmp_path / 'out'}")  # and the mapping back gives the same tensors
    assert all(torch.equal(back[k], v) for k, v in own.state_dict().items())


def _rewrite_weights(folder, drop: str, add: str) -> None:
    """The folder's model.safetensors without ``drop`` and with an extra tensor ``add``."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state[add] = state.pop(drop)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_folders_that_do_not_fit_are_refused_in_one_line(tmp_path):
    value, _ = save_llama(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"hidden_size 32 \(llama-1b: 2048\).*built-in sizes are gpt-tiny"):
        hf_llama.check_init(value, "llama-1b", 300)
    with pytest.raises(ConfigError, match="not --model tinynet"):
        hf_llama.check_init(value, "tinynet", None)
    _rewrite_weights(tmp_path / "llama", drop="model.norm.weight", add="model.final_norm.weight")
    hf_llama.check_keys.cache_clear()
    with pytest.raises(
        ConfigError, match=r"map to no parameter.*model\.final_norm\.weight; no tensor for 1 par"
    ):
        hf_llama.check_keys(value)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    for change, why in (
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0}}, "rope type 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias true"),
    ):
        (tmp_path / "other").mkdir(exist_ok=True)
        (tmp_path / "other" / "config.json").write_text(json.dumps(config | change))
        hf_llama.read_config.cache_clear()
        with pytest.raises(ConfigError, match=why):
            hf_llama.read_config(f"hf:{tmp_path / 'other'}")


def test_train_refuses_a_mismatched_folder_before_any_work(tmp_path, capsys):
    value, _ = save_llama(tmp_path / "llama")
    args = ["--data", "text", "--seq-len", "16", "--max-steps", "1", "--init-from", value]
    err = fails(capsys, "train", "--model", "gpt-tiny", "--output", tmp_path / "run", *args)
    assert "config.json does not match --model gpt-tiny: hidden_size 32 (gpt-tiny: 192)" in err
    err = fails(
        capsys, "train", "--model", "gpt-tiny", "--output", tmp_path / "run", *args, "--vocab-size", "512"
    )
    assert "vocab_size 300 (the run's vocabulary: 512;" in err
    assert not (tmp_path / "run").exists()


def test_train_init_from_hf_folder_starts_from_its_weights(tmp_path):
    """The real CLI from an empty folder, the folder named relative to it: after one SGD step at lr 1e-9 the
    checkpoint holds the folder's weights (the run's own random init differs by ~0.1)."""
    value, _ = save_llama(tmp_path / "llama", **GPT_TINY)
    run_stratbench(
        "train", "--model", "gpt-tiny", "--data", "text", "--seq-len", "32", "--batch-size", "8", "--epochs", "1",
        "--max-steps", "1", "--optimizer", "sgd", "--lr", "1e-9", "--eval-samples", "8", "--progress", "false",
        "--measure-flops", "false", "--init-from", "hf:llama", "--output", "run", cwd=tmp_path,
    )  # fmt: skip
    saved = ckpt.load_any(tmp_path / "run" / "checkpoints" / "last")
    assert saved["config"]["init_from"] == f"hf:{(tmp_path / 'llama').resolve()}"  # absolute, as the model's
    want = hf_llama.builtin_state(value)
    assert sorted(saved["model"]) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(saved["model"][key], tensor, atol=1e-6, rtol=0)


def test_a_name_in_the_hugging_face_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "models--acme--tiny-llama"
    save_llama(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert hf_llama.canonical_init("hf:acme/tiny-llama") == f"hf:{repo / 'snapshots' / '0123abcd'}"
    missing = hf_llama.canonical_init("hf:acme/no-such-llama")
    with pytest.raises(ConfigError, match="no model of that name in the Hugging Face cache"):
        hf_llama.check_init(missing, "gpt-tiny", None)
