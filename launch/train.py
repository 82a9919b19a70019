r"""Pretraining and continued pretraining with CE + a numeric loss: the script path that launchers start.

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2 \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

The program (it reads top to bottom) is ``smmd_train/train.py``, also installed as ``smmd-train``.
"""

import sys

from smmd_train.loss_modules import import_loss_modules

import_loss_modules(sys.argv[1:])  # a user's own losses register before the trainer reads the registry

from smmd_train.train import cli  # noqa: E402

if __name__ == "__main__":
    cli()
