"""The tauJp penalty, its schedules and unlabeled sources, against hand computations.

Also: the penalty path never reads a label (sources built from datasets whose label
accessors raise, end to end through ``fine_tune``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from editkit.models.heads import LinearHead
from editkit.core.linearize import LinearizedModel
from editkit.train.recipe import Recipe
from editkit.core.taujp import LazyUnlabeledSource, Regularizer, UnlabeledSource, penalty, unlabeled_source
from editkit.data.tasks import TensorTaskDataset
from editkit.train.loop import fine_tune

from helpers import models
from helpers.tabular import blobs

# --------------------------------------------------------------------------- penalty by hand

KNOWN = torch.tensor(
    [
        [[3.0, 4.0], [0.0, 0.0]],  # norm 5
        [[1.0, 2.0], [2.0, 4.0]],  # norm 5
        [[0.0, 0.0], [0.0, 0.0]],  # norm 0
        [[1.0, 1.0], [1.0, -1.0]],  # norm 2
    ],
    dtype=torch.float64,
)


def hand_norms(t: torch.Tensor) -> list[float]:
    out = []
    for example in t.tolist():
        flat = [v for row in example for v in row] if isinstance(example[0], list) else example
        out.append(math.sqrt(sum(v * v for v in flat)))
    return out


def test_penalty_matches_hand_computation():
    norms = hand_norms(KNOWN)
    assert norms == [5.0, 5.0, 0.0, 2.0]
    assert penalty(KNOWN).item() == pytest.approx(sum(norms) / 4)  # 3.0
    assert penalty(KNOWN, squared=True).item() == pytest.approx(sum(n * n for n in norms) / 4)  # 13.5
    assert penalty(KNOWN).item() == pytest.approx(3.0)
    assert penalty(KNOWN, squared=True).item() == pytest.approx(13.5)


def test_penalty_random_tensor_matches_loop():
    t = torch.randn(6, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    norms = [math.sqrt(sum(v * v for v in t[i].flatten().tolist())) for i in range(6)]
    assert penalty(t).item() == pytest.approx(sum(norms) / 6, rel=1e-12)
    assert penalty(t, squared=True).item() == pytest.approx(sum(n * n for n in norms) / 6, rel=1e-12)


def small_net(seed: int = 0) -> nn.Module:
    return models.mlp(4, 6, 3, batchnorm=True, seed=seed)


@pytest.mark.parametrize("squared", [False, True])
def test_penalty_is_zero_with_finite_gradients_at_theta0(squared):
    model = LinearizedModel(small_net())
    x = torch.randn(5, 4)
    tangent = model.tangent(x)
    assert torch.count_nonzero(tangent) == 0
    p = penalty(tangent, squared=squared)
    assert p.item() == 0.0
    p.backward()
    for theta in model.theta:
        assert theta.grad is not None and torch.isfinite(theta.grad).all()


@pytest.mark.parametrize("bias", [False, True])
def test_penalty_of_a_linear_model_is_closed_form(bias):
    # f(x) = W x (+ b): J_theta0 f(x) . tau = dW x (+ db), whatever W is
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, bias=bias).double()
    g = torch.Generator().manual_seed(1)
    dW = torch.randn(2, 3, generator=g, dtype=torch.float64)
    db = torch.randn(2, generator=g, dtype=torch.float64)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    model = LinearizedModel(lin)
    model.load_task_vector({"weight": dW, **({"bias": db} if bias else {})})
    norms = []
    for i in range(5):
        out = [sum(dW[r, c].item() * x[i, c].item() for c in range(3)) + (db[r].item() if bias else 0.0)
               for r in range(2)]
        norms.append(math.sqrt(sum(v * v for v in out)))
    tangent = model.tangent(x)
    assert penalty(tangent).item() == pytest.approx(sum(norms) / 5, rel=1e-12)
    assert penalty(tangent, squared=True).item() == pytest.approx(sum(n * n for n in norms) / 5, rel=1e-12)


# --------------------------------------------------------------------------- schedules


def constant_sources(n: int, sizes=None, dim: int = 2) -> list[UnlabeledSource]:
    sizes = sizes or [10] * n
    return [UnlabeledSource(f"s{k}", torch.full((sizes[k], dim), float(k)), seed=k) for k in range(n)]


def source_id(batch: torch.Tensor) -> int:
    values = batch.unique()
    assert len(values) == 1, "a reg batch mixed sources"
    return int(values.item())


def test_cyclic_draws_from_step_mod_n():
    reg = Regularizer(constant_sources(3), lam=0.1, schedule="cyclic", batch_size=4)
    assert reg.active
    for step in range(11):
        batches = reg.batches(step)
        assert len(batches) == 1
        assert batches[0].shape == (4, 2)
        assert source_id(batches[0]) == step % 3


def test_strict_draws_one_batch_from_every_source():
    reg = Regularizer(constant_sources(3), lam=0.1, schedule="strict", batch_size=5)
    for step in range(3):
        batches = reg.batches(step)
        assert [source_id(b) for b in batches] == [0, 1, 2]
        assert all(b.shape == (5, 2) for b in batches)


def test_mixed_spreads_one_batch_over_every_source_in_turn():
    """Row j of step s comes from source (s * 4 + j) % 3: 4 rows a step, each source 4 rows every 3 steps."""
    reg = Regularizer(constant_sources(3), lam=0.1, schedule="mixed", batch_size=4)
    rows = [[(source_id(b), len(b)) for b in reg.batches(step)] for step in range(3)]
    assert rows == [[(0, 2), (1, 1), (2, 1)], [(0, 1), (1, 2), (2, 1)], [(0, 1), (1, 1), (2, 2)]]


def test_mixed_with_fewer_rows_than_sources_takes_the_next_sources_each_step():
    reg = Regularizer(constant_sources(3), lam=0.1, schedule="mixed", batch_size=2)
    assert [[source_id(b) for b in reg.batches(step)] for step in range(3)] == [[0, 1], [0, 2], [1, 2]]
    assert all(len(b) == 1 for step in range(3) for b in reg.batches(step))


def test_mixed_with_one_source_draws_what_cyclic_does():
    """A stream's first task (the generic source alone) trains the same vector under either schedule."""
    mixed = Regularizer([index_source(9, 1)], lam=0.1, schedule="mixed", batch_size=4)
    cyclic = Regularizer([index_source(9, 1)], lam=0.1, schedule="cyclic", batch_size=4)
    for step in range(5):
        assert [b.tolist() for b in mixed.batches(step)] == [b.tolist() for b in cyclic.batches(step)]


