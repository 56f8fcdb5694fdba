"""The modality seam, proven on a tiny sequence classifier before any text code lands.

A random 2-layer HF BERT (built from a config, nothing downloaded, eager attention so
forward-mode AD runs through it) reads right-padded token ids with an attention mask.
Two faces of it: mean-pooled features over real tokens ``(N, D)`` and per-token hidden
states ``(N, T, D)``. Ground truth: each example run alone with no padding at all,
central finite differences of a directly edited copy (float64), the first AdamW step
(identical in the linear and non-linear modes at tau = 0), and norms computed by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import editkit  # noqa: F401  (makes transformers' torchvision imports work on CPU torch)
from editkit.core.batching import SequenceBatch, SequenceBatching, TensorBatching, call_on, length_bands
from editkit.core.linearize import LinearizedModel, NonLinearModel
from editkit.core.taujp import LazyUnlabeledSource, Regularizer, UnlabeledSource, penalty
from editkit.eval.accuracy import ClassificationScorer, evaluate_vector
from editkit.models.backbone import Backbone, state_fingerprint
from editkit.models.heads import LinearHead
from editkit.train.loop import StepComputer, fine_tune
from editkit.train.recipe import Recipe

from helpers import models

VOCAB, HIDDEN, PAD = 30, 16, 0

# --------------------------------------------------------------------------- the tiny sequence classifier


class TinyBert(nn.Module):
    """Random BERT; ``per_token`` returns hidden states, otherwise their mean over real tokens."""

    def __init__(self, *, per_token: bool = False, seed: int = 0, max_positions: int = 32) -> None:
        super().__init__()
        self.bert = models.bert(seed=seed, pooling=False, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                intermediate_size=24, max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, pad_token_id=PAD, attn_implementation="eager")
        self.per_token = per_token

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.per_token:
            return hidden
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)


def sequences(n: int, seed: int, lengths: tuple[int, int] = (2, 9)) -> list[torch.Tensor]:
    """``n`` token id sequences (no pad id inside) of random lengths in ``[lengths[0], lengths[1])``."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (size,), generator=g) for size in sizes]


class SequenceTask(Dataset):
    """Labelled variable-length sequences: the label is whether the first token is in the lower half of the vocab."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i], int(self.items[i][0] < VOCAB // 2)


def classifier_head(seed: int = 0) -> LinearHead:
    """A fixed random 2-class head over the features."""
    g = torch.Generator().manual_seed(seed)
    return LinearHead(torch.randn(2, HIDDEN, generator=g), torch.zeros(2))


def random_tau(module: nn.Module, scale: float, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale
            for n, p in module.named_parameters()}


def linearized(module: nn.Module, tau: dict[str, torch.Tensor]) -> LinearizedModel:
    model = LinearizedModel(copy.deepcopy(module))
    model.load_task_vector(tau)
    return model


def alone(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model`` on one sequence with no padding at all, batch dimension dropped."""
    return model(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0]


def padded_more(batch: SequenceBatch, extra: int) -> SequenceBatch:
    """The same examples with ``extra`` more padding columns."""
    return SequenceBatch(F.pad(batch.inputs, (0, extra), value=PAD), F.pad(batch.attention_mask, (0, extra)))


# --------------------------------------------------------------------------- batching


def test_collate_concat_split_round_trip_with_different_lengths():
    batching = SequenceBatching(pad_id=PAD, per_token=True)
    groups = [sequences(3, seed=0, lengths=(2, 4)), sequences(2, seed=1, lengths=(7, 9)), sequences(4, seed=2)]
    batches = [batching.collate(g) for g in groups]
    assert [b.inputs.shape[1] for b in batches] == [max(len(s) for s in g) for g in groups]
    joined = batching.concat(batches[0], batches[1:])
    width = max(len(s) for g in groups for s in g)
    assert joined.inputs.shape == joined.attention_mask.shape == (9, width)
    sizes = [len(b) for b in batches]
    pieces = zip(batching.split(joined.inputs, sizes), batching.split(batching.output_mask(joined), sizes))
    for group, (ids, mask) in zip(groups, pieces, strict=True):
        for row, seq in enumerate(group):
            assert torch.equal(ids[row, : len(seq)], seq)
            assert (ids[row, len(seq):] == PAD).all()
            assert mask[row].tolist() == [True] * len(seq) + [False] * (width - len(seq))


