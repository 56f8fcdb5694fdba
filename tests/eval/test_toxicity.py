"""The ``profanity`` toxicity scorer, read from the real pinned alt-profanity-check wheel.

The wheel is fetched into the cache on first use (``$EDITKIT_CACHE``); the refusal tests
use an empty cache and a download command that fails, so they need no network.
"""

from __future__ import annotations

import sys
import zipfile

import joblib
import numpy as np
import pytest
import sklearn

from editkit import settings
from editkit.core import artifacts
from editkit.data import cache
from editkit.errors import MissingResourceError
from editkit.eval import toxicity
from editkit.eval.toxicity import TOXICITY_SCORERS

PROFANE = "You are a fucking idiot and your shit idea sucks"
CLEAN = "The Prime Minister announced a relief package for farmers affected by the bushfires."


@pytest.fixture(scope="module")
def scorer():
    return TOXICITY_SCORERS["profanity"].build()


def test_record_options_and_attributes(scorer):
    record = TOXICITY_SCORERS["profanity"]
    assert record.option_names == ("threshold",) and record.options[0].default == 0.5
    assert scorer.name == "profanity" and scorer.threshold == 0.5
    assert record.build(threshold=0.8).threshold == 0.8
    assert record.check() == []


def test_scores_hand_picked_texts(scorer):
    scores = scorer.score([PROFANE, CLEAN])
    assert scores.dtype == np.float64 and scores.shape == (2,)
    assert scores[0] > 0.5 > scores[1]
    assert scorer.score([]).shape == (0,)


def test_score_is_predict_proba_of_the_wheels_joblib_files(scorer, tmp_path):
    """The scorer equals the model's P(class 1) computed here from the extracted joblib files."""
    with zipfile.ZipFile(artifacts.fetch(cache.ALT_PROFANITY_CHECK_WHEEL)) as wheel:
        wheel.extractall(tmp_path, members=[toxicity.PROFANITY_VECTORIZER, toxicity.PROFANITY_MODEL])
    vectorizer = joblib.load(tmp_path / toxicity.PROFANITY_VECTORIZER)
    model = joblib.load(tmp_path / toxicity.PROFANITY_MODEL)
    assert list(model.classes_) == [0, 1]
    texts = [PROFANE, CLEAN, "I don't care if this is controversial", "damn", ""]
    expected = model.predict_proba(vectorizer.transform(texts))[:, 1]
    np.testing.assert_array_equal(scorer.score(texts), expected)
    assert np.all((expected >= 0) & (expected <= 1))


def test_refuses_another_scikit_learn(monkeypatch, scorer):
    monkeypatch.setattr(sklearn, "__version__", "1.5.2")
    lines = TOXICITY_SCORERS["profanity"].check()
    assert len(lines) == 1
    assert "scikit-learn 1.9.1" in lines[0] and "scikit-learn 1.5.2" in lines[0]
    assert lines[0].endswith("pip install scikit-learn==1.9.1 joblib==1.6.0")
    with pytest.raises(MissingResourceError) as info:
        TOXICITY_SCORERS["profanity"].build()
    assert str(info.value) == lines[0]


def test_refusal_when_the_wheel_cannot_be_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(artifacts, "_command", lambda a: [sys.executable, "-c", "import sys; sys.exit('no network')"])
    lines = TOXICITY_SCORERS["profanity"].check()
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "pip download --no-deps alt-profanity-check==1.9.1" in lines[0] and "no network" in lines[0]
    with pytest.raises(MissingResourceError, match="alt-profanity-check"):
        TOXICITY_SCORERS["profanity"].build()
