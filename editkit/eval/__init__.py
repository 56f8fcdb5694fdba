"""Scoring edited models: accuracy, the exact coefficient sweeps of linearized vectors, diagnostics."""
