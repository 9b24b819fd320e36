# Every target creates .venv and installs the project first (idempotent: the stamp file
# is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where torch comes from: pip's own index by default (this project's machines serve the CPU
# build there); elsewhere TORCH_INDEX=https://download.pytorch.org/whl/cpu keeps PyPI's CUDA
# build (gigabytes of nvidia-* wheels) out.
TORCH_INDEX ?=

.PHONY: run test lint typecheck bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# torch first, pinned, so nothing pulls a CUDA build
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# a venv made before transformers was capped may hold Hugging Face's `kernels`, which
	# shadows fairgate's kernels/ package; nothing fairgate installs needs it
	$(BIN)/pip uninstall -q -y kernels 2>/dev/null || true
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fairgate serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check fairgate protocol engine gateway tuner control tenants kernels tests bench
	$(BIN)/mypy

test: $(STAMP) lint
	-deploy/ci/install-tools.sh promtool chromium  # promtool and a browser; tests skip without
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
