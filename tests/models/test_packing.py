"""Packed rows: a padded batch of texts through an encoder's tail with no padding computed.

Ground truth: the same tail run on the padded batch without packing (outputs at real positions,
gradients of a loss over them, and the jvp's tangent), for both mask formats transformers builds
(SDPA's boolean mask, eager attention's additive one), and the layout checked position by position.
"""

from __future__ import annotations

import pytest
import torch

from editkit.core.linearize import LinearizedModel
from editkit.models.blocks import BlockTail
from editkit.models.packing import Packing, mask_slot
from helpers import models

LENGTHS = (9, 3, 5, 2, 9, 4, 1)
WIDTH, HIDDEN = max(LENGTHS), 32


def mask_of(lengths) -> torch.Tensor:
    return (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()


def test_the_layout_puts_every_real_position_once_and_keeps_each_sequence_contiguous():
    packing = Packing.of(mask_of(LENGTHS))
    assert packing.rows == 4  # first fit, longest first: 9 | 9 | 5+4 | 3+2+1
    row, column = packing.target
    assert len(set(zip(row.tolist(), column.tolist()))) == sum(LENGTHS)  # no two positions share a place
    for example, length in enumerate(LENGTHS):
        places = (packing.segment == example).nonzero().tolist()
        assert len(places) == length and len({r for r, _ in places}) == 1
        columns = [c for _, c in places]
        assert columns == list(range(columns[0], columns[0] + length))
    hidden = torch.randn(len(LENGTHS), WIDTH, 3) * mask_of(LENGTHS)[..., None]
    assert torch.equal(packing.unpack(packing.pack(hidden)), hidden)


def test_a_batch_without_padding_to_spare_is_not_packed():
    assert not Packing.of(mask_of((4, 4, 3))).saves


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_tail_gives_the_padded_tails_outputs_gradients_and_tangents(attention):
    encoder = models.bert(num_hidden_layers=2, hidden_size=HIDDEN, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, attn_implementation=attention).double()
    packed_tail, padded_tail = (BlockTail(encoder, 2, 2, pack=pack) for pack in (True, False))
    mask = mask_of(LENGTHS)
    hidden = torch.randn(len(LENGTHS), WIDTH, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    real = mask.bool()
    weights = torch.randn(len(LENGTHS), WIDTH, HIDDEN, dtype=torch.float64)

    def outputs_and_gradients(tail):
        tail.zero_grad()
        out = tail(hidden, mask)
        (out[real] * weights[real]).sum().backward()
        return out, [p.grad.clone() for p in tail.parameters()]

    rows = []
    handle = packed_tail.layers["1"].register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    (packed, packed_grads), (padded, padded_grads) = outputs_and_gradients(packed_tail), outputs_and_gradients(padded_tail)
    handle.remove()
    assert rows == [Packing.of(mask).rows, len(LENGTHS)]  # the same block ran 4 packed rows, then 7 padded ones
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-10, atol=1e-12)
    assert (packed[~real] == 0).all()
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)

    tau = {n: torch.randn_like(p) * 0.01 for n, p in packed_tail.named_parameters()}
    tangents = []
    for tail in (packed_tail, padded_tail):
        model = LinearizedModel(tail)
        model.load_task_vector(tau)
        with torch.no_grad():
            tangents.append(model.primal_and_tangent(hidden, attention_mask=mask)[1])
    torch.testing.assert_close(tangents[0][real], tangents[1][real], rtol=1e-9, atol=1e-12)


def test_blocks_with_another_per_position_input_are_not_packed():
    """Rotary position embeddings or a position bias would be misplaced in packed rows: no mask slot is found."""
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    assert mask_slot((mask, None), {"past_key_values": None}, 5) == (0, mask)
    assert mask_slot((mask,), {"position_embeddings": torch.zeros(2, 5, 8)}, 5) is None
    assert mask_slot((None,), {}, 5) is None
