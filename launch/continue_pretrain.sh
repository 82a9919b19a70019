#!/usr/bin/env bash
# Continued pretraining of a local Hugging Face checkpoint with CE + SMMD under ZeRO-3 (weights are
# partitioned while they load). Same variables as pretrain.sh (launch/deepspeed_train.sh), plus
# MODEL_DIR and EXPORT_DIR:
#   MODEL_DIR=/models/llama-3-8b DATA=/data/math.jsonl LR=2e-5 NUM_NODES=2 bash launch/continue_pretrain.sh
# The rate: LR when set, else the DeepSpeed config's optimizer lr, else (a config that leaves it "auto",
# as the ready-made ones do) 2e-5, a continued-pretraining rate (train.py's own default, 3e-4, is for
# training from scratch). Without WARMUP_STEPS the warmup is train.py's (100 steps, at most 10% of
# MAX_STEPS).
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

RECIPE_DEFAULTS="gradient_accumulation_steps=GRAD_ACCUM=gradient_accumulation_steps=8 lr=LR=optimizer.params.lr=2e-5"

# shellcheck source=launch/deepspeed_train.sh
. "$LAUNCH_DIR/deepspeed_train.sh" --model "$MODEL_DIR" --export_hf "${EXPORT_DIR:-$OUTPUT_DIR/hf}" "$@"
