# rlfleet developer commands. `make test` sets up .venv from scratch (torch's CPU wheel first, then
# every package of the repo in editable mode) and runs the whole test suite; `make demo` trains the tiny
# model through the whole fleet (see README).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SERVICE_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard services/*/pyproject.toml))
STAMP := $(VENV)/.installed

.PHONY: install test test-load test-faults demo lint protos clean

$(STAMP): pyproject.toml constraints.txt $(wildcard services/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@# torch first and pinned: anything looser pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[dev,model]' $(foreach d,$(SERVICE_DIRS),-e $(d))
	touch $@

install: $(STAMP)

# Two pytest-xdist workers, each taking whole test files (conftest.py); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -m 'not faults' -n $(TEST_WORKERS)

# Every fault-injection case (tests/faults, about 3 minutes on 2 cores); `make test` runs only the fast ones.
test-faults: $(STAMP)
	$(PY) -m pytest tests/faults

# The load tests in their full form (25 s of load per service); `make test` runs them for a few seconds.
test-load: $(STAMP)
	RLFLEET_LOAD_SECONDS=25 $(PY) -m pytest tests/load -s

demo: $(STAMP)
	$(VENV)/bin/rlfleet demo

# mypy reads each test directory on its own: each has a conftest.py of its own.
TYPED := rlfleet bench scripts tests/*.py $(filter-out %.egg-info,$(wildcard services/*/rlfleet_*))
TEST_DIRS := $(filter-out %__pycache__/,$(wildcard tests/*/ services/*/tests/))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(TYPED)
	for dir in $(TEST_DIRS); do $(VENV)/bin/mypy $$dir || exit 1; done

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache
