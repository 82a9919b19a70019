#!/usr/bin/env bash
# Pretraining from scratch with CE + SMMD under ZeRO-3 via the deepspeed launcher.
#   NUM_NODES=4 GPUS_PER_NODE=8 HOSTFILE=launch/hostfile MODEL=7b TOKENIZER=/data/tok TP=2 \
#   DATA=/data/corpus.jsonl OUTPUT_DIR=/ckpt/7b bash launch/pretrain.sh [extra train.py flags]
# Every variable can be overridden from the environment (the shared ones: launch/deepspeed_train.sh,
# which passes the batch, learning-rate and parallelism flags only when their variable is set);
# TP, the AutoTP degree (vocabulary-parallel LM head), must divide the ranks per node; SP=2 (or 4,
# 8) splits each sequence over that many ranks instead (Ulysses, for long SEQ_LEN). Extra arguments
# go to train.py. Relative paths (TOKENIZER, DATA, OUTPUT_DIR, HOSTFILE, DS_CONFIG, ...) are taken
# from the folder it is called from, as for any command.
set -euo pipefail
LAUNCH_DIR="$(cd "$(dirname "$0")" && pwd)"

MODEL="${MODEL:-1b}"
TOKENIZER="${TOKENIZER:?set TOKENIZER to a tokenizer directory}"
DATA="${DATA:?set DATA to one or more training files}"
OUTPUT_DIR="${OUTPUT_DIR:-outputs/pretrain-$MODEL}"
MAX_STEPS="${MAX_STEPS:-10000}"
SAVE_STEPS="${SAVE_STEPS:-500}"

RECIPE_DEFAULTS="gradient_accumulation_steps=GRAD_ACCUM=gradient_accumulation_steps=8"

# shellcheck source=launch/deepspeed_train.sh
. "$LAUNCH_DIR/deepspeed_train.sh" --model "$MODEL" --tokenizer "$TOKENIZER" "$@"
