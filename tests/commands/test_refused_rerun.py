"""A refused rerun leaves a finished run's folder byte-identical (issue 42, item 1). Every refusal of
`stratbench train` comes before its first write into --output: in this process (--nproc 1) and under
stratbench's launcher (torchrun workers, whose set-up errors the launcher says once). The CLI runs each case from
an empty folder into one finished run, whose every file (and link) is hashed before and after: the --nproc 1 cases
through its `main` in the test's process (a fresh interpreter for each cost ~3-9 s, ~2 min of the suite, for the
same code path), the issue's own case and every launched case as a user runs them (a fresh interpreter).

To add a case: one entry in REFUSALS (its flags, a piece of the line it must print, its exit code) and, when it
needs input files, a function that writes them into the case's folder (its flags name that folder ``{inputs}``)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_stratbench
from stratbench.cli import main
from stratbench.core.config import TrainConfig
from stratbench.core.errors import StratbenchError
from stratbench.launching.executors import make_executor
from stratbench.launching.job import run_job_on

RUN = [
    "--model", "gpt-tiny", "--data", "text", "--seq-len", "16", "--batch-size", "8", "--epochs", "1",
    "--max-steps", "2", "--eval-samples", "16", "--progress", "false", "--measure-flops", "false",
]  # fmt: skip
"""The finished run, and the flags every refused rerun starts from (a case's flags come after and win)."""

LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}  # fmt: skip
"""A tiny Hugging Face config (tests/models/test_hf.py's)."""


def _odd_token_file(inputs: Path) -> None:
    (inputs / "odd.bin").write_bytes(bytes(range(256)) * 19 + bytes(137))  # 5,001 bytes: not whole uint16 tokens


def _token_file(inputs: Path) -> None:
    (inputs / "tokens.bin").write_bytes(bytes(range(256)) * 20)


def _bad_tokenizer(inputs: Path) -> None:
    (inputs / "tokenizer.json").write_text("{not a tokenizer")


def _hf_folder(inputs: Path, weights: dict[str, bytes]) -> None:
    folder = inputs / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    for name, data in weights.items():
        (folder / name).write_bytes(data)


def _hf_pickle_weights(inputs: Path) -> None:
    _hf_folder(inputs, {"pytorch_model.bin": b"PK\x03\x04 a pickle" + bytes(64)})


def _hf_bad_safetensors(inputs: Path) -> None:
    _hf_folder(inputs, {"model.safetensors": (16).to_bytes(8, "little") + b"{not json, sorry}" + bytes(64)})


def _hf_keys_of_another_model(inputs: Path) -> None:
    import torch
    from safetensors.torch import save_file

    folder = inputs / "hf"
    _hf_folder(inputs, {})
    save_file({"transformer.wte.weight": torch.zeros(320, 32)}, str(folder / "model.safetensors"))


def _hf_config(inputs: Path, **changes) -> None:
    folder = inputs / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))


def _hf_encoder(inputs: Path) -> None:
    _hf_config(inputs, model_type="bert", architectures=["BertForMaskedLM"], type_vocab_size=2)


def _hf_larger_than_the_host(inputs: Path) -> None:
    _hf_config(inputs, hidden_size=65536, intermediate_size=262144, num_hidden_layers=64, num_attention_heads=512,
               num_key_value_heads=512)  # fmt: skip


def _token_beyond_any_vocabulary(inputs: Path) -> None:
    (inputs / "big.bin").write_bytes((4_000_000_000).to_bytes(4, "little") * 1024)


def _weights_that_fit_nothing(inputs: Path) -> None:
    import torch

    torch.save({"some.other.weight": torch.zeros(3, 3)}, inputs / "other.pt")


def _garbage_weights(inputs: Path) -> None:
    (inputs / "garbage.pt").write_bytes(bytes(range(256)) * 4)


@dataclass(frozen=True)
class Refusal:
    """One refused rerun: flags after RUN (``{inputs}``: the folder ``make`` wrote into), a piece of the one
    line it must print, its exit code (2: bad input; 3: a method that cannot run here), and whether it is also
    run under stratbench's launcher (``--strategy ddp --nproc 2``: a refusal that only the workers' set-up finds)."""

    args: tuple[str, ...]
    says: str
    make: Callable[[Path], None] | None = None
    exit_code: int = 2
    launched: bool = False
    needs: str | None = None  # a module the case needs (skipped without it)