def test_concatenated_outputs_equal_each_example_alone():
    """Padding to a common length changes no real position's output (per token) and no pooled feature."""
    groups = [sequences(3, seed=3, lengths=(2, 4)), sequences(2, seed=4, lengths=(6, 9))]
    for per_token in (True, False):
        module = TinyBert(per_token=per_token).double()
        batching = SequenceBatching(pad_id=PAD, per_token=per_token)
        batches = [batching.collate(g) for g in groups]
        joined = batching.concat(batches[0], batches[1:])
        args, kwargs = batching.arguments(joined)
        with torch.no_grad():
            outputs = batching.split(module(*args, **kwargs), [len(b) for b in batches])
            for group, out in zip(groups, outputs):
                for row, seq in enumerate(group):
                    expected = alone(module, seq)
                    got = out[row, : len(seq)] if per_token else out[row]
                    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_backbone_features_in_chunks_of_a_sequence_batch():
    module = TinyBert()
    backbone = Backbone("tiny-bert", module, HIDDEN, batching=SequenceBatching(pad_id=PAD))
    batch = backbone.batching.collate(sequences(7, seed=5))
    expected = module(batch.inputs, attention_mask=batch.attention_mask).detach()
    torch.testing.assert_close(backbone.features(batch, batch_size=3), expected)


def test_tensor_batching_is_cat_and_split():
    batching = TensorBatching()
    parts = [torch.randn(n, 3, 2) for n in (4, 1, 2)]
    joined = batching.concat(parts[0], parts[1:])
    assert torch.equal(joined, torch.cat(parts))
    assert all(torch.equal(a, b) for a, b in zip(batching.split(joined, [4, 1, 2]), parts, strict=True))
    assert batching.output_mask(joined) is None
    assert batching.arguments(joined) == ((joined,), {})


# --------------------------------------------------------------------------- linearized call with masks


@pytest.mark.parametrize("per_token", [True, False])
def test_f_lin_matches_central_differences_with_masks(per_token):
    """J.tau on a padded batch (mask passed through jvp) = central differences of an edited copy, float64."""
    module = TinyBert(per_token=per_token).double()
    batching = SequenceBatching(pad_id=PAD, per_token=per_token)
    batch = batching.collate(sequences(4, seed=6))
    args, kwargs = batching.arguments(batch)
    tau = random_tau(module, 0.05)
    eps = 1e-5

    def edited(sign: float) -> torch.Tensor:
        copy_ = copy.deepcopy(module)
        with torch.no_grad():
            for n, p in copy_.named_parameters():
                p.add_(sign * eps * tau[n])
            return copy_(*args, **kwargs)

    fd = (edited(1.0) - edited(-1.0)) / (2 * eps)
    model = linearized(module, tau)
    with torch.no_grad():
        primal, tangent = model.primal_and_tangent(*args, **kwargs)
        unmasked = model.tangent(batch.inputs, attention_mask=torch.ones_like(batch.attention_mask))
    real = batch.attention_mask.bool() if per_token else slice(None)
    assert fd[real].norm() > 1e-2
    assert float((tangent[real] - fd[real]).norm() / fd[real].norm()) < 1e-7
    torch.testing.assert_close(primal, module(*args, **kwargs).detach(), rtol=0, atol=1e-12)
    # the mask really reached the module inside the jvp: attending to the padding changes the tangent
    assert float((unmasked[real] - tangent[real]).norm()) > 1e-3


# --------------------------------------------------------------------------- the penalty ignores padding


def test_masked_penalty_by_hand():
    """Per example, the L2 norm over real positions only; whatever sits at padded positions."""
    tangent = torch.tensor([[[3.0, 4.0], [1e6, float("nan")]],
                            [[1.0, 2.0], [2.0, 4.0]]])
    mask = torch.tensor([[1, 0], [1, 1]])
    by_hand = (5.0 + 5.0) / 2
    assert float(penalty(tangent, mask=mask)) == pytest.approx(by_hand)
    assert float(penalty(tangent, mask=mask, squared=True)) == pytest.approx((25.0 + 25.0) / 2)
    # without padding a mask of ones changes nothing
    dense = tangent[1:]
    assert float(penalty(dense, mask=torch.ones(1, 2))) == float(penalty(dense))


