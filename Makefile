# The two set-up commands of the README. Both create .venv if missing and install the project first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The suite in 3 worker processes (pytest-xdist), a test file at a time each; TEST_JOBS=0 runs it in this process.
# 3 on 2 cores: many tests wait (processes starting, ranks on each other, Ray and SLURM daemons) and a third
# worker uses what 2 leave idle (docs/testing.md).
TEST_JOBS ?= 3

.PHONY: install demo test lint clean

install:
	@VENV=$(VENV) bash scripts/install.sh

demo: install
	$(VENV)/bin/stratbench demo --output runs/demo

test: install
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf runs build dist src/*.egg-info
