"""Sequence-to-sequence language models (T5 and kin) as backbones of text-to-text tasks.

A text-to-text task maps a prompt to a short target text ("cola sentence: ..." ->
"acceptable"). The authors' T5 experiments evaluate it by *teacher forcing*: the
decoder reads the target shifted right, and an example is correct when the argmax at
every target position is the target token. So the backbone's module maps

    (encoder ids, encoder mask, decoder input ids, decoder mask) -> logits (N, L, V)

one row per decoder position, and the task's head is the identity
(:class:`TextToTextHead`) whose loss is cross-entropy over the label tokens (padding
labelled ``IGNORE_INDEX``). The LM head sits inside the module, not in a fixed head as
for causal LMs, because the authors fine-tune the whole model, LM head included: with
``trainable_blocks = "all"`` it is part of theta.

The tauJp penalty is taken, as in the authors' code, on the **first decoder step's
logits** of an unlabeled example: such an example has no target, so its decoder input is
the start token alone and the module's output for it is exactly the first-step logits;
the decoder mask makes every other position padding, which the penalty never counts.
Its value is the L2 norm of J.tau over the vocabulary, averaged over the reg batch
(``penalty_on = "features"``: the module's output already is the logits).

``trainable_blocks``: ``"all"`` (default) makes every parameter theta (embeddings,
encoder, decoder, LM head: the authors' full fine-tuning); an integer K makes only the
last K decoder blocks and the decoder's final norm theta (partial linearization: the
jvp's tangents start at those blocks, so the encoder and the first decoder blocks run
as a plain forward). Either way parameters keep the model's own names
(``decoder.block.5.layer.0.SelfAttention.q.weight``), so vectors of different K over
one model share names. The whole model is still run by its own ``forward``: the module
registers only the theta part, and ``functional_call`` swaps those shared submodules'
parameters while the model runs.

Weights come from local disk only (:func:`editkit.models.lm_weights.load_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from editkit.core.batching import IGNORE_INDEX, Seq2SeqBatching
from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.models import BACKBONES, HEADS
from editkit.models.backbone import Backbone, NativeWeights, state_fingerprint
from editkit.models.blocks import ALL_BLOCKS, resolve_blocks
from editkit.models.lm_weights import MODEL_PATHS, load_pretrained, weights_check
from editkit.models.causal_lm import final_norm
from editkit.models import inputs
from editkit.models.inputs import ProgramInputs, batch_dim, text_spec

#: The objective a text-to-text head declares: ``editkit.eval.scorers.task_scorer`` scores it by
#: teacher-forced accuracy of the label tokens.
TEXT_TO_TEXT = "text-to-text"


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``path`` below ``root``, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def theta_paths(model: nn.Module, blocks: int | str) -> list[str]:
    """Dotted paths of the submodules that are theta: the model's children for ``"all"``, else the
    last K decoder blocks and the decoder's final norm (when it has one)."""
    if blocks == ALL_BLOCKS:
        return [name for name, _ in model.named_children()]
    decoder = model.get_decoder()
    name, layers = next(((n, c) for n, c in decoder.named_children() if isinstance(c, nn.ModuleList)), (None, None))
    if layers is None:
        raise ConfigError(f"{type(model).__name__}'s decoder has no list of blocks")
    k = resolve_blocks(blocks, len(layers))
    prefix = f"{_path_of(model, decoder)}.{name}"
    paths = [f"{prefix}.{i}" for i in range(len(layers) - k, len(layers))]
    try:
        paths.append(_path_of(model, final_norm(decoder)))
    except ConfigError:  # a post-norm decoder (BART) has none
        pass
    return paths


class Seq2SeqLogits(nn.Module):
    """Teacher-forced logits ``(N, L, V)`` of a sequence-to-sequence model; its parameters are theta only.

    The model is held out of the module tree (a tuple) and called whole; the theta
    submodules are the model's own objects, registered under their paths in the model.
    """

    def __init__(self, model: nn.Module, paths: Sequence[str]) -> None:
        super().__init__()
        for path in paths:
            _attach(self, path, model.get_submodule(path))
        self._model = (model,)  # a tuple: nn.Module does not register modules inside it

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor,
                decoder_attention_mask: torch.Tensor) -> torch.Tensor:
        out = self._model[0](input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             decoder_attention_mask=decoder_attention_mask, use_cache=False)
        return out.logits


