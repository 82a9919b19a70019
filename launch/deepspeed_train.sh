# Sourced by pretrain.sh and continue_pretrain.sh once they have set their defaults: runs
# launch/train.py under the deepspeed launcher with the flags both share, then the caller's own
# flags (the arguments given to `.`), then the user's. The command comes from smmd_train.launcher,
# the builder the Python tools use too. Variables, each overridable from the environment:
#   NUM_NODES (1); HOSTFILE (default: hostfile beside this script, read when NUM_NODES > 1); GPUS_PER_NODE (default:
#   DeepSpeed counts each node's devices); MASTER_ADDR, MASTER_PORT (default: 127.0.0.1 and a free
#   port on one node, the first host and 29500 with a hostfile); PYTHON; DEEPSPEED (the launcher
#   program, default: PYTHON's environment's); DS_CONFIG, TP, SP (Ulysses sequence parallelism, default
#   1; not with TP > 1), SEQ_LEN, MICRO_BATCH, GRAD_ACCUM,
#   MAX_STEPS, SAVE_STEPS, NUMERIC_LOSS (default smmd:1), DATA, OUTPUT_DIR.
# The caller sets LAUNCH_DIR (this folder); relative paths stay relative to the caller's folder (the
# deepspeed launcher starts every rank there, on every node), the defaults below are absolute.
NUM_NODES="${NUM_NODES:-1}"
HOSTFILE="${HOSTFILE:-$LAUNCH_DIR/hostfile}"

launcher=("${PYTHON:-python}" -m smmd_train.launcher --nodes "$NUM_NODES")
if [ "$NUM_NODES" -gt 1 ]; then
  if [ ! -f "$HOSTFILE" ]; then
    echo "NUM_NODES=$NUM_NODES needs a hostfile: HOSTFILE=$HOSTFILE does not exist (copy $LAUNCH_DIR/hostfile.example)" >&2
    exit 2
  fi
  launcher+=(--hostfile "$HOSTFILE")
fi
[ -z "${GPUS_PER_NODE:-}" ] || launcher+=(--gpus_per_node "$GPUS_PER_NODE")
[ -z "${MASTER_ADDR:-}" ] || launcher+=(--master_addr "$MASTER_ADDR")
[ -z "${MASTER_PORT:-}" ] || launcher+=(--master_port "$MASTER_PORT")
[ -z "${DEEPSPEED:-}" ] || launcher+=(--deepspeed "$DEEPSPEED")

# shellcheck disable=SC2086  # DATA may list several files
exec "${launcher[@]}" "$LAUNCH_DIR/train.py" \
  --deepspeed_config "${DS_CONFIG:-$(dirname "$LAUNCH_DIR")/ds_configs/zero3.json}" --tp "${TP:-1}" --sp "${SP:-1}" --data $DATA \
  --seq_len "${SEQ_LEN:-4096}" --micro_batch_size "${MICRO_BATCH:-1}" \
  --gradient_accumulation_steps "${GRAD_ACCUM:-8}" --max_steps "$MAX_STEPS" --output_dir "$OUTPUT_DIR" \
  --save_steps "$SAVE_STEPS" --resume --numeric_loss ${NUMERIC_LOSS:-smmd:1} "$@"
