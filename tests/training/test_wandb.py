"""The W&B sink (``--wandb``) as a user meets it: an offline run whose file holds the config, one loss per step and
the result summary, with no network touched and no wandb process left behind; a failed run marked failed; and
the bad inputs (the package missing, an unknown mode) refused in one line before any work."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from conftest import TINY, fails, run_stratbench

QUICK = [*TINY, "--max-steps", "6"]


# ---- reading an offline run back ---------------------------------------------------------------
# wandb (>= 0.18) has no Python reader of its run files any more (the service, a Go binary, writes them), and an
# offline run writes no files/wandb-summary.json or files/config.yaml. The .wandb file is what `wandb sync`
# uploads: a LevelDB-style log (a 7-byte header, 32 KiB blocks of records: CRC32C, length, kind, data) whose
# records are wandb's own protobuf Records. Reading it is what shows that the data reached W&B's run file.

_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"
_BLOCK = 32 * 1024
_FULL, _LAST = 1, 4


def read_wandb_records(path: Path) -> list:
    """Every Record of a run file, in order (records split over blocks are joined)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:7] == _HEADER, f"{path} is not a W&B run file (header {data[:7]!r})"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _items(updates) -> dict:
    return {(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in updates}


def read_offline_run(folder: Path) -> dict:
    """The config, the history rows (one per logged step), the summary and the exit code of an offline run."""
    files = list(folder.glob("run-*.wandb"))
    assert len(files) == 1, files
    run: dict = {"config": {}, "history": [], "summary": {}, "exit_code": None}
    for record in read_wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["config"].update(_items(record.run.config.update))
            run["name"], run["project"] = record.run.display_name, record.run.project
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def processes_with(marker: str) -> list[psutil.Process]:
    """Processes whose environment holds ``marker``: the run and every process it started (wandb's service)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if marker in proc.environ().get("STRATBENCH_WANDB_TEST", ""):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


# ---- a real run ----------------------------------------------------------------------------------
def test_offline_run_holds_config_steps_and_summary_touches_no_network_and_leaves_no_process(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    marker = uuid.uuid4().hex
    # A trap: every address wandb could reach (its server, any proxy) points at this socket, which must stay
    # unvisited. The marker, inherited by every process the run starts, finds any wandb process left over.
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    url = f"http://127.0.0.1:{trap.getsockname()[1]}"
    env = {
        "STRATBENCH_WANDB_TEST": marker, "WANDB_BASE_URL": url, "HTTP_PROXY": url, "HTTPS_PROXY": url,
        "ALL_PROXY": url, "NO_PROXY": "", "WANDB_API_KEY": "",
    }  # fmt: skip
    proc = run_stratbench(
        "train", "--output", str(out), "--strategy", "single", *QUICK, "--wandb", "--wandb-mode", "offline",
        "--wandb-project", "wandb-test", env=env,
    )  # fmt: skip
    res = json.loads((out / "result.json").read_text())
    with pytest.raises(BlockingIOError):
        trap.accept()  # nothing connected: offline means no network
    trap.close()
    assert processes_with(marker) == [], "a wandb process outlived the run"

    folders = list((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, folders
    assert f"wandb sync {folders[0]}" in proc.stdout, proc.stdout  # the one-line note: where, and how to upload
    run = read_offline_run(folders[0])
    assert run["name"] == "single/fp32" and run["project"] == "wandb-test"
    assert run["config"]["strategy"] == "single" and run["config"]["batch_size"] == 32
    assert run["config"]["run"]["environment"]["torch"] == torch.__version__
    assert run["config"]["run"]["micro_batch_size"] == 32

    steps = [row for row in run["history"] if "train/loss" in row]
    assert [row["_step"] for row in steps] == list(range(1, 7)), "one history row per optimizer step"
    assert [row["train/loss"] for row in steps] == pytest.approx(res["metrics"]["loss_curve"], rel=1e-12)
    assert all(row["train/samples_per_s"] > 0 and row["train/memory_bytes"] > 0 for row in steps)
    assert steps[-1]["val/accuracy"] == pytest.approx(res["metrics"]["val_accuracy"])

    summary = run["summary"]
    assert summary["status"] == "ok" and run["exit_code"] == 0
    assert summary["throughput_samples_per_s"] == pytest.approx(res["metrics"]["throughput_samples_per_s"])
    assert summary["peak_memory_bytes"] == max(res["metrics"]["peak_memory_bytes"])


def test_a_failed_run_is_marked_failed_and_its_service_stopped(tmp_path, monkeypatch):
    """The sink alone, in this process: a run that did not end "ok" finishes with exit code 1 and its status,
    and close stops the service process that wandb.finish leaves running (and puts WANDB_MODE back)."""
    pytest.importorskip("wandb")
    from stratbench.core.config import TrainConfig
    from stratbench.training.sinks import WandbSink

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = TrainConfig(output=str(tmp_path), wandb=True, wandb_mode="offline")
    sink = WandbSink(cfg, tmp_path, header={"world_size": 1})
    row = {"step": 1, "epoch": 0.1, "loss": 2.5, "lr": 0.1, "step_time_s": 0.2, "samples_per_s": 160.0}
    sink.log_step(row)
    sink.close({"status": "diverged", "reason": "loss is nan at step 2", "metrics": {"steps": 1}})

    assert not [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]
    assert "WANDB_MODE" not in os.environ
    run = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*")))
    assert run["exit_code"] == 1
    assert run["summary"]["status"] == "diverged" and run["summary"]["reason"] == "loss is nan at step 2"
    assert run["history"][0]["train/loss"] == 2.5 and run["config"]["run"] == {"world_size": 1}


# ---- the mode --------------------------------------------------------------------------------------
def test_auto_mode_is_online_only_with_a_login(tmp_path, monkeypatch):
    from stratbench.training.sinks import resolve_wandb_mode

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert resolve_wandb_mode("auto") == "offline", "no login: offline, never a prompt"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    assert resolve_wandb_mode("auto") == "online", "`wandb login` wrote the netrc entry"
    assert resolve_wandb_mode("offline") == "offline", "an explicit mode wins"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert resolve_wandb_mode("auto") == "offline", "the login is for another host"
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled", "wandb's own switch"


# ---- bad input ---------------------------------------------------------------------------------------
def test_wandb_without_the_package_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails; find_spec finds nothing
    out = tmp_path / "run"
    err = fails(capsys, "train", "--output", str(out), *QUICK, "--wandb")
    assert err == "stratbench train: error: --wandb needs the wandb package: pip install 'stratbench[wandb]'"
    assert not out.exists(), "refused before any work"


def test_unknown_wandb_mode_names_the_allowed_ones(capsys, tmp_path):
    err = fails(capsys, "train", "--output", str(tmp_path / "run"), *QUICK, "--wandb", "--wandb-mode", "cloud")
    assert "'cloud'" in err and "auto, online, offline, disabled" in err