class WholeSeq2Seq(nn.Module):
    """The whole model, every parameter registered, called as :class:`Seq2SeqLogits` calls it: what a program of a
    sequence-to-sequence backbone runs (theta_0 outside the fine-tuned part included)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor,
                decoder_attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=decoder_attention_mask, use_cache=False).logits


def label_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's real label tokens (``IGNORE_INDEX`` marks padding)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


class TextToTextHead(nn.Module):
    """The identity over the module's logits, fixed; its ``loss`` is :func:`label_token_loss`.

    Identity because the LM head is part of the module (theta); one instance serves every
    task (the label texts tell tasks apart). Linear, so ``penalty_on = "logits"`` measures
    the same tangents as ``"features"`` (with the causal-LM norm over the sequence axis).
    """

    objective = TEXT_TO_TEXT

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    loss = staticmethod(label_token_loss)


@dataclass
class Seq2SeqBackbone(Backbone):
    """A sequence-to-sequence LM: its theta part is the module, the whole model and tokenizer ride along.

    model: the whole model, theta_0 (in eval mode, gradients off).
    tokenizer: its tokenizer (it appends the end-of-sequence token, as T5's does).
    head: the shared :class:`TextToTextHead`.
    """

    model: nn.Module = field(repr=False, default=None)
    tokenizer: Any = field(repr=False, default=None)
    head: TextToTextHead = field(repr=False, default_factory=TextToTextHead)

    @property
    def decoder_start(self) -> int:
        return int(self.model.config.decoder_start_token_id)

    def fingerprint(self) -> str:
        """Identity of the whole model: a set of decoder blocks alone could sit on another encoder."""
        return state_fingerprint(self.model.state_dict())

    def native_weights(self) -> NativeWeights:
        """The whole model's Hugging Face directory, tokenizer included."""
        return NativeWeights("transformers", self.model, "transformers.AutoModelForSeq2SeqLM.from_pretrained",
                             file=None, tokenizer=self.tokenizer)

    def teacher_forcing(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder input of a labelled example: the start token, then the labels but the last."""
        return torch.cat([torch.tensor([self.decoder_start]), labels[:-1]])

    def first_step(self) -> torch.Tensor:
        """The decoder input of an unlabeled example: the start token alone (its output: the first-step logits)."""
        return torch.tensor([self.decoder_start])

    def program_inputs(self) -> ProgramInputs:
        """A program reads the prompt's ids and mask and the decoder's (teacher forcing: the start token, then the
        target but its last token), and returns the logits ``(N, L, V)`` of every decoder position."""
        device = next(self.model.parameters()).device
        pad = int(self.batching.pad_id)
        ids = torch.full((2, 6), pad, dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        mask[1, 4:] = 0
        decoder = torch.full((2, 3), self.decoder_start, dtype=torch.long, device=device)
        decoder_mask = torch.ones_like(decoder)
        decoder_mask[1, 2:] = 0
        limit = int(getattr(self.model.config, "n_positions", 0) or 4096)
        prompt = {0: batch_dim(), 1: torch.export.Dim("length", min=1, max=limit)}
        target = {0: prompt[0], 1: torch.export.Dim("target_length", min=1, max=limit)}
        spec = {**text_spec(self.tokenizer, pad_id=pad,
                            names=("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")),
                "kind": inputs.TEXT_TO_TEXT, "decoder_start_token_id": self.decoder_start}
        return ProgramInputs(WholeSeq2Seq(self.model), (ids, mask, decoder, decoder_mask),
                             (prompt, prompt, target, target), spec)

    def program_batch(self, dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The four inputs of examples ``indices`` (prompt and teacher-forced decoder input, padded)."""
        batch = self.batching.collate([dataset[i][0] for i in indices])
        return batch.input_ids, batch.attention_mask, batch.decoder_input_ids, batch.decoder_attention_mask


def seq2seq_backbone(model: nn.Module, tokenizer: Any, *, trainable_blocks: int | str = ALL_BLOCKS,
                     name: str = "seq2seq-lm") -> Seq2SeqBackbone:
    """The backbone of a loaded sequence-to-sequence model (theta_0)."""
    model.eval().requires_grad_(False)
    paths = theta_paths(model, trainable_blocks)
    label = "all" if trainable_blocks == ALL_BLOCKS else f"last {trainable_blocks} decoder blocks"
    pad = model.config.pad_token_id
    return Seq2SeqBackbone(name=f"{name}[{label}]", module=Seq2SeqLogits(model, paths),
                           feature_dim=model.config.vocab_size, batching=Seq2SeqBatching(pad if pad is not None else 0),
                           model=model, tokenizer=tokenizer)


def _family(model: str = "google/flan-t5-small", trainable_blocks: int | str = ALL_BLOCKS,
            hub_cache: str | None = None, device: str | None = None) -> Seq2SeqBackbone:
    lm, tokenizer = load_pretrained(model, "AutoModelForSeq2SeqLM", hub_cache=hub_cache)
    if device:
        lm.to(device)
    return seq2seq_backbone(lm, tokenizer, trainable_blocks=trainable_blocks, name=model)


def _text_to_text_head(backbone: Backbone, task: Any, dataset: str, seed: int) -> TextToTextHead:
    if not isinstance(backbone, Seq2SeqBackbone):
        raise ConfigError(f"heads kind {TEXT_TO_TEXT!r} needs a seq2seq-lm backbone, not {backbone.name}")
    return backbone.head


BACKBONES.register("seq2seq-lm", Record.of(_family, check=weights_check("google/flan-t5-small"), help={
    "model": "a local checkpoint directory, or a hub id found in the local Hugging Face cache (google/flan-t5-small)",
    "trainable_blocks": "'all': every parameter is fine-tuned; K: only the last K decoder blocks (and the decoder's "
                        "final norm)",
    "hub_cache": "Hugging Face hub cache directory to look hub ids up in (default: HF_HOME's)",
    "device": "device the model is moved to after loading on the CPU"}, paths=MODEL_PATHS))
HEADS.register(TEXT_TO_TEXT, Record.of(_text_to_text_head))
