"""Text as language-modelling data for a causal-LM backbone.

A text task's examples are token sequences; what its backbone (the decoder's
trainable tail) reads is the hidden states the frozen prefix computes from them.
Those depend on theta_0 alone, so they are computed once here, when the data is
built, and every later step and every scored model reuses them.

Texts are packed: joined with the tokenizer's end-of-sequence token and cut into
blocks of ``max_length`` tokens (the usual language-modelling layout; no padding,
every token predicted). Named corpora (``TEXT_CORPORA``) give the texts of each
split; registered here:

- task source ``text`` (``source = "text:<corpus>"``): the corpus's train / val /
  test splits as a language-modelling task (its head: ``[heads] kind = "lm"``);
- generic source ``text`` (``[generic] kind = "text"``, ``corpus = ...``): unlabeled
  blocks of a corpus's train split for the tauJp penalty.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from editkit.core.batching import IGNORE_INDEX
from editkit.core.registry import Record
from editkit.core.taujp import LazyUnlabeledSource
from editkit.data import GENERIC_SOURCES, TASK_SOURCES, TEXT_CORPORA
from editkit.data.tasks import TaskData
from editkit.errors import ConfigError
from editkit.core.derived_cache import cached, digest

#: The layout of a cached prefix-state entry; bumped when it changes, so older entries are missed, never misread.
PREFIX_CACHE_FORMAT = 1
#: Splits a corpus provides.
SPLITS = ("train", "val", "test")
#: A word, as :func:`pack_focused` judges words: letters, and apostrophes inside them.
WORD = re.compile(r"[A-Za-z](?:[A-Za-z']*[A-Za-z])?")
#: Which of some words to train on (one bool per word): a word-level classifier, such as a toxicity scorer's flags.
WordFlags = Callable[[Sequence[str]], Sequence[bool]]
PREFIX_BATCH = 16


class TokenSequences(Dataset):
    """Text examples as a tail reads them: item i is (prefix hidden states ``(T_i, D)``, its label).

    The label is the token ids themselves (language modelling: the next-token loss shifts
    them), or the class id of ``labels`` (text classification; also ``targets``, which
    probes and Avalanche read). In language modelling the token after an end-of-sequence
    token is not a target (``IGNORE_INDEX``): a block packs several texts joined by EOS
    (:func:`pack`), and which text comes next is no skill of the model's. Scored, that guess
    dominates the perplexity of corpora of short texts; trained on, it is learned by every
    vector (an instruct model's EOS ends a chat turn, after which raw text is very unlikely),
    so negating a vector would unlearn it and look like lost language ability. ``input(i)`` gives the states alone, so a tauJp source never
    reads a label. States are computed when first read, a chunk of ``PREFIX_BATCH`` texts of
    similar lengths at a time (so a chunk is little padding), and kept: a run pays for the
    prefix of the texts it reads, once (negation never reads the train split; a short run
    reads a few chunks of it), and the next run on this machine reads them back from the cache
    (:func:`stored_prefix_states`).
    """

    def __init__(self, ids: Sequence[torch.Tensor], backbone: Any, labels: torch.Tensor | None = None,
                 kept: Sequence[torch.Tensor] | None = None, texts: Sequence[str] | None = None,
                 max_length: int | None = None) -> None:
        self.ids = list(ids)
        #: The texts the ids were tokenized from (labelled texts), and the length they were cut at: what an exported
        #: model's inputs are made from (``editkit predict``, and the checks that its program scores as editkit does).
        self.texts = None if texts is None else list(texts)
        self.max_length = max_length
        if labels is not None and len(labels) != len(self.ids):
            raise ValueError(f"{len(self.ids)} texts but {len(labels)} labels")
        self.targets = labels
        self.kept = None if kept is None else list(kept)
        self._backbone = backbone
        self._eos = getattr(getattr(backbone, "tokenizer", None), "eos_token_id", None)
        # texts by length (ties in text order): chunk c is _by_length[c * PREFIX_BATCH : (c + 1) * PREFIX_BATCH]
        self._by_length = sorted(range(len(self.ids)), key=lambda i: len(self.ids[i]))
        self._place = {index: place for place, index in enumerate(self._by_length)}
        self._chunks: dict[int, list[torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def state(self, index: int) -> torch.Tensor:
        """Text ``index``'s prefix states (its chunk computed on first use)."""
        chunk, offset = divmod(self._place[index], PREFIX_BATCH)
        if chunk not in self._chunks:
            members = self._by_length[chunk * PREFIX_BATCH : (chunk + 1) * PREFIX_BATCH]
            self._chunks[chunk] = stored_prefix_states(self._backbone, [self.ids[i] for i in members])
        return self._chunks[chunk][offset]

    @property
    def states(self) -> list[torch.Tensor]:
        """Every text's prefix states (all computed)."""
        return [self.state(i) for i in range(len(self))]

    def precompute(self, index: Iterable[int]) -> None:
        """Compute now the states of the chunks holding texts ``index`` (the ones a training run will read):
        the same chunks, so the same states, as reading them later would compute, but outside the steps."""
        for i in index:
            self.state(i)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state(index), self.text_targets(index) if self.targets is None else self.targets[index]

    def text_targets(self, index: int) -> torch.Tensor:
        """Block ``index``'s next-token targets: its ids, the token after each EOS ignored (the next text's first),
        and with ``kept`` every token it does not keep ignored too."""
        ids = self.ids[index]
        ignored = torch.zeros_like(ids, dtype=torch.bool)
        if self._eos is not None:
            ignored[1:] = ids[:-1] == self._eos
        if self.kept is not None:
            ignored |= ~self.kept[index]
        return ids.masked_fill(ignored, IGNORE_INDEX)

    def input(self, index: int) -> torch.Tensor:
        return self.state(index)


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
#: Words whose final period does not end a sentence.
ABBREVIATIONS = frozenset({"Mr", "Mrs", "Ms", "Dr", "St", "Jr", "Sr", "Mt", "Lt", "Col", "Gen", "Sgt", "Capt",
                           "Prof", "vs"})


def sentences(text: str) -> list[str]:
    """The sentences of ``text``: lines cut after ``.``, ``!`` or ``?`` (and closing quotes or brackets) where a
    capital, a digit or an opening quote follows, except after an abbreviation (:data:`ABBREVIATIONS`) or an
    initial (``J.``, ``U.S.``)."""
    found = []
    for line in text.splitlines():
        start = 0
        for end in _SENTENCE_END.finditer(line):
            last = line[start:end.start()].split()[-1:]
            if last and (last[0].rstrip(".") in ABBREVIATIONS or re.fullmatch(r"(?:[A-Z]\.)+", last[0])):
                continue
            found.append(line[start:end.start()] + end.group().rstrip())
            start = end.end()
        found.append(line[start:])
    return [s.strip() for s in found if s.strip()]


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int | None = None) -> list[torch.Tensor]:
    """Each text's token ids with the tokenizer's special tokens, at most ``max_length`` of them (None: all)."""
    if not texts:
        return []
    encoded = tokenizer(list(texts), truncation=max_length is not None, max_length=max_length,
                        add_special_tokens=True)["input_ids"]
    return [torch.tensor(ids, dtype=torch.long) for ids in encoded]


