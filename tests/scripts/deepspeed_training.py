"""Run under the deepspeed launcher (or as one plain process for TP=1) by tests/train/test_deepspeed.py.

Per variant (each of ``--families``; tied or untied embeddings; the materialized loss or
``fused_linear``; with ``--offload``, ZeRO-3 with and without parameter and optimizer offload), in one
process: a tiny causal LM of that family (LlamaForCausalLM by default; the families of
``helpers.models.FAMILY_CONFIGS``, so the launching test puts tests/ on PYTHONPATH; each ``--shape``
sets heads, KV heads, vocabulary and embeddings, e.g. 9 heads over 3 KV heads and a 50,257 vocabulary,
which AutoTP splits unevenly; several shapes train one after the other in the same processes, which
start once) from a config under ZeRO-3 (fp32, torch AdamW), AutoTP with
a vocabulary-parallel LM head when ``--tp`` > 1, ``smmd_scale.install`` on the engine and a few
optimizer steps on fixed batches. Rank 0 writes, per shape (``<out>/<name>.json``) and variant, the
per-step losses and gradient norms, the installed loss's statistics, each rank's LM head shard and
first q_proj rows and, for a fused variant, the relative differences of its final weights to its
materialized twin's (per tensor and the largest). Variants of a family other than Llama are named
``<family>-<variant>``. The ordered shutdown at
the end must leave no process group alive (else the rank exits 1).
"""

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups
from helpers.models import FAMILY_CONFIGS, MOE_FAMILIES, tiny_causal_lm
from transformers.integrations import HfDeepSpeedConfig

import smmd_scale
from smmd_train import compat
from smmd_train.distributed.groups import destroy_at_shutdown, init_distributed, shutdown_distributed
from smmd_train.distributed.process_end import skip_final_collections
from smmd_train.distributed.process_start import keep_imports

parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--shape", nargs=5, action="append", metavar=("NAME", "HEADS", "KV_HEADS", "VOCAB", "EMBEDDINGS"),
                    help="a model shape to train, its results in <out>/<NAME>.json (repeat for several, one after "
                    "the other in the same processes): query heads of 16 (hidden 16 x heads), KV heads (AutoTP "
                    "splits them, unevenly too; TP may not exceed them), the vocabulary (AutoTP splits it unevenly "
                    "too), embeddings 'untied', 'tied' or 'untied,tied'; default: main 4 2 2048 untied,tied")
parser.add_argument("--offload", action="store_true", help="also train each variant with ZeRO-3 offload")
parser.add_argument("--families", nargs="+", default=["llama"], choices=sorted(FAMILY_CONFIGS))
parser.add_argument("--untied_only", nargs="*", default=[], choices=sorted(FAMILY_CONFIGS),
                    help="families to train with untied embeddings only")
parser.add_argument("--out", required=True, help="a directory")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
BATCH, LENGTH = 4, 24


class Shape(NamedTuple):
    name: str
    heads: int
    kv_heads: int
    vocab: int
    embeddings: tuple


SHAPES = [Shape(name, int(heads), int(kv_heads), int(vocab), tuple(embeddings.split(",")))
          for name, heads, kv_heads, vocab, embeddings in (args.shape or [("main", 4, 2, 2048, "untied,tied")])]