class FirstPositionHead(nn.Module):
    """Logits from the first position of per-token outputs (pooled outputs pass through)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = classifier_head()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features[:, 0] if features.dim() == 3 else features)


def penalty_term(module: nn.Module, tau, batching: SequenceBatching, task: SequenceBatch,
                 reg_batches: list[SequenceBatch], lam: float, squared: bool) -> torch.Tensor:
    """The regularizer term of one step as the train loop computes it (one jvp of task + reg batches)."""
    # the step scores the reg batches it is handed; the source only makes the regularizer active
    reg = Regularizer([UnlabeledSource("unused", task)], lam=lam, squared=squared)
    y = torch.zeros(len(task), dtype=torch.long)
    with torch.no_grad():
        return StepComputer(linearized(module, tau), FirstPositionHead(), reg, batching).loss(task, y, reg_batches)[1]


@pytest.mark.parametrize("squared", [False, True])
@pytest.mark.parametrize("per_token", [True, False])
def test_step_penalty_equals_hand_computation_that_ignores_padding(per_token, squared):
    module = TinyBert(per_token=per_token).double()
    batching = SequenceBatching(pad_id=PAD, per_token=per_token)
    tau = random_tau(module, 0.05, seed=2)
    task = batching.collate(sequences(3, seed=7, lengths=(9, 12)))  # longer than every reg sequence
    reg_groups = [sequences(4, seed=8), sequences(2, seed=9, lengths=(2, 4))]
    lam = 0.7

    model = linearized(module, tau)
    with torch.no_grad():
        per_source = []
        for group in reg_groups:
            norms = torch.stack([alone(model.tangent, seq).norm() for seq in group])
            per_source.append((norms.square() if squared else norms).mean())
    by_hand = lam * torch.stack(per_source).mean()

    reg_batches = [batching.collate(g) for g in reg_groups]
    computed = penalty_term(module, tau, batching, task, reg_batches, lam, squared)
    assert float(by_hand) > 1e-3
    # the step scores in float32 (it casts outputs as it does for bf16 autocast); the module runs in float64
    assert float(computed) == pytest.approx(float(by_hand), rel=1e-6)
    # pad every batch more: the penalty must not change
    more = penalty_term(module, tau, batching, padded_more(task, 5), [padded_more(b, 3) for b in reg_batches],
                        lam, squared)
    assert float(more) == pytest.approx(float(by_hand), rel=1e-6)


# --------------------------------------------------------------------------- training and evaluation


LR = 2e-3


def recipe(mode: str, **kw) -> Recipe:
    base = dict(mode=mode, steps=8, batch_size=8, lr=LR, warmup=0.0, weight_decay=0.0, grad_clip=1.0, seed=0)
    return Recipe(**{**base, **kw})


def sequence_regularizer(batching: SequenceBatching, lam: float = 1.0) -> Regularizer:
    """One eager source (a collated SequenceBatch) and one lazy source collated per draw."""
    eager = UnlabeledSource("eager", batching.collate(sequences(10, seed=11)), seed=0)
    lazy = LazyUnlabeledSource("lazy", SequenceTask(sequences(10, seed=12)), seed=1, collate=batching.collate)
    return Regularizer([eager, lazy], lam=lam, batch_size=4)


TRAIN = sequences(32, seed=10)


def train_ce(module: nn.Module, mode: str, tau, batching: SequenceBatching) -> float:
    model = (NonLinearModel if mode == "nonlinear" else LinearizedModel)(copy.deepcopy(module))
    model.load_task_vector(tau)
    args, kwargs = batching.arguments(batching.collate(TRAIN))
    labels = torch.tensor([label for _, label in SequenceTask(TRAIN)])
    with torch.no_grad():
        return F.cross_entropy(classifier_head()(model(*args, **kwargs)), labels).item()


@pytest.mark.parametrize("mode", ["nonlinear", "linear", "taujp"])
def test_fine_tune_trains_the_sequence_classifier_in_every_mode(mode):
    module = TinyBert()
    batching = SequenceBatching(pad_id=PAD)
    before = state_fingerprint(module.state_dict())
    reg = sequence_regularizer(batching) if mode == "taujp" else None
    result = fine_tune(module, classifier_head(), SequenceTask(TRAIN), recipe(mode), reg, batching=batching)
    assert state_fingerprint(module.state_dict()) == before
    assert set(result.task_vector) == {n for n, _ in module.named_parameters()}
    assert all(torch.isfinite(t).all() for t in result.task_vector.values())
    assert train_ce(module, mode, result.task_vector, batching) < train_ce(module, mode, {}, batching)
    penalties = [h["penalty"] for h in result.history]
    if mode == "taujp":
        assert penalties[0] == 0.0 and all(p > 0 for p in penalties[1:])  # tau = 0 at the first step
    else:
        assert penalties == [0.0] * len(penalties)


def test_first_step_is_the_same_in_every_mode():
    """At tau = 0 f_lin = f with the same gradient, and the penalty's gradient is 0: one step banks the same vector."""
    batching = SequenceBatching(pad_id=PAD)
    vectors = {}
    for mode in ("nonlinear", "linear", "taujp"):
        reg = sequence_regularizer(batching) if mode == "taujp" else None
        vectors[mode] = fine_tune(TinyBert(), classifier_head(), SequenceTask(TRAIN), recipe(mode, steps=1), reg,
                                  batching=batching).task_vector
    assert max(float(t.abs().max()) for t in vectors["linear"].values()) == pytest.approx(LR, rel=1e-3)
    for mode in ("nonlinear", "taujp"):
        for name, t in vectors["linear"].items():
            # AdamW's first step is ~lr * sign(gradient): float32 noise in near-zero gradients moves it slightly
            torch.testing.assert_close(vectors[mode][name], t, rtol=0, atol=1e-4 * LR)


