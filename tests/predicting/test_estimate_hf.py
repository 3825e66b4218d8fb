"""estimate, estimate --time, advise and compare's memory budget for a Hugging Face model (``--model hf:FOLDER``,
a tiny Llama config written here with transformers' own LlamaConfig): its parameters and layers from the config
built on the meta device, the published activation formula on its shape, its decoder layers as the FSDP units, and
a cell over the budget skipped before it runs (all of them failed or went blank before: the formula asked for a
built-in size, "unknown transformer size"). Each command runs as a user runs it, from an empty folder."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import cli, run_stratbench

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the hf extra: pip install 'stratbench[hf]')",
)

LM = ["--data", "text", "--seq-len", "32"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A 2-layer Llama config folder (no weights), saved by transformers: ``hf:FOLDER``."""
    from stratbench.models.hf import import_transformers

    transformers = import_transformers()  # through stratbench's torchvision fix, as the CLI imports it
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(folder)  # fmt: skip
    return f"hf:{folder}"


def _parameters(model: str) -> int:
    """The model's parameters as transformers builds it from the config (on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model[len("hf:") :])
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_estimate_takes_the_shapes_from_the_config(llama, tmp_path):
    out = run_stratbench(
        "estimate", "--model", llama, *LM, "--strategy", "fsdp", "--world-size", "2", "--batch-size", "8",
        cwd=tmp_path,
    ).stdout  # fmt: skip
    out = " ".join(out.split())  # lines wrap at the terminal's width
    assert "fsdp: FSDP units: 2 x LlamaDecoderLayer (declared by the model" in out, out
    assert "by the published formula" in out, out
    res = json.loads(  # the same in this process, as JSON
        cli("estimate", "--model", llama, *LM, "--strategy", "fsdp", "--world-size", "2", "--batch-size", "8", "--json")
    )["results"][0]["estimate"]
    assert res["num_parameters"] == _parameters(llama) and res["vocab_size"] == 256
    f = res["activation_formula"]  # the formula on the config's shape, beside the trace
    assert f["bytes"] > 0 and abs(f["difference"]) < 0.3, f
    assert "2 x LlamaDecoderLayer" in res["units"]


def test_estimate_time_projects_every_method_that_can_run_it(llama, tmp_path):
    res = json.loads(
        run_stratbench(
            "estimate", "--model", llama, *LM, "--time", "--strategy", "all", "--batch-size", "64", "--json",
            cwd=tmp_path,
        ).stdout  # fmt: skip
    )["results"]
    rows = {r["strategy"]: r for r in res}
    for name in ("single", "ddp", "fsdp", "deepspeed"):
        if name not in rows:  # deepspeed is an optional extra
            continue
        p = rows[name]["projection"]
        assert p["status"] == "ok" and p["step_s"] > 0 and p["tokens_per_s"] > 0, (name, p)
        assert p["model_family"] == "transformer", (name, p)
        assert rows[name]["estimate"]["total_bytes"] > 0, name
    # the decoder layers are FSDP's units: one gather per layer and one for the root (embedding, norm, head)
    gathers = [c for c in rows["fsdp"]["projection"]["comm_rows"] if c["kind"] == "all_gather"]
    assert gathers and all(c["calls"] == 3 for c in gathers), gathers


def test_advise_recommends_a_method(llama):
    out = cli("advise", "--model", llama, *LM, "--devices", "4", "--device-memory", "24GiB")
    assert "recommended: " in out and f"stratbench train --model {llama}" in out, out


def test_compare_memory_budget_skips_an_hf_cell_that_does_not_fit(llama, tmp_path):
    """The budget is the estimate: with 1 MiB per device every cell is over it and recorded as 'does not fit'
    (before, the estimate raised, the budget was silently not applied and every cell was to run)."""
    out = run_stratbench(
        "compare", "--preset", "llm-quick", "--model", llama, *LM, "--only", "single,fsdp", "--dry-run",
        "--device-memory", "1MiB", cwd=tmp_path,
    ).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if "_fp32_" in ln]
    assert len(lines) >= 2 and all("skipped: does not fit (estimate" in ln for ln in lines), out
    assert "0 to run" in out, out


def test_the_default_window_follows_the_models_positions(llama):
    """No --seq-len: 64 tokens, the config's max_position_embeddings (train's default, 256, is more than the model
    takes); an explicit longer window is refused in one line naming both."""
    res = json.loads(cli("estimate", "--model", llama, "--data", "text", "--batch-size", "8", "--json"))
    assert res["results"][0]["estimate"]["seq_len"] == 64
    with pytest.raises(Exception, match="--seq-len 128 is longer than .* max_position_embeddings of 64"):
        cli("estimate", "--model", llama, "--data", "text", "--seq-len", "128")
