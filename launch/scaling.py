"""A scaling sweep: train.py at several world sizes (and TP degrees), then throughput, per-rank
throughput, efficiency and peak memory against world size in TensorBoard and a table.

    python launch/scaling.py --world_sizes 8 16 32 --tp 1 2 --hostfile launch/hostfile \
        --output_dir sweeps/7b -- --deepspeed_config ds_configs/zero3.json --model 7b ...
    tensorboard --logdir sweeps/7b/tensorboard

Strong (fixed global batch) or weak (fixed batch per replica) scaling: ``smmd_train/scaling.py``.
"""

import sys

from smmd_train.scaling import main

if __name__ == "__main__":
    sys.exit(main())
