# Sourced by pretrain.sh and continue_pretrain.sh once they have set their defaults: runs
# launch/train.py under the deepspeed launcher with the flags both share, then the caller's own
# flags (the arguments given to `.`), then the user's. The command comes from smmd_train.distributed.launcher,
# the builder the Python tools use too. Variables, each overridable from the environment:
#   NUM_NODES (1); HOSTFILE (default: hostfile beside this script, read when NUM_NODES > 1); GPUS_PER_NODE (default:
#   DeepSpeed counts each node's devices); MASTER_ADDR, MASTER_PORT (default: 127.0.0.1 and a free
#   port on one node, the first host and 29500 with a hostfile); PYTHON; DEEPSPEED (the launcher
#   program, default: PYTHON's environment's); DS_CONFIG (default ds_configs/zero3.json), SEQ_LEN
#   (default 4096: no DeepSpeed config holds a sequence length, and train.py's own 1024 is sized for
#   small runs), MAX_STEPS, SAVE_STEPS, DATA, OUTPUT_DIR.
# Passed only when set, so that the DeepSpeed config, else train.py's default, decides otherwise:
#   MICRO_BATCH (--micro_batch_size: the config's train_micro_batch_size_per_gpu, else 1), GRAD_ACCUM
#   (--gradient_accumulation_steps: the config's, else the recipe's 8), LR (--lr: the config's optimizer
#   lr, else train.py's 3e-4, continue_pretrain.sh's 2e-5), WARMUP_STEPS (--warmup_steps: 100, at most 10% of MAX_STEPS), TP (--tp: the config's
#   tensor_parallel.autotp_size, else 1), SP (--sp, Ulysses sequence parallelism: 1; not with TP > 1),
#   NUMERIC_LOSS (--numeric_loss: smmd). A variable that contradicts the config is refused by name:
#   SMMD_FLAG_SOURCES tells train.py which flag each set variable gave (the ranks inherit it on one
#   node; with NUM_NODES > 1 DeepSpeed's multi-node runner passes only some variables on, so there
#   the refusal names the flag alone).
# The caller sets LAUNCH_DIR (this folder); relative paths stay relative to the caller's folder (the
# deepspeed launcher starts every rank there, on every node), the defaults below are absolute.
# With --dry_run among the arguments, train.py runs here, in one process, for the NUM_NODES x GPUS_PER_NODE
# ranks the job would start (--world_size, --gpus_per_node): no launcher, no hostfile read.
NUM_NODES="${NUM_NODES:-1}"
HOSTFILE="${HOSTFILE:-$LAUNCH_DIR/hostfile}"

dry_run=()
for argument in "$@"; do
  if [ "$argument" = "--dry_run" ]; then
    : "${GPUS_PER_NODE:?a dry run checks the NUM_NODES x GPUS_PER_NODE ranks of the job: set GPUS_PER_NODE}"
    dry_run=(--world_size "$((NUM_NODES * GPUS_PER_NODE))" --gpus_per_node "$GPUS_PER_NODE")
  fi
done

if [ ${#dry_run[@]} -gt 0 ]; then
  launcher=("${PYTHON:-python}")
else
  launcher=("${PYTHON:-python}" -m smmd_train.distributed.launcher --nodes "$NUM_NODES")
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
fi

config="${DS_CONFIG:-$(dirname "$LAUNCH_DIR")/ds_configs/zero3.json}"
# shellcheck disable=SC2086  # DATA may list several files
flags=(--deepspeed_config "$config" --data $DATA
       --seq_len "${SEQ_LEN:-4096}" --max_steps "$MAX_STEPS" --output_dir "$OUTPUT_DIR" --save_steps "$SAVE_STEPS"
       --resume)
sources=()
for pair in micro_batch_size=MICRO_BATCH gradient_accumulation_steps=GRAD_ACCUM lr=LR warmup_steps=WARMUP_STEPS \
            tp=TP sp=SP numeric_loss=NUMERIC_LOSS; do
  variable="${pair#*=}"
  [ -n "${!variable:-}" ] || continue
  # shellcheck disable=SC2206  # NUMERIC_LOSS may list several terms
  flags+=("--${pair%=*}" ${!variable})
  sources+=("$pair")
done
export SMMD_FLAG_SOURCES="${sources[*]}"

# The recipe's own values, where neither their variable nor the DeepSpeed config decides (the config
# says "auto" or has no such key): RECIPE_DEFAULTS, "flag=variable=config.key=value ..." (the caller's;
# both scripts: 8 accumulation steps, continue_pretrain.sh also lr 2e-5).
if [ -n "${RECIPE_DEFAULTS:-}" ]; then
  # shellcheck disable=SC2086  # one argument per default
  auto=$("${PYTHON:-python}" - "$config" $RECIPE_DEFAULTS 2>/dev/null <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
for default in sys.argv[2:]:
    value = config
    for part in default.split("=")[2].split("."):
        value = value.get(part, "auto") if isinstance(value, dict) else "auto"
    if value == "auto":
        print(default)
PY
  ) || auto=""  # an unreadable config: train.py names the problem
  for default in $auto; do
    IFS="=" read -r flag variable _ value <<< "$default"
    [ -n "${!variable:-}" ] || flags+=("--$flag" "$value")
  done
fi

exec "${launcher[@]}" "$LAUNCH_DIR/train.py" "${flags[@]}" ${dry_run[@]+"${dry_run[@]}"} "$@"
