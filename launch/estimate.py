"""Per-GPU memory for training a Llama, Mistral, Qwen2/3 or Gemma(-2, -3) model under ZeRO-3 (+ AutoTP), before
booking a cluster.

    python launch/estimate.py --model 7b --nodes 4 --gpus_per_node 8 [--tp 2] [--offload]
        [--seq_len 4096] [--micro_batch 1] [--gradient_checkpointing] [--vocab_size 128256]
        [--no-flash_attention] [--gpu_memory_gib 80] [--json]
    python launch/estimate.py --model /models/llama-3-8b --nodes 1 --gpus_per_node 8   # an HF folder or config.json
    python launch/estimate.py --all --nodes 1 --gpus_per_node 8 [...]   # markdown table, 1b..70b

What is counted, and what is not: ``smmd_train/tools/memory.py``.
"""

from smmd_train.tools.memory import main

if __name__ == "__main__":
    main()
