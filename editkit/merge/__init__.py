"""Combining task vectors: task arithmetic, TIES-merging and the coefficient rules."""
