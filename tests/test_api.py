"""The Python API (stratbench.api) refuses a bad value in one line (a StratbenchError naming it), as the commands
do, before any work: world sizes, node counts, time limits, repeats, cell names, the executor and the hardware
profile (before, several raised ZeroDivisionError, TypeError or AttributeError from deep inside)."""

from __future__ import annotations

import pytest

from stratbench import api
from stratbench.core.errors import StratbenchError


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: api.estimate(model="tinynet", world_size=0), "world_size must be at least 1 and at most 4096, got 0"),
        (lambda: api.estimate(model="tinynet", world_size=-1), "world_size must be at least 1"),
        (lambda: api.estimate(model="tinynet", world_size=10**6), "at most 4096"),
        (lambda: api.estimate(model="tinynet", world_size="two"), "world_size: cannot read 'two' as int"),
        (lambda: api.estimate(model="tinynet", world_size=True), "world_size must be a number, not True"),
        (lambda: api.plan_sweep("quick", world_size="x"), "world_size: cannot read 'x' as int"),
        (lambda: api.plan_sweep("quick", world_size=1.5), "world_size: cannot read 1.5 as int"),
        (lambda: api.plan_sweep("quick", nodes=0), "nodes must be at least 1, got 0"),
        (lambda: api.plan_sweep("quick", timeout="soon"), "timeout: cannot read 'soon' as float"),
        (lambda: api.plan_sweep("quick", timeout=0), "timeout must be above 0, got 0"),
        (lambda: api.plan_sweep("quick", only=[1]), "only must be a string of comma-separated names or a list"),
        (lambda: api.plan_sweep("quick", executor=object()), "executor must be an Executor or one of: local"),
        (lambda: api.plan_sweep("quick", executor="nowhere"), "--executor 'nowhere' is not one of: local"),
        (lambda: api.plan_sweep("quick", hardware=5), "hardware must be a system name or a profile file, not int"),
        (lambda: api.compare("quick", repeats="x"), "repeats: cannot read 'x' as int"),
        (lambda: api.compare("quick", repeats=0), "repeats must be at least 1, got 0"),
        (lambda: api.run_sweep(None), "run_sweep() takes the SweepPlan plan_sweep() returns, not NoneType"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line(call, says):
    with pytest.raises(StratbenchError) as info:
        call()
    assert says in str(info.value) and "\n" not in str(info.value)


def test_good_values_still_work():
    assert api.estimate(model="tinynet", world_size="2", strategy="ddp", image_size=32, batch_size=8).world_size == 2
    plan = api.plan_sweep("quick", only="ddp", world_size=2, timeout="60")  # a string as --only takes it
    assert {p.cell.method for p in plan.plans} == {"ddp"} and plan.timeout_s == 60
