"""Peers measured side by side with smmd_scale in the benchmarks (never runtime dependencies)."""
