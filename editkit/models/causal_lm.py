"""Causal language models as backbones, partially linearized.

Linearizing a whole decoder costs a jvp through every block at every step, which
on a CPU is many times a plain step. editkit splits the decoder instead:

- the **prefix** (embeddings and the first L - K blocks) stays theta_0. Its hidden
  states depend on nothing trainable, so they are computed once per input
  (:meth:`CausalLMBackbone.prefix`) and cached by the text data sources;
- the **tail** (the last K blocks and the final norm, ``trainable_blocks = K``, or
  ``"all"``) is the backbone's module: theta. ``linear`` / ``taujp`` linearize it,
  ``nonlinear`` fine-tunes it. Its output is the final hidden state of every
  position ``(N, T, D)``: what the tauJp penalty measures by default;
- the **LM head** (usually tied to the embeddings) is the task's fixed head,
  :class:`LanguageModelHead`, whose loss is the next-token loss over real positions;
  with ``trainable_head = true`` an untied copy of it ends the tail instead (:class:`LogitTail`),
  so it is theta and the module outputs logits.

The tail is a :class:`~editkit.models.blocks.BlockTail` (the model's own blocks called
with the arguments the model itself gives them), so any decoder-only architecture works
(GPT-2, Llama, Mistral, Qwen2...), with no per-architecture code.

Weights are read from local disk only (``editkit.models.lm_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from editkit.core.batching import SequenceBatching
from editkit.core.objectives import next_token_loss, next_token_loss_of_states
from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.models import BACKBONES, HEADS
from editkit.models.backbone import Backbone, state_fingerprint
from editkit.models.blocks import BlockTail, TailBackbone, resolve_blocks
from editkit.models.lm_weights import MODEL_PATHS, load_causal_lm, weights_check

_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def final_norm(base: nn.Module) -> nn.Module:
    for name in _FINAL_NORMS:
        if isinstance(getattr(base, name, None), nn.Module):
            return getattr(base, name)
    raise ConfigError(f"{type(base).__name__} has no final norm ({', '.join(_FINAL_NORMS)})")


class DecoderTail(BlockTail):
    """The last K decoder blocks and the final norm: prefix hidden states -> final hidden states."""

    def __init__(self, base: nn.Module, blocks: int, total: int) -> None:
        super().__init__(base, blocks, total)
        self.norm = final_norm(base)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(super().forward(hidden, attention_mask))


class LogitTail(DecoderTail):
    """A :class:`DecoderTail` followed by an untied copy of the LM head, both theta: prefix hidden states -> logits.

    The output embedding is where a language model says which token comes next, so an edit there can lower
    a few tokens' logits and leave the rest of the vocabulary alone; the tail's hidden states cannot do that
    without moving every token's logit. The copy is untied from the input embedding, which (part of the
    prefix) stays theta_0. Block and norm parameters keep the names they have in a :class:`DecoderTail`.
    That such an edit exists does not mean fine-tuning finds it: on the ``toxic`` scenario it did not
    (docs/scenarios/toxic.md, the ``trainable_head`` rows).
    """

    def __init__(self, base: nn.Module, blocks: int, total: int, head: nn.Linear) -> None:
        super().__init__(base, blocks, total)
        self.lm_head = head

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(super().forward(hidden, attention_mask))


class LanguageModelHead(nn.Module):
    """Final hidden states -> next-token logits, fixed (theta_0's output embedding, tied or not); the identity
    when the tail ends in a trainable head (:class:`LogitTail`) and already outputs the logits.

    ``loss`` is the next-token loss over real positions (labels are token ids with
    ``IGNORE_INDEX`` at padding); the train loop uses it instead of cross-entropy.
    The head is linear without bias, so the tangent of the logits is the head applied
    to the tangent of the hidden states (what ``penalty_on = "logits"`` measures).
    """

    objective = "language-modeling"

    def __init__(self, output: nn.Linear | None) -> None:
        super().__init__()
        if output is not None and output.bias is not None:
            raise ConfigError("the language-model head has a bias: its tangent would not be the head of the tangent")
        # Shared with the model (tied embeddings stay tied and frozen); None when the tail ends in the head.
        self.weight = None if output is None else output.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.weight is None else hidden @ self.weight.detach().t()

    loss = staticmethod(next_token_loss)

    def features_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of final hidden states: logits only where a next token is a target."""
        return next_token_loss_of_states(self, hidden, labels)


@dataclass
class CausalLMBackbone(TailBackbone):
    """A causal LM split into a frozen prefix and a trainable tail (the module, a :class:`DecoderTail`).

    lm: the whole model, theta_0 (sampling continuations runs it with edited tail weights).
    head: the fixed :class:`LanguageModelHead`.
    """

    lm: nn.Module = field(repr=False, default=None)
    head: LanguageModelHead = field(repr=False, default=None)
    auto_class: ClassVar[str] = "AutoModelForCausalLM"

    def fingerprint(self) -> str:
        """Identity of the whole model (prefix, tail and head): a tail alone could sit on another prefix."""
        return state_fingerprint(self.lm.state_dict())

    def program_inputs(self) -> None:
        """No program: a language model's take-away model is its Hugging Face directory (generation needs it)."""
        return None

    def tail_parameters(self) -> dict[str, str]:
        """Theta's parameter name -> the full model's name (``layers.27.mlp.up_proj.weight`` ->
        ``model.layers.27.mlp.up_proj.weight``; ``lm_head.weight`` with a trainable head), for applying a
        vector to :attr:`lm`."""
        names = {id(p): n for n, p in self.lm.named_parameters(remove_duplicate=False)}
        return {n: names[id(p)] for n, p in self.module.named_parameters()}


def untied_output(lm: nn.Module) -> nn.Linear:
    """The model's output embedding, given its own copy of the weights when tied to the input embedding."""
    output = lm.get_output_embeddings()
    if output.weight is lm.get_input_embeddings().weight:
        output.weight = nn.Parameter(output.weight.detach().clone(), requires_grad=False)
        lm.config.tie_word_embeddings = False
    return output


def causal_lm_backbone(lm: nn.Module, tokenizer: Any, *, trainable_blocks: int | str = 4,
                       trainable_head: bool = False, name: str = "causal-lm") -> CausalLMBackbone:
    """Split a loaded causal LM (theta_0) into prefix, tail and head; with ``trainable_head`` the (untied) LM
    head is part of the tail, whose output is then the logits."""
    lm.eval().requires_grad_(False)
    total = lm.config.num_hidden_layers
    blocks = resolve_blocks(trainable_blocks, total)
    batching = SequenceBatching(pad_id=0, per_token=True)  # inputs are hidden states: padded with zeros
    if trainable_head:
        module, output = LogitTail(lm.base_model, blocks, total, untied_output(lm)), None
        name, width = f"{name}[tail {blocks}/{total} + head]", lm.config.vocab_size
    else:
        module, output = DecoderTail(lm.base_model, blocks, total), lm.get_output_embeddings()
        name, width = f"{name}[tail {blocks}/{total}]", lm.config.hidden_size
    return CausalLMBackbone(name=name, module=module, feature_dim=width, batching=batching, lm=lm,
                            tokenizer=tokenizer, head=LanguageModelHead(output))


def _family(model: str = "smollm2-135m-instruct", trainable_blocks: int | str = 4, trainable_head: bool = False,
            hub_cache: str | None = None) -> CausalLMBackbone:
    lm, tokenizer = load_causal_lm(model, hub_cache=hub_cache)
    return causal_lm_backbone(lm, tokenizer, trainable_blocks=trainable_blocks, trainable_head=trainable_head,
                              name=model)


def _lm_head(backbone: Backbone, task: Any, dataset: str, seed: int) -> LanguageModelHead:
    if not isinstance(backbone, CausalLMBackbone):
        raise ConfigError(f"heads kind 'lm' needs a causal-lm backbone, not {backbone.name}")
    return backbone.head


BACKBONES.register("causal-lm", Record.of(_family, check=weights_check("smollm2-135m-instruct"), help={
    "model": "a packaged model name (smollm2-135m-instruct), a local directory or .gguf file, or a hub id "
             "found in the local Hugging Face cache",
    "trainable_blocks": "the last K decoder blocks (plus the final norm) are fine-tuned; 'all' for every block",
    "trainable_head": "the LM head (untied from the input embedding) is fine-tuned too; the tail then outputs logits",
    "hub_cache": "Hugging Face hub cache directory to look hub ids up in (default: HF_HOME's)"}, paths=MODEL_PATHS))
HEADS.register("lm", Record.of(_lm_head))
