"""A tiny T5 with a word-level tokenizer, and GLUE parquet files as the hub serves ``nyu-mll/glue``.

Both are written into directories that :func:`helpers.hub.hub_repo` turns into Hugging Face cache
layouts, so the code under test finds them with the hub's own local-only lookups. Rows are generated
from a handful of words the tokenizer knows, so every prompt and target tokenizes to known ids.
"""

from __future__ import annotations

import random
from pathlib import Path

from helpers.models import t5

SPECIALS = ["<pad>", "</s>", "<unk>"]
#: Words of the prompts' templates and of the targets (T5's), then of the generated sentences.
WORDS = ["cola", "sst2", "mrpc", "rte", "sentence:", "sentence1:", "sentence2:", "acceptable", "unacceptable",
         "negative", "positive", "not_equivalent", "equivalent", "entailment", "not_entailment",
         "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "hat", "big", "small"]
SENTENCE_WORDS = WORDS[15:]
#: Text columns of each config, as the hub has them (each also has ``label`` and ``idx``).
COLUMNS = {"cola": ("sentence",), "sst2": ("sentence",), "mrpc": ("sentence1", "sentence2"),
           "rte": ("sentence1", "sentence2")}
#: Rows per hub split.
SIZES = {"train": 20, "validation": 6, "test": 4}


def t5_tokenizer():
    """A word-level fast tokenizer over :data:`WORDS` that appends ``</s>`` (id 1) as T5's does; pad is 0."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def write_t5(directory: Path) -> None:
    """The tiny T5 and its tokenizer, as ``save_pretrained`` writes them."""
    t5(vocab_size=len(SPECIALS) + len(WORDS)).save_pretrained(directory)
    t5_tokenizer().save_pretrained(directory)


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(SENTENCE_WORDS) for _ in range(rng.randint(2, 6)))


def glue_table(config: str, rows: int, seed: int):
    """A pyarrow table with the hub's columns of ``config``: its text columns, ``label`` (0 / 1), ``idx``."""
    import pyarrow as pa

    rng = random.Random(f"{config}:{seed}")
    columns = {c: [sentence(rng) for _ in range(rows)] for c in COLUMNS[config]}
    labels = [rng.randint(0, 1) for _ in range(rows)]
    return pa.table({**columns, "label": pa.array(labels, pa.int64()), "idx": pa.array(range(rows), pa.int32())})


def write_glue(directory: Path, configs=tuple(COLUMNS)) -> None:
    """``<config>/{train,validation,test}-00000-of-00001.parquet`` for each config, as on the hub."""
    import pyarrow.parquet as pq

    for config in configs:
        (directory / config).mkdir()
        for seed, (split, rows) in enumerate(SIZES.items()):
            pq.write_table(glue_table(config, rows, seed), directory / config / f"{split}-00000-of-00001.parquet")
