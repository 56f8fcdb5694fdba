"""Tiny random models the tests build: small enough for float64 finite differences, never downloaded.

Each factory seeds torch's global generator itself, so a model is a pure function of its
arguments: two tests asking for the same shape and seed get bit-identical parameters, and a
test that draws more random numbers after building one sees the same stream as before.
The transformer factories build from a config (random weights), which is why they need no
network and no cache.
"""

from __future__ import annotations

import string

import torch
from torch import nn

import editkit  # noqa: F401  (its torchvision shim must run before open_clip or transformers is imported)


def mlp(d_in: int, hidden: int, d_out: int, *, batchnorm: bool = False, dropout: float = 0.0,
        seed: int = 0) -> nn.Sequential:
    """Linear -> [BatchNorm1d] -> Tanh -> [Dropout] -> Linear in eval mode, float32 (cast it after building,
    so every dtype starts from the same draws).

    BatchNorm is the layer whose buffers and train/eval split the linearization must respect;
    its running statistics stay at their defaults here, a test that needs non-trivial ones sets them.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(d_in, hidden)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    layers.append(nn.Tanh())
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, d_out))
    return nn.Sequential(*layers).eval()


def tiny_clip(seed: int = 0):
    """The registered one-layer open_clip config with random weights, as an editkit CLIP backbone."""
    from editkit.models.clip import TINY_MODEL_NAME, build_clip

    torch.manual_seed(seed)
    return build_clip(TINY_MODEL_NAME, pretrained=None)


def bert(*, seed: int = 0, pooling: bool = True, **config) -> nn.Module:
    """A random ``BertModel`` in eval mode; ``config`` overrides the tiny defaults below."""
    import transformers

    cfg = transformers.BertConfig(**{**dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=37), **config})
    torch.manual_seed(seed)
    return transformers.BertModel(cfg, add_pooling_layer=pooling).eval()


def gpt2(*, seed: int = 0, **config) -> nn.Module:
    """A random ``GPT2LMHeadModel`` in eval mode; ``config`` overrides the tiny defaults below.

    Dropout is off and attention is the eager implementation, so forward-mode AD runs through it
    and two forwards of the same input agree exactly.
    """
    import transformers

    cfg = transformers.GPT2Config(**{**dict(vocab_size=99, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0, attn_implementation="eager"), **config})
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(*, seed: int = 0, **config) -> nn.Module:
    """A random ``LlamaForCausalLM`` (tied embeddings, grouped-query attention, SDPA) in eval mode;
    ``config`` overrides the tiny defaults below."""
    import transformers

    cfg = transformers.LlamaConfig(**{**dict(vocab_size=99, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                             num_key_value_heads=1, intermediate_size=24, max_position_embeddings=64,
                                             tie_word_embeddings=True, bos_token_id=0, eos_token_id=0), **config})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


#: The characters :func:`char_tokenizer` knows, one token each after ``<eos>`` (id 0).
CHARS = string.ascii_letters + string.digits + " .,!?'"


def char_tokenizer():
    """A character-level fast tokenizer (one token per character, ``<eos>`` = 0), built in memory.

    One token per character makes token counts and packed blocks computable by hand from the text;
    it is a real ``PreTrainedTokenizerFast``, so ``save_pretrained`` writes loadable files.
    """
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.decoder = tokenizers.decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def t5(*, seed: int = 0, **config) -> nn.Module:
    """A random ``T5ForConditionalGeneration`` (two encoder and three decoder blocks, SDPA, decoder outputs
    unscaled as in T5 v1.1 / flan-t5) in eval mode; ``config`` overrides the tiny defaults below. Pad 0 is the
    decoder's start token and eos is 1, as in T5."""
    import transformers

    cfg = transformers.T5Config(**{**dict(vocab_size=40, d_model=16, d_kv=8, d_ff=24, num_layers=2,
                                          num_decoder_layers=3, num_heads=2, relative_attention_num_buckets=8,
                                          dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                          decoder_start_token_id=0, tie_word_embeddings=False), **config})
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def char_llama_checkpoint(directory, *, seed: int = 0, num_hidden_layers: int = 2):
    """``directory`` holding a random :func:`llama` (``num_hidden_layers`` blocks, ``seed``) and the
    :func:`char_tokenizer`, saved as a checkpoint a scenario's ``model`` can name; returns ``directory``."""
    tokenizer = char_tokenizer()
    llama(vocab_size=len(tokenizer), num_hidden_layers=num_hidden_layers, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
