"""Several short sequences in one row: padding-free batches for blocks whose positions are already encoded.

A batch of texts is padded to its longest, and on a CPU every padded position costs as much
as a real one in every linear layer. Once the embeddings have added the position information
(BERT, MiniLM, RoBERTa: absolute positions, in the cached prefix states), a block no longer
knows where a hidden state sits in its row: sequences can share a row if attention stays
inside each one. :class:`Packing` lays the real positions of a right-padded batch into as few
rows as the longest sequence allows (first fit, longest first), gives the attention mask that
keeps each sequence to itself, and puts the blocks' outputs back in the padded layout. Every
real position's output is the one it has in the padded batch; the pack and unpack are index
operations, so gradients and forward-mode tangents pass through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Packing:
    """Where each real position of a right-padded ``(N, T)`` batch goes in ``rows`` packed rows of ``T``.

    source / target: ``(example, position)`` and ``(row, column)`` index pairs of the real positions.
    segment: ``(rows, T)`` the example each packed position holds (-1: empty).
    """

    shape: tuple[int, int]
    rows: int
    source: tuple[torch.Tensor, torch.Tensor]
    target: tuple[torch.Tensor, torch.Tensor]
    segment: torch.Tensor

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "Packing":
        """First-fit-decreasing packing of the rows' real positions (a right-padded mask, 1 = real)."""
        n, width = attention_mask.shape
        lengths = attention_mask.sum(dim=1).tolist()
        free: list[int] = []  # room left in each packed row
        row_of, offset_of = [0] * n, [0] * n
        for i in sorted(range(n), key=lambda i: -lengths[i]):
            row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
            if row == len(free):
                free.append(width)
            row_of[i], offset_of[i] = row, width - free[row]
            free[row] -= lengths[i]
        device = attention_mask.device
        count = torch.tensor(lengths, device=device)
        example = torch.repeat_interleave(torch.arange(n, device=device), count)
        starts = torch.cumsum(count, 0) - count
        position = torch.arange(len(example), device=device) - torch.repeat_interleave(starts, count)
        row = torch.tensor(row_of, device=device)[example]
        column = torch.tensor(offset_of, device=device)[example] + position
        segment = torch.full((len(free), width), -1, dtype=torch.long, device=device)
        segment[row, column] = example
        return cls((n, width), len(free), (example, position), (row, column), segment)

    @property
    def saves(self) -> bool:
        """Whether the packed rows hold fewer positions than the padded batch."""
        return self.rows < self.shape[0]

    def pack(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, T, ...)`` padded -> ``(rows, T, ...)`` packed (empty positions zero)."""
        empty = hidden.new_zeros((self.rows, self.shape[1], *hidden.shape[2:]))
        return empty.index_put(self.target, hidden[self.source])

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``(rows, T, ...)`` packed -> ``(N, T, ...)`` padded (padding positions zero)."""
        empty = packed.new_zeros((*self.shape, *packed.shape[2:]))
        return empty.index_put(self.source, packed[self.target])

    def occupied(self) -> torch.Tensor:
        """``(rows, T)`` 1 where a packed position holds a real one: the 2-D mask of the packed batch."""
        return (self.segment >= 0).long()

    def attention(self, like: torch.Tensor) -> torch.Tensor:
        """The mask that keeps each packed sequence to itself, in the format of ``like`` (the 4-D mask the
        model builds for a padded batch: boolean, True = attend; or additive float, 0 = attend). An empty
        position attends to itself alone, so no row of the softmax is empty (no NaN to reach a gradient)."""
        same = (self.segment[:, :, None] == self.segment[:, None, :]) & (self.segment[:, None, :] >= 0)
        same |= torch.eye(self.shape[1], dtype=torch.bool, device=same.device)
        same = same[:, None].expand(-1, like.shape[1], -1, -1)
        if like.dtype == torch.bool:
            return same
        return torch.zeros(same.shape, dtype=like.dtype, device=like.device).masked_fill(~same, torch.finfo(like.dtype).min)


def mask_slot(args: tuple, kwargs: dict[str, Any], width: int) -> tuple[int | str, torch.Tensor] | None:
    """Where a block's arguments hold the 4-D attention mask ``(N, 1 or H, T, T)``, and that mask; None when
    another tensor is among them (position embeddings, a relative-position bias: per-position inputs that
    packing would misplace) or no mask is."""
    found = None
    for key, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() != 4 or tuple(value.shape[-2:]) != (width, width) or found is not None:
            return None
        found = (key, value)
    return found


def with_mask(args: tuple, kwargs: dict[str, Any], slot: int | str, mask: torch.Tensor) -> tuple[tuple, dict]:
    """The block's arguments with ``mask`` in ``slot``."""
    if isinstance(slot, int):
        return (*args[:slot], mask, *args[slot + 1 :]), kwargs
    return args, {**kwargs, slot: mask}
