"""Bad input gets one clear line naming the bad value (and the allowed ones) before any work, and a
non-zero exit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import fails
from stratbench.cli import main


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--strategy", "zero9", "single"),
        ("--precision", "fp8", "bf16-mixed"),
        ("--model", "vgg", "resnet50"),
        ("--data", "mnist", "digits"),
        ("--optimizer", "lion", "adamw"),
    ],
)
def test_unknown_choice(capsys, tmp_path, flag, value, allowed):
    err = fails(capsys, "train", "--output", str(tmp_path), flag, value)
    assert repr(value) in err and allowed in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--batch-size", "0"), ("--epochs", "-1"), ("--grad-accum", "0")]
)
def test_non_positive(capsys, tmp_path, flag, value):
    err = fails(capsys, "train", "--output", str(tmp_path), flag, value)
    assert flag[2:].replace("-", "_") in err and value in err


def test_not_a_number(capsys, tmp_path):
    err = fails(capsys, "train", "--output", str(tmp_path), "--epochs", "three")
    assert "'three'" in err and "int" in err


def test_missing_cifar_dir_says_where_to_put_it(capsys, tmp_path):
    err = fails(
        capsys,
        "train",
        "--output",
        str(tmp_path),
        "--data",
        "cifar10",
        "--data-dir",
        str(tmp_path / "nowhere"),
    )
    assert "cifar-10-batches-py" in err and "--download" in err


def test_missing_imagefolder(capsys, tmp_path):
    err = fails(
        capsys,
        "train",
        "--output",
        str(tmp_path),
        "--data",
        "imagefolder",
        "--data-dir",
        str(tmp_path / "nope"),
    )
    assert "nope" in err


def test_batch_must_divide(capsys, tmp_path):
    err = fails(capsys, "train", "--output", str(tmp_path), "--batch-size", "30", "--grad-accum", "4")
    assert "30" in err and "global" in err


def test_corrupt_checkpoint(capsys, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    err = fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(bad))
    assert "corrupt" in err and str(bad) in err


def test_foreign_checkpoint(capsys, tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, foreign)
    err = fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(foreign))
    assert "not a stratbench checkpoint" in err


def test_missing_checkpoint_and_weights(capsys, tmp_path):
    err = fails(capsys, "train", "--output", str(tmp_path / "o"), "--resume-from", str(tmp_path / "gone.pt"))
    assert "not found" in err
    err = fails(capsys, "train", "--output", str(tmp_path / "o"), "--weights", str(tmp_path / "w.pt"))
    assert "not found" in err


def test_unknown_yaml_key(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochz: 3\n")
    err = fails(capsys, "train", "--config", str(cfg))
    assert "'epochz'" in err and "epochs" in err


def test_tf32_needs_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    err = fails(capsys, "train", "--output", str(tmp_path), "--tf32")
    assert "tf32" in err.lower() and "cpu" in err


def test_list_names_every_strategy_and_precision(capsys):
    assert main(["list", "--check"]) == 0
    out = capsys.readouterr().out
    from stratbench.core.precision import SPECS
    from stratbench.strategies.base import all_strategies

    for name in [*all_strategies(), *SPECS]:
        assert name in out
    # a method judged on a model it applies to (tp: the default image model has no tp plan) says which
    tp = next(ln for ln in out.splitlines() if ln.startswith("│ tp "))
    assert "yes (on gpt-tiny)" in tp, tp


# ---- every input that used to end in a traceback, a hang or a silent acceptance (issue 14) ----------------
TINY_ARGS = [
    "--model", "tinynet", "--width", "8", "--norm", "none", "--data", "digits", "--batch-size", "32",
    "--epochs", "1", "--max-steps", "2", "--progress", "false", "--measure-flops", "false",
]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step single run (a checkpoint to resume, export or consolidate)."""
    out = tmp_path_factory.mktemp("bad-input") / "run"
    assert main(["train", "--output", str(out), *TINY_ARGS]) == 0
    return out