def build_engine(shape: Shape, family: str, tied: bool, offload: bool):
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "torch_adam": True, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6}
    if offload:
        config["zero_optimization"].update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp, "vocab_parallel_lm_head": True}
        if family in MOE_FAMILIES:
            # DeepSpeed rejects the MoE families' HF tp_plan (its experts' partition styles); shard the
            # attention and leave the router and the experts whole on every rank (the head stays vocab-parallel).
            config["tensor_parallel"]["partition_config"] = {"use_default_specs": False, "layer_specs": [
                {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"}]}
    zero_init = HfDeepSpeedConfig(dict(config))
    model = tiny_causal_lm(family, shape.vocab, tied=tied, hidden_size=16 * shape.heads, heads=shape.heads,
                           kv_heads=shape.kv_heads, intermediate_size=128, dtype=torch.float32)
    with compat.muon_left_unimported(config):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               mpu=groups if args.tp > 1 else None)
    del zero_init
    return destroy_at_shutdown(engine)


def main() -> None:
    init_distributed(timeout_minutes=5)
    if args.tp > 1:
        compat.init_tensor_parallel_groups(args.tp)
    for shape in SHAPES:
        result = train_shape(shape)
        if dist.get_rank() == 0:
            with open(Path(args.out) / f"{shape.name}.json", "w") as handle:
                json.dump(result, handle)


def train_shape(shape: Shape) -> dict:
    """Every variant of ``shape`` (each family, embedding, offload, materialized and fused); rank 0's
    record of them."""
    vocab_size = shape.vocab
    # Numeric tokens on both sides of the TP=2 split (1024 for 2048): ids 100..119 and vocab_size // 2 + 76 ..
    upper = vocab_size // 2 + 76
    vocab = smmd_scale.NumericVocab(list(range(100, 120)) + list(range(upper, upper + 10)),
                                    list(range(20)) + list(range(10)), vocab_size)
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab_size, (BATCH, LENGTH), generator=generator)
        numeric = torch.rand(BATCH, LENGTH, generator=generator) < 0.4
        ids[numeric] = vocab.token_ids[torch.randint(0, len(vocab), (int(numeric.sum()), ), generator=generator)]
        batches.append(ids)

    result = {"tp": args.tp, "tokens": BATCH * LENGTH, "vocab_size": vocab_size, "hidden_size": 16 * shape.heads,
              "variants": {}}
    materialized_weights = {}
    variants = [(family, offload, embedding == "tied") for family in args.families
                for offload in ((False, True) if args.offload else (False, )) for embedding in shape.embeddings
                if embedding == "untied" or family not in args.untied_only]
    for family, offload, tied in variants:
        for fused in (False, True):
            name = f"{'tied' if tied else 'untied'}{'-offload' if offload else ''}{'-fused' if fused else ''}"
            name = name if family == "llama" else f"{family}-{name}"
            engine = build_engine(shape, family, tied, offload)
            variant = {}
            if args.tp > 1 and not fused:
                # DeepSpeed installed its own CE-only vocab-parallel loss; ours with weight 0 must agree with it.
                with torch.no_grad():
                    deepspeed_ce = engine(input_ids=batches[0], labels=batches[0]).loss.item()
                variant["deepspeed_loss_function"] = type(engine.module.loss_function).__name__
                probe = smmd_scale.install(engine, smmd_scale.SMMDLoss(vocab), weight=0.0)
                with torch.no_grad():
                    ours_ce = engine(input_ids=batches[0], labels=batches[0]).loss.item()
                variant["ce_ours_vs_deepspeed"] = [ours_ce, deepspeed_ce]
                probe.restore()
            installed = smmd_scale.install(engine, smmd_scale.SMMDLoss(vocab), weight=1.0, fused_linear=fused)
            variant["fused_linear"] = installed.fused_linear
            variant["vocab_parallel"] = installed.vocab_parallel
            variant["head"] = None if installed.head is None else [installed.head.vocab_start_index,
                                                                    installed.head.vocab_end_index]
            losses, grad_norms, stats = [], [], []
            for ids in batches:
                output = engine(input_ids=ids, labels=ids)
                variant.setdefault("training_logits", output.logits is not None)
                engine.backward(output.loss)
                engine.step()
                losses.append(output.loss.item())
                grad_norms.append(float(engine.get_global_grad_norm()))
                stats.append(installed.last_stats)
            variant.update(losses=losses, grad_norms=grad_norms, stats=stats)
            q_proj = engine.module.model.layers[0].self_attn.q_proj.weight
            shard = {"head": variant["head"], "q_proj_rows": getattr(q_proj, "ds_shape", q_proj.shape)[0]}
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, shard)
            variant["heads"] = [rank["head"] for rank in shards]
            variant["q_proj_rows"] = [rank["q_proj_rows"] for rank in shards]
            weights = compat.consolidated_state_dict(engine)  # a collective: every rank calls it
            if dist.get_rank() == 0:
                twin = name.replace("-fused", "")
                if fused:
                    reference = materialized_weights[twin]
                    # per tensor: |w_fused - w_materialized| / |w_materialized| (Frobenius norms)
                    differences = {key: ((weights[key] - reference[key]).norm() / reference[key].norm()).item()
                                   for key in reference}
                    variant["weights_relative_differences"] = differences
                    variant["weights_relative_difference"] = max(differences.values())
                else:
                    materialized_weights[name] = {key: value.clone() for key, value in weights.items()}
            result["variants"][name] = variant
            installed.restore()
            del engine
    return result


if __name__ == "__main__":
    keep_imports()  # here, not in main(), as train.py does (smmd_train.distributed.process_start)
    try:
        main()
    finally:
        # Every group must be gone before interpreter shutdown; one still held fails the run.
        leftover = shutdown_distributed()
    assert leftover == 0, f"{leftover} process group(s) outlived the shutdown"
    skip_final_collections()  # as train.py ends (smmd_train.distributed.process_end)