def pack(tokenizer: Any, texts: Sequence[str], length: int, *, limit: int | None = None) -> list[torch.Tensor]:
    """Token-id blocks of ``length`` from ``texts`` joined by end-of-sequence tokens.

    The last block may be shorter (kept when it has two tokens or more: one prediction).
    ``limit``: at most that many blocks (the first ones); tokenizing stops once they are full,
    so a few blocks of a large corpus (WikiText-103's train split) cost only their own texts.
    """
    stream, _ = _token_stream(tokenizer, texts, length, limit)
    return _cut(stream, length, limit)


def pack_focused(tokenizer: Any, texts: Sequence[str], length: int, flags: WordFlags, *,
                 limit: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`pack`'s blocks, and per block which of its tokens spell a word ``flags`` flags (bool, same shape).

    A token counts when its characters overlap a flagged word's (so " f" and "uck" of " fuck" both do);
    end-of-sequence tokens never do. Needs a fast tokenizer (its offsets say which characters a token spells).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"focus_words needs a fast tokenizer (its character offsets), not {type(tokenizer).__name__}")
    words = sorted({m.group() for text in texts for m in WORD.finditer(text)})
    flagged = {word for word, flag in zip(words, flags(words)) if flag}
    spans = [[m.span() for m in WORD.finditer(text) if m.group() in flagged] for text in texts]
    stream, kept = _token_stream(tokenizer, texts, length, limit, spans)
    return _cut(stream, length, limit), [block.bool() for block in _cut(kept, length, limit)]


