#!/usr/bin/env bash
# The prepared device check for the cuda backend, one short call on a GPU machine:
#   1. the cuda backend-parity tests (tests/backends/test_cuda_backend.py) on the GPU;
#   2. the smollm2-lora benchmark (T=256, batch 8, bfloat16) against Hugging Face + PEFT,
#      eager and torch.compile, on the same GPU, as `gradtape bench --json` lines.
# Budget: under 8 minutes on one H200 (tests ~1-2 min, benchmark ~3-4 min incl. loading
# both models, NVRTC compiles and torch.compile).
#
# Needs on the machine: python3 with numpy, torch (CUDA), transformers, peft, cupy.  Nothing
# is downloaded: this repository is installed with `pip install --no-deps -e .` (or just
# put on PYTHONPATH), and what the machine may lack travels with the working tree in
# models/ (untracked, not ignored), put there beforehand with bench/prepare_gpu_check.sh:
#   models/SmolLM2-135M-Instruct.Q4_1.gguf  the model (or set $GRADTAPE_SMOLLM2_GGUF)
#   models/pylib/                           pure-python packages the machine may lack
#                                           (gguf for transformers' GGUF loader, pytest)
# Environment: GPU_CHECK_REPS (timed steps per side, default 10), GPU_CHECK_SKIP_TESTS=1,
# GPU_CHECK_SKIP_BENCH=1, PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
[ -d models/pylib ] && export PYTHONPATH="$PWD/models/pylib:$PYTHONPATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export GRADTAPE_CACHE="${GRADTAPE_CACHE:-/tmp/gradtape-cache}"
t0=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - t0 ))s] $*" >&2; }

say "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
$PY - <<'PY' >&2 || { echo "gpu_check: python environment incomplete (see above)" >&2; exit 2; }
import importlib, sys
for m in ("numpy", "torch", "transformers", "peft", "cupy"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"  MISSING {m}: {e}"); sys.exit(1)
import torch, cupy
print(f"  torch.cuda: {torch.cuda.is_available()} {torch.version.cuda}; "
      f"cupy devices: {cupy.cuda.runtime.getDeviceCount()}, CUDA runtime "
      f"{cupy.cuda.runtime.runtimeGetVersion()}")
PY
$PY -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 \
    && say "installed gradtape (editable, no deps)" || say "pip install -e . failed; using PYTHONPATH=src"

GGUF="${GRADTAPE_SMOLLM2_GGUF:-}"
if [ -z "$GGUF" ]; then
    for c in models/*.gguf shared/*.gguf; do [ -f "$c" ] && { GGUF="$PWD/$c"; break; }; done
fi
if [ -z "$GGUF" ]; then
    GGUF=$($PY -c 'from gradtape.llama import default_model_path as p; print(p())' 2>/dev/null || true)
fi
[ -n "$GGUF" ] && export GRADTAPE_SMOLLM2_GGUF="$GGUF"

status=0
if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]; then
    if $PY -c 'import pytest' 2>/dev/null; then
        say "backend-parity tests on the GPU (tests/backends/test_cuda_backend.py) ..."
        timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/backends/test_cuda_backend.py 2>&1 | tail -25
        rc=${PIPESTATUS[0]}
        say "tests exit status $rc"
        [ "$rc" = 0 ] || status=1
    else
        say "pytest not installed (put it in models/pylib with bench/prepare_gpu_check.sh); tests skipped"
        status=1
    fi
fi

if [ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]; then
    if [ -z "$GGUF" ] || [ ! -f "$GGUF" ]; then
        say "no SmolLM2 GGUF (models/*.gguf or \$GRADTAPE_SMOLLM2_GGUF); benchmark skipped"
        status=1
    else
        say "smollm2-lora on the GPU: T=256, batch 8, bfloat16, vs HF+PEFT eager and torch.compile ..."
        timeout 330 $PY bench/lora_bench.py --json --with-compile --device cuda --batch 8 \
            --storage bfloat16 --workloads smollm2-lora --reps "${GPU_CHECK_REPS:-10}" \
            --warmup 3 --gguf "$GGUF"
        rc=$?
        say "benchmark exit status $rc"
        [ "$rc" = 0 ] || status=1
    fi
fi
say "done (status $status)"
exit $status
