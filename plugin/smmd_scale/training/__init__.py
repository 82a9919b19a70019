"""Training utilities behind launch/train.py: model presets and memory estimates, data loading and
packing, configuration, checkpoints and export. Each module is testable on its own."""
