"""Data-parallel training on CPU (gloo, 2 processes) banks what one process banks.

Also: the batch sampler reproduces the single-process order exactly, shards
partition each global batch, lazy penalty sources draw the eager batches, and
bf16 autocast goes through the jvp.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from editkit.integrations.avalanche.benchmark import Experience
from editkit.models.backbone import Backbone
from editkit.bank.store import Bank
from editkit.train.runtime import GlobalBatchSampler, Runtime
from editkit.util.sharding import shard_bounds
from editkit.models.heads import LinearHead
from editkit.train.recipe import Recipe
from editkit.runs.stream import run_stream
from editkit.core.taujp import LazyUnlabeledSource, Regularizer, UnlabeledSource, unlabeled_source
from editkit.data.tasks import TensorTaskDataset
from editkit.train.loop import fine_tune, labelled_batches

from helpers import models

# --------------------------------------------------------------------------- sampling


def old_labelled_batches(dataset, batch_size, seed):
    """The single-process loader as it was before data parallelism (reference)."""
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=len(dataset) >= batch_size)
    while True:
        for batch in loader:
            yield batch[0], batch[1]


@pytest.mark.parametrize("n,batch", [(23, 5), (20, 5), (3, 8)])
def test_single_process_batches_are_unchanged(n, batch):
    data = TensorTaskDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n) % 3)
    new, old = labelled_batches(data, batch, seed=7), old_labelled_batches(data, batch, seed=7)
    for _ in range(4 * max(1, n // batch) + 3):  # several epochs
        (x1, y1), (x0, y0) = next(new), next(old)
        assert torch.equal(x1, x0) and torch.equal(y1, y0)


@pytest.mark.parametrize("world", [2, 3])
def test_shards_partition_every_global_batch(world):
    n, batch = 29, 7
    single = GlobalBatchSampler(n, batch, seed=3)
    ranks = [GlobalBatchSampler(n, batch, seed=3, rank=r, world_size=world) for r in range(world)]
    for epoch in (2, 0, 1):  # any order: set_epoch is a pure function of the epoch
        single.set_epoch(epoch)
        for sampler in ranks:
            sampler.set_epoch(epoch)
        for whole, *parts in zip(single, *ranks):
            assert sum(parts, []) == whole
    assert [shard_bounds(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    weights = [s.shard_fraction for s in ranks]
    assert sum(weights) == pytest.approx(world)


def test_lazy_source_draws_the_eager_batches_and_never_labels():
    x = torch.randn(11, 3, generator=torch.Generator().manual_seed(0))
    loaded: list[int] = []

    class InputsOnly(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def input(self, i):
            loaded.append(i)
            return x[i]

        def __getitem__(self, i):
            raise AssertionError("labelled items must not be read")

    eager, lazy = UnlabeledSource("e", x, seed=4), LazyUnlabeledSource("l", InputsOnly(), seed=4)
    for size in (4, 4, 5, 9):
        assert torch.equal(eager.next_batch(size), lazy.next_batch(size))
    assert len(loaded) == 22  # exactly the sampled items, nothing else
    # a rank's slice is the matching part of the global batch
    full = UnlabeledSource("f", x, seed=9).next_batch(5)
    parts = [LazyUnlabeledSource("p", InputsOnly(), seed=9).next_batch(5, shard=(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat(parts), full)
    assert isinstance(unlabeled_source("t", TensorTaskDataset(x, torch.zeros(11))), UnlabeledSource)
    assert unlabeled_source("l", InputsOnly()).lazy


def test_bf16_autocast_runs_through_the_jvp():
    module, head, train, other = _problem()
    reg = Regularizer([UnlabeledSource("o", other, seed=1)], lam=0.5, batch_size=4)
    recipe = Recipe(mode="taujp", steps=2, batch_size=8, lr=1e-2, warmup=0)
    result = fine_tune(module, head, train, recipe, reg, runtime=Runtime(precision="bf16"))
    assert result.history[1]["penalty"] > 0
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in result.task_vector.values())


# --------------------------------------------------------------------------- 2 processes, gloo


def _problem(seed: int = 0):
    module = models.mlp(4, 16, 8, batchnorm=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    head = LinearHead(torch.randn(3, 8, generator=g), torch.zeros(3))
    x = torch.randn(45, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    other = torch.randn(30, 4, generator=g) + 1.5
    return module, head, TensorTaskDataset(x, y), other


def _stream_inputs():
    module, head, train, other = _problem()
    g = torch.Generator().manual_seed(1)
    train2 = TensorTaskDataset(other, (other[:, 2] > 1.5).long())
    exps = [Experience(0, "a", 0, train, train, None, 3), Experience(1, "b", 1, train2, train2, None, 3)]
    backbone = Backbone("mlp", module, 8)
    heads = {"a": head, "b": LinearHead(torch.randn(3, 8, generator=g), torch.zeros(3))}
    # uneven shards on 2 processes (9 -> 5 + 4, reg 5 -> 3 + 2), two micro-batches per step
    recipe = Recipe(mode="taujp", steps=6, batch_size=9, accumulation=2, lr=5e-2, warmup=2, weight_decay=0.1,
                    reg_batch=5, generic=False)
    return exps, backbone, heads, recipe


def _ddp_worker(rank: int, world: int, port: int, bank_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from editkit.train import runtime as distributed

    runtime = distributed.setup("cpu", "fp32", 0)
    try:
        assert runtime.world_size == world and runtime.rank == rank
        exps, backbone, heads, recipe = _stream_inputs()
        run_stream(exps, backbone, heads, recipe, bank_dir, scenario="ddp", runtime=runtime)
        if rank != 0:
            assert Bank(bank_dir).names() == ["a", "b"]  # rank 0 wrote it before the barrier released us
    finally:
        distributed.teardown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_gloo_processes_bank_the_single_process_vectors(tmp_path):
    import torch.multiprocessing as mp

    exps, backbone, heads, recipe = _stream_inputs()
    single = run_stream(exps, backbone, heads, recipe, tmp_path / "single", scenario="ddp")
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path / "ddp")), nprocs=2, start_method="spawn")
    one, two = Bank(tmp_path / "single"), Bank(tmp_path / "ddp")
    assert two.names() == one.names() == ["a", "b"]
    assert two.base == one.base
    for name in one.names():
        a, b = one.load(name), two.load(name)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].abs().max() > 0
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
        assert two.get(name).recipe == one.get(name).recipe
        # evaluation was sharded over the two processes and summed: the same accuracies
        assert two.get(name).metrics["single_task"] == pytest.approx(one.get(name).metrics["single_task"])
        assert two.get(name).metrics["merged"]["per_task"] == pytest.approx(one.get(name).metrics["merged"]["per_task"])
    assert [s.single_task for s in single.steps] == pytest.approx([two.get(n).metrics["single_task"] for n in "ab"])


class WithUnusedLayer(nn.Module):
    """A backbone whose second layer never reaches the features (a pooler nobody uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from editkit.errors import ConfigError
    from editkit.train import runtime as distributed

    runtime = distributed.setup("cpu", "fp32", 0)
    try:
        _, head, train, _ = _problem()
        recipe = Recipe(mode="nonlinear", steps=2, batch_size=8, lr=1e-2, warmup=0)
        # DDP would leave this step's gradients unreduced (and fail only at the next): refused before it applies
        with pytest.raises(ConfigError, match=r"2 backbone parameters never reach the features \(unused.weight"):
            fine_tune(WithUnusedLayer(), head, train, recipe, runtime=runtime)
    finally:
        distributed.teardown()


@pytest.mark.slow
def test_a_parameter_without_gradient_is_refused_under_data_parallelism():
    import torch.multiprocessing as mp

    _, head, train, _ = _problem()
    recipe = Recipe(mode="nonlinear", steps=2, batch_size=8, lr=1e-2, warmup=0)
    tau = fine_tune(WithUnusedLayer(), head, train, recipe).task_vector  # one process: trains, unused stays at 0
    assert tau["used.weight"].abs().max() > 0 and tau["unused.weight"].abs().max() == 0
    mp.start_processes(_unused_worker, args=(2, _free_port()), nprocs=2, start_method="spawn")


def test_every_process_scores_a_mixed_step_whole():
    """Mixed reg batches are a row or two per source: not sliced, not weighted, so the mean of the processes'
    gradients is the single-process penalty's."""
    def mixed(shard=None) -> Regularizer:
        sources = [UnlabeledSource(f"o{k}", torch.arange(6.0).unsqueeze(1) + 10 * k, seed=k) for k in range(3)]
        return Regularizer(sources, schedule="mixed", batch_size=2, shard=shard)

    alone, ranks = mixed(), [mixed((r, 4)) for r in range(4)]
    for step in range(4):
        expected = [b.tolist() for b in alone.batches(step)]
        assert sum(len(b) for b in expected) == 2
        assert all([b.tolist() for b in rank.batches(step)] == expected for rank in ranks)
    tangent = torch.tensor([[3.0, 4.0]])
    assert ranks[0].loss([tangent]).item() == pytest.approx(alone.loss([tangent]).item())


def test_more_processes_than_a_reg_batch_is_refused():
    from editkit.errors import ConfigError

    with pytest.raises(ConfigError, match="reg_batch"):
        Regularizer([UnlabeledSource("o", torch.zeros(4, 2))], schedule="cyclic", batch_size=2, shard=(0, 4))
    with pytest.raises(ConfigError, match="cannot be split"):
        GlobalBatchSampler(10, 3, world_size=4)
