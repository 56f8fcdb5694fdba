"""Text as language-modelling data: packing by hand, cached prefix states against the backbone's own prefix,
and the ``text`` task and generic sources on a corpus the test registers.

The character tokenizer makes every block computable by hand (one token per character, ``<eos>`` = 0).
"""

from __future__ import annotations

import pytest
import torch

from editkit.data import GENERIC_SOURCES, TASK_SOURCES
from editkit.core.batching import IGNORE_INDEX
from editkit.data.text import TokenSequences, corpus_split, pack, pack_focused, sequences
from editkit.errors import ConfigError
from editkit.models.causal_lm import causal_lm_backbone
from helpers import models
from helpers.text import registered_corpora

EOS = 0
CORPUS = {"train": ["the cat sat", "on the mat", "a dog"], "val": ["hello"], "test": ["good bye", "ok"]}


def ids(text: str) -> list[int]:
    return [models.CHARS.index(c) + 1 for c in text]


@pytest.fixture(scope="module")
def tokenizer():
    return models.char_tokenizer()


@pytest.fixture(scope="module")
def backbone(tokenizer):
    lm = models.gpt2(n_layer=2, vocab_size=len(tokenizer), attn_implementation="sdpa")
    return causal_lm_backbone(lm, tokenizer, trainable_blocks=1)


@pytest.fixture
def corpus():
    with registered_corpora({"test-corpus": CORPUS}):
        yield "test-corpus"


# --------------------------------------------------------------------------- packing


def test_pack_joins_texts_with_eos_and_cuts_blocks(tokenizer):
    stream = ids("abc") + [EOS] + ids("de") + [EOS] + ids("fghi") + [EOS]  # 12 tokens
    blocks = pack(tokenizer, ["abc", "de", "fghi"], 5)
    assert [b.tolist() for b in blocks] == [stream[0:5], stream[5:10], stream[10:12]]
    assert all(b.dtype == torch.long for b in blocks)
    assert [b.tolist() for b in pack(tokenizer, ["abc", "de", "fghi"], 5, limit=2)] == [stream[0:5], stream[5:10]]


def test_pack_drops_a_last_block_with_nothing_to_predict(tokenizer):
    assert [b.tolist() for b in pack(tokenizer, ["abc"], 3)] == [ids("abc")]  # the lone <eos> left over is dropped
    assert pack(tokenizer, [], 4) == []


def flag_words(*flagged: str):
    """Word flags that flag exactly ``flagged``, recording every list of words they are asked about."""
    asked: list[list[str]] = []

    def flags(words):
        asked.append(list(words))
        return [word in flagged for word in words]

    flags.asked = asked
    return flags


def test_pack_focused_keeps_the_tokens_of_flagged_words_only():
    """One token per character: "you dumb ass" + <eos> + "a dumber dumb" + <eos> in blocks of 8. Flagging "dumb"
    keeps characters 4-7 of the first text and 9-12 of the second (not "dumber", another word), never a space
    or an <eos>; each unique word is asked about once."""
    tokenizer = models.char_tokenizer()
    flags = flag_words("dumb")
    blocks, kept = pack_focused(tokenizer, ["you dumb ass", "a dumber dumb"], 8, flags)
    assert [b.tolist() for b in blocks] == [b.tolist() for b in pack(tokenizer, ["you dumb ass", "a dumber dumb"], 8)]
    stream = [0] * 4 + [1] * 4 + [0] * 4 + [0] + [0] * 9 + [1] * 4 + [0]  # 13 + 14 tokens
    assert [k.tolist() for k in kept] == [[bool(v) for v in stream[i:i + 8]] for i in range(0, 27, 8)]
    assert flags.asked == [["a", "ass", "dumb", "dumber", "you"]]


def test_pack_focused_refuses_a_tokenizer_without_character_offsets():
    class Slow:
        eos_token_id = 0
        is_fast = False

    with pytest.raises(ConfigError, match="focus_words needs a fast tokenizer .*not Slow"):
        pack_focused(Slow(), ["you dumb ass"], 8, flag_words("dumb"))


def test_focused_targets_ignore_every_token_but_the_kept_ones(backbone):
    data = sequences(backbone, ["you dumb ass", "a dumb"], 32, focus=flag_words("dumb", "ass"))
    ids = data.ids[0]
    targets = data[0][1]
    kept_positions = [i for i, t in enumerate(targets.tolist()) if t != IGNORE_INDEX]
    assert kept_positions == [4, 5, 6, 7, 9, 10, 11, 15, 16, 17, 18]  # "dumb", "ass"; "dumb" of the second text
    assert torch.equal(targets[kept_positions], ids[kept_positions])
    assert sequences(backbone, ["you dumb ass"], 32)[0][1].tolist() == ids[:13].tolist()  # unfocused: every token
    with pytest.raises(ConfigError, match="no word of the text is flagged"):
        sequences(backbone, ["a kind word"], 32, focus=flag_words("dumb"))


# --------------------------------------------------------------------------- prefix states


