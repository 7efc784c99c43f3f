# Set-up and the two entry points: `make gates` (the phase gates, in order) and
# `make test` (lint, every test: single-process with xdist, then every torchrun run). The
# mutation audit of the phases cheap enough for CI runs inside the tests, on a copy of the tree
# formatted by ruff with a module moved (tests/test_refactor_survives.py).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned: the CPU build lies on local disk here; unpinned, pip would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
# Phases `make audit` plants and checks by default (python -m gates audit); docs/gates.md says why these.
AUDIT_PHASES ?= 05,06
AUDIT_JOBS ?= 2

# Every run compiles the tree's modules and rewrites its test modules' asserts: cached bytecode saves
# seconds in each of the ~80 processes a gate run starts, so it is on whatever the environment says.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup gates test lint audit exercise-all

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

gates: setup
	$(BIN)/python -m gates run

lint: setup
	$(BIN)/ruff check .

audit: setup
	$(BIN)/python -m gates audit --phase $(AUDIT_PHASES) --jobs $(AUDIT_JOBS)

# Hand every phase out in turn (python -m gates exercise) and check that the gates fail exactly it, block what
# stands on it and pass the rest, in every run mode; then that phases 01-08 pass with the engine (09-11) handed out.
# CI runs the same tests for phases 01, 05, 06 and 08, single-process; this takes hours on 2 CPU cores.
exercise-all: setup
	EXERCISE_ALL=1 $(BIN)/python -m pytest -p no:cacheprovider -v tests/test_exercise_repository.py \
		tests/test_exercise_resume.py

# Every step always runs; pytest exit 5 (nothing collected) is not a failure.
# The tests marked alone (a time bound under load) run after the rest, with nothing beside them.
# --dist loadfile keeps each test file on one worker, so module-scoped fixtures are built once; one OpenMP
# thread per worker (a worker per core: more threads only wait for each other, 6x slower per small op).
# The torchrun report goes to build/, so `gates status` still shows the last `make gates` / `gates run`.
test: setup
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/lint-imports --no-cache || status=1; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --dist loadfile --durations=25 -m "not torchrun and not alone" \
		phases tests || [ $$? -eq 5 ] || status=1; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "alone and not torchrun" phases tests || [ $$? -eq 5 ] || status=1; \
	$(BIN)/python -m gates run --mode torchrun --keep-going --skip-empty \
		--report build/make-test-torchrun-report.json || status=1; \
	exit $$status
