#!/usr/bin/env bash
# Continued pretraining of a local Hugging Face checkpoint with CE + SMMD under ZeRO-3 (weights are
# partitioned while they load). Same variables as pretrain.sh (launch/deepspeed_train.sh), plus
# MODEL_DIR, LR, WARMUP_STEPS and EXPORT_DIR:
#   MODEL_DIR=/models/llama-3-8b DATA=/data/math.jsonl NUM_NODES=2 bash launch/continue_pretrain.sh
# TP=2 (or 4, 8) adds AutoTP tensor parallelism with a vocabulary-parallel LM head, or SP=2 (or 4,
# 8) Ulysses sequence parallelism for long sequences; DS_CONFIG=
# ds_configs/zero3_offload.json offloads parameters and optimizer states to the CPU. Relative paths
# are taken from the folder it is called from.
set -euo pipefail
LAUNCH_DIR="$(cd "$(dirname "$0")" && pwd)"

MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to a local Hugging Face model directory}"
DATA="${DATA:?set DATA to one or more training files}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/continue-$(basename "$MODEL_DIR")}"
MAX_STEPS="${MAX_STEPS:-2000}"
SAVE_STEPS="${SAVE_STEPS:-250}"

# shellcheck source=launch/deepspeed_train.sh
. "$LAUNCH_DIR/deepspeed_train.sh" --model "$MODEL_DIR" --lr "${LR:-2e-5}" --warmup_steps "${WARMUP_STEPS:-50}" \
  --export_hf "${EXPORT_DIR:-$OUTPUT_DIR/hf}" "$@"
