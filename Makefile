# Set-up and the two entry points: `make gates` (the phase gates, in order) and
# `make test` (every test: single-process with xdist, then every torchrun run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned: the CPU build lies on local disk here; unpinned, pip would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: setup gates test

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

gates: setup
	$(BIN)/python -m gates run

# Both commands always run; pytest exit 5 (nothing collected) is not a failure.
# --dist loadfile keeps each test file on one worker, so module-scoped fixtures are built once.
test: setup
	@status=0; \
	$(BIN)/python -m pytest -n auto --dist loadfile -m "not torchrun" phases tests || [ $$? -eq 5 ] || status=1; \
	$(BIN)/python -m gates run --mode torchrun --keep-going --skip-empty || status=1; \
	exit $$status
