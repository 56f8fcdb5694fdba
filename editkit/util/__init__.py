"""Small helpers every layer may use: atomic file writes, peak-memory windows, the progress protocol,
settings fields with a fixed set of values."""
