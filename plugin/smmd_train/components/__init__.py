"""The components room: the parts of a train step that are not the model. ``loss_reporter`` (what the
run's loss is and how it is reported), ``evaluation`` (held-out CE, perplexity and numeric metrics),
``schedule`` (warmup then cosine), ``guard`` (non-finite steps skipped on every rank together).
"""
