"""Small numeric corpora written to disk, as a user would have them."""

import json
import random


def write_corpus(path, documents: int, seed: int = 0, number_share: float = 0.0, number: int = 123):
    """Arithmetic lines; ``number`` replaces the fixed filler number in ``number_share`` of them
    (the token count of the corpus is the same whatever ``number`` is: both are single tokens)."""
    generator = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(documents):
            a, b = generator.randint(0, 499), generator.randint(0, 499)
            filler = number if generator.random() < number_share else 123
            handle.write(json.dumps({"text": f"Q: {a} + {b} = ? A: {a + b}. Then {filler} more."}) + "\n")
    return path
