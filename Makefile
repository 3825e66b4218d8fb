# The two set-up commands of the README. Both create .venv if missing and install the project first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The suite in 2 worker processes (pytest-xdist), a test file at a time each; TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2

.PHONY: install demo test test-clusters lint clean

install:
	@VENV=$(VENV) bash scripts/install.sh

demo: install
	$(VENV)/bin/stratbench demo --output runs/demo

# Every test but the ones that start a real Ray or SLURM cluster on this machine (marker "clusters"), which
# test-clusters runs one after the other (side by side their daemons and cells slow each other several-fold).
# .ci/run runs both. A -m in PYTEST_ARGS replaces the selection (CI's second pass: -m equivalence).
test: install
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder -m "not clusters" $(PYTEST_ARGS)

test-clusters: install
	$(PY) -m pytest -m clusters $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf runs build dist src/*.egg-info
