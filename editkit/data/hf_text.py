"""The text of the paper's GPT-2 negation path: Civil Comments and WikiText-103, from local Hugging Face copies.

Both datasets are read as the parquet files the Hugging Face hub serves, in the layout
``huggingface_hub`` caches them (what ``hf download <repo> --repo-type dataset`` leaves)::

    <root>/datasets--google--civil_comments/snapshots/<rev>/data/{train,validation,test}-*.parquet
    <root>/datasets--Salesforce--wikitext/snapshots/<rev>/wikitext-103-raw-v1/{train,validation,test}-*.parquet

with ``<root>/datasets--.../refs/main`` naming ``<rev>``. ``<root>`` is the ``data_root``
option, else ``$EDITKIT_DATA``, else the Hugging Face hub cache (``HF_HUB_CACHE`` /
``HF_HOME``); the first root holding the snapshot is read. Nothing is downloaded: a
missing piece is one line of :func:`check` saying what to run on a machine with
internet. Only the columns used are read (pyarrow), and Civil Comments' toxicity filter
is pushed down to the parquet reader, so its 1.8M training rows never become Python strings.

Corpora registered in ``TEXT_CORPORA`` (splits ``train`` / ``val`` / ``test``):

``civil-comments-toxic``
    train: Civil Comments train rows with ``toxicity`` > :data:`TOXICITY_ABOVE` (the
    authors' filter). val / test: the same filter on its validation / test split, with
    every comment whose normalized form (:func:`~editkit.data.toxic_corpus.normalize`)
    occurs in the toxic train rows (or earlier in the split) dropped, so evaluation never
    scores a memorised comment; of these held-out comments, shuffled (seeded), the first
    half is the split's target text.
``civil-comments-prompts``
    val / test: the opening words (:func:`opening`) of the other half of those held-out
    comments, at most :data:`PROMPTS_PER_SPLIT`; test starts with the paper's prompt
    :data:`~editkit.data.toxic_corpus.PAPER_PROMPT`. A prompt therefore opens a toxic
    comment the model never trained on, as RealToxicityPrompts' prompts do. train is empty.
``wikitext-103``
    WikiText-103 (raw) articles: train is the tauJp source, validation the control for
    choosing alpha, test the control perplexity. The hub stores one row per line; an
    article is the rows from one top-level heading (`` = Title = ``) to the next, joined
    as they are (rows keep their newlines), so packing puts an end-of-sequence token
    between articles, not between paragraphs.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from editkit.core.registry import Record
from editkit.data import TEXT_CORPORA
from editkit.data.toxic_corpus import PAPER_PROMPT, normalize
from editkit.errors import MissingResourceError
from editkit.settings import data_root as resolve_data_root
from editkit.util.hub import hf_hub_cache

#: Civil Comments rows strictly above this toxicity are toxic text (the authors' filter).
TOXICITY_ABOVE = 0.8
#: A prompt is the first half of a comment's words, at most this many.
PROMPT_WORDS = 8
#: Held-out prompts per split (test adds the paper's prompt), so each gets several samples.
PROMPTS_PER_SPLIT = 99
#: editkit's split names -> the hub's.
HUB_SPLITS = {"train": "train", "val": "validation", "test": "test"}
_HEADING = re.compile(r"^ = [^=].* = $")


@dataclass(frozen=True)
class HubDataset:
    """A dataset repository on the hub: its parquet files of split ``s`` are ``<folder>/<s>-*.parquet``."""

    repo: str
    folder: str
    how: str  # what to run on a machine with internet

    def snapshot(self, data_root: str | None) -> Path | None:
        """The cached snapshot directory of the first root holding one, or None; never online."""
        for root in self.roots(data_root):
            if (found := _snapshot(self.repo, root)) is not None:
                return found
        return None

    @staticmethod
    def roots(data_root: str | None) -> list[Path]:
        given = resolve_data_root(data_root)
        return ([given] if given else []) + [hf_hub_cache()]

    def files(self, snapshot: Path, split: str) -> list[Path]:
        return sorted((snapshot / self.folder).glob(f"{HUB_SPLITS[split]}-*.parquet"))

    def problems(self, data_root: str | None = None) -> list[str]:
        """One line if no root holds the snapshot, else one per split without parquet files."""
        snapshot = self.snapshot(data_root)
        where = " or ".join(str(r) for r in self.roots(data_root))
        how = (f"on a machine with internet run `{self.how}` and copy its Hugging Face cache to {where} "
               "(or set HF_HUB_CACHE / EDITKIT_DATA to a directory holding it)")
        if snapshot is None:
            return [f"the dataset {self.repo} is not in {where}: {how}"]
        return [f"the dataset {self.repo} at {snapshot} has no {self.folder}/{HUB_SPLITS[s]}-*.parquet: {how}"
                for s in HUB_SPLITS if not self.files(snapshot, s)]

    def parquet(self, split: str, data_root: str | None) -> list[Path]:
        """The split's parquet files; raises :class:`MissingResourceError` (how to get them) when absent."""
        snapshot = self.snapshot(data_root)
        files = self.files(snapshot, split) if snapshot is not None else []
        if not files:
            raise MissingResourceError("\n".join(self.problems(data_root)))
        return files


