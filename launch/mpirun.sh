#!/usr/bin/env bash
# train.py under mpirun: every rank learns its rank, the world size and the master address
# through mpi4py (rank 0's host name unless MASTER_ADDR is set), no deepspeed launcher needed.
#   NP=16 HOSTS=node-001:8,node-002:8 bash launch/mpirun.sh --deepspeed_config ds_configs/zero3.json ...
# The MPI runtime comes with the project: `pip install -e ".[mpi]"` installs mpich, whose mpirun
# needs no root flags. Open MPI as root also needs OMPI_ALLOW_RUN_AS_ROOT=1 and
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, and --oversubscribe past the core count.
# Relative paths are taken from the folder it is called from.
set -euo pipefail

NP="${NP:-2}"
PYTHON="${PYTHON:-python}"
args=(-np "$NP")
if [ -n "${HOSTS:-}" ]; then
  args+=(-hosts "$HOSTS")
else
  args+=(-launcher fork -hosts 127.0.0.1)  # one machine, no ssh
fi
exec mpirun "${args[@]}" "$PYTHON" "$(cd "$(dirname "$0")" && pwd)/train.py" "$@"