def _token_stream(tokenizer: Any, texts: Sequence[str], length: int, limit: int | None,
                  spans: Sequence[Sequence[tuple[int, int]]] | None = None) -> tuple[list[int], list[int]]:
    """The texts' token ids joined by EOS, read until ``limit`` blocks are full; with ``spans`` (per text, the
    character spans of its flagged words) also 1 / 0 per token: whether it overlaps one of them."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    kept: list[int] = []
    for index, text in enumerate(texts):
        if limit is not None and len(stream) >= limit * length:
            break
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=spans is not None)
        stream.extend(encoded["input_ids"])
        if spans is not None:
            kept.extend(int(any(start < stop and first < end for first, stop in spans[index]))
                        for start, end in encoded["offset_mapping"])
        if eos is not None:
            stream.append(eos)
            kept.append(0)
    return stream, kept


def _cut(stream: list[int], length: int, limit: int | None) -> list[torch.Tensor]:
    """``stream`` in blocks of ``length`` (a last block of fewer than two tokens dropped), the first ``limit``."""
    blocks = [torch.tensor(stream[i : i + length], dtype=torch.long) for i in range(0, len(stream), length)]
    blocks = [b for b in blocks if len(b) >= 2]
    return blocks[:limit] if limit is not None else blocks


@torch.no_grad()
def prefix_states(backbone: Any, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The frozen prefix's hidden states of each block, computed as one right-padded batch."""
    batch = backbone.batching.collate(blocks)
    hidden = backbone.prefix(batch.inputs.to(backbone.device), batch.attention_mask.to(backbone.device)).cpu()
    return [h[: len(ids)].clone() for h, ids in zip(hidden, blocks)]


