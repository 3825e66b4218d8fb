"""The published-results table (src/stratbench/measuring/published.yaml) is well-formed, shipped with the package,
and the held-out benchmark (benchmarks/projection_published.py) predicts one of its entries."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

import conftest


def test_published_yaml_is_package_data_and_safe_yaml() -> None:
    text = resources.files("stratbench.measuring").joinpath("published.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["version"] == 1 and len(data["entries"]) >= 20
    pyproject = (conftest.REPO / "pyproject.toml").read_text()
    assert "measuring/published.yaml" in pyproject


def test_every_entry_has_fields_a_source_and_a_known_unit(projection_published) -> None:
    entries = projection_published.load_published()
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids)), "ids must be unique"
    problems = {e["id"]: projection_published.check_entry(e, entries) for e in entries}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}
    for e in entries:
        assert e["unit"] in projection_published.UNITS
        assert e["throughput"] > 0 and e["gpus"] >= e["nodes"] >= 1
        assert e["source"]["row"].startswith("|"), f"{e['id']}: quote the table row as printed"
        ref = e.get("baseline")
        if ref:  # a 1-GPU basis from the same source and setup
            base = next(x for x in entries if x["id"] == ref)
            assert base["gpus"] == 1 and base["source"]["path"] == e["source"]["path"]
            assert (base["model"], base["gpu"], base["precision"]) == (e["model"], e["gpu"], e["precision"])


def test_the_multi_gpu_evidence_covers_what_issue_33_asks(projection_published) -> None:
    multi = [e for e in projection_published.load_published() if e["gpus"] > 1 and (e.get("baseline") or e.get("anchor"))]
    assert len(multi) >= 6
    assert {e["family"] for e in multi} == {"convnet", "transformer"}
    assert {"ddp", "fsdp"} <= {e["method"] for e in multi}
    assert any(e["nodes"] > 1 for e in multi) and any(e["gpus"] >= 64 for e in multi)
    assert len({e["gpu"] for e in multi}) >= 3


def test_check_entry_names_what_is_missing(projection_published) -> None:
    entries = projection_published.load_published()
    bad = dict(entries[0], unit="furlongs/s", source={"repo": "x"})
    del bad["gpus"]
    problems = projection_published.check_entry(bad, entries)
    assert "no gpus" in problems and any("unknown unit" in p for p in problems)
    assert any("source has no row" in p for p in problems)


def test_predict_one_entry_from_its_own_one_gpu_figure(projection_published) -> None:
    entries = projection_published.load_published()
    by_id = {e["id"]: e for e in entries}
    entry = by_id["dle-rn50-v100-16-fp32-8gpu"]
    row = projection_published.predict(entry, by_id)
    assert row.reason == "" and row.predicted is not None
    # calibrated on the 1-GPU figure (367 img/s), 8 GPUs cannot beat 8 x 367 nor fall far below the published 2,855
    assert 0.8 * entry["throughput"] < row.predicted <= 8 * 367 * 1.0001
    assert row.error == pytest.approx(row.predicted / entry["throughput"] - 1)


def test_an_entry_stratbench_cannot_express_is_na_with_its_reason(projection_published) -> None:
    by_id = {e["id"]: e for e in projection_published.load_published()}
    row = projection_published.predict(by_id["zeropp-gpt49b-v100-z3-1k-ib4"], by_id)
    assert row.predicted is None and "shape" in row.reason


def test_a_float8_figure_is_priced_as_float8_and_anchored_on_the_fp8_efficiency(projection_published) -> None:
    """torchtitan's float8 figures are projected as --float8 tensorwise with bf16-mixed; anchoring one solves for the
    fp8 efficiency with the rest at the efficiency of its float8_base (the same table's compile-only figure)."""
    by_id = {e["id"]: e for e in projection_published.load_published()}
    e = by_id["torchtitan-llama3-8b-h100-fp8-8gpu"]
    cfg = projection_published.config(e)
    assert (cfg.float8, cfg.precision) == ("tensorwise", "bf16-mixed")
    system = projection_published.system_of(e)
    cal = projection_published.anchored_calibration(e, system)
    base = projection_published.anchored_calibration(by_id[e["float8_base"]], system)
    assert set(cal) == {"bf16", "fp8"} and cal["bf16"].efficiency == base["bf16"].efficiency
    p = projection_published._project(e, cfg, system, cal)
    assert projection_published.in_unit(e, p.throughput) == pytest.approx(e["throughput"], rel=1e-6)
    assert p.float8["efficiency"] == cal["fp8"].efficiency and "anchored on" in p.float8["source"]


def test_the_multi_node_entries_load_and_name_known_systems_and_models(projection_published) -> None:
    """Issue 45: every ``check: multi-node`` entry names a model the benchmark knows and a hardware profile that
    resolves; the projectable ones convert their unit and have an anchor of the same model and micro-batch on no
    more GPUs."""
    entries = projection_published.load_published()
    by_id = {e["id"]: e for e in entries}
    multi = [e for e in entries if e.get("check") == projection_published.MULTI_NODE]
    assert len(multi) >= 50 and {"deepspeed", "fsdp"} <= {e["method"] for e in multi}
    assert any(e.get("strategy_options", {}).get("zero_hpz") for e in multi)
    assert any(e.get("strategy_options", {}).get("replicate") for e in multi)
    anchors = {e.get("anchor") for e in multi}
    for e in multi:
        assert e["model"] in projection_published.MODELS
        assert e["nodes"] > 1 or e["id"] in anchors, f"{e['id']}: one node, and no multi-node row's anchor"
        system = projection_published.system_of(e)
        assert system.gpus_per_node * e["nodes"] == e["gpus"], e["id"]
        if e.get("not_projectable"):
            continue
        anchor = by_id[e.get("anchor") or e["id"]]
        assert (anchor["model"], anchor["batch_per_gpu"]) == (e["model"], e["batch_per_gpu"]), e["id"]
        assert anchor["gpus"] <= e["gpus"], f"{e['id']}: predicted from a smaller or equal figure only"
        # TFLOPs per GPU <-> samples/s round trip through Megatron's FLOP count
        assert projection_published.in_unit(e, projection_published.samples_per_s(e)) == pytest.approx(e["throughput"])


def test_a_zero3_figure_is_predicted_across_bandwidths_and_an_unknown_option_is_na(projection_published) -> None:
    """The ZeRO++ blog's ZeRO-3 bar at 1 x 100 Gb/s per node, from its 4 x 100 Gb/s anchor (calibrated on the
    anchor's own system): within 10%; a row with an option the deepspeed strategy lacks is n/a naming it."""
    by_id = {e["id"]: e for e in projection_published.load_published()}
    row = projection_published.predict(by_id["zeropp-gpt18b-v100-z3-2k-ib1"], by_id)
    assert row.reason == "" and abs(row.error) < 0.10, row
    entry = dict(by_id["zeropp-gpt18b-v100-z3-2k-ib1"], strategy_options={"zero_stage": 3, "no_such_option": 1})
    row = projection_published.predict(entry, by_id)
    assert row.predicted is None and "no_such_option" in row.reason
