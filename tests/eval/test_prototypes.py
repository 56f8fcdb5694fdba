"""Class statistics and the head they make: means and within-class scatters of normalized features checked by
hand, the shared-covariance discriminant over every listed task's classes (global offsets included) against
numpy input by input, its shrinkage's two ends, and the bench's class-incremental accuracy of a combination
(merged statistics) and of theta_0 (pretrained ones) counted input by input."""

from __future__ import annotations

import math

import pytest
import torch

from editkit.core.prototypes import Prototypes, capped_rows, class_head, class_prototypes
from editkit.errors import BankError, ConfigError
from editkit.settings import CLASS_HEAD_SHRINKAGE

from helpers.prototypes import CLASSES, evaluator_setup, features_at, head_by_hand, random_prototypes

R = 1 / math.sqrt(2)


def test_statistics_are_per_class_means_and_scatters_of_the_normalized_features():
    """Inputs of very different norms count alike: class 0 averages (3, 4)/5 and (10, 0)/10, class 1 (0, 2)/2 and
    (1, 1)/sqrt 2; each class's two inputs sit +-d from its mean, so it scatters 2 d d^T; the pretrained set is
    computed the same way from its own features."""
    merged = torch.tensor([[3.0, 4.0], [0.0, 2.0], [10.0, 0.0], [1.0, 1.0]])
    pretrained = torch.tensor([[0.0, -7.0], [5.0, 0.0], [0.0, -1.0], [0.0, 3.0]])
    labels = torch.tensor([0, 1, 0, 1])
    found = class_prototypes(merged, pretrained, labels, 2, task="t")
    torch.testing.assert_close(found.merged, torch.tensor([[0.8, 0.4], [R / 2, (1 + R) / 2]]))
    torch.testing.assert_close(found.pretrained, torch.tensor([[0.0, -1.0], [0.5, 0.5]]))
    d0, d1 = torch.tensor([0.2, -0.4]), torch.tensor([R / 2, (R - 1) / 2])
    torch.testing.assert_close(found.merged_scatter, 2 * torch.outer(d0, d0) + 2 * torch.outer(d1, d1))
    # pretrained: class 0's two inputs are both (0, -1), class 1's (1, 0) and (0, 1) sit +-(0.5, -0.5) from its mean
    torch.testing.assert_close(found.pretrained_scatter, torch.tensor([[0.5, -0.5], [-0.5, 0.5]]))
    assert found.counts.tolist() == [2, 2] and found.classes == 2 and found.examples == 4
    assert found.merged.dtype == torch.float32 and found.merged_scatter.dtype == torch.float32
    assert found.describe() == {"format": "prototypes-2", "classes": 2, "features": 2, "examples": 4}


def test_a_class_without_an_input_has_no_mean_and_is_never_chosen():
    """Classes 1 and 3 have no training input: count 0, a zero row, and an input facing away from every real
    mean still goes to one of them, not to an empty class."""
    features = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [2.0, 0.0, 0.1], [0.0, 3.0, -0.1]])
    found = class_prototypes(features, features, torch.tensor([0, 2, 0, 2]), 4, task="cars")
    assert found.counts.tolist() == [2, 0, 2, 0] and found.examples == 4
    assert found.merged[1].abs().sum() == 0 and found.merged[3].abs().sum() == 0
    head = class_head([found], "merged", CLASS_HEAD_SHRINKAGE)
    assert set(head.predict(torch.randn(200, 3, generator=torch.Generator().manual_seed(0))).tolist()) <= {0, 2}


def test_a_label_outside_the_classes_is_refused_by_task_and_label():
    features = torch.randn(4, 3)
    with pytest.raises(ConfigError, match="task cars: label 5 is not one of its 3 classes"):
        class_prototypes(features, features, torch.tensor([0, 1, 2, 5]), 3, task="cars")


