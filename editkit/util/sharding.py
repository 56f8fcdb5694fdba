"""How N processes split a global batch: contiguous slices, earlier ranks taking the remainder.

Both the training loop (labelled batches) and the tauJp regularizer (reg batches)
cut batches this way, so N processes see exactly the examples one process would.
"""


def shard_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s contiguous share of ``size`` items."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