def test_sequences_cache_the_backbones_prefix_states_on_first_read(backbone, monkeypatch):
    texts = ["the cat sat on the mat", "a dog"]
    blocks = pack(backbone.tokenizer, texts, 8)
    calls = []
    prefix = backbone.prefix
    monkeypatch.setattr(backbone, "prefix", lambda *a, **k: calls.append(1) or prefix(*a, **k))
    data = sequences(backbone, texts, 8)
    assert isinstance(data, TokenSequences) and calls == []  # nothing computed until read
    assert len(data) == len(blocks) == 4
    eos = backbone.tokenizer.eos_token_id
    for i, block in enumerate(blocks):
        states, labels = data[i]
        # the targets are the ids, except the first token of each packed text (it follows an EOS): -100
        assert labels.tolist() == [-100 if t and block[t - 1] == eos else int(v) for t, v in enumerate(block)]
        want = prefix(block[None], torch.ones(1, len(block), dtype=torch.long))[0]
        torch.testing.assert_close(states, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(data.input(i), states)
    assert len(calls) == 1  # one batch for the whole split, then cached


def test_sequences_refuse_a_backbone_without_a_prefix_and_empty_text(backbone, tiny_clip):
    with pytest.raises(ConfigError, match="text data needs a text backbone"):
        sequences(tiny_clip, ["text"], 8)
    with pytest.raises(ConfigError, match="no text to build sequences from"):
        sequences(backbone, [], 8)


# --------------------------------------------------------------------------- the text sources


def test_text_task_source_packs_each_split_of_a_registered_corpus(backbone, corpus):
    task = TASK_SOURCES["text"].build("lm-task", corpus, backbone, max_length=6, eval_blocks=1)
    assert task.name == "lm-task" and task.classes == []
    for split in ("train", "val", "test"):
        want = pack(backbone.tokenizer, CORPUS[split], 6, limit=None if split == "train" else 1)
        assert [b.tolist() for b in getattr(task, split).ids] == [b.tolist() for b in want]
    assert TASK_SOURCES["text"].check("lm-task", corpus) == []


def test_focus_words_narrow_the_train_targets_and_leave_validation_and_test_whole(backbone, corpus):
    task = TASK_SOURCES["text"].build("lm-task", corpus, backbone, max_length=32, focus_words=flag_words("cat", "ok"))
    train = task.train[0][1]
    assert [i for i, t in enumerate(train.tolist()) if t != IGNORE_INDEX] == [4, 5, 6]  # "the cat sat": "cat"
    for name in ("val", "test"):  # every token's target, as without focus (the text after an <eos> aside)
        whole = sequences(backbone, CORPUS[name], 32)
        split = getattr(task, name)
        assert [split[i][1].tolist() for i in range(len(split))] == [whole[i][1].tolist() for i in range(len(whole))]
        assert any(t != IGNORE_INDEX for t in whole[0][1].tolist()[4:])


def test_text_generic_source_serves_prefix_states_of_the_train_split(backbone, corpus):
    source = GENERIC_SOURCES["text"].build(backbone, 0, corpus=corpus, max_length=6, size=3)
    blocks = pack(backbone.tokenizer, CORPUS["train"], 6, limit=3)
    assert len(source) == 3
    batch = source.next_batch(3)
    assert batch.inputs.shape == (3, 6, backbone.feature_dim)
    lengths = batch.attention_mask.sum(1).tolist()
    assert sorted(lengths) == sorted(len(b) for b in blocks)
    states = sequences(backbone, CORPUS["train"], 6, limit=3).states
    drawn = {tuple(batch.inputs[row, :length].flatten().tolist()) for row, length in enumerate(lengths)}
    assert drawn == {tuple(s.flatten().tolist()) for s in states}  # every block once, never its tokens


def test_a_generic_source_pools_several_corpora_each_up_to_its_size(backbone):
    """Two corpora: each one's first ``size`` blocks, so a long corpus does not crowd out a short one."""
    other = {"train": ["zzzzzzzzzzzzzzzz"], "val": ["v"], "test": ["t"]}  # 17 tokens: blocks of 6, 6, 5
    with registered_corpora({"test-corpus": CORPUS, "other-corpus": other}):
        source = GENERIC_SOURCES["text"].build(backbone, 0, corpus=["test-corpus", "other-corpus"], max_length=6,
                                               size=2)
        assert GENERIC_SOURCES["text"].check(corpus=["test-corpus", "other-corpus"]) == []
    assert source.name == "test-corpus+other-corpus" and len(source) == 4
    expected = pack(backbone.tokenizer, CORPUS["train"], 6, limit=2) + pack(backbone.tokenizer, other["train"], 6,
                                                                            limit=2)
    batch = source.next_batch(4)
    lengths = batch.attention_mask.sum(1).tolist()
    assert sorted(lengths) == sorted(len(b) for b in expected) == [6, 6, 6, 6]
    drawn = {tuple(batch.inputs[row, :length].flatten().tolist()) for row, length in enumerate(lengths)}
    assert drawn == {tuple(s.flatten().tolist()) for s in TokenSequences(expected, backbone).states}

def test_corpus_split_refuses_an_unknown_split_and_corpus(corpus):
    assert corpus_split(corpus, "val") == CORPUS["val"]
    with pytest.raises(ConfigError, match="unknown split 'dev'"):
        corpus_split(corpus, "dev")
    with pytest.raises(ConfigError, match="unknown text corpus 'nope'"):
        corpus_split("nope", "train")
