"""A bank's manifest entry: everything needed to find, trust and describe one vector, checked the same way
when it is appended and when it is read back (a hand edit or a bug is refused by field, never half-read)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from editkit.core.adapters import LoraSpec
from editkit.core.modes import Family, Mode
from editkit.errors import BankError


def short_fingerprint(fingerprint: str | None) -> str:
    """Enough of a fingerprint for a human to tell two apart in an error message."""
    if fingerprint is None:
        return "<none>"
    algo, sep, digest = fingerprint.partition(":")
    return f"{algo}:{digest[:12]}" if sep else fingerprint[:19]



def check_mode(mode: str) -> None:
    if mode not in tuple(Mode):
        raise BankError(f"unknown vector mode {mode!r}; expected one of {', '.join(Mode)}")



#: Provenance keys that manifests written before ``provenance`` existed kept inside ``metrics``.
LEGACY_PROVENANCE_KEYS = ("scenario_file", "build")


@dataclass(frozen=True)
class VectorEntry:
    """One manifest entry: everything needed to find, trust and describe a vector.

    ``metrics`` holds what was measured; ``provenance`` what the vector was made from
    beyond its recipe (the run writes ``scenario_file`` and ``build``, the backbone and
    data options it was given), so the scenario can be rebuilt around it later.
    """

    name: str
    task: str
    mode: str
    base: str
    file: str
    checksum: str
    created: str
    scenario: str | None = None
    step: int | None = None
    recipe: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    #: The task's curvature at theta_0 banked beside the vector (the data-free penalty's input), as the bank wrote
    #: it: its ``file`` and ``checksum``, and what :meth:`editkit.core.curvature.Curvature.describe` says of it.
    #: Empty when none was computed.
    curvature: dict = field(default_factory=dict)
    #: The task's class prototypes banked beside the vector (a head shared by every class seen), as the bank wrote
    #: them: their ``file`` and ``checksum``, and what :meth:`editkit.core.prototypes.Prototypes.describe` says of
    #: them. Empty when none were computed (a task without classes, or a bank written before they existed).
    prototypes: dict = field(default_factory=dict)

    @property
    def family(self) -> Family:
        return Mode(self.mode).family

    @property
    def adapter(self) -> LoraSpec | None:
        """The LoRA adapter the vector is (its recipe's), or None for a full vector."""
        return LoraSpec.from_fields(self.recipe)

    @property
    def weight_updates(self) -> bool:
        """A plain-LoRA vector: its factors are scaled and merged as weight updates s * B A."""
        return self.adapter is not None and not Mode(self.mode).linearized

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest stores it; without ``curvature`` or ``prototypes`` where it has none (as
        written before they existed)."""
        values = dataclasses.asdict(self)
        for key in BESIDE_FILES:
            if not values[key]:
                del values[key]
        return values

    @classmethod
    def from_json(cls, data: Any) -> VectorEntry:
        """Parse one entry, refusing anything a hand edit or a bug could have mangled.

        An entry without ``provenance`` (written before it existed) has its provenance
        read out of ``metrics``, where those manifests kept it.
        """
        if not isinstance(data, dict):
            raise BankError(f"manifest entry is not an object: {data!r:.80}")
        missing = [key for key in REQUIRED_FIELDS if not isinstance(data.get(key), str)]
        if missing:
            label = data.get("name", "<unnamed>")
            raise BankError(f"manifest entry {label!r} lacks string field(s): {', '.join(missing)}")
        described = {key: data[key] for key in DESCRIBED_FIELDS if data.get(key) is not None}
        if "provenance" not in data and isinstance(described.get("metrics"), dict):
            metrics = described["metrics"]
            described["provenance"] = {k: metrics[k] for k in LEGACY_PROVENANCE_KEYS if metrics.get(k) is not None}
            described["metrics"] = {k: v for k, v in metrics.items() if k not in LEGACY_PROVENANCE_KEYS}
        check_mode(data["mode"])
        return cls(**{key: data[key] for key in REQUIRED_FIELDS},
                   **checked_fields(described, f"manifest entry {data['name']!r}"))


#: The entry's records of the files banked beside its vector: each names its ``file`` and ``checksum``.
BESIDE_FILES = ("curvature", "prototypes")
#: The fields every entry has (the bank sets ``file``, ``checksum`` and ``created`` itself) and the
#: optional ones a writer may give :meth:`Bank.append`, both as :class:`VectorEntry` declares them.
REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(VectorEntry) if f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING)
DESCRIBED_FIELDS = tuple(f.name for f in dataclasses.fields(VectorEntry) if f.name not in REQUIRED_FIELDS)


def checked_fields(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An entry's optional fields, checked the same way when appended and when read back.

    Refuses unknown names, a ``step`` that is not an integer and a ``scenario`` that is
    not a string (either may be None); ``recipe``, ``metrics`` and ``provenance`` are
    JSON objects, copied (None: empty), so a refused value never reaches the disk.
    """
    unknown = sorted(set(values) - set(DESCRIBED_FIELDS))
    if unknown:
        raise BankError(f"{where}: unknown entry field(s) {unknown}; known: {', '.join(DESCRIBED_FIELDS)}")
    step, scenario = values.get("step"), values.get("scenario")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise BankError(f"{where}: step must be an integer or null")
    if scenario is not None and not isinstance(scenario, str):
        raise BankError(f"{where}: scenario must be a string or null")
    objects = {key: json_copy(values.get(key), f"{where}: {key}")
               for key in ("recipe", "metrics", "provenance", *BESIDE_FILES)}
    return {"scenario": scenario, "step": step, **objects}


def json_copy(value: dict | None, what: str) -> dict:
    """A private JSON-safe copy, so a refused value never reaches the disk half-written."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BankError(f"{what} must be a dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise BankError(f"{what} must be JSON-serialisable: {exc}") from exc