@pytest.mark.parametrize("squared", [False, True])
def test_strict_loss_is_lambda_times_mean_of_source_penalties(squared):
    reg = Regularizer(constant_sources(2), lam=0.25, schedule="strict", batch_size=2, squared=squared)
    t0 = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)  # norms 5, 0
    t1 = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 0.0]], dtype=torch.float64)  # norms 1, 2, 2
    if squared:
        per_source = [(25 + 0) / 2, (1 + 4 + 4) / 3]
    else:
        per_source = [(5 + 0) / 2, (1 + 2 + 2) / 3]
    expected = 0.25 * (per_source[0] + per_source[1]) / 2
    assert reg.loss([t0, t1]).item() == pytest.approx(expected, rel=1e-12)
    # one source (cyclic): lam * its penalty
    assert reg.loss([t1]).item() == pytest.approx(0.25 * per_source[1], rel=1e-12)


def test_inactive_regularizer_draws_nothing():
    assert Regularizer(constant_sources(2), lam=0.0).batches(0) == []
    assert not Regularizer(constant_sources(2), lam=0.0).active
    assert Regularizer([], lam=0.1).batches(3) == []
    assert not Regularizer([], lam=0.1).active
    assert Regularizer([], lam=0.1, schedule="strict").batches(0) == []


def test_unknown_schedule_refused():
    with pytest.raises(ValueError):
        Regularizer(constant_sources(1), schedule="round-robin")


def test_batch_larger_than_source_wraps_around():
    src = UnlabeledSource("tiny", torch.arange(3.0).unsqueeze(1), seed=0)
    batch = src.next_batch(5)
    assert batch.shape == (5, 1)
    values = batch.squeeze(1).tolist()
    assert sorted(values[:3]) == [0.0, 1.0, 2.0]  # first epoch complete before the second starts


