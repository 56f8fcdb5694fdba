"""theta_0's sampled continuations kept on disk (:mod:`editkit.core.derived_cache`), so each machine samples them once.

Every ``editkit negate toxic`` and every mode of the bench scores theta_0 again, a thousand continuations each
time, and the same model, prompts and sampling settings always sample the same texts. The key holds the model's
fingerprint (all its weights), the prompts, the device kind, the precision, every sampling setting and the torch and
transformers versions (another version's float rounding samples other texts); the entry, a JSON file, also holds
the digest of its continuations, so an edited text is a miss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from editkit.core.derived_cache import cached, digest

#: The entry layout; bumped when it changes, so older entries are missed, never misread.
FORMAT = 1
FOLDER = "samples"

Pairs = list[tuple[str, str]]


def sample_key(model: str, prompts: Sequence[str], device: str, **settings: Any) -> dict[str, Any]:
    """What decides the texts sampled: ``model`` (a fingerprint of all its weights), the prompts, the device kind
    (``cpu``, ``cuda``), ``settings`` (precision, samples, new tokens, seed, temperature, top-p, batch size) and the
    versions."""
    import transformers

    return {"format": FORMAT, "model": model, "prompts": digest(list(prompts)), "device": device,
            "torch": torch.__version__, "transformers": transformers.__version__, **settings}


def cached_samples(key: dict[str, Any], sample: Callable[[], Pairs]) -> Pairs:
    """The continuations stored under ``key``, else ``sample()``'s, stored for the next call."""
    return cached(FOLDER, ".json", key, sample, load=_load, save=_save)


def _load(path: Path, key: dict[str, Any]) -> Pairs | None:
    entry = json.loads(path.read_text(encoding="utf-8"))
    pairs = entry.get("pairs") if isinstance(entry, dict) else None
    if (not isinstance(pairs, list) or entry.get("key") != key or entry.get("sha256") != digest(pairs)
            or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in pairs)):
        return None
    return [(prompt, text) for prompt, text in pairs]


def _save(path: Path, key: dict[str, Any], pairs: Pairs) -> None:
    stored = [list(pair) for pair in pairs]
    path.write_text(json.dumps({"key": key, "sha256": digest(stored), "pairs": stored}), encoding="utf-8")
