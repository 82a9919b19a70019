"""A scaling sweep (``launch/scaling.sh`` runs this): train.py at several world sizes and TP
degrees, then throughput, per-rank throughput, efficiency and peak memory against world size in
TensorBoard and a table.

    python launch/scaling.py --world_sizes 1,2,4 --tp 1,2 --max_steps 20 --output_dir sweeps/tiny \
        --deepspeed_config ds_configs/zero3.json --model tiny --tokenizer tok --data train.jsonl

Strong (fixed global batch) or weak (``--weak``: fixed batch per replica) scaling: ``smmd_train/tools/scaling.py``.
"""

import sys

from smmd_train.loss_modules import import_loss_modules

import_loss_modules(sys.argv[1:])  # a user's own losses register before the sweep reads train.py's flags

from smmd_train.tools.scaling import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