RECORD = (
    '{"id": "single-fp32-w1", "method": "single", "label": "single", "precision": "fp32", "world_size": 1, '
    '"batch_size": 32, "status": "failed", "reason": "test", "machine": {"hostname": "h", "device": "CPU"}, '
    '"metrics": {}, "config": {}, "environment": {}}'
)
"""One cell record of results.jsonl, as little as the report renders."""


def _tree(root):
    """Names, sizes and modification times of everything under ``root``: what 'unchanged' means."""
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


BAD = {
    # train: numbers out of range, non-finite, a non-builder, a file as output, unreachable node ranks
    "image-size-huge": (["train", "--output", "{new}", "--image-size", "100000"], "image_size"),
    "momentum-negative": (["train", "--output", "{new}", "--momentum", "-1"], "momentum"),
    "num-workers-negative": (["train", "--output", "{new}", "--num-workers", "-1"], "num_workers"),
    "lr-inf": (["train", "--output", "{new}", "--lr", "inf"], "lr"),
    "lr-nan": (["train", "--output", "{new}", "--lr", "nan"], "lr"),
    "weight-decay-nan": (["train", "--output", "{new}", "--weight-decay", "nan"], "weight_decay"),
    "clip-negative": (["train", "--output", "{new}", "--clip-grad-norm", "-1"], "clip_grad_norm"),
    "model-not-a-builder": (["train", "--output", "{new}", "--model", "os:system"], "os:system"),
    "output-is-a-file": (["train", "--output", "{file}", *TINY_ARGS], "existing file"),
    "dist-timeout-zero": (["train", "--output", "{new}", "--dist-timeout-s", "0"], "dist_timeout_s"),
    "max-restarts-negative": (["train", "--output", "{new}", "--max-restarts", "-1"], "max_restarts"),
    "master-port-too-big": (["train", "--output", "{new}", "--master-port", "99999"], "99999"),
    "node-rank-beyond-nnodes": (
        ["train", "--output", "{new}", "--nnodes", "2", "--node-rank", "5"],
        "node_rank",
    ),
    "keep-last-zero": (["train", "--output", "{new}", "--keep-last", "0"], "keep_last"),
    "seed-negative": (["train", "--output", "{new}", "--seed", "-3"], "seed"),
    # resume into another model or optimizer: say which keys differ
    "resume-other-width": (
        ["train", "--output", "{run}", *TINY_ARGS, "--width", "16", "--resume"],
        "--width 8",
    ),
    "resume-other-optimizer": (
        ["train", "--output", "{run}", *TINY_ARGS, "--optimizer", "adamw", "--resume"],
        "--optimizer sgd",
    ),
    "init-other-width": (
        ["train", "--output", "{new}", *TINY_ARGS, "--width", "4", "--init-from", "{ckpt}"],
        "width",
    ),
    # inference on garbage
    "evaluate-garbage-onnx": (
        ["evaluate", "--backend", "onnxruntime", "--onnx", "{garbage}"],
        "not a readable ONNX",
    ),
    "predict-garbage-onnx": (
        ["predict", "--backend", "onnxruntime", "--onnx", "{garbage}", "{garbage}"],
        "not a readable ONNX",
    ),
    "report-binary-results": (["report", "{sweep}"], "line 1"),
    "report-line-cut-in-the-middle": (["report", "{torn}"], "line 2"),
    "report-binary-calibration": (["report", "{cal}"], "calibration.jsonl line 1"),
    "report-calibration-for-not-a-list": (["report", "{calfor}"], "'for' is not a list"),
    "estimate-hardware-file-not-text": (["estimate", "--time", "--hardware", "{garbage}"], "not text"),
    "bench-infer-output-dir": (["bench-infer", "--model", "tinynet", "--output", "{run}"], "is a folder"),
    "bench-infer-threads-zero": (["bench-infer", "--model", "tinynet", "--threads", "0"], "--threads"),
    "bench-infer-max-seconds-negative": (
        ["bench-infer", "--model", "tinynet", "--max-seconds", "-1"],
        "--max-seconds",
    ),
    "bench-infer-image-size-zero": (
        ["bench-infer", "--model", "tinynet", "--image-size", "0"],
        "--image-size",
    ),
    "export-opset-zero": (
        ["export", "--checkpoint", "{ckpt}", "--output", "{tmp}/m.onnx", "--opset", "0"],
        "--opset",
    ),
    "export-real-samples-negative": (
        ["export", "--checkpoint", "{ckpt}", "--output", "{tmp}/m.onnx", "--real-samples", "-5"],
        "--real-samples",
    ),
    "estimate-batch-not-divisible": (
        ["estimate", "--strategy", "ddp", "--world-size", "3", "--batch-size", "128"],
        "128",
    ),
    "estimate-zero-stage-with-ddp": (
        ["estimate", "--strategy", "ddp", "--world-size", "2", "--zero-stage", "2"],
        "ddp",
    ),
    "estimate-absurd-world": (
        ["estimate", "--strategy", "fsdp", "--world-size", "1000000", "--batch-size", "1000000"],
        "--world-size",
    ),
    "advise-batch-not-divisible": (
        ["advise", "--devices", "3", "--device-memory", "24GiB", "--batch-size", "128"],
        "--devices 3",
    ),
    # the exact command: the batch is named before "no GPU detected" (no --device-memory on a CPU)
    "advise-batch-not-divisible-no-memory": (["advise", "--devices", "3", "--batch-size", "128"], "--devices 3"),
    "consolidate-over-a-file": (["consolidate", "{ckpt}", "{file}"], "--force"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_with_one_line(capsys, tmp_path, finished_run, case):
    argv, expected = BAD[case]
    (tmp_path / "file.txt").write_text("keep me\n")
    (tmp_path / "garbage.onnx").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "results.jsonl").write_bytes(b'\xcd\xff\x00binary\n{"id": "x"}\n')
    (tmp_path / "torn").mkdir()  # a line cut short, then more appended: not the torn last line a crash leaves
    (tmp_path / "torn" / "results.jsonl").write_text(f"{RECORD}\n{RECORD[:40]}\n{RECORD}\n")
    for name, line in (("cal", b"\xcd\xff\x00binary\n"),
                       ("calfor", b'{"id": "p", "calibration": {"kind": "probe", "for": "single-fp32-w1"}}\n')):
        (tmp_path / name).mkdir()  # a sound results.jsonl beside a bad calibration.jsonl (compare --calibrate)
        (tmp_path / name / "results.jsonl").write_text(RECORD + "\n")
        (tmp_path / name / "calibration.jsonl").write_bytes(line)
    values = {
        "new": tmp_path / "new",
        "file": tmp_path / "file.txt",
        "run": finished_run,
        "ckpt": finished_run / "checkpoints" / "last",
        "garbage": tmp_path / "garbage.onnx",
        "sweep": tmp_path / "sweep",
        "torn": tmp_path / "torn",
        "cal": tmp_path / "cal",
        "calfor": tmp_path / "calfor",
        "tmp": tmp_path,
    }
    argv = [a.format(**values) for a in argv]
    before, run_before = _tree(tmp_path), _tree(finished_run)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]
    assert _tree(tmp_path) == before and _tree(finished_run) == run_before, "the command changed files"


