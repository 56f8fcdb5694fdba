"""The last K blocks of a transformers model as a module of their own: what partial linearization trains.

Linearizing every block costs a jvp through all of them at every step, which on a CPU is many
times a plain step. A transformer splits cleanly instead:

- the **prefix** (embeddings and the first L - K blocks) stays theta_0. Its hidden states
  depend on nothing trainable, so they are computed once per input (:meth:`BlockTail.prefix`)
  and cached by the data sources;
- the **tail** (the last K blocks, ``trainable_blocks = K``, or ``"all"``) is theta.

The tail calls the model's own blocks with the arguments the model itself would give them
(causal or padding mask, rotary position embeddings...): they are captured by running the base
model on zero embeddings up to its first block (:func:`block_arguments`). So any architecture whose
blocks take the hidden states first works (GPT-2, Llama, Qwen2, BERT, MiniLM...), with no
per-architecture code. Blocks keep their index in the full model (``layers.27.mlp.up_proj.weight``),
so task vectors of different K over one model share names.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from editkit.errors import ConfigError
from editkit.models.backbone import Backbone, NativeWeights, state_fingerprint
from editkit.models.packing import Packing, mask_slot, with_mask

#: ``trainable_blocks`` value that makes every block theta.
ALL_BLOCKS = "all"


class _Stop(Exception):
    """Raised by a forward pre-hook to end a forward pass once what was wanted is captured."""


#: Held while a capturing hook is on a block and while a tail runs its blocks: the prefix of a tauJp
#: source is computed in the loader thread while the main thread trains the tail through the same
#: modules, and a hook of one thread must never fire in the other's forward pass.
_BLOCKS_IN_USE = threading.RLock()


def transformer_blocks(base: nn.Module, count: int) -> nn.ModuleList:
    """The base model's list of ``count`` blocks (``layers`` in Llama, ``h`` in GPT-2, ``encoder.layer`` in BERT):
    the first ``ModuleList`` of that length in module order."""
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ConfigError(f"{type(base).__name__} has no list of {count} transformer blocks")


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
    """What a block receives besides its hidden states, for inputs shaped like ``hidden``.

    The base model runs on zero embeddings up to its first block (``first``): masks and
    position embeddings depend only on the shape and the attention mask, never on the
    embeddings or on theta, and are the same for every block.
    """
    zeros = torch.zeros_like(hidden)
    args, kwargs = _capture_input(base, first, inputs_embeds=zeros, attention_mask=attention_mask)
    return args[1:], kwargs


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


class BlockTail(nn.Module):
    """The last K blocks: prefix hidden states ``(N, T, D)`` -> the last block's hidden states ``(N, T, D)``.

    Blocks are held under their index in the full model, so parameter names match it.
    The base model and its first block are kept out of the module tree (they are
    theta_0 and must not become theta): only their call conventions are used.

    pack: run a padded batch as packed rows (:mod:`editkit.models.packing`) whenever that holds
        fewer positions. Only for models whose positions enter with the embeddings (BERT-like
        encoders); a block that takes any other per-position input runs the padded batch.
    """

    def __init__(self, base: nn.Module, blocks: int, total: int, *, pack: bool = False) -> None:
        super().__init__()
        every = transformer_blocks(base, total)
        self.first = total - blocks
        self.layers = nn.ModuleDict({str(i): every[i] for i in range(self.first, total)})
        self._base = (base, every[0])  # a tuple: nn.Module does not register modules inside it
        self.pack = pack

    @property
    def base_model(self) -> nn.Module:
        """The whole transformers model the blocks belong to (theta_0 outside the tail), e.g. for writing it out."""
        return self._base[0]

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        base, first = self._base
        with _BLOCKS_IN_USE:
            packing = Packing.of(attention_mask) if self.pack and attention_mask is not None else None
            packed = self._packed_arguments(packing, hidden) if packing is not None and packing.saves else None
            if packed is not None:
                hidden, (args, kwargs) = packing.pack(hidden), packed
            else:
                args, kwargs = block_arguments(base, first, hidden, attention_mask)
            for block in self.layers.values():
                out = block(hidden, *args, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
        return packing.unpack(hidden) if packed is not None else hidden

    def _packed_arguments(self, packing: Packing, hidden: torch.Tensor) -> tuple[tuple, dict] | None:
        """The blocks' arguments for the packed rows: what the model gives a padded batch of that shape, its
        4-D attention mask replaced by the packing's; None when the blocks take another per-position input."""
        base, first = self._base
        probe = packing.occupied()
        probe[:, -1] = 0  # some padding, so the model builds a 4-D mask whose format the packing's mask copies
        shape = hidden.new_zeros((packing.rows, *hidden.shape[1:]))
        args, kwargs = block_arguments(base, first, shape, probe)
        slot = mask_slot(args, kwargs, hidden.shape[1])
        if slot is None:
            return None
        return with_mask(args, kwargs, slot[0], packing.attention(like=slot[1]))

    @torch.no_grad()
    def prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states entering the tail's first block ``(N, T, D)``: computed by theta_0 alone."""
        base, _ = self._base
        args, _ = _capture_input(base, self.layers[str(self.first)], input_ids=input_ids, attention_mask=attention_mask)
        return args[0]


