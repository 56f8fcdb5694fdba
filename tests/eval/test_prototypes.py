"""Class prototypes and the head they make: means of normalized features checked by hand, the cosine argmax over
every listed task's classes (global offsets included), and the bench's class-incremental accuracy of a
combination (tuned prototypes) and of theta_0 (pretrained ones) counted input by input."""

from __future__ import annotations

import math

import pytest
import torch

from editkit.core.prototypes import Prototypes, capped_rows, class_prototypes, nearest
from editkit.errors import BankError, ConfigError

from helpers.prototypes import CLASSES, evaluator_setup, features_at, nearest_by_hand

R = 1 / math.sqrt(2)


def test_prototypes_are_per_class_means_of_the_normalized_features():
    """Inputs of very different norms count alike: class 0 averages (3, 4)/5 and (10, 0)/10, class 1 (0, 2)/2 and
    (1, 1)/sqrt 2; the pretrained set is computed the same way from its own features."""
    tuned = torch.tensor([[3.0, 4.0], [0.0, 2.0], [10.0, 0.0], [1.0, 1.0]])
    pretrained = torch.tensor([[0.0, -7.0], [5.0, 0.0], [0.0, -1.0], [0.0, 3.0]])
    labels = torch.tensor([0, 1, 0, 1])
    found = class_prototypes(tuned, pretrained, labels, 2, task="t")
    torch.testing.assert_close(found.tuned, torch.tensor([[0.8, 0.4], [R / 2, (1 + R) / 2]]))
    torch.testing.assert_close(found.pretrained, torch.tensor([[0.0, -1.0], [0.5, 0.5]]))
    assert found.counts.tolist() == [2, 2] and found.classes == 2 and found.examples == 4
    assert found.tuned.dtype == torch.float32
    assert found.describe() == {"format": "prototypes-1", "classes": 2, "features": 2, "examples": 4}


def test_a_class_without_an_input_has_no_prototype_and_is_never_chosen():
    """Classes 1 and 3 have no training input: count 0, a zero row, and an input facing away from every real
    prototype still goes to the least far of them, not to an empty class's cosine of 0."""
    features = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    found = class_prototypes(features, features, torch.tensor([0, 2, 0, 2]), 4, task="cars")
    assert found.counts.tolist() == [2, 0, 2, 0] and found.examples == 4
    torch.testing.assert_close(found.tuned, torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 1.0, 0], [0, 0, 0]]))
    assert nearest(torch.tensor([[-1.0, -2.0, 0.0], [-2.0, -1.0, 0.0], [0.0, 1.0, 0.1]]), [found.tuned]).tolist() == [0, 2, 2]


def test_a_label_outside_the_classes_is_refused_by_task_and_label():
    features = torch.randn(4, 3)
    with pytest.raises(ConfigError, match="task cars: label 5 is not one of its 3 classes"):
        class_prototypes(features, features, torch.tensor([0, 1, 2, 5]), 3, task="cars")


def test_prototypes_of_mismatched_shapes_are_refused():
    with pytest.raises(ConfigError, match="one count per class"):
        Prototypes(torch.zeros(3, 4), torch.zeros(3, 5), torch.ones(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="one count per class"):
        Prototypes(torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(2, dtype=torch.long))


def test_nearest_is_the_cosine_argmax_over_every_listed_tasks_classes_with_global_offsets():
    """Three tasks of 2, 3 and 1 classes: the winner's global index is its task's offset (0, 2, 5) plus its
    class. The prototypes' norms differ by orders of magnitude, which a dot product would follow."""
    g = torch.Generator().manual_seed(0)
    means = [torch.randn(2, 4, generator=g) * 100, torch.randn(3, 4, generator=g), torch.randn(1, 4, generator=g) * 0.01]
    features = torch.randn(200, 4, generator=g)
    found = nearest(features, means)
    assert found.tolist() == nearest_by_hand(features, means)
    assert set(found.tolist()) >= {0, 2, 5}  # every task wins somewhere: the offsets are exercised
    assert torch.equal(nearest(features * torch.rand(200, 1, generator=g) * 50, means), found)  # scale-free


def test_nearest_follows_the_angle_not_the_length():
    """(1, 0.1) is closer in angle to task 1's (1, 0) than to task 0's (10, 10), whose dot product is larger."""
    assert nearest(torch.tensor([[1.0, 0.1]]), [torch.tensor([[10.0, 10.0]]), torch.tensor([[1.0, 0.0]])]).tolist() == [1]


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
    """Each task's accuracy, input by input: its features at the combination, the cosine argmax over the
    prototypes of ``among`` (tuned for a combination, pretrained for theta_0), right when it is the input's
    own class of its own task."""
    kind = "tuned" if combo else "pretrained"
    means = [banked[t].means(kind) for t in among]
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
        predicted = nearest_by_hand(features, means)
        right = sum(p == offset + int(y) for p, y in zip(predicted, task.test.targets))
        out[task.name] = right / len(task.test.targets)
    return out


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_class_incremental_accuracy_is_the_nearest_prototype_among_the_seen_classes(tmp_path, mode):
    """theta_0 is scored against the pretrained sets, a combination against the tuned ones; ``among`` decides
    which tasks' classes compete, in its order."""
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


def test_the_pretrained_and_tuned_sets_give_different_answers(tmp_path):
    """The check above would pass with one set for both if the two happened to agree: here they do not."""
    _, _, _, banked, ev = evaluator_setup(tmp_path, "linear")
    ev.compute_tangents(["a", "b"])
    theta0 = ev.class_incremental_accuracies({}, "test", ["a", "b"])
    assert not torch.equal(banked["a"].tuned, banked["a"].pretrained)
    assert theta0 != ev.class_incremental_accuracies({"a": 1e-9}, "test", ["a", "b"])


def test_a_task_outside_among_or_among_outside_the_stream_is_refused(tmp_path):
    _, _, _, _, ev = evaluator_setup(tmp_path, "nonlinear")
    with pytest.raises(ConfigError, match="task.s. b are not among the tasks classified over .a."):
        ev.class_incremental_accuracies({}, "test", ["a", "b"], among=["a"])
    with pytest.raises(ConfigError, match="the stream's tasks are a, b"):
        ev.class_incremental_accuracies({}, "test", ["a"], among=["a", "imagenet"])


def test_a_bank_without_prototypes_is_refused_naming_the_task_and_the_resume_that_fills_them_in(tmp_path):
    _, _, _, _, ev = evaluator_setup(tmp_path, "nonlinear", prototypes=False)
    assert set(ev.accuracies({"a": 1.0}, "test", ["a", "b"])) == {"a", "b"}  # task-incremental needs none
    with pytest.raises(BankError, match=r"task a's vector 'a' was banked without class prototypes; fill them in "
                                        r"with `editkit stream --scenario tiny --mode nonlinear --bank .* --resume`"):
        ev.class_incremental_accuracies({"a": 1.0}, "test", ["a", "b"])
