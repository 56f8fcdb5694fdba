"""Two penalized steps of a tiny GPT-2's last block on cached prefix states, for tests that recompute
the logged penalty by hand (per mode, on features or logits)."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from editkit.core.batching import IGNORE_INDEX
from editkit.core.objectives import next_token_loss
from editkit.core.taujp import Regularizer, UnlabeledSource
from editkit.models.causal_lm import causal_lm_backbone
from editkit.train.loop import FineTuneResult, fine_tune
from editkit.train.recipe import Recipe
from helpers import models


@dataclass
class TwoSteps:
    """A two-step run, the one-step run's vector, and the reg batch step 1's penalty was taken on."""

    backbone: Any
    two: FineTuneResult
    tau: dict[str, torch.Tensor]
    reg_batch: Any


def _blocks(seed: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 99, (length,), generator=g) for length in lengths]


def two_penalized_steps(mode: str, penalty_on: str) -> TwoSteps:
    """Two steps (lambda 0.3, 3 reg rows from 5 padded blocks) of a 2-layer GPT-2 with its last block trainable.

    Checks step 0, which is at theta_0: penalty 0 and the full model's own next-token loss. Step 1's
    penalty is taken at the one-step vector (what a one-step run returns) on the reg batch drawn second.
    """
    lm = models.gpt2(n_layer=2, attn_implementation="sdpa")
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1)
    batching = backbone.batching

    def states(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        batch = batching.collate(blocks)
        hidden = backbone.prefix(batch.inputs, batch.attention_mask)
        return [h[: len(b)] for h, b in zip(hidden, blocks)]

    train_blocks = _blocks(0, (6, 4, 5, 3))
    train = list(zip(states(train_blocks), train_blocks))
    reg_inputs = batching.collate(states(_blocks(1, (5, 2, 4, 3, 6))))

    def regularizer() -> Regularizer:
        return Regularizer([UnlabeledSource("other", reg_inputs, seed=0)], lam=0.3, batch_size=3,
                           measure=penalty_on)

    recipe = Recipe(mode=mode, steps=2, batch_size=len(train), lr=1e-2, warmup=0.0, grad_clip=1e9,
                    penalty_on=penalty_on)
    two = fine_tune(backbone.module, backbone.head, train, recipe, regularizer(), batching=batching)
    one = fine_tune(backbone.module, backbone.head, train, recipe.with_overrides(steps=1), regularizer(),
                    batching=batching)

    ids = batching.collate_labels(train_blocks)
    full = lm(input_ids=torch.where(ids == IGNORE_INDEX, 0, ids), attention_mask=(ids != IGNORE_INDEX).long())
    assert two.history[0]["penalty"] == 0.0
    assert two.history[0]["ce"] == pytest.approx(float(next_token_loss(full.logits, ids)), rel=1e-5)

    draws = regularizer()
    draws.batches(0)
    (reg_batch,) = draws.batches(1)
    return TwoSteps(backbone, two, one.task_vector, reg_batch)


def mean_sequence_norm(tangent: torch.Tensor, lengths: list[int], *, per_vocabulary: bool) -> float:
    """The penalty by hand: L2 over each sequence's real positions, averaged over sequences (and, for logit
    tangents, over the vocabulary: one norm per sequence and vocabulary entry)."""
    if per_vocabulary:
        vocab = tangent.shape[-1]
        return sum(float(tangent[n, :length, v].norm()) for n, length in enumerate(lengths)
                   for v in range(vocab)) / (len(lengths) * vocab)
    return sum(float(tangent[n, :length].norm()) for n, length in enumerate(lengths)) / len(lengths)


def mean_distribution_norm(logits: torch.Tensor, tangent: torch.Tensor, lengths: list[int]) -> float:
    """The distribution penalty by hand: per real position sum_v p_v (t_v - E_p t)^2 with p = softmax(logits),
    summed over each sequence, square-rooted, averaged over sequences."""
    probs, tangent = logits.double().softmax(-1), tangent.double()
    per_position = (probs * tangent**2).sum(-1) - (probs * tangent).sum(-1) ** 2
    return sum(math.sqrt(float(per_position[n, :length].sum())) for n, length in enumerate(lengths)) / len(lengths)
