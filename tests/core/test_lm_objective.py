"""The language-modelling pieces of the core against hand computations.

The next-token loss against a loop over positions, the collation of per-position float inputs
(a frozen prefix's hidden states) and of token-id labels, the logits form of the tauJp penalty
(L2 over the sequence axis, averaged over examples and vocabulary, padding masked) and on the
distribution (twice the KL, by finite differences), and tauJp steps of a tiny GPT-2 tail whose logged
penalty is recomputed from the tangent by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from editkit.core.batching import IGNORE_INDEX, SequenceBatching
from editkit.core.linearize import LinearizedModel
from editkit.core.objectives import next_token_loss, next_token_nll
from editkit.core.taujp import distribution_penalty, penalty
from editkit.models.causal_lm import LanguageModelHead
from helpers.lm_steps import mean_distribution_norm, mean_sequence_norm, two_penalized_steps

# --------------------------------------------------------------------------- next-token loss


def test_next_token_nll_equals_a_hand_loop_over_real_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    lengths = [5, 3, 1]  # the last row predicts nothing: one token
    for row, length in enumerate(lengths):
        labels[row, length:] = IGNORE_INDEX
        logits[row, length:] = 1e4  # padded positions' logits must not matter either

    nll, count = 0.0, 0
    for row, length in enumerate(lengths):
        for t in range(length - 1):  # position t predicts token t + 1
            nll -= math.log(float(torch.softmax(logits[row, t].double(), 0)[labels[row, t + 1]]))
            count += 1
    got, got_count = next_token_nll(logits, labels)
    assert got_count == count == 4 + 2
    assert float(got) == pytest.approx(nll, rel=1e-6)
    assert float(next_token_loss(logits, labels)) == pytest.approx(nll / count, rel=1e-6)


def test_next_token_loss_of_all_padding_is_zero_not_nan():
    labels = torch.full((2, 3), IGNORE_INDEX)
    assert float(next_token_loss(torch.randn(2, 3, 4), labels)) == 0.0


def test_the_loss_of_hidden_states_projects_only_target_positions_and_is_the_hand_loss_with_its_gradient():
    """The head applied where a next token counts (a few targets, as focus_words leaves): the same loss as a loop over
    those positions (the loss is taken in float32, as the full one is), and the same gradient as projecting every position; padded or ignored positions'
    states never reach the head."""
    g = torch.Generator().manual_seed(3)
    head = LanguageModelHead(torch.nn.Linear(4, 9, bias=False).double())
    hidden = torch.randn(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    labels[0, [1, 2, 4]] = IGNORE_INDEX  # row 0 predicts tokens 3 and 5 only (positions 2 and 4)
    labels[1, 3:] = IGNORE_INDEX  # row 1: padding after 3 tokens (positions 0 and 1 predict)
    counted = [(0, 2), (0, 4), (1, 0), (1, 1)]
    weight = head.weight.detach()
    nll = -sum(float(torch.log_softmax(hidden[r, t].detach() @ weight.t(), 0)[labels[r, t + 1]]) for r, t in counted)
    projected = []
    head_forward = head.forward
    head.forward = lambda states: projected.append(states.shape[0]) or head_forward(states)
    loss = head.features_loss(hidden, labels)
    assert projected == [len(counted)]
    assert float(loss.detach()) == pytest.approx(nll / len(counted), rel=1e-6)
    (got,) = torch.autograd.grad(loss, hidden)
    (full,) = torch.autograd.grad(next_token_loss(head_forward(hidden), labels), hidden)
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-9)
    assert got[0, [0, 1, 3, 5]].abs().max() == 0 and got[1, 2:].abs().max() == 0


# --------------------------------------------------------------------------- collation of prefix states and labels


def test_collate_pads_float_items_with_zeros_and_builds_the_mask():
    batching = SequenceBatching(pad_id=7, per_token=True)  # a pad id for tokens; hidden states pad with 0
    g = torch.Generator().manual_seed(1)
    items = [torch.randn(length, 4, generator=g, dtype=torch.float64) for length in (2, 3, 1)]
    batch = batching.collate(items)
    assert batch.inputs.shape == (3, 3, 4) and batch.inputs.dtype == torch.float64
    for row, item in enumerate(items):
        assert torch.equal(batch.inputs[row, : len(item)], item)
        assert (batch.inputs[row, len(item):] == 0).all()
    assert batch.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert batching.output_mask(batch).tolist() == batch.attention_mask.bool().tolist()
    args, kwargs = batching.arguments(batch)
    assert args == (batch.inputs,) and kwargs == {"attention_mask": batch.attention_mask}


def test_concat_of_float_batches_pads_the_shorter_with_zeros():
    batching = SequenceBatching(pad_id=7, per_token=True)
    short = batching.collate([torch.ones(1, 2)])
    long = batching.collate([torch.ones(3, 2)])
    joined = batching.concat(short, [long])
    assert joined.inputs.tolist() == [[[1, 1], [0, 0], [0, 0]], [[1, 1], [1, 1], [1, 1]]]
    assert joined.attention_mask.tolist() == [[1, 0, 0], [1, 1, 1]]


def test_collate_labels_pads_token_ids_with_ignore_index_and_stacks_class_ids():
    batching = SequenceBatching(pad_id=7)
    labels = batching.collate_labels([torch.tensor([4, 5, 6]), torch.tensor([8])])
    assert labels.dtype == torch.long
    assert labels.tolist() == [[4, 5, 6], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batching.collate_labels([1, 0, 1]).tolist() == [1, 0, 1]


# --------------------------------------------------------------------------- the penalty on logit tangents


def test_over_sequence_penalty_is_the_hand_formula_over_real_positions():
    """mean over (n, v) of sqrt(sum over real t of tangent[n, t, v]^2); padded positions hold garbage."""
    tangent = torch.tensor([[[3.0, 0.0], [4.0, 1.0], [1e6, float("nan")]],
                            [[1.0, 2.0], [-1e6, 5.0], [7.0, float("inf")]]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    by_hand = (math.sqrt(3**2 + 4**2) + math.sqrt(0**2 + 1**2) + 1.0 + 2.0) / 4
    assert float(penalty(tangent, mask=mask, over_sequence=True)) == pytest.approx(by_hand)
    assert float(penalty(tangent, mask=mask, over_sequence=True, squared=True)) == pytest.approx((25 + 1 + 1 + 4) / 4)
    # against the per-example norm of every real entry, which the features penalty takes
    assert float(penalty(tangent, mask=mask)) == pytest.approx((math.sqrt(9 + 16 + 1) + math.sqrt(5)) / 2)


def test_over_sequence_penalty_matches_a_loop_on_random_tangents():
    g = torch.Generator().manual_seed(2)
    tangent = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    lengths = [6, 2, 4]
    mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long()
    by_hand = sum(math.sqrt(sum(float(tangent[n, t, v]) ** 2 for t in range(lengths[n])))
                  for n in range(3) for v in range(5)) / 15
    assert float(penalty(tangent, mask=mask, over_sequence=True)) == pytest.approx(by_hand, rel=1e-12)


# --------------------------------------------------------------------------- the penalty on the distribution


def test_distribution_penalty_by_hand_on_two_tokens():
    """p = (1/2, 1/2), tangent (1, -1): the log-probabilities' tangent is (1, -1), its p-weighted squared norm 1;
    p = (0.9, 0.1) (logits log 9, 0), tangent (0, 1): the mean moves by 0.1, the variance is 0.9 * 0.01 + 0.1 * 0.81."""
    logits = torch.tensor([[[0.0, 0.0], [math.log(9.0), 0.0]]], dtype=torch.float64)
    tangent = torch.tensor([[[1.0, -1.0], [0.0, 1.0]]], dtype=torch.float64)
    assert float(distribution_penalty(logits, tangent, squared=True)) == pytest.approx(1.0 + 0.09)
    assert float(distribution_penalty(logits, tangent)) == pytest.approx(math.sqrt(1.09))


def test_distribution_penalty_is_twice_the_kl_by_finite_differences_over_real_positions():
    """Per example, sum over real positions of 2 KL(softmax(z) || softmax(z + eps t)) / eps^2, averaged over +-eps
    (the cubic term cancels; float64, eps 1e-4): the squared penalty. Padded positions hold garbage that must
    not count."""
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    tangent = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    lengths = [5, 2, 4]
    mask = (torch.arange(5) < torch.tensor(lengths)[:, None]).long()
    eps = 1e-4
    log_p = logits.log_softmax(-1)
    kl = sum((log_p.exp() * (log_p - (logits + e * tangent).log_softmax(-1))).sum(-1) for e in (eps, -eps)) / 2
    per_example = [2 * float(kl[n, :length].sum()) / eps**2 for n, length in enumerate(lengths)]
    logits[~mask.bool()] = float("nan")
    tangent[~mask.bool()] = float("inf")
    assert float(distribution_penalty(logits, tangent, mask=mask, squared=True)) == pytest.approx(
        sum(per_example) / 3, rel=1e-6)
    assert float(distribution_penalty(logits, tangent, mask=mask)) == pytest.approx(
        sum(math.sqrt(v) for v in per_example) / 3, rel=1e-6)


def test_distribution_penalty_ignores_a_shift_of_every_logit_and_has_a_gradient_at_zero():
    """Adding the same number to every logit leaves the distribution alone; at tau = 0 (a run's first step)
    the gradient is finite."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 7, generator=g)
    assert float(distribution_penalty(logits, torch.full((2, 3, 7), 5.0))) == pytest.approx(0.0, abs=1e-5)
    tangent = torch.zeros(2, 3, 7, requires_grad=True)
    distribution_penalty(logits, tangent).backward()
    assert torch.isfinite(tangent.grad).all()


# --------------------------------------------------------------------------- one tauJp step on logits


def test_taujp_on_logits_logs_lambda_free_penalty_of_the_heads_image_of_the_tangent():
    """Two steps of a GPT-2 tail with penalty_on = logits; step 1's logged penalty is recomputed by hand: the
    head applied to the linearized tail's tangent at the one-step vector, on the reg batch drawn second."""
    run = two_penalized_steps("taujp", "logits")
    batch = run.reg_batch
    model = LinearizedModel(run.backbone.module)
    model.load_task_vector(run.tau)
    with torch.no_grad():
        logits_tangent = run.backbone.head(model.tangent(batch.inputs, attention_mask=batch.attention_mask))
    by_hand = mean_sequence_norm(logits_tangent, batch.attention_mask.sum(1).tolist(), per_vocabulary=True)
    assert by_hand > 1e-4
    assert run.two.history[1]["penalty"] == pytest.approx(by_hand, rel=1e-5)


def test_taujp_on_the_distribution_logs_the_p_weighted_norm_of_the_log_probabilities_tangent():
    """penalty_on = distribution: step 1's logged penalty by hand, per real position sum_v p_v (t_v - E_p t)^2
    with p theta_0's next-token distribution and t the head's image of the linearized tail's tangent, summed
    over the sequence, square-rooted, averaged over the reg batch."""
    run = two_penalized_steps("taujp", "distribution")
    batch = run.reg_batch
    model = LinearizedModel(run.backbone.module)
    model.load_task_vector(run.tau)
    head = run.backbone.head
    with torch.no_grad():
        logits = head(run.backbone.module(batch.inputs, attention_mask=batch.attention_mask))
        tangent = head(model.tangent(batch.inputs, attention_mask=batch.attention_mask))
    lengths = batch.attention_mask.sum(1).tolist()
    by_hand = mean_distribution_norm(logits, tangent, lengths)
    assert min(lengths) < batch.inputs.shape[1] and by_hand > 1e-4
    assert run.two.history[1]["penalty"] == pytest.approx(by_hand, rel=1e-4)
