"""Text corpora a test registers for the duration of a block, so text scenarios run on known sentences."""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

from editkit.core.registry import Record
from editkit.data import TEXT_CORPORA

#: A corpus as a test gives it: split name (``train`` / ``val`` / ``test``) -> texts.
Corpus = Mapping[str, Sequence[str]]


def _splits(corpus: Corpus):
    def build(split: str, seed: int = 0) -> list[str]:
        return list(corpus[split])

    return build


@contextlib.contextmanager
def registered_corpora(corpora: Mapping[str, Corpus]) -> Iterator[None]:
    """Each named corpus in ``TEXT_CORPORA`` inside the block, removed afterwards (even when the block fails)."""
    for name, corpus in corpora.items():
        TEXT_CORPORA.register(name, Record.of(_splits(corpus)))
    try:
        yield
    finally:
        for name in corpora:
            TEXT_CORPORA.unregister(name)