def test_taujp_lowers_the_penalty_on_other_sequences():
    batching = SequenceBatching(pad_id=PAD)
    others = batching.collate(sequences(10, seed=11))
    args, kwargs = batching.arguments(others)
    norms = {}
    for mode in ("linear", "taujp"):
        reg = sequence_regularizer(batching, lam=5.0) if mode == "taujp" else None
        tau = fine_tune(TinyBert(), classifier_head(), SequenceTask(TRAIN), recipe(mode, steps=12), reg,
                        batching=batching).task_vector
        with torch.no_grad():
            norms[mode] = float(penalty(linearized(TinyBert(), tau).tangent(*args, **kwargs)))
    assert norms["taujp"] < 0.7 * norms["linear"], norms


def test_classification_scorer_on_sequences_matches_per_example_argmax():
    module = TinyBert()
    batching = SequenceBatching(pad_id=PAD)
    task = SequenceTask(sequences(13, seed=13))
    tau = random_tau(module, 0.02, seed=3)
    head = classifier_head(seed=1)
    scores = evaluate_vector(module, "linear", tau, [ClassificationScorer("seq", head, task, batching)], batch_size=4)
    model = linearized(module, tau)
    with torch.no_grad():
        correct = [int(head(alone(model, ids)[None]).argmax()) == label for ids, label in task]
    assert 0 < sum(correct) < len(correct)  # a score that can tell right from wrong
    assert scores == {"seq": sum(correct) / len(correct)}


def test_a_stream_of_sequence_tasks_goes_through_the_backbones_batching(tmp_path):
    """run_stream trains, regularizes (lazy source of the earlier task), banks and scores variable-length
    sequences only if every stage uses the backbone's batching; scores checked per example, unpadded."""
    from editkit.bank.store import Bank
    from editkit.integrations.avalanche.benchmark import Experience
    from editkit.runs.stream import run_stream

    batching = SequenceBatching(pad_id=PAD)
    backbone = Backbone("tiny-bert", TinyBert(), HIDDEN, batching=batching)
    tasks = {name: (SequenceTask(sequences(24, seed=20 + i)), SequenceTask(sequences(11, seed=30 + i)))
             for i, name in enumerate(("first", "second"))}
    exps = [Experience(i, name, i, train, test, None, 2) for i, (name, (train, test)) in enumerate(tasks.items())]
    heads = {name: classifier_head(seed=i) for i, name in enumerate(tasks)}
    result = run_stream(exps, backbone, heads, recipe("taujp", steps=4, reg_batch=3), tmp_path / "bank",
                        scenario="sequences")

    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["first", "second"]
    merged = linearized(backbone.module, bank.merge({"first": 1.0, "second": 1.0}))
    with torch.no_grad():
        for name, (_, test) in tasks.items():
            correct = [int(heads[name](alone(merged, ids)[None]).argmax()) == label for ids, label in test]
            assert result.steps[-1].merged["per_task"][name] == pytest.approx(sum(correct) / len(correct))