REFUSALS: dict[str, Refusal] = {
    # data and tokenizer (found while the data is built)
    "odd-token-file": Refusal(("--data", "tokens:{inputs}/odd.bin"), "5001 bytes", _odd_token_file, launched=True),
    "missing-token-file": Refusal(("--data", "tokens:{inputs}/none.bin"), "does not exist"),
    "token-dtype-float32": Refusal(
        ("--data", "tokens:{inputs}/tokens.bin", "--token-dtype", "float32"), "float32", _token_file
    ),
    "bad-tokenizer": Refusal(
        ("--tokenizer", "{inputs}/tokenizer.json"), "tokenizer", _bad_tokenizer, needs="tokenizers"
    ),
    "batch-not-a-number": Refusal(("--batch-size", "1e12"), "1e12"),
    "batch-beyond-the-data": Refusal(("--batch-size", "1000000000000"), "smaller than one global batch"),
    # model and weights (found while the model is built)
    "hf-pytorch-model-bin": Refusal(
        ("--model", "hf:{inputs}/hf"), "pytorch_model.bin", _hf_pickle_weights, needs="transformers"
    ),
    "hf-bad-weights-file": Refusal(
        ("--model", "hf:{inputs}/hf"), "could not build", _hf_bad_safetensors, needs="transformers"
    ),
    "hf-keys-of-another-model": Refusal(
        ("--model", "hf:{inputs}/hf"), "missing", _hf_keys_of_another_model, needs="transformers"
    ),
    "hf-not-a-decoder": Refusal(("--model", "hf:{inputs}/hf"), "bert", _hf_encoder, needs="transformers"),
    "hf-larger-than-the-host": Refusal(
        ("--model", "hf:{inputs}/hf"), "memory available", _hf_larger_than_the_host, needs="transformers"
    ),
    "hf-window-beyond-its-positions": Refusal(
        ("--model", "hf:{inputs}/hf", "--seq-len", "128"), "128", lambda inputs: _hf_config(inputs),
        needs="transformers",
    ),
    "token-beyond-any-vocabulary": Refusal(
        ("--data", "tokens:{inputs}/big.bin", "--token-dtype", "uint32"), "4000000000", _token_beyond_any_vocabulary
    ),
    "weights-fit-nothing": Refusal(
        ("--weights", "{inputs}/other.pt"), "no tensor that fits", _weights_that_fit_nothing, launched=True
    ),
    "weights-not-a-state-dict": Refusal(("--weights", "{inputs}/garbage.pt"), "garbage.pt", _garbage_weights),
    "weights-missing": Refusal(("--weights", "{inputs}/none.pt"), "not found"),
    # the method, the precision, the options
    "unknown-strategy-option": Refusal(("--zero-stage", "2"), "--zero-stage"),
    "unknown-precision": Refusal(("--precision", "fp8"), "fp8"),
    "precision-not-for-the-method": Refusal(
        ("--strategy", "deepspeed", "--precision", "fp64"), "no fp64 mode", exit_code=3, needs="deepspeed"
    ),
    "one-process-method-on-two": Refusal(("--strategy", "single", "--nproc", "2"), "world size 2", exit_code=3),
    "grad-accum-does-not-divide": Refusal(("--grad-accum", "3"), "3"),
    # resuming or starting from a checkpoint that does not fit
    "resume-other-optimizer": Refusal(("--resume", "--optimizer", "adamw"), "--optimizer"),
    "init-from-missing": Refusal(("--init-from", "{inputs}/none"), "none"),
}


