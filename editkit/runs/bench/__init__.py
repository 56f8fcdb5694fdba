"""``editkit bench``: the paper's tables for any scenario (run, rich tables, PNG plots)."""
