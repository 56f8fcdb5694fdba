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
  :class:`LanguageModelHead`, whose loss is the next-token loss over real positions.

The tail calls the model's own decoder blocks with the arguments the model itself
would give them (causal / padding mask, rotary position embeddings...): they are
captured by running the base model on zeros up to its first block
(:func:`block_arguments`). So any decoder-only architecture whose blocks take the
hidden states first works (GPT-2, Llama, Mistral, Qwen2...), with no per-architecture
code. Task-vector parameter names are the model's own (``layers.27.mlp.up_proj.weight``),
so vectors of different K over the same model share names.

Weights are read from local disk only (``editkit.models.lm_weights``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from editkit.core.batching import SequenceBatching
from editkit.core.objectives import next_token_loss
from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.models import BACKBONES, HEADS
from editkit.models.backbone import Backbone, state_fingerprint

#: ``trainable_blocks`` value that makes every decoder block theta.
ALL_BLOCKS = "all"
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


class _Stop(Exception):
    """Raised by a forward pre-hook to end a forward pass once what was wanted is captured."""


#: Held while a capturing hook is on a block and while the tail runs its blocks: the prefix of a tauJp
#: source is computed in the loader thread while the main thread trains the tail through the same
#: modules, and a hook of one thread must never fire in the other's forward pass.
_BLOCKS_IN_USE = threading.RLock()


def decoder_blocks(base: nn.Module, count: int) -> nn.ModuleList:
    """The base model's list of ``count`` decoder blocks (``layers`` in Llama, ``h`` in GPT-2)."""
    for module in base.children():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ConfigError(f"{type(base).__name__} has no list of {count} decoder blocks")


def final_norm(base: nn.Module) -> nn.Module:
    for name in _FINAL_NORMS:
        if isinstance(getattr(base, name, None), nn.Module):
            return getattr(base, name)
    raise ConfigError(f"{type(base).__name__} has no final norm ({', '.join(_FINAL_NORMS)})")


def _capture_input(base: nn.Module, block: nn.Module, **inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) ``block`` is called with when ``base`` runs on ``inputs``; the pass stops there."""
    captured: dict[str, Any] = {}

    def hook(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)
        raise _Stop

    with _BLOCKS_IN_USE:
        handle = block.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            base(**inputs, use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
    return captured["args"], captured["kwargs"]


def block_arguments(base: nn.Module, first: nn.Module, hidden: torch.Tensor,
                    attention_mask: torch.Tensor | None) -> tuple[tuple, dict]:
    """What a decoder block receives besides its hidden states, for inputs shaped like ``hidden``.

    The base model runs on zero embeddings up to its first block (``first``): masks and
    position embeddings depend only on the shape and the attention mask, never on the
    embeddings or on theta, and are the same for every block.
    """
    zeros = torch.zeros_like(hidden)
    args, kwargs = _capture_input(base, first, inputs_embeds=zeros, attention_mask=attention_mask)
    return args[1:], kwargs


class DecoderTail(nn.Module):
    """The last K decoder blocks and the final norm: prefix hidden states -> final hidden states.

    Blocks are held under their index in the full model, so parameter names match it.
    The base model and its first block are kept out of the module tree (they are
    theta_0 and must not become theta): only their call conventions are used.
    """

    def __init__(self, base: nn.Module, blocks: int, total: int) -> None:
        super().__init__()
        every = decoder_blocks(base, total)
        self.first = total - blocks
        self.layers = nn.ModuleDict({str(i): every[i] for i in range(self.first, total)})
        self.norm = final_norm(base)
        self._base = (base, every[0])  # a tuple: nn.Module does not register modules inside it

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        base, first = self._base
        with _BLOCKS_IN_USE:
            args, kwargs = block_arguments(base, first, hidden, attention_mask)
            for block in self.layers.values():
                out = block(hidden, *args, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
        return self.norm(hidden)


class LanguageModelHead(nn.Module):
    """Final hidden states -> next-token logits, fixed (theta_0's output embedding, tied or not).

    ``loss`` is the next-token loss over real positions (labels are token ids with
    ``IGNORE_INDEX`` at padding); the train loop uses it instead of cross-entropy.
    The head is linear without bias, so the tangent of the logits is the head applied
    to the tangent of the hidden states (what ``penalty_on = "logits"`` measures).
    """

    objective = "language-modeling"

    def __init__(self, output: nn.Linear) -> None:
        super().__init__()
        if output.bias is not None:
            raise ConfigError("the language-model head has a bias: its tangent would not be the head of the tangent")
        self.weight = output.weight  # shared with the model (tied embeddings stay tied and frozen)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.detach().t()

    loss = staticmethod(next_token_loss)


@dataclass
class CausalLMBackbone(Backbone):
    """A causal LM split into a frozen prefix and a trainable tail (the module).

    lm: the whole model, theta_0 (sampling continuations runs it with edited tail weights).
    tokenizer: its tokenizer (right padding; a pad token set).
    head: the fixed :class:`LanguageModelHead`.
    """

    lm: nn.Module = field(repr=False, default=None)
    tokenizer: Any = field(repr=False, default=None)
    head: LanguageModelHead = field(repr=False, default=None)

    @property
    def tail(self) -> DecoderTail:
        return self.module

    @torch.no_grad()
    def prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states entering the tail's first block ``(N, T, D)``: computed by theta_0 alone."""
        base = self.lm.base_model
        first = self.tail.layers[str(self.tail.first)]
        args, _ = _capture_input(base, first, input_ids=input_ids, attention_mask=attention_mask)
        return args[0]

    def fingerprint(self) -> str:
        """Identity of the whole model (prefix, tail and head): a tail alone could sit on another prefix."""
        return state_fingerprint(self.lm.state_dict())

    def tail_parameters(self) -> dict[str, str]:
        """Tail parameter name -> the full model's name (``layers.27.mlp.up_proj.weight`` ->
        ``model.layers.27.mlp.up_proj.weight``), for applying a vector to :attr:`lm`."""
        names = {id(p): n for n, p in self.lm.named_parameters(remove_duplicate=False)}
        return {n: names[id(p)] for n, p in self.tail.named_parameters()}


def resolve_blocks(trainable_blocks: int | str, total: int) -> int:
    """K from the ``trainable_blocks`` setting (an int in 1..total, or ``"all"``; the command line gives text)."""
    if trainable_blocks == ALL_BLOCKS:
        return total
    if isinstance(trainable_blocks, str) and trainable_blocks.isdigit():
        trainable_blocks = int(trainable_blocks)
    if isinstance(trainable_blocks, bool) or not isinstance(trainable_blocks, int) or not 1 <= trainable_blocks <= total:
        raise ConfigError(f"trainable_blocks must be an integer in 1..{total} or {ALL_BLOCKS!r}, "
                          f"not {trainable_blocks!r}")
    return trainable_blocks


def causal_lm_backbone(lm: nn.Module, tokenizer: Any, *, trainable_blocks: int | str = 4,
                       name: str = "causal-lm") -> CausalLMBackbone:
    """Split a loaded causal LM (theta_0) into prefix, tail and head."""
    lm.eval().requires_grad_(False)
    total = lm.config.num_hidden_layers
    blocks = resolve_blocks(trainable_blocks, total)
    tail = DecoderTail(lm.base_model, blocks, total)
    batching = SequenceBatching(pad_id=0, per_token=True)  # inputs are hidden states: padded with zeros
    return CausalLMBackbone(name=f"{name}[tail {blocks}/{total}]", module=tail, feature_dim=lm.config.hidden_size,
                            batching=batching, lm=lm, tokenizer=tokenizer,
                            head=LanguageModelHead(lm.get_output_embeddings()))


def _family(model: str = "smollm2-135m-instruct", trainable_blocks: int | str = 4,
            hub_cache: str | None = None) -> CausalLMBackbone:
    from editkit.models.lm_weights import load_causal_lm

    lm, tokenizer = load_causal_lm(model, hub_cache=hub_cache)
    return causal_lm_backbone(lm, tokenizer, trainable_blocks=trainable_blocks, name=model)


def _family_check(model: str = "smollm2-135m-instruct", trainable_blocks: int | str = 4,
                  hub_cache: str | None = None) -> list[str]:
    from editkit.models.lm_weights import causal_lm_problems

    return causal_lm_problems(model, hub_cache=hub_cache)


def _lm_head(backbone: Backbone, task: Any, dataset: str, seed: int) -> LanguageModelHead:
    if not isinstance(backbone, CausalLMBackbone):
        raise ConfigError(f"heads kind 'lm' needs a causal-lm backbone, not {backbone.name}")
    return backbone.head


BACKBONES.register("causal-lm", Record.of(_family, check=_family_check, help={
    "model": "a packaged model name (smollm2-135m-instruct), a local directory or .gguf file, or a hub id "
             "found in the local Hugging Face cache",
    "trainable_blocks": "the last K decoder blocks (plus the final norm) are fine-tuned; 'all' for every block",
    "hub_cache": "Hugging Face hub cache directory to look hub ids up in (default: HF_HOME's)"}))
HEADS.register("lm", Record.of(_lm_head))
