#!/usr/bin/env bash
# Train the default drafts' recipe for SmolLM2-135M-Instruct from scratch on today's data
# (configs/smollm2-135m-{eagle3,draftlm}.yaml; the committed drafts are chains of warm starts as the data grew, each
# run's command in drafts/*/README.md):
#   1. held-out MT-Bench text answered greedily by the target (for the teacher-forced tau estimate; 40 questions,
#      of which the trainer's periodic estimate uses heldout_samples)
#   2. the target's features, computed once (offline mode; shared by all drafts; incremental, so a rerun or an
#      interrupted build only computes what is missing). The trainer would build both itself, but PARALLEL=1
#      would then build them three times at once.
#   3. the EAGLE-3 head, the Saguaro-aware EAGLE-3 head (issue 7) and the draft LM, trained with DeepSpeed
#      (CPU: gloo; GPUs: unchanged)
#   4. exports into OUT_DIR (bf16; the draft LM compact: its trained tensors only) and a tau estimate of each
# Needs data/smollm2-135m/regenerated.jsonl.gz (scripts/regenerate_data.py). Extra arguments go to the feature
# build and every training run (e.g. --max_steps 200 --autocast auto). NUM_GPUS (default 1) ranks per run;
# PARALLEL=1 trains the three drafts at once. OUT_DIR (default runs/default-drafts in the repository; a relative
# OUT_DIR is taken from the current directory) receives the exported drafts:
# the committed drafts/ folders are never written. Promote one after comparing its tau with the committed one's
# (drafts/<name>/README.md), e.g.
#   rm -r drafts/smollm2-135m-eagle3 && cp -r runs/default-drafts/smollm2-135m-eagle3 drafts/ && git add drafts/
set -euo pipefail
OUT_DIR=${OUT_DIR:+$(realpath -m "$OUT_DIR")}  # a relative OUT_DIR is the caller's, resolved before the cd
cd "$(dirname "$0")/.."

NUM_GPUS=${NUM_GPUS:-1}
OUT_DIR=${OUT_DIR:-runs/default-drafts}
case "$(realpath -m "$OUT_DIR")/" in
  "$(realpath -m drafts)"/*) echo "OUT_DIR=$OUT_DIR is inside drafts/: export elsewhere, then promote" >&2; exit 1 ;;
esac
EAGLE=configs/smollm2-135m-eagle3.yaml
DRAFTLM=configs/smollm2-135m-draftlm.yaml
SAGUARO=configs/smollm2-135m-eagle3-saguaro.yaml
DATA=data/smollm2-135m/regenerated.jsonl.gz
HELDOUT=runs/heldout/mtbench-smollm2-135m.jsonl

[ -f "$DATA" ] || { echo "missing $DATA: run scripts/regenerate_data.py first" >&2; exit 1; }
[ -f "$HELDOUT" ] || python -m train.heldout generate "$HELDOUT" --split mtbench --every 2 --max-tokens 384 \
    --batch-size 20
deepspeed --num_gpus "$NUM_GPUS" train/precompute_features.py --config "$EAGLE" "$@"

if [ "${PARALLEL:-0}" = 1 ]; then  # all runs at once, one thread each (a small CPU)
  deepspeed --num_gpus "$NUM_GPUS" --master_port 29701 train/train_draft.py --config "$EAGLE" --num_threads 1 "$@" &
  deepspeed --num_gpus "$NUM_GPUS" --master_port 29702 train/train_draft.py --config "$DRAFTLM" --num_threads 1 "$@" &
  deepspeed --num_gpus "$NUM_GPUS" --master_port 29703 train/train_draft.py --config "$SAGUARO" --num_threads 1 "$@" &
  wait %1 && wait %2 && wait %3
else
  for cfg in "$EAGLE" "$DRAFTLM" "$SAGUARO"; do
    deepspeed --num_gpus "$NUM_GPUS" train/train_draft.py --config "$cfg" "$@"
  done
fi

python -m train.export runs/smollm2-135m-eagle3 "$OUT_DIR/smollm2-135m-eagle3" --dtype bfloat16
python -m train.export runs/smollm2-135m-draftlm "$OUT_DIR/smollm2-135m-draftlm" --dtype bfloat16 --compact
python -m train.export runs/smollm2-135m-eagle3-saguaro "$OUT_DIR/smollm2-135m-eagle3-saguaro" --dtype bfloat16

for name in smollm2-135m-eagle3 smollm2-135m-draftlm smollm2-135m-eagle3-saguaro; do
  python -m train.heldout estimate --draft "$OUT_DIR/$name" --heldout "$HELDOUT" --k 7
done
echo "exported to $OUT_DIR/; to promote one (after comparing its tau with drafts/<name>/README.md's):"
echo "  rm -r drafts/<name> && cp -r $OUT_DIR/<name> drafts/ && git add drafts/<name>"
