#!/usr/bin/env bash
# Reproduces models/kvp-tiny: the exact sequence of tools/model/train.py runs that made the committed weights
# (one torch thread, seed 0; each phase resumes the previous one's checkpoint, weights + optimizer + data RNG).
# About 80 minutes of one core of this machine in all; the model card (models/kvp-tiny/README.md) explains
# why the run has phases.
#
#   tools/model/train_kvp_tiny.sh [python]      (default /work/venv/bin/python; needs torch + safetensors)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-/work/venv/bin/python}
T=(tools/model/train.py --layers 4 --ckpt _engine_train --out models/kvp-tiny)
rm -rf _engine_train

# A. curriculum 128 -> 1024 tokens, all tasks + fixed-length induction strings, copy without the '@' marker;
#    stopped at step 3700 of its 5000-step schedule. Learns passkey and copy (by position), not multi-key recall.
"$PY" "${T[@]}" --steps 5000 --copy-marker 0 --stop-at 3700
# B. induction strings of random length only (256 tokens): content-based induction forms (~600 steps).
"$PY" "${T[@]}" --resume --steps 3700 --finetune-steps 3000 --ft-mix induction --ft-length 256 --ft-batch 16 \
  --dense-keys 1 --copy-marker 0 --stop-at 4500
# C. all tasks at 512 tokens with dense multi-key samples (2..12 keys): multi-key recall is learned.
"$PY" "${T[@]}" --resume --steps 4500 --finetune-steps 2500 --ft-length 512 --ft-batch 8 --dense-keys 1 \
  --min-keys 2 --task-weights multikey=2 --copy-marker 0 --stop-at 5550
# D. the same at 1024 tokens, passkey and copy weighted up.
"$PY" "${T[@]}" --resume --steps 5550 --finetune-steps 2000 --ft-length 1024 --ft-batch 4 --dense-keys 1 \
  --min-keys 2 --task-weights passkey=3,copy=3,multikey=2 --copy-marker 0 --stop-at 6250
# E. the final task formats (copy with the '@' marker) at 1024 tokens, to the end of its schedule (step 8250).
"$PY" "${T[@]}" --resume --steps 6250 --finetune-steps 2000 --ft-length 1024 --ft-batch 4 --dense-keys 1 \
  --min-keys 2 --task-weights passkey=3,copy=3,multikey=2
# F. half the rows copies, lr 5e-4, to step 9750; writes tools/model/eval_results.json.
"$PY" "${T[@]}" --resume --steps 8250 --finetune-steps 1500 --ft-lr 5e-4 --ft-length 1024 --ft-batch 4 \
  --ft-mix copy,multikey,passkey,copy --dense-keys 1 --min-keys 2 --task-weights copy=2