def _digest(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's content hash, a link's target, a folder's mark."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[key] = "dir"
        else:
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished gpt-tiny run (result.json ok, metrics.csv, config.yaml, a checkpoint), made by the CLI."""
    folder = tmp_path_factory.mktemp("finished")
    run_stratbench("train", *RUN, "--output", "run", cwd=folder, timeout=600)
    run = folder / "run"
    assert json.loads((run / "result.json").read_text())["status"] == "ok"
    return run


def _refused(case: Refusal, run: Path, cwd: Path, *extra: str, capsys=None) -> None:
    """Run ``case`` into ``run`` from ``cwd``: in a fresh interpreter, or through the CLI's ``main`` in this
    process (``capsys`` given; the caller has made ``cwd`` the working folder)."""
    if case.needs and importlib.util.find_spec(case.needs) is None:
        pytest.skip(f"needs {case.needs}")
    inputs = cwd / "inputs"
    inputs.mkdir()
    if case.make is not None:
        case.make(inputs)
    args = [*RUN, *extra, *(a.replace("{inputs}", str(inputs)) for a in case.args), "--output", str(run)]
    before = _digest(run)
    if capsys is None:
        proc = run_stratbench("train", *args, cwd=cwd, check=False, timeout=600)
        code, err = proc.returncode, proc.stderr
    else:
        code, err = main(["train", *args]), capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == case.exit_code, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("stratbench train: error: "), err[-3000:]
    assert case.says in lines[0], lines[0]
    changed = _changed(before, _digest(run))
    assert not changed, f"the refused rerun changed {changed} in the finished run"
    assert sorted(p.name for p in cwd.iterdir()) == ["inputs"], "the refused rerun wrote into its working folder"


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refused_rerun_leaves_the_finished_run_as_it_was(name, finished, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(REFUSALS[name], finished, tmp_path, capsys=capsys)


def test_the_issues_refused_rerun_as_a_user_runs_it(finished, tmp_path):
    """The issue's case (a 5,001-byte token file into a finished run) in a fresh interpreter, as a user runs it."""
    _refused(REFUSALS["odd-token-file"], finished, tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(n for n, c in REFUSALS.items() if c.launched))
def test_a_refusal_in_the_workers_set_up_leaves_the_finished_run_as_it_was(name, finished, tmp_path):
    """Found by the torchrun workers while they build the data or the model: the launcher says it in one line
    (not once per rank, no torchrun report), with the workers' exit code, and nothing is written."""
    _refused(REFUSALS[name], finished, tmp_path, "--strategy", "ddp", "--nproc", "2")


def test_a_refused_run_into_a_new_folder_leaves_no_folder(tmp_path):
    """The lock the run takes on a folder it created goes again when set-up refuses the input."""
    _odd_token_file(tmp_path)
    proc = run_stratbench("train", *RUN, "--data", "tokens:odd.bin", "--output", "new", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "5001 bytes" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "new").exists()


def test_a_refusal_on_an_executors_nodes_leaves_the_finished_run_as_it_was(finished, tmp_path):
    """`train --executor ray|slurm` starts `stratbench train` on the nodes (here the local executor's nodes,
    through the same run_job_on): their refusal is the error here, and the nodes' config and logs, staged in the
    output folder, go with it."""
    _odd_token_file(tmp_path)
    cfg = TrainConfig(model="gpt-tiny", data=f"tokens:{tmp_path / 'odd.bin'}", seq_len=16, batch_size=8, epochs=1,
                      max_steps=2, eval_samples=16, progress=False, measure_flops=False, output=str(finished))  # fmt: skip
    before = _digest(finished)
    with pytest.raises(StratbenchError, match="5001 bytes"):
        run_job_on(make_executor("local"), cfg)
    assert not _changed(before, _digest(finished)), _changed(before, _digest(finished))


SWEEP_RECORD = {
    "id": "single-fp32-w1", "method": "single", "label": "single", "precision": "fp32", "world_size": 1,
    "batch_size": 32, "status": "ok", "reason": "", "machine": {"hostname": "h", "device": "CPU"},
    "metrics": {"train_time_s": 1.0}, "config": {}, "environment": {},
}  # fmt: skip
"""One finished cell of a sweep's results.jsonl."""


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--lr", "nan"), "lr must be a finite number"),
        (("--model", "nosuchmodel"), "unknown model"),
        (("--model", "gpt-tiny", "--data", "tokens:none.bin"), "does not exist"),
    ],
)
def test_a_compare_no_cell_of_which_can_run_leaves_the_finished_sweep_as_it_was(tmp_path, flags, says):
    """`compare` into a finished sweep with input every cell refuses: one line, and the sweep's results and
    report stay as they were (not a new row per refused cell and a report rewritten around them)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(json.dumps(SWEEP_RECORD) + "\n")
    (sweep / "report.md").write_text("# the finished sweep's report\n")
    before = _digest(sweep)
    proc = run_stratbench("compare", "--preset", "quick", "--only", "single", "--only", "fp32", "--output", "sweep",
                          *flags, cwd=tmp_path, check=False)  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("stratbench compare: error: no cell can run") and says in lines[0], lines[0]
    assert not _changed(before, _digest(sweep)), _changed(before, _digest(sweep))
