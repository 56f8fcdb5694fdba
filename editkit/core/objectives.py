"""Training objectives a fixed head defines for its task.

A classification head is trained with cross-entropy on ``(N, C)`` logits. A language
model's head predicts the next token at every position: its logits are ``(N, T, V)``
and its labels the token ids ``(N, T)``, with ``IGNORE_INDEX`` where the sequence is
padding. A head that is not a classifier carries its own ``loss`` method
(:func:`head_loss` finds it), so the train loop needs to know no modality.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from editkit.core.batching import IGNORE_INDEX

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def head_loss(head: nn.Module) -> Loss:
    """The head's own ``loss(logits, labels)`` if it defines one, else cross-entropy over classes."""
    return getattr(head, "loss", F.cross_entropy)


def features_loss(head: nn.Module) -> Loss:
    """The training loss of ``head`` on features ``(features, labels) -> loss``: the head's own ``features_loss`` if
    it defines one (a head that need not score every position, such as a language model's where few tokens are
    targets), else :func:`head_loss` of its logits."""
    if hasattr(head, "features_loss"):
        return head.features_loss
    loss = head_loss(head)
    return lambda features, labels: loss(head(features), labels)


def next_token_loss_of_states(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`next_token_loss` of ``head(hidden)``, the head applied only at the positions whose next token is a
    target: the same loss, but the vocabulary-wide projection (most of a small model's step) skips the positions
    that do not count (padding, the token after an end of text, the tokens ``focus_words`` leaves out)."""
    targets = labels[:, 1:]
    kept = targets != IGNORE_INDEX
    logits = head(hidden[:, :-1][kept]).float()
    return F.cross_entropy(logits, targets[kept], reduction="sum") / max(1, int(kept.sum()))


def next_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of -log p(next token), number of predicted tokens) of a batch of sequences.

    Position t's logits predict the token at t + 1 (the causal shift); targets equal to
    ``IGNORE_INDEX`` (padding) are skipped. Summing over tokens, not averaging per
    sequence, lets callers weight every token of a corpus equally: perplexity is
    ``exp(total nll / total tokens)``.
    """
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    targets = labels[:, 1:].reshape(-1)
    nll = F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, int((targets != IGNORE_INDEX).sum())


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood over the batch's real target tokens (the LM training loss)."""
    nll, count = next_token_nll(logits, labels)
    return nll / max(1, count)