CIVIL_COMMENTS = HubDataset("google/civil_comments", "data", "hf download google/civil_comments --repo-type dataset")
WIKITEXT_103 = HubDataset("Salesforce/wikitext", "wikitext-103-raw-v1",
                          'hf download Salesforce/wikitext --repo-type dataset --include "wikitext-103-raw-v1/*"')


def _snapshot(repo: str, root: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", cache_dir=str(root), local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _column(files: list[Path], column: str, filters: Any = None) -> list[str]:
    import pyarrow.parquet as pq

    return [text for f in files for text in pq.read_table(f, columns=[column], filters=filters)[column].to_pylist()]


# --------------------------------------------------------------------------- Civil Comments


@functools.lru_cache(maxsize=4)
def _toxic_comments(files: tuple[Path, ...]) -> tuple[str, ...]:
    """Comments with toxicity above :data:`TOXICITY_ABOVE`, in file order (read once per file set).

    Compared in float32, the column's type: toxicity is a fraction of annotators stored as float32,
    and 0.8 (4 of 5) stored so is 0.80000001 as a double; it is not above 0.8.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    above = pc.field("toxicity") > pa.scalar(TOXICITY_ABOVE, pa.float32())
    return tuple(_column(list(files), "text", filters=above))


def _toxic(split: str, data_root: str | None) -> tuple[str, ...]:
    return _toxic_comments(tuple(CIVIL_COMMENTS.parquet(split, data_root)))


def held_out(split: str, seed: int = 0, data_root: str | None = None) -> tuple[list[str], list[str]]:
    """(target texts, prompt sources) of ``val`` or ``test``: the split's toxic comments not in train,
    deduplicated, shuffled with ``seed`` and cut in two halves (target first)."""
    seen = {normalize(text) for text in _toxic("train", data_root)}
    comments = []
    for text in _toxic(split, data_root):
        if (form := normalize(text)) not in seen:
            seen.add(form)
            comments.append(text)
    random.Random(f"{seed}:{split}").shuffle(comments)
    half = (len(comments) + 1) // 2
    return comments[:half], comments[half:]


def opening(text: str) -> str | None:
    """The first half of ``text``'s words, at most :data:`PROMPT_WORDS`; None for a text under four words."""
    words = text.split()
    count = min(PROMPT_WORDS, len(words) // 2)
    return " ".join(words[:count]) if count >= 2 else None


def civil_comments_toxic(split: str, seed: int = 0, data_root: str | None = None) -> list[str]:
    if split == "train":
        return list(_toxic("train", data_root))
    return held_out(split, seed, data_root)[0]


def civil_comments_prompts(split: str, seed: int = 0, data_root: str | None = None) -> list[str]:
    if split == "train":
        return []
    prompts = [p for p in map(opening, held_out(split, seed, data_root)[1]) if p is not None][:PROMPTS_PER_SPLIT]
    return [PAPER_PROMPT] + prompts if split == "test" else prompts


# --------------------------------------------------------------------------- WikiText-103


def articles(rows: list[str]) -> list[str]:
    """Rows joined into articles, each starting at a top-level heading row; empty articles dropped."""
    found: list[list[str]] = [[]]
    for row in rows:
        if _HEADING.match(row.rstrip("\n")):
            found.append([])
        found[-1].append(row)
    return [text for text in ("".join(article).strip() for article in found) if text]


def wikitext_103(split: str, seed: int = 0, data_root: str | None = None) -> list[str]:
    """The split's articles in file order (``seed`` is unused: the hub's splits are fixed)."""
    return articles(_column(WIKITEXT_103.parquet(split, data_root), "text"))


# --------------------------------------------------------------------------- registration


_HELP = {"seed": "seed of the held-out halves (target text / prompts)",
         "data_root": "directory holding the hub-cache copies (default: $EDITKIT_DATA, then the Hugging Face cache)"}
TEXT_CORPORA.register("civil-comments-toxic", Record.of(civil_comments_toxic, check=CIVIL_COMMENTS.problems,
                                                        help=_HELP))
TEXT_CORPORA.register("civil-comments-prompts", Record.of(civil_comments_prompts,
                                                          check=CIVIL_COMMENTS.problems, help=_HELP))
TEXT_CORPORA.register("wikitext-103", Record.of(wikitext_103, check=WIKITEXT_103.problems, help={
    "seed": "unused (the hub's splits are fixed)", "data_root": _HELP["data_root"]}))
