"""The ``toxblock`` scorer: tox-block's Keras BiLSTM ported to PyTorch, read from the real pinned wheel.

Ground truth: the package's own prediction code (``tox_block.prediction.make_predictions(texts,
rescale=False)``, TensorFlow 2.15.1, keras_preprocessing 1.1.2) was run once on the texts below and its
six outputs are written here; the port must reproduce them without TensorFlow.
"""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch

from editkit import settings
from editkit.core import artifacts
from editkit.errors import ConfigError, MissingResourceError
from editkit.eval import toxblock
from editkit.eval.toxicity import TOXICITY_SCORERS
from editkit.scenario.spec import load_scenario

FILLER = "the weather report said it would rain in the afternoon"
INSULT = "you are a disgusting pathetic moron"

#: text -> tox-block's six outputs (toxic, severe_toxic, obscene, threat, insult, identity_hate) under TensorFlow.
REFERENCE = {
    "You are a wonderful person and I love this community.":
        [0.42854321002960205, 0.003810042981058359, 0.03244749829173088, 0.015283373184502125, 0.16757600009441376,
         0.027893630787730217],
    "Shut up you stupid idiot, nobody cares what you think.":
        [0.9965423941612244, 0.11447314918041229, 0.9112093448638916, 0.008118884637951851, 0.9620287418365479,
         0.029529066756367683],
    "The committee will meet on Tuesday to discuss the budget.":
        [0.0007238477119244635, 9.222863809554838e-06, 0.00011576988617889583, 6.611939170397818e-05,
         9.666499681770802e-05, 5.454831989482045e-05],
    "I will kill you and your whole family":
        [0.93943190574646, 0.1366213858127594, 0.22814875841140747, 0.9251819849014282, 0.4304836094379425,
         0.16926886141300201],
    "zzqx blorf wibble":
        [0.019497180357575417, 0.00022367275960277766, 0.00377272954210639, 0.0006492089596576989,
         0.00416756235063076, 0.0019300688290968537],
    # 127 words: the insult at the start is cut away (Keras keeps the last 100 ids) ...
    " ".join([INSULT] + [FILLER] * 12):
        [0.0015051235677674413, 2.2052427084418014e-05, 0.0004180736723355949, 6.635067984461784e-05,
         0.00023424056416843086, 7.634758367203176e-05],
    # ... and kept at the end.
    " ".join([FILLER] * 12 + [INSULT]):
        [0.3878363370895386, 0.0055669015273451805, 0.07116160541772842, 0.008077239617705345, 0.26210537552833557,
         0.010487736202776432],
    "HeLLo!!! (world)...\tgo\nHOME; you—IDIOT":
        [0.18355508148670197, 0.0022856667637825012, 0.022946549579501152, 0.019865810871124268,
         0.033747024834156036, 0.00932303536683321],
}


@pytest.fixture(scope="module")
def scorer():
    return TOXICITY_SCORERS["toxblock"].build()


def test_reproduces_the_packages_tensorflow_outputs(scorer):
    texts = list(REFERENCE)
    with torch.no_grad():
        outputs = scorer.model(scorer.tokenizer.encode(texts)).double().numpy()
    np.testing.assert_allclose(outputs, np.array(list(REFERENCE.values())), rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(scorer.score(texts), outputs[:, 0])
    threat = TOXICITY_SCORERS["toxblock"].build(label="threat")
    np.testing.assert_allclose(threat.score(texts), outputs[:, 3])


def test_scores_across_batches_equal_one_batch(scorer, monkeypatch):
    texts = list(REFERENCE) * 3
    whole = scorer.score(texts)
    monkeypatch.setattr(toxblock, "BATCH", 5)
    np.testing.assert_allclose(scorer.score(texts), whole, rtol=1e-5, atol=1e-7)  # matmul blocking differs
    assert whole.dtype == np.float64 and scorer.score([]).shape == (0,)


def test_tokenizer_is_keras_texts_to_sequences_then_pre_padding():
    tok = toxblock.WordTokenizer({"hello": 3, "world": 7, "go": 1}, num_words=20, length=4, filters="!,.()\t\n",
                                 lower=True, split=" ")
    assert tok.ids("HeLLo, (WORLD)!\tunknown go") == [3, 7, 1]
    assert tok.encode(["hello world", "", "go go go hello world"]).tolist() == [
        [0, 0, 3, 7], [0, 0, 0, 0], [1, 1, 3, 7]]


def test_hard_sigmoid_is_keras_2s():
    x = torch.tensor([-3.0, -2.5, -1.0, 0.0, 1.0, 2.5, 3.0])
    assert toxblock.hard_sigmoid(x).tolist() == pytest.approx([0.0, 0.0, 0.3, 0.5, 0.7, 1.0, 1.0])


def test_encoder_unpickler_refuses_any_other_global():
    class Evil:
        def __reduce__(self):
            import os
            return (os.getcwd, ())

    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle posix.getcwd"):
        toxblock.read_tokenizer(pickle.dumps(Evil()))


def test_refuses_a_saved_model_with_other_gates():
    h5py = pytest.importorskip("h5py")
    layers = [{"class_name": "Embedding", "config": {"mask_zero": False}},
              {"class_name": "Bidirectional", "config": {"merge_mode": "concat", "layer": {"config": {
                  "recurrent_activation": "sigmoid", "activation": "tanh"}}}}]
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as h5:
        h5.attrs["model_config"] = json.dumps({"config": {"layers": layers}})
    with pytest.raises(MissingResourceError, match="'sigmoid'.*expected .*'hard_sigmoid'"):
        toxblock.read_model(buffer.getvalue(), "model.h5")


def test_unknown_label_is_refused_by_name():
    with pytest.raises(ConfigError, match="no output 'hate'.*identity_hate"):
        TOXICITY_SCORERS["toxblock"].build(label="hate")


def test_is_the_toxic_scenarios_scorer():
    assert load_scenario("toxic").negation.scorer == "toxblock"


def test_refusal_when_the_wheel_cannot_be_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path))

    def offline(artifact, dest):
        raise MissingResourceError(artifacts.explain(artifact, "no network"))

    monkeypatch.setattr(artifacts, "_download", offline)
    [line] = TOXICITY_SCORERS["toxblock"].check()
    assert "tox-block" in line and "pip download --no-deps tox-block==0.1.2" in line and "\n" not in line
    with pytest.raises(MissingResourceError, match="tox-block"):
        TOXICITY_SCORERS["toxblock"].build()
