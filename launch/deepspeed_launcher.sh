# Sourced by pretrain.sh and continue_pretrain.sh: builds the deepspeed launcher command line in
# the array `launcher` from NUM_NODES, GPUS_PER_NODE, HOSTFILE (multi-node only), MASTER_ADDR and
# MASTER_PORT, each overridable from the environment.
NUM_NODES="${NUM_NODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HOSTFILE="${HOSTFILE:-launch/hostfile}"
MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"
MASTER_PORT="${MASTER_PORT:-29500}"

launcher=(deepspeed --num_nodes "$NUM_NODES" --num_gpus "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR"
          --master_port "$MASTER_PORT")
if [ "$NUM_NODES" -gt 1 ]; then
  if [ ! -f "$HOSTFILE" ]; then
    echo "NUM_NODES=$NUM_NODES needs a hostfile: HOSTFILE=$HOSTFILE does not exist (see launch/hostfile.example)" >&2
    exit 2
  fi
  launcher+=(--hostfile "$HOSTFILE")
fi
