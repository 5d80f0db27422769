#!/usr/bin/env bash
# GPU check, one command (one GPU: under 5 minutes): the GPU tests (CUDA-graph replays of verification, the EAGLE-3
# head's and the draft LM's steps equal eager; the engine lossless with graphs), then SSD-EAGLE-3 end to end with the
# verifier and the speculator as two processes (one GPU: both on it, gloo; two GPUs: one each, NCCL): eager vs graph
# tokens/s for AR, SD-EAGLE-3 and SSD-EAGLE-3, and greedy output equal to AR on a few prompts. Random models of
# SmolLM2-135M's shape built in memory (no model files).
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"
timeout 150 python -m pytest tests/gpu -q -rs
PYTHONPATH=.:tests:scripts timeout 150 python tests/gpu/e2e.py --tokens 128
