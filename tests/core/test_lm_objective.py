"""The language-modelling pieces of the core against hand computations.

The next-token loss against a loop over positions, the collation of per-position float inputs
(a frozen prefix's hidden states) and of token-id labels, the logits form of the tauJp penalty
(L2 over the sequence axis, averaged over examples and vocabulary, padding masked), and one
tauJp step of a tiny GPT-2 tail whose logged penalty is recomputed from the tangent by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from editkit.core.batching import IGNORE_INDEX, SequenceBatching
from editkit.core.linearize import LinearizedModel
from editkit.core.objectives import next_token_loss, next_token_nll
from editkit.core.taujp import penalty
from helpers.lm_steps import mean_sequence_norm, two_penalized_steps

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
