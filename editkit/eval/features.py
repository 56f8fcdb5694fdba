"""A model's outputs over one split, batch by batch, kept as fp32 tensors on the CPU.

What the bench's coefficient sweeps and a stream's incremental evaluation both keep:
one output vector per input (features, or a vector's tangents), never the inputs
themselves. In-memory tasks are sliced directly; other datasets (image files, parquet)
are read through a DataLoader with the runtime's workers each time a model has to see them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from editkit.core.batching import Batching, labelled_collate
from editkit.data.tasks import TensorTaskDataset
from editkit.train.runtime import Runtime

#: Inputs per forward or jvp when a stream or the bench scores a split. Both use it, so the tangents a stream
#: computed are, batch for batch, the ones the bench would compute (which is what lets the bench take them over).
EVAL_BATCH_SIZE = 256


def held_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs, targets) when the dataset holds both as tensors (in-memory tasks), else None."""
    inputs, targets = getattr(dataset, "inputs", None), getattr(dataset, "targets", None)
    if isinstance(inputs, torch.Tensor) and targets is not None:
        return inputs, torch.as_tensor(targets)
    return None


def prefix(dataset: Dataset, n: int) -> Dataset:
    """The first ``n`` items of a dataset (sliced tensors for in-memory tasks, else a Subset)."""
    held = held_tensors(dataset)
    if held is not None:
        return TensorTaskDataset(held[0][:n], held[1][:n])
    return Subset(dataset, range(min(n, len(dataset))))


def split_batches(dataset: Dataset, batch_size: int, batching: Batching,
                  runtime: Runtime) -> Iterator[tuple[Any, torch.Tensor]]:
    """(inputs, labels) batches of a split, in order, collated by the backbone's batching."""
    held = held_tensors(dataset)
    if held is not None:
        inputs, targets = held
        for i in range(0, len(inputs), batch_size):
            yield inputs[i : i + batch_size], targets[i : i + batch_size]
        return
    yield from DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=runtime.workers,
                          pin_memory=runtime.device.type == "cuda", collate_fn=labelled_collate(batching))


@torch.no_grad()
def outputs_over(fn: Callable[..., Any], dataset: Dataset, *, batch_size: int, batching: Batching,
                 runtime: Runtime, bar=None, labels: list[torch.Tensor] | None = None) -> Any:
    """``fn`` (a module, a model's ``tangent`` or ``primal_and_tangent``) over a split's inputs on the runtime's
    device (autocast as configured), concatenated as fp32 on the CPU: a tensor, or a tuple of them when ``fn``
    returns a tuple. ``labels``, when given, receives the labels batch by batch; ``bar`` advances per batch."""
    pieces: list[tuple[torch.Tensor, ...]] = []
    single = True
    for x, y in split_batches(dataset, batch_size, batching, runtime):
        with runtime.autocast():
            out = batching.run(fn, x.to(runtime.device, non_blocking=True))
        single = isinstance(out, torch.Tensor)
        pieces.append(tuple(o.float().cpu() for o in ((out,) if single else out)))
        if labels is not None:
            labels.append(y)
        if bar is not None:
            bar.advance(1)
    joined = tuple(torch.cat(column) for column in zip(*pieces))
    return joined[0] if single else joined
