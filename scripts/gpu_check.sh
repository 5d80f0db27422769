#!/usr/bin/env bash
# GPU check (one GPU, under 5 minutes): the GPU tests, then a short throughput comparison on random models of
# SmolLM2-135M's shape built in memory (no model files), with whatever torch the machine has.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python -m pytest tests/gpu -q
python scripts/gpu_throughput.py --tokens 128
