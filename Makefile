# Two commands do all the set-up on a fresh Linux machine with Python 3.11:
#   make repro   the main job (dvc repro at the scale this machine fits)
#   make test    the tests but the end-to-end ones; make test-e2e runs those (.ci/run runs both)
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# Stage commands call `python`: the venv's, whether or not it is activated.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: repro test test-avx2 test-e2e bench device-bundle clean-venv

$(BIN)/.installed: requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.lock
	touch $@

repro: $(BIN)/.installed
	$(BIN)/dvc repro
	@echo
	@echo "The report: $(CURDIR)/reports/report.html (one file, opens offline: xdg-open or open it, or any browser)"
	@echo "            reports/report.md, figures in reports/figures/; the curves: .venv/bin/dvc plots show"

test: $(BIN)/.installed
	$(BIN)/ruff check gradaccum stages tests benchmarks
	$(BIN)/python -m pytest -q -m "not slow" tests

# The numerical tests again on the kernels of a CPU with AVX2 and nothing newer: float results must hold on any
# CPU, not only on this one's kernels. tests/test_kernels.py proves that PyTorch and oneDNN both took the setting.
NUMERICAL := tests/test_kernels.py tests/test_models.py tests/test_accumulation.py tests/test_train.py \
             tests/test_autocast_policy.py
test-avx2: $(BIN)/.installed
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -q -m "not slow" $(NUMERICAL)

# The tests marked slow: the pipeline end to end on a fresh copy (dvc repro, dvc exp run, scripts/gpu_check.sh).
test-e2e: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m slow tests

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.repro

# The folder a lent GPU machine's call carries (docs/device.md): wheels it lacks, Fashion-MNIST, the prediction.
device-bundle: $(BIN)/.installed
	$(BIN)/python -m gradaccum.device bundle

clean-venv:
	rm -rf $(VENV)
