"""``editkit bench --ray``: the bench's independent units as tasks of a Ray cluster, no scheduler of editkit's own.

A unit is a module-level function and its arguments, with its own CPU / GPU request (:class:`Unit`); Ray places,
runs and, when a worker dies, re-runs it (``max_retries``). The bench gives it four kinds of unit
(:mod:`editkit.runs.bench.run`): a mode's stream for one seed or task order (it fills that stream's bank, and a
re-run resumes from what the bank already holds), a strategy's run under one protocol, each repeat's evaluation
over its finished banks (it needs that repeat's stream units, not its strategies), and with ``--tune`` each row's
selection trials (:mod:`editkit.runs.bench.selection`), one unit a trial.
Every unit sets its torch threads to the CPUs it asked for and records them, so a unit computes what the
plain command computes with ``--threads`` equal to that number: the same rows, to the last digit.

Files live where every node sees them: banks and run directories are paths the driver and all workers share (one
machine, or a network filesystem on a cluster), checked before any work by :func:`check_shared` (a file the driver
writes must be read back on every node). Nothing is shipped over Ray but arguments and results.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from editkit.errors import ConfigError, EditkitError, MissingResourceError
from editkit.util.progress import Progress

#: How often Ray re-runs a unit whose worker died (a killed process, a lost node).
RETRIES = 2
RAY_EXTRA = 'pip install -e ".[ray]"'


@dataclass(frozen=True)
class Unit:
    """One piece of the grid: ``call(*args, *results)`` in a worker with ``cpus`` CPUs (its torch threads) and
    ``gpus`` GPUs, where ``results`` are those of the earlier units of the same :func:`run_units` call that it
    ``needs`` (by index): Ray starts it once they are done, whatever else still runs."""

    name: str
    call: Callable[..., Any]
    args: tuple
    cpus: int = 1
    gpus: float = 0.0
    needs: tuple[int, ...] = ()


def connect(address: str) -> str:
    """Join the Ray cluster at ``address`` (``auto``: the one running here, else a local one on this machine's
    CPUs) before any work; a missing extra or an unreachable address is refused in one line. Returns how the
    cluster was joined."""
    try:
        import ray
    except ImportError:
        raise MissingResourceError(f"--ray needs Ray, an optional extra: {RAY_EXTRA}") from None
    if ray.is_initialized():
        return "joined already"
    quiet = {"logging_level": "ERROR", "log_to_driver": False, "include_dashboard": False}
    if address == "auto":
        try:
            ray.init(address="auto", **quiet)
            return "the cluster running here"
        except (ConnectionError, RuntimeError):
            ray.init(**quiet)
            return f"a local cluster ({int(ray.cluster_resources().get('CPU', 0))} CPUs)"
    refusal = (f"--ray {address}: no Ray cluster answers there (start one with `ray start --head`, then pass its "
               "address HOST:PORT, or --ray auto for one on this machine)")
    if not _answers(address):  # Ray itself retries an address that does not answer for minutes
        raise ConfigError(refusal)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(refusal) from exc
    return f"the cluster at {address}"


def _answers(address: str, timeout: float = 5.0) -> bool:
    """Whether something accepts a connection at ``address`` (``HOST:PORT``, or ``ray://HOST:PORT``)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def check_shared(paths: Sequence[Path]) -> None:
    """Refuse, before any work, a path some node of the cluster cannot read: a probe file written here must be
    read back on every alive node (banks and run directories are where the units write)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probes = []
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".editkit-probe-{uuid.uuid4().hex}"
        probe.write_text("editkit", encoding="utf-8")
        probes.append(probe)
    try:
        seen = ray.remote(num_cpus=0)(_readable)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        checks = [(node["NodeManagerAddress"], seen.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node["NodeID"], soft=False)).remote([str(p) for p in probes])) for node in nodes]
        for host, check in checks:
            missing = ray.get(check)
            if missing:
                raise ConfigError(f"node {host} cannot read {Path(missing[0]).parent}: banks and run directories "
                                  "must be on a filesystem every node sees (a shared mount), else results are lost")
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)


def _readable(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.path.isfile(p)]


def run_units(units: Sequence[Unit], progress: Progress) -> list[Any]:
    """Every unit as a Ray task at once (Ray queues what the cluster cannot hold yet, and a unit that needs others
    until they are done); their results in the order given. One line per unit as it is queued, starts (on which
    node, which attempt), ends or fails; the first failure that is not a dead worker stops the bench with the
    unit's own one-line message."""
    import ray

    board = ray.remote(num_cpus=0)(_Board).remote()
    # a GPU unit's worker exits after it: CUDA reads the visible devices once a process, and Ray may give the
    # worker's next unit another GPU (Ray's own default for a function declared with GPUs)
    on_cpus, on_gpus = ray.remote(_run_unit), ray.remote(max_calls=1)(_run_unit)
    refs: list[Any] = []
    for u in units:  # the results a unit needs as top-level arguments: Ray resolves them before it starts the unit
        task = on_gpus if u.gpus else on_cpus
        refs.append(task.options(num_cpus=u.cpus, num_gpus=u.gpus, max_retries=RETRIES, name=u.name).remote(
            board, u.name, u.call, u.args, u.cpus, *(refs[i] for i in u.needs)))
    names = {ref: unit.name for ref, unit in zip(refs, units)}
    for unit in units:
        after = f", after {', '.join(units[i].name for i in unit.needs)}" if unit.needs else ""
        progress.note(f"{unit.name}: queued ({unit.cpus} CPU{'s' if unit.cpus > 1 else ''}"
                      f"{f', {unit.gpus:g} GPU' if unit.gpus else ''}{after})")
    pending, results, shown = list(refs), {}, 0
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        events = ray.get(board.since.remote(shown))
        shown += len(events)
        for line in events:
            progress.note(line)
        for ref in done:
            try:
                results[ref], ran = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(getattr(exc, "cause", None), EditkitError) else None
                progress.note(f"{names[ref]}: failed")
                if cause is not None:
                    raise cause from None
                raise
            progress.note(f"{names[ref]}: done on {ran['node']} in {ran['seconds']:.0f} s "
                          f"({ran['threads']} thread{'s' if ran['threads'] > 1 else ''})")
    return [results[ref] for ref in refs]


class _Board:
    """What the units say as they start: the driver reads it to tell a unit running, and where, from a queued
    one, and a re-run (a worker that died) from a first attempt."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.attempts: dict[str, int] = {}

    def started(self, name: str, node: str) -> None:
        attempt = self.attempts[name] = self.attempts.get(name, 0) + 1
        again = f" (attempt {attempt}: its worker died, resumed from what it had written)" if attempt > 1 else ""
        self.lines.append(f"{name}: running on {node}{again}")

    def since(self, index: int) -> list[str]:
        return self.lines[index:]


def _run_unit(board: Any, name: str, call: Callable[..., Any], args: tuple, cpus: int, *needed: tuple[Any, dict]
              ) -> tuple[Any, dict]:
    """A unit in its worker: its torch threads set to its CPUs (what the numbers depend on beyond the seed);
    ``needed``: what the units it needs returned (their results passed on after ``args``).

    It tells the board it started without waiting for the answer: a task blocked in ``ray.get`` hands its CPUs
    back to Ray, which starts a queued unit on them, and the node then runs more units than it has CPUs."""
    import ray
    import torch

    node = ray.util.get_node_ip_address()
    board.started.remote(name, node)
    torch.set_num_threads(cpus)
    start = time.perf_counter()
    result = call(*args, *(done for done, _ in needed))
    return result, {"node": node, "threads": torch.get_num_threads(), "seconds": time.perf_counter() - start}
