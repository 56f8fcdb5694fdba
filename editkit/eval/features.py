"""A model's outputs over one split, batch by batch, kept as fp32 tensors on the CPU.

What the bench's coefficient sweeps and a stream's incremental evaluation both keep:
one output vector per input (features, or a vector's tangents), never the inputs
themselves. In-memory tasks are sliced directly; other datasets (image files, parquet)
are read through a DataLoader with the runtime's workers each time a model has to see them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from editkit.core.batching import Batching, labelled_collate
from editkit.core.linearize import LinearizedModel, build_task_model
from editkit.core.prototypes import Prototypes, capped_rows, class_prototypes
from editkit.data.tasks import TensorTaskDataset
from editkit.settings import PROTOTYPE_EXAMPLES_PER_CLASS
from editkit.train.runtime import Runtime
from editkit.util.progress import Progress

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
    """The first ``n`` items of a dataset."""
    return subset(dataset, range(min(n, len(dataset))))


def subset(dataset: Dataset, rows: Sequence[int]) -> Dataset:
    """The items ``rows`` of a dataset, in that order (indexed tensors for in-memory tasks, else a Subset)."""
    held = held_tensors(dataset)
    if held is not None:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return TensorTaskDataset(held[0][index], held[1][index])
    return Subset(dataset, list(rows))


def class_labels(dataset: Dataset) -> torch.Tensor:
    """Every item's class label: the dataset's ``targets`` where it keeps them, else read item by item."""
    targets = getattr(dataset, "targets", None)
    if targets is None:
        targets = [dataset[i][1] for i in range(len(dataset))]
    return torch.as_tensor(targets).long()


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


def task_prototypes(module: torch.nn.Module, mode: str, tau: Mapping[str, torch.Tensor], dataset: Dataset,
                    classes: int, *, task: str, seed: int, batch_size: int, batching: Batching, runtime: Runtime,
                    progress: Progress) -> Prototypes:
    """A task's class statistics (:mod:`editkit.core.prototypes`) on its training split ``dataset``, at most
    :data:`~editkit.settings.PROTOTYPE_EXAMPLES_PER_CLASS` inputs per class (a choice drawn with ``seed``): their
    features under the stream's merged model theta_0 + ``tau`` in ``mode``'s model (``merged``) and under theta_0
    (``pretrained``), both from one pass over the inputs."""
    rows = capped_rows(class_labels(dataset), PROTOTYPE_EXAMPLES_PER_CLASS, seed)
    model = runtime.place(build_task_model(module, mode, names=list(tau)))
    model.load_task_vector(tau)
    model.eval()
    labels: list[torch.Tensor] = []
    with progress.task(f"prototypes of {task}", total=-(-len(rows) // batch_size)) as bar:
        pretrained, merged = outputs_over(pretrained_and_tuned(model), subset(dataset, rows.tolist()),
                                          batch_size=batch_size, batching=batching, runtime=runtime, bar=bar,
                                          labels=labels)
    return class_prototypes(merged, pretrained, torch.cat(labels), classes, task=task)


def pretrained_and_tuned(model: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The features of theta_0 and of the task model ``model`` holds (theta_0 + tau) of one batch: a linearized
    model's from its one jvp, f(x; theta_0) and f(x; theta_0) + J tau (what its forward computes); an ordinary
    model's from a forward of the frozen module and one of the model."""
    if isinstance(model, LinearizedModel):
        def both(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            primal, tangent = model.primal_and_tangent(*args, **kwargs)
            return primal, primal + tangent
    else:
        def both(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return model.module(*args, **kwargs), model(*args, **kwargs)
    return both