def test_prototypes_of_mismatched_shapes_are_refused():
    square = torch.eye(4)
    with pytest.raises(ConfigError, match="one count per class"):
        Prototypes(torch.zeros(3, 4), torch.zeros(3, 5), square, square, torch.ones(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="one count per class"):
        Prototypes(torch.zeros(3, 4), torch.zeros(3, 4), square, square, torch.ones(2, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"scatters .*\(4, 5\)"):
        Prototypes(torch.zeros(3, 4), torch.zeros(3, 4), square, torch.zeros(4, 5), torch.ones(3, dtype=torch.long))


@pytest.mark.parametrize("shrinkage", [0.0, 0.3, CLASS_HEAD_SHRINKAGE])
def test_the_head_is_the_shared_covariance_discriminant_over_every_listed_tasks_classes(shrinkage):
    """Three tasks of 2, 3 and 1 classes: the winner's global index is its task's offset (0, 2, 5) plus its
    class, checked against numpy input by input; the features' norms do not matter (normalized first)."""
    tasks = [random_prototypes(2, 4, 0), random_prototypes(3, 4, 1), random_prototypes(1, 4, 2)]
    g = torch.Generator().manual_seed(0)
    features = torch.randn(200, 4, generator=g)
    found = class_head(tasks, "merged", shrinkage).predict(features)
    assert found.tolist() == head_by_hand(features, tasks, "merged", shrinkage)
    won = set(found.tolist())  # every task wins somewhere: the offsets are exercised
    assert won & {0, 1} and won & {2, 3, 4} and 5 in won
    assert torch.equal(class_head(tasks, "merged", shrinkage).predict(features * torch.rand(200, 1, generator=g) * 50),
                       found)
    assert found.tolist() != class_head(tasks, "pretrained", shrinkage).predict(features).tolist()


def test_shrinkage_one_is_the_euclidean_nearest_mean_of_the_normalized_features():
    tasks = [random_prototypes(2, 4, 3), random_prototypes(3, 4, 4)]
    features = torch.randn(300, 4, generator=torch.Generator().manual_seed(1))
    means = torch.cat([t.merged for t in tasks])
    nearest = torch.cdist(torch.nn.functional.normalize(features, dim=1), means).argmin(dim=1)
    assert torch.equal(class_head(tasks, "merged", 1.0).predict(features), nearest)


def test_the_discriminant_discounts_the_direction_the_classes_spread_along():
    """Class means (0, 0.95) and (0.3, 1.0), both classes spread widely along x and hardly along y. The input
    (0.05, 1) is 0.07 from class 0's mean and 0.25 from class 1's, but along y, the direction neither class spreads
    in, it sits at class 1's height: the discriminant (shrinkage 0) follows y, the nearest mean (shrinkage 1) x."""
    means = torch.tensor([[0.0, 0.95], [0.3, 1.0]])
    scatter = torch.tensor([[10.0, 0.0], [0.0, 0.01]])
    task = Prototypes(means, means, scatter, scatter, torch.tensor([50, 50]))
    x = torch.tensor([[0.05, 1.0]])
    assert class_head([task], "merged", 1.0).predict(x).tolist() == [0]
    assert class_head([task], "merged", 0.0).predict(x).tolist() == [1]


def test_capped_rows_take_at_most_the_cap_per_class_by_a_seeded_choice():
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 7)
    rows = capped_rows(labels, 4, seed=5)
    assert rows.tolist() == sorted(rows.tolist()) and len(set(rows.tolist())) == len(rows)
    assert torch.bincount(labels[rows]).tolist() == [4, 3, 4]
    assert torch.equal(capped_rows(labels, 4, seed=5), rows)
    assert not torch.equal(capped_rows(labels, 4, seed=6), rows)
    assert capped_rows(labels, 100, seed=5).tolist() == list(range(20))


# ----------------------------------------------------------------------------- the bench's evaluator


def class_incremental_by_hand(module, tasks, vectors, banked, combo, linearized, among):
    """Each task's accuracy, input by input: its features at the combination, the discriminant over the
    statistics of ``among`` (merged for a combination, pretrained for theta_0), right when it is the input's
    own class of its own task."""
    kind = "merged" if combo else "pretrained"
    tau = {k: sum(c * vectors[v][k] for v, c in combo.items()) for k in vectors["a"]} if combo else None
    out = {}
    for task in tasks:
        x = task.test.inputs
        if tau is None:
            with torch.no_grad():
                features = module(x)
        else:
            features = features_at(module, tau, x, linearized=linearized)
        offset = sum(CLASSES[t] for t in among[: among.index(task.name)])
        predicted = head_by_hand(features, [banked[t] for t in among], kind, CLASS_HEAD_SHRINKAGE)
        right = sum(p == offset + int(y) for p, y in zip(predicted, task.test.targets))
        out[task.name] = right / len(task.test.targets)
    return out


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_class_incremental_accuracy_is_the_head_over_the_seen_classes(tmp_path, mode):
    """theta_0 is scored against the pretrained sets, a combination against the merged ones; ``among`` decides
    which tasks' classes compete (the seen ones: a prefix of the stream, in any order)."""
    module, tasks, vectors, banked, ev = evaluator_setup(tmp_path, mode)
    if ev.linearized:
        ev.compute_tangents(["a", "b"])
    for combo in ({}, {"a": 1.0, "b": 1.0}, {"b": 0.5}):
        for among in (["a", "b"], ["b", "a"]):
            expected = class_incremental_by_hand(module, tasks, vectors, banked, combo, ev.linearized, among)
            found = ev.class_incremental_accuracies(combo, "test", ["a", "b"], among=among)
            assert found == pytest.approx(expected, abs=1e-9)
        alone = class_incremental_by_hand(module, tasks[:1], vectors, banked, combo, ev.linearized, ["a"])
        assert ev.class_incremental_accuracies(combo, "test", ["a"], among=["a"]) == pytest.approx(alone, abs=1e-9)
        assert ev.class_incremental_accuracies(combo, "test", ["a", "b"]) == pytest.approx(
            class_incremental_by_hand(module, tasks, vectors, banked, combo, ev.linearized, ["a", "b"]), abs=1e-9)


def test_the_pretrained_and_merged_sets_give_different_answers(tmp_path):
    """The check above would pass with one set for both if the two happened to agree: here they do not."""
    _, _, _, banked, ev = evaluator_setup(tmp_path, "linear")
    ev.compute_tangents(["a", "b"])
    theta0 = ev.class_incremental_accuracies({}, "test", ["a", "b"])
    assert not torch.equal(banked["a"].merged, banked["a"].pretrained)
    assert theta0 != ev.class_incremental_accuracies({"a": 1e-9}, "test", ["a", "b"])


def test_a_task_outside_among_or_among_outside_the_stream_is_refused(tmp_path):
    _, _, _, _, ev = evaluator_setup(tmp_path, "nonlinear")
    with pytest.raises(ConfigError, match="among b: the classes seen are those of the stream's first tasks .a, b."):
        ev.class_incremental_accuracies({}, "test", ["b"], among=["b"])
    with pytest.raises(ConfigError, match="task.s. b are not among the tasks classified over .a."):
        ev.class_incremental_accuracies({}, "test", ["a", "b"], among=["a"])
    with pytest.raises(ConfigError, match="the stream's tasks are a, b"):
        ev.class_incremental_accuracies({}, "test", ["a"], among=["a", "imagenet"])


def test_a_bank_without_prototypes_is_refused_naming_the_task_and_the_resume_that_fills_them_in(tmp_path):
    _, _, _, _, ev = evaluator_setup(tmp_path, "nonlinear", prototypes=False)
    assert set(ev.accuracies({"a": 1.0}, "test", ["a", "b"])) == {"a", "b"}  # task-incremental needs none
    with pytest.raises(BankError, match=r"task a's vector 'a' was banked without class prototypes \(or with an "
                                        r"earlier format of them\); fill them in "
                                        r"with `editkit stream --scenario tiny --mode nonlinear --bank .* --resume`"):
        ev.class_incremental_accuracies({"a": 1.0}, "test", ["a", "b"])
