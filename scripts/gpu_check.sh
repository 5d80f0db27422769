#!/usr/bin/env bash
# GPU check, one command, bounded: the GPU tests (CUDA-graph replays of verification, of the EAGLE-3 head's and of
# the draft LM's steps equal eager; the engine lossless with graphs; SSD as two processes on one GPU), then
# SSD-EAGLE-3 end to end with the verifier and the speculator as two processes (one GPU: both on it, gloo; two
# GPUs: one each, NCCL): eager vs graph tokens/s for AR, SD-EAGLE-3 and SSD-EAGLE-3, and greedy output equal to AR
# on a few prompts. Random models of SmolLM2-135M's shape built in memory (no model files, no network).
#
#   bash scripts/gpu_check.sh                 # a CUDA machine: about 5 minutes, never more than GPU_CHECK_BUDGET
#   DEVICE=cpu bash scripts/gpu_check.sh      # the same steps on CPU at tiny sizes (the script's plumbing)
#   WHEELS=dir bash scripts/gpu_check.sh      # first install missing Python packages from a folder of wheels
#                                             (an image without pydantic: pydantic, pydantic-core, annotated-types,
#                                             typing-inspection, typing-extensions)
#
# Every step runs under its own `timeout` (capped by what is left of GPU_CHECK_BUDGET seconds, default 540), so the
# script always ends with its summary: PASS / FAIL / TIMEOUT / SKIP per step and the tokens/s table. Exit status:
# 0 when every step passed, 1 otherwise. Output is unbuffered; redirect it with `2>&1 | tee log` to keep it.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET:-540}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/tests:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG_DIR=$(mktemp -d)
declare -a SUMMARY=()
FAILED=0

step() {  # step NAME LIMIT_SECONDS COMMAND...: run under timeout, capped by the budget left; record the outcome
    local name=$1 limit=$2 left=$((BUDGET - SECONDS)) start=$SECONDS rc
    shift 2
    if ((left < 20)); then
        SUMMARY+=("SKIP    $name (budget spent)"); FAILED=1; return 1
    fi
    ((limit > left - 5)) && limit=$((left - 5))
    echo; echo "=== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if ((rc == 0)); then SUMMARY+=("PASS    $name (${took}s)")
    elif ((rc == 124 || rc == 137)); then SUMMARY+=("TIMEOUT $name (${took}s, limit ${limit}s)"); FAILED=1
    else SUMMARY+=("FAIL    $name (exit $rc, ${took}s)"); FAILED=1
    fi
    return "$rc"
}

if [[ -n "${WHEELS:-}" ]]; then
    step install-wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$LOG_DIR/site" \
        "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$LOG_DIR/site"
fi

PREFLIGHT='
import importlib.util, sys, torch
device = sys.argv[1]
missing = [m for m in ("transformers", "pydantic", "safetensors", "pytest", "scipy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {missing} (WHEELS=dir installs them from a folder of wheels)")
import ssd_eagle.engine.factory, ssd_eagle.ssd.worker, helpers, gpu_throughput  # the imports of every later step
if device == "cuda":
    assert torch.cuda.is_available(), "no CUDA device (DEVICE=cpu runs the plumbing on CPU)"
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(), "x",
          torch.cuda.device_count())
else:
    print("torch", torch.__version__, "on CPU: the GPU tests skip, the end-to-end rows run tiny and without graphs")
'
if step preflight 120 "$PY" -c "$PREFLIGHT" "$DEVICE"; then
    step gpu-tests 240 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider
    if [[ $DEVICE == cuda ]]; then
        step e2e 300 "$PY" tests/gpu/e2e.py --device cuda:0 --tokens 128
    else
        step e2e 900 "$PY" tests/gpu/e2e.py --device cpu --tokens 8 --layers 2 --greedy-tokens 4 --greedy-layers 2
    fi
fi

echo; echo "=== summary (DEVICE=$DEVICE, ${SECONDS}s of ${BUDGET}s)"
printf '  %s\n' "${SUMMARY[@]}"
if [[ -f "$LOG_DIR/e2e.log" ]]; then
    echo; sed -n '/^configuration/,/^$/p' "$LOG_DIR/e2e.log"
    grep -E '^(PASS|FAIL) greedy' "$LOG_DIR/e2e.log" | sed 's/^/  /'
fi
if [[ -f "$LOG_DIR/gpu-tests.log" ]]; then
    grep -E '(passed|failed|error|skipped)' "$LOG_DIR/gpu-tests.log" | tail -n 1 | sed 's/^/  gpu tests: /'
fi
rm -rf "$LOG_DIR"
exit "$FAILED"
