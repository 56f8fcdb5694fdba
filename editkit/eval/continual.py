"""The continual-learning field's numbers of a stream: its accuracy matrix, ACC, BWT and forgetting.

``matrix[t][i]`` is the accuracy on task ``i`` of the model a stream holds after its experience ``t``
(None for a task not seen yet): for editkit's modes, the merged model theta_0 + the first t + 1 vectors at
alpha = 1, which the stream scores after every experience. From the last row:

- **ACC**: the mean of ``matrix[T-1][i]`` over every task;
- **BWT** (backward transfer; Lopez-Paz & Ranzato 2017): the mean over ``i < T-1`` of
  ``matrix[T-1][i] - matrix[i][i]``, what learning the later tasks did to each earlier one (negative:
  forgetting);
- **forgetting** (Chaudhry et al. 2018): the mean over ``i < T-1`` of
  ``max_{l < T-1} matrix[l][i] - matrix[T-1][i]``, the drop from each task's best.

BWT and forgetting need two experiences at least; with one they are None. A model trained on every task at
once (joint training) has one row only: :func:`final_metrics`.
"""

from __future__ import annotations

from typing import Mapping, Sequence, TypedDict

Matrix = list[list[float | None]]

#: The two ways a stream's model is scored (and a strategy trained). ``task``: task-incremental, each input
#: classified among its own task's classes, the task id given. ``class``: class-incremental as the field runs it,
#: one classifier over every class seen so far, no task id at training or test time.
PROTOCOLS = ("task", "class")


class ContinualMetrics(TypedDict):
    tasks: list[str]
    matrix: Matrix
    acc: float
    bwt: float | None
    forgetting: float | None


def accuracy_matrix(tasks: Sequence[str], rows: Sequence[Mapping[str, float]]) -> Matrix:
    """``rows[t]``: task -> accuracy after experience ``t`` (the tasks seen so far); as a matrix over ``tasks``."""
    return [[row.get(task) for task in tasks] for row in rows]


def continual_metrics(tasks: Sequence[str], rows: Sequence[Mapping[str, float]]) -> ContinualMetrics:
    """ACC, BWT and forgetting of a stream over ``tasks`` (in stream order), from each experience's scores."""
    if len(rows) != len(tasks) or not tasks:
        raise ValueError(f"a stream of {len(tasks)} tasks needs one row of scores per experience, got {len(rows)}")
    matrix = accuracy_matrix(tasks, rows)
    missing = [(t, i) for t in range(len(tasks)) for i in range(t + 1) if matrix[t][i] is None]
    if missing:
        t, i = missing[0]
        raise ValueError(f"no accuracy of task {tasks[i]!r} after experience {t} ({tasks[t]!r})")
    last, earlier = matrix[-1], range(len(tasks) - 1)
    acc = sum(last) / len(last)
    if not earlier:
        return {"tasks": list(tasks), "matrix": matrix, "acc": acc, "bwt": None, "forgetting": None}
    bwt = sum(last[i] - matrix[i][i] for i in earlier) / len(earlier)
    forgetting = sum(max(matrix[l][i] for l in range(i, len(tasks) - 1)) - last[i] for i in earlier) / len(earlier)
    return {"tasks": list(tasks), "matrix": matrix, "acc": acc, "bwt": bwt, "forgetting": forgetting}


def final_metrics(tasks: Sequence[str], row: Mapping[str, float]) -> ContinualMetrics:
    """ACC of a model scored once, after training on every task together: its matrix is that one row."""
    return {"tasks": list(tasks), "matrix": [[row[task] for task in tasks]],
            "acc": sum(row[task] for task in tasks) / len(tasks), "bwt": None, "forgetting": None}
