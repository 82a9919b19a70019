#!/usr/bin/env bash
# Pretraining from scratch with CE + SMMD under ZeRO-3 via the deepspeed launcher.
#   NUM_NODES=4 GPUS_PER_NODE=8 HOSTFILE=launch/hostfile MODEL=7b TOKENIZER=/data/tok TP=2 \
#   DATA=/data/corpus.jsonl OUTPUT_DIR=/ckpt/7b bash launch/pretrain.sh [extra train.py flags]
# Every variable below can be overridden from the environment; extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="${MODEL:-1b}"
TOKENIZER="${TOKENIZER:?set TOKENIZER to a tokenizer directory}"
DATA="${DATA:?set DATA to one or more training files}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/pretrain-$MODEL}"
DS_CONFIG="${DS_CONFIG:-ds_configs/zero3.json}"
TP="${TP:-1}"  # AutoTP degree (vocabulary-parallel LM head); must divide GPUS_PER_NODE
SEQ_LEN="${SEQ_LEN:-4096}"
MICRO_BATCH="${MICRO_BATCH:-1}"
GRAD_ACCUM="${GRAD_ACCUM:-8}"
MAX_STEPS="${MAX_STEPS:-10000}"
SMMD_WEIGHT="${SMMD_WEIGHT:-1.0}"

# shellcheck source=launch/deepspeed_launcher.sh
. launch/deepspeed_launcher.sh

# shellcheck disable=SC2086  # DATA may list several files
exec "${launcher[@]}" launch/train.py \
  --deepspeed_config "$DS_CONFIG" --tp "$TP" --model "$MODEL" --tokenizer "$TOKENIZER" --data $DATA \
  --seq_len "$SEQ_LEN" --micro_batch_size "$MICRO_BATCH" --gradient_accumulation_steps "$GRAD_ACCUM" \
  --max_steps "$MAX_STEPS" --output_dir "$OUTPUT_DIR" --save_steps "${SAVE_STEPS:-500}" --resume \
  --smmd_weight "$SMMD_WEIGHT" "$@"
