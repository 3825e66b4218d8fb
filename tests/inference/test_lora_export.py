"""After a LoRA run (docs/finetuning.md, "After training"): `export --merge-lora` writes a folder that
transformers' `from_pretrained` loads, under exactly the Hugging Face model's keys, and `--format peft` the
adapters alone in a folder that `peft.PeftModel.from_pretrained` loads onto the base; both give the run's logits,
and `evaluate` / `predict --prompt` read either folder (and the run folder) as they read the checkpoint. A
built-in model's merged weights are its bare state dict; the bad inputs are refused in one line before any write.

One tiny Llama (transformers' LlamaConfig, ~37k parameters) trained 4 steps with rank-4 adapters on every Linear
but the head; fp32 throughout."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from conftest import cli, fails, run_stratbench, train
from stratbench.checkpoints.checkpoint import save_full
from stratbench.inference.predictor import build_from_meta, load_model
from stratbench.models.hf import import_transformers, quiet_transformers

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
    reason="needs peft and transformers (the lora and hf extras)",
)

SEQ, VOCAB = 32, 256
TOL = 1e-5
"""fp32: the merged weight W + 2 x B A rounds once more than the adapted forward's two products, which moves
logits of |logit| <= ~4 by ~1e-7 (measured: 2.7e-7 merged, 0 read back); 1e-5 is far below the change the
adapters make (checked to exceed 1e-3 first, so that equality is not the base's)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-export")


@pytest.fixture(scope="module")
def base(root):
    """A tiny Llama saved by transformers (config.json + model.safetensors): the run's ``hf:FOLDER``."""
    import_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    with quiet_transformers():
        LlamaForCausalLM(config).save_pretrained(root / "llama")
    # a tokenizer file the merged export copies (a tokenizer.json would change the run's data: bytes here)
    (root / "llama" / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    return root / "llama"


@pytest.fixture(scope="module")
def run(root, base):
    res = train(
        root / "run", "--model", f"hf:{base}", "--data", "text", "--seq-len", str(SEQ), "--batch-size", "8",
        "--epochs", "1", "--max-steps", "4", "--optimizer", "adamw", "--lr", "0.01", "--eval-samples", "16",
        "--progress", "false", "--measure-flops", "false", "--timing-warmup-steps", "1", "--lora-rank", "4",
    )  # fmt: skip
    assert res["status"] == "ok" and res["model_meta"]["lora"]["rank"] == 4
    return root / "run"


@pytest.fixture(scope="module")
def exports(root, run):
    """The merged folder and the adapter folder, written by the CLI (in process), and what each printed."""
    merged, adapter = root / "merged", root / "adapter"
    printed = (
        cli("export", "--checkpoint", run, "--merge-lora", "--output", merged),
        cli("export", "--checkpoint", run, "--format", "peft", "--output", adapter),
    )
    return merged, adapter, printed


@pytest.fixture(scope="module")
def reference(run):
    """Token windows and the run's own logits on them (the adapted model, rebuilt from the checkpoint)."""
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    model = load_model(run / "checkpoints" / "last").model
    with torch.no_grad():
        return x, model(x)


def _hf_logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits[..., :VOCAB]


def test_merged_export_loads_in_transformers_with_the_runs_logits(exports, base, reference):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    merged, _, (printed, _) = exports
    assert "loaded with transformers' AutoModelForCausalLM.from_pretrained: max abs diff" in printed
    assert {p.name for p in merged.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "stratbench.json",
    }
    with (
        safe_open(str(merged / "model.safetensors"), "pt") as f,
        safe_open(str(base / "model.safetensors"), "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())  # the HF model's own names: no hf. prefix, no lora key left
    x, logits = reference
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(merged).eval()
        original = AutoModelForCausalLM.from_pretrained(base).eval()
    assert (_hf_logits(original, x) - logits).abs().max() > 1e-3, "the adapters must change the model"
    assert (_hf_logits(model, x) - logits).abs().max() < TOL


def test_adapter_export_loads_in_peft_with_the_runs_logits(exports, base, reference):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, adapter, (_, printed) = exports
    assert "loaded with peft's PeftModel.from_pretrained on the base" in printed
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(base))
    assert len(config["target_modules"]) == 14 and "lm_head" not in config["target_modules"]  # all-linear
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 28
    x, logits = reference
    with quiet_transformers():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    assert (_hf_logits(model, x) - logits).abs().max() < TOL


def test_evaluate_and_predict_read_the_run_folder_and_both_exports(exports, run):
    """evaluate on either export gives the run's validation loss (the same 16 windows); predict --prompt gives the
    run folder's greedy continuation from either export, the adapter folder's from a fresh interpreter."""
    merged, adapter, _ = exports
    val_loss = json.loads((run / "result.json").read_text())["metrics"]["val_loss"]
    for source in (merged, adapter):
        out = json.loads(cli("evaluate", "--checkpoint", source, "--eval-samples", "16", "--json"))
        assert out["val_loss"] == pytest.approx(val_loss, rel=1e-6), source
    prompt = ("--prompt", "def ", "--max-new-tokens", "6", "--json")
    ids = json.loads(cli("predict", "--checkpoint", run, *prompt))["ids"]
    assert json.loads(cli("predict", "--checkpoint", merged, *prompt))["ids"] == ids
    proc = run_stratbench("predict", "--checkpoint", str(adapter), *prompt)  # a user's command
    assert json.loads(proc.stdout)["ids"] == ids


@pytest.fixture(scope="module")
def builtin(root):
    """A LoRA checkpoint of the built-in gpt-tiny (rank 2 on wq, wv), its adapters' B made non-zero."""
    meta = {
        "model": "gpt-tiny", "num_classes": VOCAB, "class_names": [], "image_size": 0, "mean": [], "std": [],
        "seq_len": SEQ, "data": "text", "lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": "wq,wv"},
    }  # fmt: skip
    torch.manual_seed(0)
    model = build_from_meta(meta)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    path = root / "gpt-lora.pt"
    save_full(path, {"model": model.state_dict(), "meta": meta, "config": {"data": "text", "seq_len": SEQ}})
    return path


def test_a_builtin_models_merged_weights_are_its_bare_state_dict(builtin, root):
    from safetensors.torch import load_file

    out = root / "gpt-merged.safetensors"
    printed = cli("export", "--checkpoint", builtin, "--merge-lora", "--output", out)
    assert "reloaded with plain safetensors" in printed
    bare = build_from_meta({"model": "gpt-tiny", "num_classes": VOCAB, "seq_len": SEQ})
    state = load_file(str(out))
    assert set(state) == set(bare.state_dict())  # no lora key left
    bare.load_state_dict(state)
    x = torch.randint(0, VOCAB, (2, SEQ))
    adapted = load_model(builtin).model
    with torch.no_grad():
        plain = build_from_meta({"model": "gpt-tiny", "num_classes": VOCAB, "seq_len": SEQ})
        plain.load_state_dict({k.replace(".base_layer", ""): v for k, v in adapted.state_dict().items()
                               if ".lora_" not in k})  # fmt: skip
        assert (plain(x) - adapted(x)).abs().max() > 1e-3, "the adapters must change the model"
        assert (bare(x) - adapted(x)).abs().max() < TOL


def test_a_builtin_transformers_merged_weights_load_in_transformers_as_a_llama(builtin, root):
    """--format hf on a built-in transformer: a Llama folder (keys mapped, q/k rows permuted to its rotary
    layout: models.hf_llama) that transformers loads with the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    out = root / "gpt-hf"
    printed = cli("export", "--checkpoint", builtin, "--merge-lora", "--format", "hf", "--output", out)
    assert "AutoModelForCausalLM.from_pretrained" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "stratbench.json"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    x = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert (model(input_ids=x).logits - load_model(builtin).model(x)).abs().max() < TOL


@pytest.mark.parametrize(("kind", "library", "tensor"), [("nf4", "torchao", "NF4Tensor"), ("int8", "bitsandbytes", "Int8Params")])
def test_a_qlora_run_merges_into_its_dequantised_base(root, kind, library, tensor):
    """A QLoRA checkpoint (NF4 or int8 base, quantised again as it loads): the merge dequantises each base
    weight, adds the update and writes full-precision weights with the QLoRA model's logits (export's own parity
    check too)."""
    pytest.importorskip(library)
    meta = {
        "model": "gpt-tiny", "num_classes": VOCAB, "class_names": [], "image_size": 0, "mean": [], "std": [],
        "seq_len": SEQ, "data": "text",
        "lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": "wq,wv", "quantize_base": kind},
    }  # fmt: skip
    torch.manual_seed(0)
    model = build_from_meta({k: v for k, v in meta.items() if k != "lora"} | {"lora": meta["lora"] | {"quantize_base": "none"}})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    path = root / f"gpt-qlora-{kind}.pt"
    save_full(path, {"model": model.state_dict(), "meta": meta, "config": {"data": "text", "seq_len": SEQ}})
    out = root / f"gpt-qlora-{kind}-merged.safetensors"
    cli("export", "--checkpoint", path, "--merge-lora", "--output", out)
    qlora = load_model(path).model
    assert sum(type(p).__name__ == tensor for p in qlora.parameters()) == 2 * 4  # wq and wv in 4 blocks
    bare = build_from_meta({"model": "gpt-tiny", "num_classes": VOCAB, "seq_len": SEQ})
    from safetensors.torch import load_file

    bare.load_state_dict(load_file(str(out)))
    x = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert (bare(x) - qlora(x)).abs().max() < TOL


def test_bad_exports_are_refused_in_one_line_before_any_write(exports, builtin, run, root, capsys):
    merged, adapter, _ = exports
    new = root / "never-written"
    cases = [
        (("--checkpoint", merged, "--merge-lora"), "trained without LoRA"),  # a merged export has no adapters
        (("--checkpoint", builtin, "--format", "peft"), "gpt-tiny is stratbench's own"),
        (("--checkpoint", run, "--format", "hf"), "add --merge-lora"),
        (("--checkpoint", run, "--format", "peft", "--merge-lora"), "choose one"),
        (("--checkpoint", merged, "--format", "peft"), "trained without --lora-rank"),
    ]
    for args, said in cases:
        err = fails(capsys, "export", *args, "--output", new)
        assert said in err, err
        assert not new.exists()
    before = sorted(p.name for p in adapter.iterdir())
    err = fails(capsys, "export", "--checkpoint", run, "--merge-lora", "--output", adapter)
    assert (
        f"--output {adapter} holds an adapter export; a merged export replaces only an earlier one" in err
    ), err
    assert sorted(p.name for p in adapter.iterdir()) == before
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("mine")
    err = fails(capsys, "export", "--checkpoint", run, "--format", "peft", "--output", root / "mine")
    assert "holds other files (notes.txt)" in err, err


def test_an_adapter_folder_without_its_base_or_with_other_keys_is_refused(exports, root, capsys):
    _, adapter, _ = exports
    baseless = root / "baseless"
    shutil.copytree(adapter, baseless)
    config = json.loads((baseless / "adapter_config.json").read_text())
    (baseless / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": None}))
    err = fails(capsys, "evaluate", "--checkpoint", baseless)
    assert "names no base model (base_model_name_or_path is None)" in err, err

    from safetensors.torch import load_file, save_file

    renamed = root / "renamed"
    shutil.copytree(adapter, renamed)
    state = load_file(str(renamed / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    state["base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"] = state.pop(key)
    save_file(state, str(renamed / "adapter_model.safetensors"))
    err = fails(capsys, "predict", "--checkpoint", renamed, "--prompt", "def ")
    assert f"1 missing ({key}); 1 unexpected (" in err and "lora_C" in err, err
