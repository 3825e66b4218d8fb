"""The held-out validation (benchmarks/projection_heldout.py): its results file and the error bands are what its
rows render to, the rows file is today's projection, and every projection carries its basis' band."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

import conftest
from stratbench.core.config import TrainConfig
from stratbench.measuring.hardware import resolve
from stratbench.predicting import projection


@pytest.fixture(scope="module")
def heldout():
    folder = str(conftest.REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("projection_heldout")
    finally:
        sys.path.remove(folder)


def test_the_results_file_and_the_bands_are_what_the_rows_render_to(heldout):
    rows = json.loads(heldout.ROWS.read_text())
    assert heldout.RESULTS.read_text() == heldout.render(rows)
    assert json.loads(heldout.BANDS.read_text()) == json.loads(json.dumps(heldout.bands(rows)))
    assert len(rows) >= 40 and {r["role"] for r in rows} == {"sets", "held out"}
    assert {r["group"] for r in rows if r["gpus"] == 1} >= {"resnet", "efficientnet", "bert-large"}


def test_the_rows_file_is_todays_projection(heldout):
    """A 1-GPU row's default projection and a multi-GPU row's naive prediction, recomputed: the rows file is stale
    where published.yaml, hardware.yaml or the projection changed since the benchmark last ran."""
    rows = {r["id"]: r for r in json.loads(heldout.ROWS.read_text())}
    by_id = {e["id"]: e for e in heldout.pp.load_published()}
    one = rows["dle-rn50-v100-16-fp32-1gpu"]
    assert heldout.on_basis(by_id[one["id"]], "efficiency")[0] == pytest.approx(one["default"], rel=1e-9)
    multi = rows["dle-effnet-b0-a100-80-amp-fp16-8gpu"]
    assert multi["naive"] == pytest.approx(2489 * 8)
    assert multi["reference"] == "dle-effnet-b0-a100-80-amp-fp16-1gpu"
    entries = list(by_id.values()) + heldout.timm_entries()
    assert set(rows) == {e["id"] for e in heldout.selected(entries)}
    timm = {e["id"]: e for e in heldout.timm_entries()}["timm-mobilenetv3_small_100-rtx3090-amp"]
    assert heldout.on_basis(timm, "roofline")[0] == pytest.approx(rows[timm["id"]]["roofline"], rel=1e-9)


def test_a_row_beyond_its_gpus_peak_is_flagged_kept_and_scored(heldout):
    """The implied share of the peak: DeepLearningExamples' BERT-large phase-2 figure on one V100 in fp32 (19
    sequences/s) needs more than V100's 15.7 TFLOP/s on stratbench's count; it stays in the table and in the band."""
    by_id = {e["id"]: e for e in heldout.pp.load_published()}
    rows = {r["id"]: r for r in json.loads(heldout.ROWS.read_text())}
    over, fine = "dle-bert-pretrain-s512-v100-32-fp32-1gpu", "dle-bert-pretrain-s128-v100-32-amp-fp16-1gpu"
    share = heldout.peak_share(by_id[over])
    assert share > 1 and share == pytest.approx(rows[over]["peak_share"], rel=1e-9)
    assert 0.2 < rows[fine]["peak_share"] < 0.7
    assert f"{over} ({share:.0%})" in heldout.render(list(rows.values()))
    assert rows[over]["roofline"] is not None and rows[over]["role"] == "held out"


def test_every_row_beyond_the_bound_is_listed_once_with_its_reason(heldout):
    rows = json.loads(heldout.ROWS.read_text())
    lines = heldout.miss_lines(rows)
    beyond = [r for r in rows if r["gpus"] == 1 and abs(heldout.err(r, "roofline") or 0) > heldout.MISS_LIMIT]
    names = [n.rsplit(" ", 1)[0] for line in lines[1:-1] for n in line.split(": ")[-1].split(", ")]
    assert beyond and sorted(names) == sorted(r.get("timm_model") or r["id"] for r in beyond)
    squad = next(line for line in lines if "run_squad.py" in line)
    assert "dle-bert-squad-a100-tf32-1gpu +78%" in squad and "dle-bert-squad-v100-32-fp32" not in squad  # +6.9%


def test_timm_rows_run_torchvision_as_a_user_names_it_and_another_network_is_not_projected(heldout):
    """timm's RTX 3090 rows are projected through torchvision's model of the mapped name, as `--model
    torchvision.models:NAME` runs it, at the row's batch and image size with timm's SGD; a row whose torchvision
    model has another parameter count (another network under a similar name) is kept, unprojected, with why."""
    entries = {e["timm_model"]: e for e in heldout.timm_entries()}
    cfg = heldout.pp.config(entries["efficientnet_b3"], "single", 1)
    assert (cfg.model, cfg.image_size, cfg.batch_size, cfg.optimizer, cfg.precision) == (
        "torchvision.models:efficientnet_b3",
        288,
        128,
        "sgd",
        "fp16-mixed",
    )
    assert heldout.other_network(entries["efficientnet_b3"]) == ""
    why = heldout.other_network(entries["regnetx_004"])  # torchvision's 400MF RegNet is another configuration
    assert (
        why.startswith("not the same network: torchvision's regnet_x_400mf has 5.50 M parameters")
        and "+6.5%" in why
    )
    rows = {r["id"]: r for r in json.loads(heldout.ROWS.read_text())}
    row = rows[entries["regnetx_004"]["id"]]
    assert row["roofline"] is None and row["why"] == {"default": why, "roofline": why} and row["role"] == "held out"
    timm_rows = [r for r in rows.values() if r["table"] == "timm"]
    assert len(timm_rows) == len(entries) and all(r["role"] == "held out" for r in timm_rows)
    assert {r["family"] for r in timm_rows} == {"convnet", "transformer"}


def test_a_projection_says_its_basis_and_that_basis_band():
    cfg = TrainConfig(
        model="tinynet", image_size=16, num_classes=10, width=8, batch_size=8, strategy="single"
    )
    p = projection.project(cfg, resolve("a100-sxm"), 1, 1, memory=False)
    bands = json.loads((conftest.REPO / "src/stratbench/measuring/error_bands.json").read_text())
    assert (
        p.basis == "family fallback"
        and p.error_band["median"] == bands["bands"]["family fallback"]["families"]["convnet"]["median"]
        and p.error_band["over"].endswith("(convnets)")
    )  # a convnet quotes the convnets' band; a family with too few scored rows, the basis' band over all
    assert (
        projection.error_band("family fallback", "unknown")["rows"]
        == bands["bands"]["family fallback"]["rows"]
    )
    assert (
        p.error_band["p80"] >= p.error_band["median"] > 0 and "projection_heldout" in p.error_band["source"]
    )
    assert projection.error_band("hardware file") == {}
    cpu = projection.project(cfg, resolve("cpu-gloo"), 1, 1, memory=False)  # every band is of GPU figures
    assert cpu.basis == "family fallback" and cpu.error_band == {}


def test_estimate_prints_the_band_in_text_and_json(capsys):
    from stratbench.cli import main

    args = ["estimate", "--model", "tinynet", "--width", "8", "--image-size", "16", "--num-classes", "10",
            "--strategy", "single", "--time", "--hardware", "a100-sxm", "--gpus-per-node", "1"]  # fmt: skip
    assert main([*args, "--json"]) == 0  # the default basis on a GPU with roofline fractions: the roofline
    row = json.loads(capsys.readouterr().out)["results"][0]["projection"]
    assert row["basis"] == "roofline with published fractions" and row["error_band"]["rows"] > 0
    assert main([*args, "--basis", "efficiency"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    band = projection.error_band("family fallback", "convnet")
    assert f"basis: family fallback; held-out error band: median {band['median']:.1%}" in text


def test_docs_projection_tables_are_what_the_benchmarks_render(heldout):
    """docs/projection.md's held-out table is the benchmark's render of the rows file, with the band each basis
    quotes; its example projection table names each row's basis and quotes error_bands.json's band for it."""
    rows = json.loads(heldout.ROWS.read_text())
    doc = heldout.DOC.read_text()
    block = doc.split(heldout.DOC_BEGIN, 1)[1].split(heldout.DOC_END, 1)[0]
    assert block.strip().splitlines() == heldout.doc_lines(rows)
    assert "**band each basis quotes**" in block
    readme = heldout.README.read_text().split(heldout.DOC_BEGIN, 1)[1].split(heldout.DOC_END, 1)[0]
    assert readme.strip().splitlines() == heldout.readme_lines(rows)  # the README's bands are today's
    assert len(heldout.readme_lines(rows)) == 2 + len(json.loads(heldout.BANDS.read_text())["bands"])
    example = importlib.import_module("projection_doc_example")
    table = doc.split(example.BEGIN, 1)[1].split(example.END, 1)[0].strip().splitlines()
    basis = "roofline with published fractions"  # the default basis on a built-in GPU (--basis auto)
    band = json.loads(heldout.BANDS.read_text())["bands"][basis]["families"]["convnet"]
    cell = example.band_cell(band | {"basis": basis})
    assert [r.split(" | ")[0] for r in table[2:]] == [f"| {m}" for m in example.METHODS]
    assert all(r.endswith(f"| {basis} | {cell} |") for r in table[2:])


def test_torchtitan_rows_run_the_built_in_llama_and_none_is_scored_on_a_default_it_set(heldout):
    """torchtitan's Llama 3.1 8B figures are projected through the built-in llama-8b on tokens (fsdp per block, as
    `estimate --model llama-8b --strategy fsdp` runs it); the 8-GPU figure re-derives the H100 bf16 transformer
    default, sets it, and is left out of the default's scores, while the other torchtitan rows are scored."""
    pp = heldout.pp
    by_id = {e["id"]: e for e in pp.load_published()}
    anchor = by_id["torchtitan-llama3-8b-h100-bf16-8gpu"]
    cfg = pp.config(anchor)
    assert (cfg.model, cfg.data, cfg.seq_len, cfg.vocab_size) == (
        "llama-8b",
        "synthetic-tokens",
        8192,
        128256,
    )
    derived = pp.anchored_calibration(anchor, pp.system_of(anchor))["bf16"].efficiency
    default = pp.builtin().evidence[("h100-sxm", "transformer", "bf16")]
    assert derived == pytest.approx(default.value, abs=0.001) and anchor["id"] in default.evidence
    rows = {r["id"]: r for r in json.loads(heldout.ROWS.read_text())}
    assert rows[anchor["id"]]["role"] == "sets" and rows[anchor["id"]]["sets"] == [
        "h100-sxm bf16 transformer"
    ]
    scored = [r for r in heldout.anchor_lines(list(rows.values())) if r.startswith("- held out")]
    held = [r for r in rows.values() if r["model"] == "llama3-8b" and r["role"] == "held out"]
    errors = [heldout.err(r, "default") for r in held]
    assert len(held) == 5 and scored == ["- " + heldout._summary("held out, default projection", errors)]
