#!/usr/bin/env bash
# Continued pretraining of a local Hugging Face checkpoint with CE + SMMD under ZeRO-3
# (weights are partitioned while they load). Same variables as pretrain.sh, plus MODEL_DIR:
#   MODEL_DIR=/models/llama-3-8b DATA=/data/math.jsonl NUM_NODES=2 bash launch/continue_pretrain.sh
# TP=2 (or 4, 8) adds AutoTP tensor parallelism with a vocabulary-parallel LM head; DS_CONFIG=
# ds_configs/zero3_offload.json offloads parameters and optimizer states to the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to a local Hugging Face model directory}"
DATA="${DATA:?set DATA to one or more training files}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/continue-$(basename "$MODEL_DIR")}"
DS_CONFIG="${DS_CONFIG:-ds_configs/zero3.json}"

# shellcheck source=launch/deepspeed_launcher.sh
. launch/deepspeed_launcher.sh

# shellcheck disable=SC2086
exec "${launcher[@]}" launch/train.py \
  --deepspeed_config "$DS_CONFIG" --tp "${TP:-1}" --model "$MODEL_DIR" --data $DATA \
  --seq_len "${SEQ_LEN:-4096}" --micro_batch_size "${MICRO_BATCH:-1}" \
  --gradient_accumulation_steps "${GRAD_ACCUM:-8}" --max_steps "${MAX_STEPS:-2000}" --lr "${LR:-2e-5}" \
  --warmup_steps "${WARMUP_STEPS:-50}" --output_dir "$OUTPUT_DIR" --save_steps "${SAVE_STEPS:-250}" --resume \
  --smmd_weight "${SMMD_WEIGHT:-1.0}" --export_hf "${EXPORT_DIR:-$OUTPUT_DIR/hf}" "$@"
