# Two commands do all the set-up on a fresh Linux machine with Python 3.11:
#   make repro   the main job (dvc repro at the scale this machine fits)
#   make test    the tests
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: repro test test-fast lint bench gpu-check clean-venv

$(BIN)/.installed: requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.lock
	touch $@

repro: $(BIN)/.installed
	$(BIN)/dvc repro

test: $(BIN)/.installed
	$(BIN)/ruff check stages tests benchmarks
	$(BIN)/python -m pytest -q tests

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run

gpu-check: $(BIN)/.installed
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

clean-venv:
	rm -rf $(VENV)
