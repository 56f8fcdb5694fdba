"""Avalanche: benchmarks built from editkit tasks, and any Avalanche benchmark read as editkit experiences."""
