"""Helpers the test rooms share: real gloo ranks (``distributed``), launcher runs (``launching``),
float64 references (``reference``), tiny models (``models``), tokenizers and corpora."""