def test_resume_without_checkpoint_says_it_starts_fresh(capsys, tmp_path):
    assert main(["train", "--output", str(tmp_path / "o"), *TINY_ARGS, "--resume"]) == 0
    assert "starting fresh" in capsys.readouterr().err


def test_consolidate_never_deletes_what_it_was_not_asked_to_replace(capsys, finished_run, tmp_path):
    target = tmp_path / "v"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "keep.txt").write_text("mine")
    ckpt = finished_run / "checkpoints" / "last"
    assert main(["consolidate", str(ckpt), str(target)]) == 0  # a folder receives model.pt
    assert (target / "sub" / "keep.txt").read_text() == "mine" and (target / "model.pt").is_file()
    assert main(["consolidate", str(ckpt), str(target)]) != 0  # model.pt exists now: --force needed
    assert main(["consolidate", "--force", str(ckpt), str(target / "model.pt")]) == 0
    # The run folder itself as the target: written into, nothing removed.
    run_files = {p.name for p in finished_run.iterdir()}
    assert main(["consolidate", str(ckpt), str(finished_run)]) == 0
    assert run_files | {"model.pt"} == {p.name for p in finished_run.iterdir()}
    (finished_run / "model.pt").unlink()


def _without_write_override() -> list[str]:
    """A command prefix under which a read-only folder is read-only: none for a normal user; as root, setpriv
    drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (the capabilities that let root write anywhere) and keeps
    uid 0, so the venv's interpreter stays reachable (`nobody` cannot run one under /root, mode 0700)."""
    if os.geteuid() != 0:
        return []
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: root writes into read-only folders")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


