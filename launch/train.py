r"""Pretraining and continued pretraining with CE + a numeric loss: the script path that launchers start.

    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json --tp 2 \
        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl --output_dir /ckpt/run1

The program (it reads top to bottom) is ``smmd_train/train.py``, also installed as ``smmd-train``.
"""

from smmd_train.train import cli

if __name__ == "__main__":
    cli()
