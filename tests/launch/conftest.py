import pytest
from helpers.train_runs import write_launch_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Llama-3-style tokenizer and small numeric corpora on disk, as a user would have them."""
    return write_launch_corpus(tmp_path_factory.mktemp("corpus"))