READ_ONLY_DRIVER = """
import contextlib, io, json, sys, traceback
from stratbench.cli import main
seen = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            code, _ = -1, traceback.print_exc()
    seen[name] = [code, err.getvalue()]
print(json.dumps(seen))
"""
"""Runs each command in one process (one interpreter start for all six) and reports exit code and stderr."""


def test_read_only_output_folder(tmp_path, finished_run):
    """Every command that writes refuses a read-only output folder in one line naming it, before any work
    (ddp: before torchrun starts) and writing nothing. One process runs all six: as root, under setpriv."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    ro, sweep = tmp_path / "ro", tmp_path / "ro-sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(RECORD + "\n")
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("base: {model: tinynet, width: 8, norm: none, data: digits, max_steps: 2}\n"
                      "cells: [{method: single, precision: fp32}]\n")  # fmt: skip
    commands = {
        "train": ["train", "--output", str(ro / "run"), *TINY_ARGS],
        "ddp": ["train", "--strategy", "ddp", "--nproc", "2", "--output", str(ro / "ddp"), *TINY_ARGS],
        "compare": ["compare", "--matrix", str(matrix), "--output", str(ro / "sweep")],
        "report": ["report", str(sweep)],
        "consolidate": ["consolidate", str(finished_run / "checkpoints" / "last"), str(ro / "m.pt")],
        "bench-infer": ["bench-infer", "--model", "tinynet", "--output", str(ro / "b.csv")],
    }
    ro.mkdir()
    for folder in (ro, sweep):
        folder.chmod(0o555)
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([*_without_write_override(), sys.executable, "-c", READ_ONLY_DRIVER, json.dumps(commands)],
                              capture_output=True, text=True, timeout=180, env=env, cwd=REPO)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        for name, (code, err) in seen.items():
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert code not in (0, -1), (name, err)
            assert len(lines) == 1 and "Traceback" not in err, (name, err)
            folder = sweep if name == "report" else ro
            assert str(folder) in lines[0] and ("Permission denied" in lines[0] or "not writable" in lines[0]), (name, lines[0])
        assert set(seen) == set(commands)
        assert list(ro.iterdir()) == [] and [p.name for p in sweep.iterdir()] == ["results.jsonl"]
    finally:
        for folder in (ro, sweep):
            folder.chmod(0o755)


def test_a_torn_last_results_line_is_noted_skipped_and_dropped_by_the_next_append(capsys, tmp_path):
    """A sweep killed while appending leaves its last line cut short: `report` names it in a note and renders the
    rest; the sweep's next record replaces it rather than being glued onto it (which lost both)."""
    import json

    from stratbench.compare.runner import append_record, load_records

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(f"{RECORD}\n{RECORD[:50]}")
    assert main(["report", str(sweep)]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(notes) == 1 and "line 2" in notes[0] and "cut short" in notes[0], notes
    assert (sweep / "report.md").exists()
    append_record(sweep, json.loads(RECORD) | {"id": "ddp-fp32-w2"})
    assert list(load_records(sweep)) == ["single-fp32-w1", "ddp-fp32-w2"]
    assert main(["report", str(sweep)]) == 0
    assert "cut short" not in capsys.readouterr().err
    (sweep / "results.jsonl").write_text(RECORD)  # whole, only its newline missing: kept
    append_record(sweep, json.loads(RECORD) | {"id": "ddp-fp32-w2"})
    assert list(load_records(sweep)) == ["single-fp32-w1", "ddp-fp32-w2"]


def _disk_full_on_torch_save(monkeypatch):
    """torch.save writes a few bytes, then the disk is full."""
    import errno

    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)