@dataclass
class TailBackbone(Backbone):
    """A backbone over text whose module runs a :class:`BlockTail`: its inputs are the prefix's hidden states.

    tokenizer: the model's tokenizer (right padding; a pad token set). Data sources tokenize with it
        and turn token ids into the module's inputs with :meth:`prefix` (once per text; theta_0 alone).
    """

    tokenizer: Any = field(repr=False, default=None)
    #: The precision of theta_0's own passes (its prefix states, perplexities and sampled continuations): ``fp32``,
    #: or ``bf16`` (autocast; whole bf16 weights to sample), whose matrix products a CPU with AVX512-BF16 or AMX
    #: runs several times faster. Set by the scenario's build from the runtime's, which trains in it too.
    precision: str = "fp32"
    #: The transformers class that loads the whole model's directory.
    auto_class: ClassVar[str] = "AutoModel"

    def native_weights(self) -> NativeWeights:
        """The whole model's Hugging Face directory, tokenizer included."""
        return NativeWeights("transformers", whole_model(self), f"transformers.{self.auto_class}.from_pretrained",
                             file=None, tokenizer=self.tokenizer)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context theta_0's own passes run in: bf16 autocast on the model's device, or nothing."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def tail(self) -> BlockTail:
        """The module's block tail (the module itself unless it wraps one)."""
        return getattr(self.module, "tail", self.module)

    @torch.no_grad()
    def prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states entering the tail's first block ``(N, T, D)``: computed by theta_0 alone, in
        :attr:`precision`, kept in the tail's parameters' dtype."""
        with self.autocast():
            states = self.tail.prefix(input_ids, attention_mask)
        return states.to(next(self.tail.parameters()).dtype)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @functools.cached_property
    def prefix_fingerprint(self) -> str:
        """Identity of what :meth:`prefix` computes: the depth the tail starts at and the whole model's weights
        outside the tail, which stay theta_0 whatever is trained or edited (vectors touch the tail alone); so it is
        computed once. What a cache of prefix states is keyed by."""
        inside = {t.data_ptr() for t in (*self.tail.parameters(), *self.tail.buffers())}
        state = {name: t for name, t in whole_model(self).state_dict().items() if t.data_ptr() not in inside}
        return f"first block {self.tail.first}, {state_fingerprint(state)}"


def whole_model(backbone: Backbone) -> nn.Module:
    """The whole model the backbone's module is part of: a causal LM's ``lm``, a seq2seq LM's ``model``, a text
    encoder's base model, CLIP's ``clip_model``."""
    for attribute in ("lm", "model", "clip_model"):
        model = getattr(backbone, attribute, None)
        if isinstance(model, nn.Module):
            return model
    tail = getattr(backbone, "tail", None)
    if isinstance(tail, BlockTail):
        return tail.base_model
    raise ConfigError(f"{backbone.name} has no whole model to write (only {type(backbone.module).__name__})")
