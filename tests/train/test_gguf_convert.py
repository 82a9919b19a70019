"""The GGUF converter (``smmd-convert-gguf``): a tiny Llama written as a GGUF file by the test itself
(the ``gguf`` package's writer, float32 tensors, a byte-level BPE tokenizer in the metadata, the
query/key rows permuted as llama.cpp's converter stores them), converted through the command's
entry point, then checked against the model it came from and against transformers reading the GGUF
directly; and ``train.py --model <converted folder>`` training from it."""

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, TokenType
from helpers.host_probe import hang_guard
from helpers.launching import environment, metrics, run, train_command
from helpers.models import tiny_llama
from helpers.style_tokenizers import gpt2_style
from transformers import AutoModelForCausalLM, AutoTokenizer

from smmd_train.tools.gguf_convert import bundled_gguf, main

HEADS, KV_HEADS = 4, 2
TEXTS = ["What is 17 + 25? Answer: 42", "In 2024 the team sold 12 cars for $3,000 each."]


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query/key projection ``[heads * head_dim, hidden]`` with each head's rows reordered from
    Hugging Face's rotary layout (first halves, then second halves) to llama.cpp's (pairs
    interleaved), as llama.cpp's converter stores Llama weights; transformers undoes it on load."""
    rows, hidden = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, hidden).swapaxes(1, 2).reshape(rows, hidden)


def write_tiny_gguf(path, model, tokenizer) -> None:
    config = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if token in special else TokenType.NORMAL for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in backend["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)

    weights = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
        for gguf_name, hf_name in names.items():
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weights[f"{prefix}{hf_name}.weight"])
        writer.add_tensor(f"blk.{layer}.attn_q.weight",
                          llama_cpp_rows(weights[f"{prefix}self_attn.q_proj.weight"], config.num_attention_heads))
        writer.add_tensor(f"blk.{layer}.attn_k.weight",
                          llama_cpp_rows(weights[f"{prefix}self_attn.k_proj.weight"], config.num_key_value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the original model, its tokenizer, the GGUF file, the folder smmd-convert-gguf wrote)."""
    directory = tmp_path_factory.mktemp("gguf")
    tokenizer = gpt2_style()
    model = tiny_llama(len(tokenizer), heads=HEADS, kv_heads=KV_HEADS, max_positions=128, seed=7,
                       tie_word_embeddings=True).eval()
    gguf_path = directory / "tiny.gguf"
    write_tiny_gguf(gguf_path, model, tokenizer)
    main([str(gguf_path), str(directory / "hf")])
    return model, tokenizer, gguf_path, directory / "hf"


def test_the_converted_folder_is_the_gguf_s_model_and_tokenizer(converted):
    model, tokenizer, gguf_path, folder = converted
    from_folder = AutoModelForCausalLM.from_pretrained(folder).eval()
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    folder_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert from_folder.config.tie_word_embeddings and from_folder.config.num_key_value_heads == KV_HEADS
    assert from_folder.dtype == torch.float32
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert folder_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        inputs = torch.tensor([ids])
        with torch.no_grad():
            logits = from_folder(inputs).logits
            # Saving float32 tensors and reading them back changes no bit.
            assert torch.equal(logits, direct(inputs).logits)
            # The GGUF holds the original's float32 tensors (rows only reordered and put back), so the
            # logits agree to float32 rounding of the same computation.
            torch.testing.assert_close(logits, model(inputs).logits, rtol=1e-5, atol=1e-5)
    assert folder_tokenizer.eos_token == tokenizer.eos_token


def test_an_existing_folder_and_a_missing_source_are_refused(converted, tmp_path, capsys):
    _, _, gguf_path, folder = converted
    for argv, message in (([str(gguf_path), str(folder)], f"{folder} exists and is not empty"),
                          ([str(tmp_path / "none.gguf"), str(tmp_path / "out")], "none.gguf: no such file"),
                          (["no-such-package-xyz", str(tmp_path / "out")],
                           "'no-such-package-xyz' is neither a .gguf file nor an installed package")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        error = capsys.readouterr().err
        assert exited.value.code == 2 and message in error and error.count("\n") == 1, error
    with pytest.raises(ValueError, match=r"the installed package 'gguf' ships 0 .gguf files"):
        bundled_gguf("gguf")


def test_without_a_usable_gguf_package_the_command_says_what_to_install(converted, tmp_path):
    """transformers reads GGUF through the gguf package (>= 0.10): an older one, as a machine may have,
    is one line naming the extra to install, not a traceback."""
    import subprocess
    import sys

    _, _, gguf_path, _ = converted
    old = tmp_path / "shadow" / "gguf-0.1.0.dist-info"  # found before the installed one on sys.path
    old.mkdir(parents=True)
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: gguf\nVersion: 0.1.0\n")
    env = environment(PYTHONPATH=os.pathsep.join(filter(None, [str(old.parent), os.environ.get("PYTHONPATH")])))
    completed = subprocess.run([sys.executable, "-m", "smmd_train.tools.gguf_convert", str(gguf_path),
                                str(tmp_path / "out")],
                               env=env, capture_output=True, text=True, timeout=hang_guard(300))
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert completed.stderr.count("\n") == 1 and "pip install 'smmd-scale[finetune]'" in completed.stderr


@pytest.mark.slow
def test_train_py_fine_tunes_the_converted_folder(converted, tmp_path):
    """train.py --model <converted folder> on prompt/completion data: 2 steps, 1 rank, CE + SMMD. Every
    completion is " 42" and every prompt holds numbers too: each step's numeric positions are its two
    completions' alone."""
    from smmd_scale import NumericVocab

    _, _, _, folder = converted
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {42 - a}? Answer:", "completion": " 42"}) + "\n"
                            for a in (17, 20, 40, 1, 30, 21)))
    output_dir = tmp_path / "run"
    run(train_command(launcher="python", deepspeed_config="ds_configs/zero3.json", model=folder, data=[data],
                      seq_len=32, micro_batch_size=2, max_steps=2, output_dir=output_dir, save_steps=2),
        timeout=600, env=environment())
    steps = {step: values for step, values in metrics(output_dir).items() if "loss/total" in values}
    assert sorted(steps) == [1, 2] and all(np.isfinite(values["loss/total"]) for values in steps.values())

    tokenizer = AutoTokenizer.from_pretrained(folder)
    numeric = set(NumericVocab.from_tokenizer(tokenizer, policy="integers", max_value=999,
                                              vocab_size=len(tokenizer)).token_ids.tolist())
    in_completion = sum(token in numeric for token in tokenizer(" 42", add_special_tokens=False)["input_ids"])
    in_prompt = sum(token in numeric for token in tokenizer("What is 17 + 25? Answer:")["input_ids"])
    assert in_completion > 0 and in_prompt > 0
    assert all(values["numeric/positions"] == 2 * in_completion for values in steps.values())