# --------------------------------------------------------------------------- sampling


def index_source(n: int, seed: int) -> UnlabeledSource:
    return UnlabeledSource("idx", torch.arange(n, dtype=torch.float64).unsqueeze(1), seed=seed)


@pytest.mark.parametrize("batch", [1, 4, 5, 7])
def test_every_index_once_per_epoch(batch):
    n = 20
    src = index_source(n, seed=3)
    drawn: list[int] = []
    while len(drawn) < 3 * n:
        drawn += [int(v) for v in src.next_batch(batch).squeeze(1).tolist()]
    for epoch in range(3):
        chunk = drawn[epoch * n:(epoch + 1) * n]
        assert sorted(chunk) == list(range(n)), f"epoch {epoch} sampled with replacement"


def test_sampling_is_seeded():
    def sequence(seed: int) -> list[int]:
        src = index_source(30, seed)
        return [int(v) for _ in range(8) for v in src.next_batch(6).squeeze(1).tolist()]

    assert sequence(0) == sequence(0)
    assert sequence(1) == sequence(1)
    assert sequence(0) != sequence(1)
    assert sequence(0)[:30] != list(range(30)) and sequence(0)[:30] != list(range(29, -1, -1))  # shuffled


@pytest.mark.parametrize("lazy", [False, True])
def test_a_restarted_source_samples_what_a_fresh_one_does(lazy):
    """A second stream over the same built scenario (the bench's) must draw the first stream's reg batches."""
    def make():
        src = index_source(30, 3)
        return LazyUnlabeledSource("lazy", TensorDataset(src.inputs), seed=3) if lazy else src

    def draw(src) -> list[int]:
        return [int(v) for _ in range(8) for v in src.next_batch(7).flatten().tolist()]  # past one epoch

    used = make()
    first = draw(used)
    assert draw(used) != first
    used.restart()
    assert draw(used) == first == draw(make())


@pytest.mark.parametrize("schedule", ["cyclic", "strict", "mixed"])
def test_skipping_steps_leaves_the_sources_where_drawing_them_would(schedule):
    """A resumed stream skips a banked task's draws: what follows must be what follows the real draws."""
    loads: list[int] = []

    def counted(items: list[torch.Tensor]) -> torch.Tensor:
        loads.append(len(items))
        return torch.stack(items)

    def regularizer(lazy: bool = False) -> Regularizer:
        sources = [index_source(n, seed) for seed, n in enumerate((13, 7))]
        if lazy:  # the sources a stream reads from disk: skipping must load nothing
            sources = [LazyUnlabeledSource(s.name, TensorDataset(s.inputs), seed=seed, collate=counted)
                       for seed, s in enumerate(sources)]
        return Regularizer(sources, lam=0.1, schedule=schedule, batch_size=5)

    def flat(batches) -> list[float]:
        return [v for b in batches for v in b.flatten().tolist()]

    drawn = regularizer()
    for step in range(9):  # 9 steps of 5 draws run past both sources' first epoch
        drawn.batches(step)
    skipped = regularizer(lazy=True)
    skipped.skip(9)
    assert loads == []
    after = [flat(drawn.batches(step)) for step in range(9, 14)]
    assert [flat(skipped.batches(step)) for step in range(9, 14)] == after
    assert after != [flat(regularizer().batches(step)) for step in range(9, 14)]  # skipping moved the sources


def test_empty_source_refused():
    with pytest.raises(ValueError):
        UnlabeledSource("empty", torch.zeros(0, 3))


# --------------------------------------------------------------------------- labels are never read


class LabelAccessed(AssertionError):
    pass


