"""The README's first snippet runs as pasted, with "my-model" a local Hugging Face folder."""

import re

import torch
from helpers.launching import REPO
from helpers.models import tiny_llama
from helpers.style_tokenizers import llama3_style


def test_the_readmes_first_snippet_runs_as_pasted(tmp_path, monkeypatch):
    snippet = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL).group(1)
    assert snippet.count('"my-model"') == 2, "the snippet loads its model from a folder named my-model"
    tokenizer = llama3_style()
    tokenizer.save_pretrained(tmp_path / "my-model")
    tiny_llama(len(tokenizer)).save_pretrained(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)  # "my-model" is a local folder, as a user's would be
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    stats = namespace["installed"].last_stats
    # "17 + 25 = 42": three numbers, one token each (Llama-3 style); 25 and 42 are targets (17 starts the row).
    assert stats is not None and stats["numeric_tokens"] == 2
    assert all(parameter.grad is not None and torch.isfinite(parameter.grad).all()
               for parameter in namespace["model"].parameters() if parameter.requires_grad)
