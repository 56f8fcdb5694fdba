"""The ``detoxify`` scorer on a tiny random BERT saved as a Detoxify release checkpoint.

The checkpoint is written in Detoxify's format (``{"state_dict", "config"}``, the training config's
``arch.args`` and ``dataset.args.classes``); the scores must equal a forward computed here by hand from
the same weights: BERT's [CLS] state, the pooler (tanh), the classifier row of the toxic label, a sigmoid.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from editkit.errors import ConfigError, MissingResourceError
from editkit.eval.toxicity import DETOXIFY_FILE, DETOXIFY_URL, TOXICITY_SCORERS, detoxify_checkpoint
from helpers.hub import empty_caches, hub_repo

#: The original checkpoint's label order; "toxic" is put third here, so the scorer must read the order.
CLASSES = ["severe_toxic", "obscene", "toxic", "threat", "insult", "identity_hate"]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "you", "are", "an", "idiot", "the", "cat", "sat", "##s", "hello"]
TEXTS = ["you are an idiot", "the cat sats", "hello", "an idiot cat sat hello you are the idiot cat"]


def _classifier(max_position_embeddings: int = 64):
    import transformers

    config = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=max_position_embeddings,
                                     num_labels=len(CLASSES))
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def _tokenizer():
    import transformers

    return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})


def _save_bert(model, directory):
    model.config.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)


def _write_checkpoint(model, path, classes=CLASSES, model_name="BertForSequenceClassification"):
    """Detoxify's release format (``scripts/convert_weights.py``): the state dict and the training config,
    with the position-ids buffer older transformers kept in it."""
    state = dict(model.state_dict())
    state["bert.embeddings.position_ids"] = torch.arange(model.config.max_position_embeddings)[None]
    config = {"arch": {"args": {"num_classes": len(classes), "model_type": "bert-base-uncased",
                                "model_name": model_name, "tokenizer_name": "BertTokenizer"}},
              "dataset": {"args": {"classes": classes}}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "config": config}, path)
    return path


def _by_hand(model, texts) -> np.ndarray:
    """sigmoid(w_toxic . tanh(W_p h_CLS + b_p) + b_toxic), one text at a time (no padding)."""
    s = model.state_dict()
    row = CLASSES.index("toxic")
    out = []
    with torch.no_grad():
        for text in texts:
            ids = _tokenizer()(text, return_tensors="pt")
            cls = model.bert(**ids).last_hidden_state[0, 0].double()
            pooled = torch.tanh(s["bert.pooler.dense.weight"].double() @ cls + s["bert.pooler.dense.bias"].double())
            logit = s["classifier.weight"][row].double() @ pooled + s["classifier.bias"][row].double()
            out.append(1.0 / (1.0 + np.exp(-logit.item())))
    return np.array(out)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return empty_caches(tmp_path, monkeypatch)


def test_scores_equal_the_hand_forward_with_the_checkpoints_label_order(hub, tmp_path):
    model = _classifier()
    checkpoint = _write_checkpoint(model, tmp_path / "toxic.ckpt")
    _save_bert(model, tmp_path / "bert")
    scorer = TOXICITY_SCORERS["detoxify"].build(checkpoint=str(checkpoint), tokenizer=str(tmp_path / "bert"))
    scores = scorer.score(TEXTS)  # one padded batch
    assert scores.dtype == np.float64 and scores.shape == (len(TEXTS),)
    np.testing.assert_allclose(scores, _by_hand(model, TEXTS), rtol=0, atol=1e-6)
    assert scorer.name == "detoxify" and scorer.threshold == 0.5
    assert scorer.score([]).shape == (0,)


def test_defaults_read_the_cache_and_bert_base_uncased_from_the_hub_cache(hub, tmp_path):
    model = _classifier()
    hub_repo(hub, "bert-base-uncased", lambda d: _save_bert(model, d))
    _write_checkpoint(model, detoxify_checkpoint())
    assert detoxify_checkpoint().name == DETOXIFY_FILE
    assert TOXICITY_SCORERS["detoxify"].check() == []
    # The default file is the release, whose name pins its sha256 prefix: this stand-in is refused as damaged.
    with pytest.raises(MissingResourceError, match="does not start with c1212f89"):
        TOXICITY_SCORERS["detoxify"].build()
    checkpoint = _write_checkpoint(model, tmp_path / "toxic.ckpt")
    scorer = TOXICITY_SCORERS["detoxify"].build(checkpoint=str(checkpoint), threshold=0.3)
    np.testing.assert_allclose(scorer.score(TEXTS[:2]), _by_hand(model, TEXTS[:2]), rtol=0, atol=1e-6)
    assert scorer.threshold == 0.3


def test_long_texts_are_truncated_to_the_models_context(hub, tmp_path):
    model = _classifier(max_position_embeddings=8)
    _save_bert(model, tmp_path / "bert")
    scorer = TOXICITY_SCORERS["detoxify"].build(checkpoint=str(_write_checkpoint(model, tmp_path / "t.ckpt")),
                                                tokenizer=str(tmp_path / "bert"))
    long = "you are an idiot " * 20
    kept = " ".join(long.split()[:6])  # [CLS] + 6 words + [SEP] = 8 positions
    np.testing.assert_allclose(scorer.score([long]), _by_hand(model, [kept]), rtol=0, atol=1e-6)


def test_a_name_carrying_a_sha256_prefix_is_checked(hub, tmp_path):
    model = _classifier()
    _save_bert(model, tmp_path / "bert")
    written = _write_checkpoint(model, tmp_path / "w.ckpt")
    digest = hashlib.sha256(written.read_bytes()).hexdigest()
    good = written.rename(tmp_path / f"toxic_original-{digest[:8]}.ckpt")
    TOXICITY_SCORERS["detoxify"].build(checkpoint=str(good), tokenizer=str(tmp_path / "bert"))
    bad = good.rename(tmp_path / f"toxic_original-{'0' * 8 if digest[:8] != '0' * 8 else '1' * 8}.ckpt")
    with pytest.raises(MissingResourceError, match="is damaged"):
        TOXICITY_SCORERS["detoxify"].build(checkpoint=str(bad), tokenizer=str(tmp_path / "bert"))


def test_other_architectures_and_files_are_refused(hub, tmp_path):
    model = _classifier()
    _save_bert(model, tmp_path / "bert")
    albert = _write_checkpoint(model, tmp_path / "a.ckpt", model_name="AlbertForSequenceClassification")
    with pytest.raises(ConfigError, match="AlbertForSequenceClassification"):
        TOXICITY_SCORERS["detoxify"].build(checkpoint=str(albert), tokenizer=str(tmp_path / "bert"))
    torch.save(model.state_dict(), tmp_path / "bare.ckpt")
    with pytest.raises(MissingResourceError, match="not a Detoxify checkpoint"):
        TOXICITY_SCORERS["detoxify"].build(checkpoint=str(tmp_path / "bare.ckpt"), tokenizer=str(tmp_path / "bert"))


def test_each_missing_piece_is_one_line_saying_how_to_get_it(hub):
    lines = TOXICITY_SCORERS["detoxify"].check()
    assert lines == [
        f"the Detoxify checkpoint {detoxify_checkpoint()} does not exist: on a machine with internet download "
        f"{DETOXIFY_URL} and copy it there",
        f"the Detoxify config and tokenizer bert-base-uncased are neither a directory nor in the Hugging Face cache "
        f"at {hub}: on a machine with internet run `hf download bert-base-uncased config.json tokenizer.json "
        f"tokenizer_config.json vocab.txt` and copy its Hugging Face cache to {hub} (or set HF_HUB_CACHE)"]
    assert DETOXIFY_URL == ("https://github.com/unitaryai/detoxify/releases/download/v0.1-alpha/"
                            "toxic_original-c1212f89.ckpt")
    with pytest.raises(MissingResourceError) as refused:
        TOXICITY_SCORERS["detoxify"].build()
    assert str(refused.value).splitlines() == lines


def test_a_directory_without_the_tokenizer_names_that_piece(hub, tmp_path):
    _classifier().config.save_pretrained(tmp_path / "config-only")
    [line] = TOXICITY_SCORERS["detoxify"].check(checkpoint=__file__, tokenizer=str(tmp_path / "config-only"))
    assert line.startswith(f"{tmp_path / 'config-only'} has no Detoxify tokenizer (tokenizer.json or vocab.txt): ")
