"""published.yaml's header says which of its figures set a default (hardware.yaml's default_efficiency names them,
with the float8_base figure of each float8 one), and how many are held out: its counts are the files' own."""

from __future__ import annotations

import re

import yaml

from stratbench.measuring.hardware import BUILTIN, PUBLISHED


def test_the_header_counts_the_figures_that_set_a_default_and_those_held_out() -> None:
    text = PUBLISHED.read_text()
    header = " ".join(ln.lstrip("# ").strip() for ln in text.split("\nversion:")[0].splitlines())
    entries = yaml.safe_load(text)["entries"]
    evidence = yaml.safe_load(BUILTIN.read_text())["default_efficiency"]
    defaults = {pid for e in evidence["entries"] for pid in e.get("published") or ()}
    # a float8 figure's float8_base prices its unconverted part: it sets the fp8 default too
    defaults |= {e["float8_base"] for e in entries if e["id"] in defaults and e.get("float8_base")}
    held = set(evidence["held_out"])
    assert defaults and held and not defaults & held
    assert f"{len(defaults)} of them set a default" in header, header
    assert f"The other {len(entries) - len(defaults)} set none: {len(held)} are held out" in header, header
    assert not re.search(r"none of them sets? a default", header, re.I)
    multi = [e for e in entries if e["id"] not in defaults | held and e["gpus"] > 1]
    assert f"{len(multi)} are multi-GPU figures" in header
    single_left = [e["id"] for e in entries if e["id"] not in defaults | held and e["gpus"] == 1]
    assert all(pid in header for pid in single_left), single_left