def _partitions(items: list[int]):
    """Every partition of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1:]]


@pytest.mark.parametrize("seed", range(6))
def test_length_bands_are_the_cheapest_grouping_of_rows(seed):
    """Against every grouping of the rows (not only contiguous ones): one call per group costs its rows times
    its longest length plus the call cost."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (6,), generator=g)
    call_cost = [0, 5, 24, 200][seed % 4]
    bands = length_bands(lengths, call_cost)
    assert sorted(torch.cat(bands).tolist()) == list(range(6))
    cost = lambda groups: sum(len(b) * max(int(lengths[i]) for i in b) + call_cost for b in groups)
    assert cost([b.tolist() for b in bands]) == min(cost(p) for p in _partitions(list(range(6))))
    if call_cost == 0:
        assert len(bands) == len(set(lengths.tolist()))  # free calls: one band per length, no padding at all
    if call_cost == 200:
        assert len(bands) == 1
    same = length_bands(torch.full((5,), 7), call_cost)
    assert len(same) == 1 and sorted(same[0].tolist()) == list(range(5))  # equal lengths: one call, every row


@pytest.mark.parametrize("per_token", [False, True])
def test_a_batch_of_very_different_lengths_runs_in_bands_with_each_rows_own_output(per_token):
    """Short rows beside long ones run as separate calls, the short ones trimmed to their own longest; each
    row's output at its real positions (and the jvp's primal and tangent) is its output alone."""
    batching = SequenceBatching(pad_id=PAD, per_token=per_token)
    items = sequences(6, seed=1, lengths=(2, 4)) + sequences(3, seed=2, lengths=(40, 45))
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    items = [items[i] for i in order]
    batch = batching.collate(items)
    assert len(length_bands(batch.lengths())) == 2
    module = TinyBert(per_token=per_token, max_positions=64).double()
    model = linearized(module, random_tau(module, 0.02))
    calls = []
    with torch.no_grad():
        out = batching.run(lambda *a, **k: calls.append(a[0].shape) or module(*a, **k), batch)
        primal, tangent = batching.run(model.primal_and_tangent, batch)
        for row, ids in enumerate(items):
            got = out[row, : len(ids)] if per_token else out[row]
            torch.testing.assert_close(got, alone(module, ids), rtol=0, atol=1e-12)
            torch.testing.assert_close(primal[row], out[row], rtol=0, atol=1e-12)
            torch.testing.assert_close(tangent[row, : len(ids)] if per_token else tangent[row],
                                       alone(model, ids) - alone(module, ids), rtol=1e-9, atol=1e-12)
    longest_short = max(len(ids) for ids in items if len(ids) < 4)
    assert sorted((shape[0], shape[1]) for shape in calls) == [(3, batch.inputs.shape[1]), (6, longest_short)]


def test_a_step_over_bands_has_the_loss_penalty_and_gradient_of_one_call():
    """Short task texts with long reg texts: the step runs in bands, and its loss, penalty and gradient
    are those of one call over the concatenated batch."""
    batching = SequenceBatching(pad_id=PAD)
    short = batching.collate(sequences(8, seed=1, lengths=(2, 4)))
    long = batching.collate(sequences(2, seed=2, lengths=(20, 21)))
    joined = batching.concat(short, [long])
    assert len(length_bands(joined.lengths())) == 2
    module = TinyBert()
    head = classifier_head(seed=1)
    y = torch.tensor([0, 1] * 4)

    def step(run_in_bands: bool):
        model = linearized(module, random_tau(module, 0.02))
        computer = StepComputer(model, head, Regularizer([UnlabeledSource("x", long)], lam=0.5), batching)
        if not run_in_bands:
            computer.batching = OneCall(batching)
        ce, reg, _ = computer.loss(short, y, [long])
        (ce + reg).backward()
        return ce, reg, [p.grad.clone() for p in model.theta]

    banded, whole = step(True), step(False)
    torch.testing.assert_close(banded[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(banded[1], whole[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(banded[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class OneCall:
    """A sequence batching that always runs one call (what a GPU does)."""

    def __init__(self, batching: SequenceBatching) -> None:
        self.inner = batching

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, fn, batch):
        return call_on(self.inner, fn, batch)