def test_full_disk_while_saving_fails_in_one_line_and_keeps_the_previous_checkpoint(capsys, tmp_path, monkeypatch):
    import json

    from stratbench.checkpoints import checkpoint as ckpt

    out = tmp_path / "run"
    assert main(["train", "--output", str(out), *TINY_ARGS]) == 0
    capsys.readouterr()
    _disk_full_on_torch_save(monkeypatch)
    code = main(["train", "--output", str(out), *TINY_ARGS, "--max-steps", "4", "--save-every-steps", "1", "--resume"])
    monkeypatch.undo()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code != 0 and len(err) == 1 and "Traceback" not in err[0], err
    assert "cannot write" in err[0] and str(ckpt.save_path_for(out, 3)) in err[0] and "No space left" in err[0], err
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "failed" and "No space left" in result["reason"]
    assert ckpt.load_any(ckpt.resolve_resume(str(out), None))["progress"]["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last", "step-00000002"]


def test_full_disk_while_consolidating_fails_in_one_line_and_replaces_nothing(capsys, tmp_path, finished_run, monkeypatch):
    src = finished_run / "checkpoints" / "last"
    target = tmp_path / "full.pt"
    target.write_bytes(b"an earlier file")
    for argv in (["consolidate", str(src), str(tmp_path / "new.pt")], ["consolidate", "--force", str(src), str(target)]):
        _disk_full_on_torch_save(monkeypatch)
        code = main(argv)
        monkeypatch.undo()
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert code != 0 and len(err) == 1 and "Traceback" not in err[0], err
        assert f"cannot write {argv[-1]}" in err[0] and "No space left" in err[0], err
    assert target.read_bytes() == b"an earlier file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]


def test_a_failed_export_leaves_the_previous_export_byte_identical(capsys, tmp_path, finished_run, monkeypatch):
    from stratbench.inference import onnx_export

    good = tmp_path / "good.onnx"
    argv = ["export", "--checkpoint", str(finished_run / "checkpoints" / "last"), "--output", str(good),
            "--exporter", "torchscript"]  # fmt: skip
    assert main(argv) == 0
    before = good.read_bytes()
    capsys.readouterr()

    def crash(kind, model, example, output, *rest):
        Path(output).write_bytes(before[: len(before) // 3])  # a partial file, then the exporter fails
        raise RuntimeError("exporter crashed halfway")

    monkeypatch.setattr(onnx_export, "_export", crash)
    code = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("model:")]
    assert code != 0 and len(err) == 1 and "exporter crashed halfway" in err[0], err
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.onnx"]


@pytest.mark.parametrize("writer", ["config.yaml", "accelerate_config.yaml"])
def test_run_files_are_written_atomically(tmp_path, monkeypatch, writer):
    """A full disk while writing a run's config leaves the earlier file whole and no temporary file."""
    import errno

    from stratbench.checkpoints import checkpoint as ckpt
    from stratbench.core.config import TrainConfig, dump_yaml
    from stratbench.strategies.accelerate import write_accelerate_config

    path = tmp_path / writer
    path.write_text("earlier\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        if writer == "config.yaml":
            dump_yaml(TrainConfig(output=str(tmp_path)), path)
        else:
            write_accelerate_config(TrainConfig(output=str(tmp_path)), "accelerate-ddp", 2, path)
    assert path.read_text() == "earlier\n"
    assert [p.name for p in tmp_path.iterdir()] == [writer]


def test_the_error_line_goes_out_in_one_write_with_its_newline(tmp_path, monkeypatch):
    """print() writes a line and its newline apart: a worker that torchrun stopped between the two left the next
    log line glued to its error (issue 42). The error line is one write, newline included."""
    import io
    import sys

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["train", "--output", str(tmp_path / "o"), "--precision", "fp8"]) == 2
    errors = [w for w in writes if "error:" in w]
    assert len(errors) == 1 and errors[0].endswith("\n") and errors[0].count("\n") == 1, writes
