"""The Hugging Face hub cache layout and a tiny real tokenizer, generated for tests (nothing downloaded).

:func:`hub_repo` writes a repository the way ``huggingface_hub`` caches it
(``<kind>--<org>--<name>/{blobs,refs/main,snapshots/<commit>}``, snapshot files linked to
blobs), so code under test finds it with the hub's own local-only lookups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

EOS = "<|endoftext|>"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WORDS = ["the cat sat on the mat", "a dog ate the hat", "hello world"]


def empty_caches(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache (returned) and an empty editkit cache, both under ``tmp_path``."""
    from huggingface_hub import constants

    from editkit import settings

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    return hub


def hub_repo(hub: Path, repo_id: str, fill: Callable[[Path], object], *, kind: str = "models") -> Path:
    """A ``kind`` (``models`` / ``datasets``) repository in the hub cache layout: ``fill(directory)`` writes its
    files (subfolders too), which become blobs linked from the snapshot. Returns the snapshot directory."""
    repo = hub / (f"{kind}--" + repo_id.replace("/", "--"))
    staging = repo / "staging"
    staging.mkdir(parents=True)
    fill(staging)
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(f for f in staging.rglob("*") if f.is_file())):
        link = snapshot / file.relative_to(staging)
        link.parent.mkdir(parents=True, exist_ok=True)
        blob = repo / "blobs" / f"blob{i}"
        file.rename(blob)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def bpe_tokenizer(texts: list[str] = WORDS, vocab_size: int = 300):
    """A real byte-level BPE tokenizer learned from ``texts``; ``<|endoftext|>`` is id 0 and there is no pad token."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts) * 5, trainer)
    return tokenizer


def fast_tokenizer(bpe, padding_side: str = "left"):
    """``bpe`` as a transformers tokenizer with ``<|endoftext|>`` as eos and bos."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, padding_side=padding_side)