class RaisingLabels(torch.Tensor):
    """A tensor whose every use raises: any read of the labels fails loudly."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LabelAccessed(f"labels were read via {getattr(func, '__name__', func)}")

    def __getattr__(self, name):  # pragma: no cover - only reached on access
        raise LabelAccessed(f"labels were read via .{name}")


def label_trap_dataset(inputs: torch.Tensor) -> TensorTaskDataset:
    ds = TensorTaskDataset(inputs, torch.zeros(len(inputs), dtype=torch.long))
    trap = torch.zeros(len(inputs), dtype=torch.long).as_subclass(RaisingLabels)
    ds.targets = trap
    ds.labels = trap
    ds.tensors = (inputs, trap)
    return ds


def test_trap_really_raises():
    ds = label_trap_dataset(torch.randn(4, 2))
    with pytest.raises(LabelAccessed):
        ds[0]
    with pytest.raises(LabelAccessed):
        ds.targets[0]
    with pytest.raises(LabelAccessed):
        ds.targets.sum()


def test_unlabeled_source_never_reads_labels():
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    src = unlabeled_source("trap", label_trap_dataset(x), seed=0)
    assert len(src) == 12
    batch = src.next_batch(12)
    # the batch holds exactly the dataset's inputs (in some order)
    assert sorted(map(tuple, batch.tolist())) == sorted(map(tuple, x.tolist()))


def test_fine_tune_taujp_never_reads_regularizer_labels(make_mlp):
    module = make_mlp(4, 8, 6, batchnorm=True, seed=0)
    head = LinearHead(torch.randn(3, 6), torch.zeros(3))
    x, y = blobs(8, torch.eye(3, 4) * 3, seed=0)
    train = TensorTaskDataset(x, y)
    sources = [
        unlabeled_source(f"other{k}", label_trap_dataset(blobs(5, -torch.eye(2, 4) * (k + 1), k)[0]), seed=k)
        for k in range(2)
    ]
    for schedule in ("cyclic", "strict", "mixed"):
        reg = Regularizer(sources, lam=0.5, schedule=schedule, batch_size=3)
        recipe = Recipe(mode="taujp", steps=2, batch_size=8, lr=1e-2, warmup=0, seed=0)
        result = fine_tune(copy.deepcopy(module), head, train, recipe, reg)
        assert result.steps == 2
        assert result.history[0]["penalty"] == 0.0  # theta = theta_0 at step 0
        assert result.history[1]["penalty"] > 0.0  # the regularizer really ran


class Precomputing(TensorDataset):
    """A dataset that records which items it was asked to encode ahead and which it was read at."""

    def __init__(self, inputs: torch.Tensor) -> None:
        super().__init__(inputs)
        self.encoded: set[int] = set()
        self.read: list[int] = []

    def precompute(self, index) -> None:
        self.encoded.update(int(i) for i in index)

    def __getitem__(self, index: int):
        self.read.append(int(index))
        return super().__getitem__(index)


@pytest.mark.parametrize("schedule", ["cyclic", "strict", "mixed"])
def test_prepare_encodes_what_the_steps_will_draw_and_draws_the_same(schedule):
    """The indices a run prepares are those its steps then load (past a source's first epoch), and preparing
    moves no source: the batches equal those of an unprepared twin."""
    def regularizer() -> Regularizer:
        sources = [LazyUnlabeledSource(f"s{seed}", Precomputing(index_source(n, seed).inputs), seed=seed)
                   for seed, n in enumerate((13, 7, 5))]
        return Regularizer(sources, lam=0.1, schedule=schedule, batch_size=4)

    prepared, plain = regularizer(), regularizer()
    prepared.prepare(11)
    assert all(s.dataset.read == [] for s in prepared.sources)  # nothing loaded while preparing
    batches = [[b.tolist() for b in prepared.batches(step)] for step in range(11)]
    assert batches == [[b.tolist() for b in plain.batches(step)] for step in range(11)]
    for source in prepared.sources:
        assert source.dataset.encoded == set(source.dataset.read) and source.dataset.read


def test_an_eager_source_prepares_nothing_and_keeps_its_draws():
    source, twin = index_source(9, 2), index_source(9, 2)
    assert source.upcoming([4] * 5) == [int(v) for _ in range(5) for v in twin.next_batch(4).flatten().tolist()]
    source.prepare(range(9))
    assert source.next_indices(20) == index_source(9, 2).next_indices(20)


def test_only_a_source_that_cannot_encode_ahead_is_loaded_in_a_thread():
    inputs = index_source(6, 0).inputs
    assert LazyUnlabeledSource("decoded", TensorDataset(inputs)).lazy
    assert not LazyUnlabeledSource("encoded", Precomputing(inputs)).lazy
    assert not Regularizer([LazyUnlabeledSource("encoded", Precomputing(inputs))], lam=0.1).lazy
