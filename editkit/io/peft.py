"""LoRA task vectors in and out of PEFT's adapter directories: ``editkit bank import --adapter`` and ``--out``.

A PEFT adapter directory is ``adapter_config.json`` (rank, alpha, target modules...) and
``adapter_model.safetensors``, whose keys are the whole model's module paths under ``base_model.model.``
with the adapter name dropped (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``).
editkit's vectors are keyed by the backbone *module*'s names (a causal LM's tail: ``layers.3...``),
``lora_A.default.weight``; the two are matched through the parameters themselves (the module's
parameters are the whole model's), so no family needs its own table.

- **Import**: an adapter trained elsewhere (plain LoRA) becomes a ``nonlinear`` adapter vector: the adapter
  itself, as editkit's plain-LoRA vectors are (:mod:`editkit.core.adapters`). The scenario's backbone gets
  the same LoRA configuration, so the bank's base is that of every vector trained with it.
- **Export**: what ``PeftModel.from_pretrained(base_model, DIR)`` loads. Linearized (L-LoRA) vectors give the
  adapter phi_0 + delta (the ordinary adapter at the merged vector's point, as a written model is the
  ordinary network at a linearized vector's weights). Plain-LoRA task arithmetic stacks the factors
  (A_1 ... A_T over B_1 ... B_T scaled by their alphas: rank r * T, alpha scaled to keep s), which is exact;
  other merges of plain-LoRA vectors are not low-rank and have no adapter form (the merged model is written).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from editkit.bank.store import Bank, VectorEntry
from editkit.core.adapters import ADAPTER_NAME, LoraSpec, LoraWeights, attached
from editkit.core.artifacts import sha256_file
from editkit.core.modes import Mode
from editkit.errors import BankError, ConfigError, MissingResourceError
from editkit.merge import vector_norm
from editkit.models.backbone import Backbone, names_in
from editkit.models.blocks import whole_model
from editkit.scenario.build import build_backbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import import_target, scenario_provenance
from editkit.train.recipe import Recipe, attach_adapter
from editkit.util.atomic import atomic_dir

log = logging.getLogger(__name__)

#: An adapter to write: its factors (backbone-module names) and configuration.
Adapter = tuple[dict[str, torch.Tensor], LoraSpec]

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
#: What PEFT puts before the whole model's module paths in a saved adapter.
PEFT_PREFIX = "base_model.model."
#: Where an exported model directory keeps the PEFT adapter of its vectors.
#: adapter_config.json keys whose non-default values editkit cannot represent, with the value it needs.
UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


def peft_names(backbone: Backbone, module_names: list[str]) -> dict[str, str]:
    """Backbone-module parameter name -> PEFT's key of it (``...lora_A.default.weight`` ->
    ``base_model.model.<whole model path>.lora_A.weight``), matched through the parameters themselves."""
    try:
        whole = whole_model(backbone)
    except ConfigError:  # the module is the whole model (EfficientNet)
        whole = backbone.module
    names = names_in(whole, backbone.module)
    tag = f".{ADAPTER_NAME}."
    return {name: PEFT_PREFIX + names[name].replace(tag, ".") for name in module_names}


# --------------------------------------------------------------------------- export


def adapter_factors(bank: Bank, coefficients: Mapping[str, float], method: str, delta: Mapping[str, torch.Tensor],
                    backbone: Backbone) -> Adapter | None:
    """The adapter (module names -> tensors) and its configuration that reproduce theta_0 + ``delta``, or None when
    the vectors are not adapters or their merge has no adapter form (see the module docstring)."""
    entries = [bank.get(n) for n in coefficients]
    spec = attached(backbone.module)
    if spec is None or entries[0].adapter is None:
        return None
    if Mode(entries[0].mode).linearized:
        phi0 = {n: p.detach() for n, p in backbone.module.named_parameters() if n in delta}
        return {n: (phi0[n] + delta[n].to(phi0[n])).contiguous() for n in delta}, spec
    if method != "task-arithmetic":
        return None
    vectors = [(bank.load(e.name), coefficients[e.name]) for e in entries]
    factors: dict[str, torch.Tensor] = {}
    for name in vectors[0][0]:
        if ".lora_A." in name:
            factors[name] = torch.cat([v[name] for v, _ in vectors], dim=0)
        else:  # B: (out, r) per vector, side by side, each scaled by its alpha
            factors[name] = torch.cat([alpha * v[name] for v, alpha in vectors], dim=1)
    rank = spec.rank * len(vectors)
    alpha = spec.scaling * (rank ** 0.5 if spec.rslora else rank)  # the same s at rank r * T
    return factors, LoraSpec(rank=rank, alpha=alpha, targets=spec.targets, rslora=spec.rslora, seed=spec.seed)


def write_adapter(out: Path, backbone: Backbone, factors: Mapping[str, torch.Tensor], spec: LoraSpec,
                  *, force: bool = False) -> Path:
    """A PEFT adapter directory at ``out`` (written whole or not at all)."""
    names = peft_names(backbone, list(factors))
    # the adapted layers by their whole paths: the backbone's module may be part of the model (a causal LM's
    # last blocks), and a bare name (q_proj) would have PEFT adapt the same layers of every block
    layers = sorted({key[len(PEFT_PREFIX):].split(".lora_")[0] for key in names.values()})
    config = spec.peft_config(tuple(layers))
    config.base_model_name_or_path = backbone.name
    with atomic_dir(out, replace=force) as tmp:
        config.save_pretrained(str(tmp))
        save_file({names[n]: t.detach().cpu().contiguous() for n, t in factors.items()}, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt"})
    log.info("wrote the PEFT adapter to %s", out)
    return out


# --------------------------------------------------------------------------- import


def read_adapter_config(directory: Path | str) -> LoraSpec:
    """The LoRA configuration of a PEFT adapter directory, refusing what an editkit vector cannot hold, by name."""
    directory = Path(directory)
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (directory / f).is_file()]
    if missing:
        raise MissingResourceError(f"{directory} is not a PEFT adapter directory: it lacks {', '.join(missing)}")
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{directory / CONFIG_FILE}: peft_type {config.get('peft_type')!r}, only LORA adapters "
                          "are task vectors here")
    for key, plain in UNSUPPORTED.items():
        if config.get(key) not in (plain, None):
            raise ConfigError(f"{directory / CONFIG_FILE}: {key} = {config[key]!r} is not supported (needs {plain!r})")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    spec = LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                    dropout=float(config.get("lora_dropout") or 0.0), targets=tuple(sorted(targets)),
                    rslora=bool(config.get("use_rslora", False)))
    return spec


def adapter_vector(directory: Path | str, backbone: Backbone) -> dict[str, torch.Tensor]:
    """The adapter's factors keyed by the backbone module's names (the backbone carries the same LoRA
    configuration); keys it does not have, and layers it adapts that the file lacks, are refused by name."""
    directory = Path(directory)
    tensors = load_file(str(directory / WEIGHTS_FILE))
    params = dict(backbone.module.named_parameters())
    ours = [n for n in params if ".lora_A." in n or ".lora_B." in n]
    wanted = {peft: name for name, peft in peft_names(backbone, ours).items()}
    unknown = sorted(set(tensors) - set(wanted))
    lacking = sorted(set(wanted) - set(tensors))
    if unknown or lacking:
        raise BankError(f"{directory / WEIGHTS_FILE} does not fit {backbone.name} with this adapter: "
                        f"keys it does not have {unknown[:3]}, adapted layers missing {lacking[:3]}")
    vector = {wanted[key]: tensor for key, tensor in tensors.items()}
    for name, tensor in vector.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise BankError(f"{directory / WEIGHTS_FILE}: {name} has shape {tuple(tensor.shape)}, the backbone's "
                            f"adapter {tuple(params[name].shape)}")
    return {n: t.to(params[n].dtype) for n, t in vector.items()}


def import_peft_adapter(bank: Bank | Path | str, scenario: str | Path, name: str, directory: Path | str, *,
                        task: str | None = None, build: BuildOptions | None = None) -> VectorEntry:
    """Bank a PEFT LoRA adapter directory as the ``nonlinear`` adapter vector ``name`` of ``scenario``'s ``task``
    (default: ``name``): the adapter itself, on the scenario's backbone carrying the adapter's configuration.
    Nothing is written when anything is refused."""
    directory = Path(directory)
    spec, task = import_target(scenario, name, task)
    lora = read_adapter_config(directory)
    recipe = Recipe(mode=Mode.NONLINEAR, adapter="lora", lora_rank=lora.rank, lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout, lora_targets=lora.targets, lora_rslora=lora.rslora)
    build = build or BuildOptions()
    backbone = build_backbone(spec, build)
    attach_adapter(backbone.module, [recipe])
    vector = adapter_vector(directory, backbone)
    files = {f: "sha256:" + sha256_file(directory / f) for f in (CONFIG_FILE, WEIGHTS_FILE)}
    provenance = {**scenario_provenance(spec, build), "imported": {"peft_adapter": str(directory.resolve()),
                                                                   "sha256": files}}
    store = bank if isinstance(bank, Bank) else Bank(bank)
    norm = vector_norm(LoraWeights(vector, lora.scaling))
    entry = store.append(name, vector, task=task, mode=Mode.NONLINEAR, base=backbone.fingerprint(),
                         scenario=spec.name, recipe=recipe.to_dict(), metrics={"tau_norm": norm},
                         provenance=provenance)
    log.info("imported PEFT adapter %s (rank %d, |dW| = %.4g) into %s", name, lora.rank, norm, store.root)
    return entry
