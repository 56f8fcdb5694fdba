"""Transformer text encoders (BERT, MiniLM...) as backbones: a text -> one feature vector.

The features are the last hidden states pooled over the text's real tokens: their mean
(``pooling = "mean"``, what sentence-transformers models such as all-MiniLM-L6-v2 are trained
for; padding never counts) or the first token's state (``"cls"``). Probe heads sit on them as
on image features, so a text task runs through the same trainer modes, bank, arithmetic and
bench as an image task.

The encoder is split like a causal LM (:mod:`editkit.models.blocks`): the embeddings and the
first L - K blocks are a frozen prefix whose hidden states are computed once per text; the last
K blocks (``trainable_blocks``, default all of them) and the pooling are the module, theta. The
tail runs padded batches as packed rows (:mod:`editkit.models.packing`): the positions are in the
prefix states already, so short texts share a row and no padding is computed. Even
with every block trainable the embedding table stays theta_0: it is half of MiniLM's parameters
and only the rows of a task's own words would move.

The pooler of BERT checkpoints (a dense layer over the first token, trained for next-sentence
prediction) is not used by either pooling, so it is no part of the module (never theta); it stays in
the encoder as theta_0, so a model written out (``editkit add --out``) is the whole checkpoint.
Weights are read from local disk only (``editkit.models.lm_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from editkit.core.batching import SequenceBatching
from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.models import BACKBONES
from editkit.models.blocks import ALL_BLOCKS, BlockTail, TailBackbone, resolve_blocks
from editkit.models.inputs import ProgramInputs, batch_dim, pad_right, text_spec
from editkit.models.lm_weights import MODEL_PATHS, load_pretrained, weights_check

POOLINGS = ("mean", "cls")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """``(N, T, D)`` hidden states -> ``(N, D)``: the mean over real positions (mask 1), or position 0."""
    if pooling == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(dim=1)
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


class PooledTail(nn.Module):
    """The encoder's last K blocks, then pooling: prefix hidden states ``(N, T, D)`` -> features ``(N, D)``."""

    def __init__(self, tail: BlockTail, pooling: str) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        self.tail = tail
        self.pooling = pooling

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return pool(self.tail(hidden, attention_mask), attention_mask, self.pooling)


class EncoderFeatures(nn.Module):
    """Token ids and mask -> pooled features through the whole encoder: the prefix states and the pooled tail of
    :class:`PooledTail` in one pass, with the same parameters. What a program of a text encoder runs."""

    def __init__(self, encoder: nn.Module, pooling: str) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return pool(hidden, attention_mask, self.pooling)


@dataclass
class EncoderBackbone(TailBackbone):
    """A text encoder split into a frozen prefix and a trainable, pooled tail (the module)."""

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    def program_inputs(self) -> ProgramInputs:
        """A program reads token ids and their mask (right-padded), any batch and length the positions allow."""
        encoder = self.tail.base_model
        device = next(encoder.parameters()).device
        ids = torch.full((2, 8), self.pad_id, dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0  # traced with padding: the mask is an input, not a constant of all ones
        length = torch.export.Dim("length", min=1, max=int(encoder.config.max_position_embeddings))
        dims = {0: batch_dim(), 1: length}
        return ProgramInputs(EncoderFeatures(encoder, self.module.pooling), (ids, mask), (dims, dims),
                             text_spec(self.tokenizer, pad_id=self.pad_id))

    def program_batch(self, dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Token ids and mask of examples ``indices`` (a :class:`~editkit.data.text.TokenSequences` split)."""
        return pad_right([dataset.ids[i] for i in indices], self.pad_id)


def encoder_backbone(encoder: nn.Module, tokenizer: Any, *, pooling: str = "mean",
                     trainable_blocks: int | str = ALL_BLOCKS, name: str = "text-encoder") -> EncoderBackbone:
    """Split a loaded encoder (theta_0; a transformers ``AutoModel`` such as ``BertModel``) into prefix and tail."""
    encoder.eval().requires_grad_(False)
    total = encoder.config.num_hidden_layers
    blocks = resolve_blocks(trainable_blocks, total)
    module = PooledTail(BlockTail(encoder, blocks, total, pack=True), pooling)
    # inputs are hidden states, padded with zeros; outputs are pooled; the tail packs (padding costs it nothing)
    batching = SequenceBatching(pad_id=0, packs=True)
    return EncoderBackbone(name=f"{name}[{pooling}, tail {blocks}/{total}]", module=module,
                           feature_dim=encoder.config.hidden_size, batching=batching, tokenizer=tokenizer)


def _family(model: str = "all-minilm-l6-v2", pooling: str = "mean", trainable_blocks: int | str = ALL_BLOCKS,
            hub_cache: str | None = None) -> EncoderBackbone:
    encoder, tokenizer = load_pretrained(model, "AutoModel", hub_cache=hub_cache)
    return encoder_backbone(encoder, tokenizer, pooling=pooling, trainable_blocks=trainable_blocks, name=model)


BACKBONES.register("text-encoder", Record.of(_family, check=weights_check("all-minilm-l6-v2"), help={
    "model": "a packaged model name (all-minilm-l6-v2), a local directory, or a hub id found in the local "
             "Hugging Face cache",
    "pooling": "features: 'mean' of the last hidden states over real tokens, or the first ('cls') token's",
    "trainable_blocks": "the last K encoder blocks are fine-tuned; 'all' for every block (embeddings stay frozen)",
    "hub_cache": "Hugging Face hub cache directory to look hub ids up in (default: HF_HOME's)"}, paths=MODEL_PATHS))
