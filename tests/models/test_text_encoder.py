"""Text encoders as backbones: a tiny random BERT split into a frozen prefix and a pooled tail.

Ground truth: the whole ``BertModel`` run on each text alone (no padding at all) and pooled by hand,
and central finite differences of the tail in float64.
"""

from __future__ import annotations

import pytest
import torch

from editkit.core.linearize import LinearizedModel
from editkit.errors import ConfigError
from editkit.models.blocks import ALL_BLOCKS
from editkit.models.heads import fit_probe, probe_head
from editkit.models.text_encoder import encoder_backbone, pool
from helpers import models
from helpers.tangents import central_difference, random_direction

LAYERS = 3
LENGTHS = (7, 4, 2)


def tiny_bert(**config):
    return models.bert(num_hidden_layers=LAYERS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       **config)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (pad id 0) of rows of different real lengths, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    ids = torch.randint(1, 99, (len(LENGTHS), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(LENGTHS)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def features(backbone, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return backbone.module(backbone.prefix(ids, mask), attention_mask=mask)


@pytest.mark.parametrize("blocks", [1, ALL_BLOCKS])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_features_of_a_padded_batch_are_each_text_alone_pooled_by_hand(blocks, pooling):
    encoder = tiny_bert()
    backbone = encoder_backbone(encoder, None, pooling=pooling, trainable_blocks=blocks)
    ids, mask = padded_batch()
    got = features(backbone, ids, mask)
    for row, length in enumerate(LENGTHS):
        with torch.no_grad():
            hidden = encoder(input_ids=ids[row : row + 1, :length]).last_hidden_state[0]
        want = hidden.mean(dim=0) if pooling == "mean" else hidden[0]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_mean_pooling_ignores_padded_positions_whatever_they_hold():
    hidden = torch.randn(2, 5, 3)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    noisy = hidden.clone()
    noisy[0, 2:] = 1e6
    torch.testing.assert_close(pool(noisy, mask, "mean"), torch.stack([hidden[0, :2].mean(0), hidden[1].mean(0)]))


@pytest.mark.parametrize("blocks", [1, ALL_BLOCKS])
def test_linearized_tail_tangent_matches_central_differences_with_masks(blocks):
    backbone = encoder_backbone(tiny_bert().double(), None, trainable_blocks=blocks)
    ids, mask = padded_batch(seed=3)
    hidden = backbone.prefix(ids, mask)
    direction = random_direction(backbone.module, seed=1)
    finite = central_difference(backbone.module, direction, 1e-6, hidden, mask)
    linear = LinearizedModel(backbone.module)
    linear.load_task_vector(direction)
    primal, tangent = linear.primal_and_tangent(hidden, attention_mask=mask)
    assert torch.linalg.vector_norm(tangent - finite) / torch.linalg.vector_norm(finite) < 1e-6
    with torch.no_grad():
        torch.testing.assert_close(primal, backbone.module(hidden, attention_mask=mask))


def test_theta_is_the_last_blocks_under_their_own_index_and_no_pooler_or_embedding():
    backbone = encoder_backbone(tiny_bert(), None, trainable_blocks=2)
    names = [n for n, _ in backbone.module.named_parameters()]
    assert {n.split(".")[2] for n in names} == {"1", "2"}
    assert all(n.startswith("tail.layers.") for n in names)
    assert backbone.name == "text-encoder[mean, tail 2/3]"


def test_unknown_pooling_and_bad_block_counts_are_refused():
    with pytest.raises(ConfigError, match="pooling must be one of mean, cls"):
        encoder_backbone(tiny_bert(), None, pooling="max")
    with pytest.raises(ConfigError, match=r"trainable_blocks must be an integer in 1\.\.3"):
        encoder_backbone(tiny_bert(), None, trainable_blocks=4)


def test_probe_head_reads_texts_of_different_lengths():
    """The probe collates variable-length prefix states through the backbone's batching: it is the logistic
    regression of the features of each text computed alone, unpadded."""
    from editkit.data.tasks import TaskData
    from editkit.data.text import TokenSequences

    backbone = encoder_backbone(tiny_bert(), None)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(1, 99, (int(n),), generator=g) for n in torch.randint(2, 9, (12,), generator=g)]
    labels = torch.tensor([0, 1] * 6)
    train = TokenSequences(ids, backbone, labels=labels)
    head = probe_head(backbone, TaskData("t", ["a", "b"], train, train, train), shots=6, seed=0)
    pooled = torch.stack([features(backbone, i[None], torch.ones(1, len(i), dtype=torch.long))[0] for i in ids])
    want = fit_probe(pooled, labels, 2, seed=0)
    torch.testing.assert_close(head.weight, want.weight, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.bias, want.bias, rtol=1e-4, atol=1e-4)