def stored_prefix_states(backbone: Any, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`prefix_states`, read from the cache when this prefix computed them for these blocks before
    (:mod:`editkit.core.derived_cache`): theta_0's prefix never changes, and a language scenario's run spends
    minutes on it (the toxic text's 1,600 blocks through 26 blocks of SmolLM2). Keyed by the prefix's fingerprint,
    the blocks' token ids (the batch they were computed in), the device kind, the precision and the versions."""
    import transformers

    fingerprint = getattr(backbone, "prefix_fingerprint", None)
    if fingerprint is None:
        return prefix_states(backbone, blocks)
    key = {"format": PREFIX_CACHE_FORMAT, "prefix": fingerprint, "device": backbone.device.type,
           "precision": getattr(backbone, "precision", "fp32"),
           "blocks": digest([ids.tolist() for ids in blocks]), "torch": torch.__version__,
           "transformers": transformers.__version__}
    return cached("prefix-states", ".safetensors", key, lambda: prefix_states(backbone, blocks),
                  load=functools.partial(_load_states, lengths=[len(ids) for ids in blocks]), save=_save_states)


def _load_states(path: Any, key: dict[str, Any], lengths: list[int]) -> list[torch.Tensor] | None:
    with safe_open(str(path), framework="pt") as stored:
        if json.loads((stored.metadata() or {}).get("key", "null")) != key or len(stored.keys()) != len(lengths):
            return None
        states = [stored.get_tensor(str(i)) for i in range(len(lengths))]
    shapes = {tuple(state.shape[1:]) for state in states}
    if len(shapes) != 1 or [len(state) for state in states] != lengths or any(
            not state.is_floating_point() or not torch.isfinite(state).all() for state in states):
        return None
    return states


def _save_states(path: Any, key: dict[str, Any], states: list[torch.Tensor]) -> None:
    save_file({str(i): state.contiguous() for i, state in enumerate(states)}, str(path),
              metadata={"key": json.dumps(key)})


def sequences(backbone: Any, texts: Sequence[str], max_length: int, *, limit: int | None = None,
              description: str = "prefix states", focus: WordFlags | None = None) -> TokenSequences:
    """Packed blocks of ``texts``; their prefix states are computed when first read. With ``focus``, only the
    tokens of the words it flags are next-token targets (:func:`pack_focused`)."""
    require_prefix(backbone)
    if focus is None:
        blocks, kept = pack(backbone.tokenizer, texts, max_length, limit=limit), None
    else:
        blocks, kept = pack_focused(backbone.tokenizer, texts, max_length, focus, limit=limit)
        if not any(k.any() for k in kept):
            raise ConfigError(f"{description}: no word of the text is flagged, so nothing is left to train on")
    if not blocks:
        raise ConfigError(f"{description}: no text to build sequences from")
    return TokenSequences(blocks, backbone, kept=kept)


def pooled_sequences(backbone: Any, texts: Mapping[str, Sequence[str]], max_length: int, *,
                     limit: int | None = None, split: str = "") -> tuple[TokenSequences, dict[str, range]]:
    """One set of blocks from several corpora (up to ``limit`` blocks each: a large corpus cannot crowd out a
    small one), and the indices of each corpus's blocks in it."""
    blocks: list[torch.Tensor] = []
    parts = {}
    for corpus, corpus_texts in texts.items():
        ids = sequences(backbone, corpus_texts, max_length, limit=limit, description=f"{corpus} {split}".strip()).ids
        parts[corpus] = range(len(blocks), len(blocks) + len(ids))
        blocks += ids
    return TokenSequences(blocks, backbone), parts


def require_prefix(backbone: Any) -> None:
    """Refuse a backbone that cannot read text (text data is its prefix's hidden states)."""
    if not hasattr(backbone, "prefix"):
        raise ConfigError(f"text data needs a text backbone (causal-lm, text-encoder), not {backbone.name}")


def corpus_split(corpus: str, split: str, seed: int = 0) -> list[str]:
    """The texts of one split of a named corpus."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}: expected {', '.join(SPLITS)}")
    return TEXT_CORPORA[corpus].build(split, seed=seed)


def _task_source(name: str, dataset: str, backbone: Any, max_length: int = 64, train_blocks: int | None = None,
                 eval_blocks: int | None = None, focus_words: WordFlags | None = None) -> TaskData:
    """The corpus's splits as a language-modelling task. ``focus_words`` (the scenario layer turns a scorer's
    name into its flags) narrows the *train* split's targets to flagged words' tokens; validation and test
    keep every token, so the target perplexity a run reports is the whole text's."""
    limits = {"train": train_blocks, "val": eval_blocks, "test": eval_blocks}
    splits = {split: sequences(backbone, corpus_split(dataset, split), max_length, limit=limits[split],
                               description=f"{name} {split}", focus=focus_words if split == "train" else None)
              for split in SPLITS}
    return TaskData(name, [], splits["train"], splits["val"], splits["test"])


def _task_check(name: str, dataset: str, max_length: int = 64, train_blocks: int | None = None,
                eval_blocks: int | None = None, focus_words: str | None = None) -> list[str]:
    return _corpus_check(dataset)  # the focus scorer's pieces: checked by the scenario, which builds it


def _corpus_check(corpus: str) -> list[str]:
    check = TEXT_CORPORA[corpus].check
    return check() if check is not None else []


def corpus_names(corpus: str | Sequence[str]) -> list[str]:
    """A ``corpus`` setting as names: one name, or a list of them (a source pooled from several corpora)."""
    return [corpus] if isinstance(corpus, str) else list(corpus)


def _generic_source(backbone: Any, seed: int, corpus: str | Sequence[str] = "", max_length: int = 64,
                    size: int | None = None) -> LazyUnlabeledSource:
    names = corpus_names(corpus)
    data, _ = pooled_sequences(backbone, {name: corpus_split(name, "train", seed) for name in names}, max_length,
                               limit=size, split="(tauJp source)")
    return LazyUnlabeledSource("+".join(names), data, seed=seed, collate=backbone.batching.collate)


def generic_check(corpus: str | Sequence[str] = "", **_: Any) -> list[str]:
    """A generic source's check: its corpora's (a user's ``file:`` corpus is read; the embedded ones say what
    they lack)."""
    return [line for name in corpus_names(corpus) for line in _corpus_check(name)]


_OPTIONS_HELP = {"max_length": "tokens per packed block",
                 "train_blocks": "at most this many train blocks (default: all)",
                 "eval_blocks": "at most this many validation / test blocks each (default: all)",
                 "focus_words": "train the next-token loss only on the tokens of the words this toxicity scorer "
                                "flags (its name, e.g. profanity; default: every token)"}
TASK_SOURCES.register("text", Record.of(_task_source, check=_task_check, help=_OPTIONS_HELP))
GENERIC_SOURCES.register("text", Record.of(_generic_source, check=generic_check, help={
    "corpus": "the text corpus whose train split is the source, or a list of corpora pooled",
    "max_length": _OPTIONS_HELP["max_length"], "size": "at most this many blocks of each corpus (default: all)"}))
