"""Task vectors from model checkpoints fine-tuned elsewhere: ``editkit bank import``.

**Import.** A model fine-tuned elsewhere becomes a bank vector tau = theta_ft - theta_0 over
the scenario backbone's module parameters, recorded as ``nonlinear`` (it is a weight-space
difference, whatever trained it) with the scenario backbone's fingerprint as its base, so it
merges, adds and negates like the vectors a stream banks. theta_0 is the scenario's backbone
itself, or a given base checkpoint, which must hold the backbone's values (compared in the
checkpoint's own dtype, so a half-precision copy of the same weights matches): a vector taken
against another model would be a task vector of nothing in the bank. Checkpoint files are
safetensors, torch files (``weights_only``: nothing is unpickled but tensors and plain
containers; an open_clip training checkpoint's ``state_dict`` is read out of it) or TorchScript
archives; their keys are laid out by open_clip or Hugging Face CLIP (converted by
``editkit.models.clip_keys``) or are the module's own names (:data:`LAYOUTS`, tried in order).
A key the backbone does not have, a parameter the checkpoint lacks, a shape that differs or a
buffer (BatchNorm statistics) that is not theta_0's is refused by name before anything is
banked: a task vector holds parameters only, and the backbone's buffers stay theta_0's.
The entry's provenance names each file with its sha256 and layout.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import load_file
from torch import nn

from editkit.bank.store import Bank, VectorEntry
from editkit.core.artifacts import sha256_file
from editkit.core.modes import Mode
from editkit.errors import BankError, ConfigError, IncompatibleVectorsError, MissingResourceError
from editkit.merge import vector_norm
from editkit.models.clip import is_torchscript_archive
from editkit.models.clip_keys import TowerState, from_hugging_face, from_open_clip, is_hugging_face, is_open_clip
from editkit.scenario.build import build_backbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import import_target, scenario_provenance

log = logging.getLogger(__name__)

#: What torch's DistributedDataParallel puts before every key of the model it wraps.
DDP_PREFIX = "module."
#: The default bank of imported vectors is ``banks/<scenario>-imported``: apart from the scenario's stream
#: banks, whose vectors must all share the stream's recipe.
IMPORTED = "imported"
#: How many names a refusal lists.
NAMES_SHOWN = 5


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's keys name the backbone module's tensors: ``detect`` looks at the keys,
    ``read`` turns the state dict into the module's own names."""

    name: str
    detect: Callable[[list[str]], bool]
    read: Callable[[Mapping[str, torch.Tensor]], TowerState]


def _own_names(state: Mapping[str, torch.Tensor]) -> TowerState:
    return TowerState(dict(state), [], [])


#: Tried in order; the last takes any checkpoint (its keys are compared with the module's).
LAYOUTS = (
    Layout("hf-clip", is_hugging_face, from_hugging_face),
    Layout("open_clip", is_open_clip, from_open_clip),
    Layout("state-dict", lambda keys: True, _own_names),
)


# --------------------------------------------------------------------------- reading checkpoints


def read_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file by key (see the module docstring for the file kinds);
    a ``module.`` prefix on every key (DistributedDataParallel) is removed."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"checkpoint {path} is a directory: give the file inside it (model.safetensors, "
                          "pytorch_model.bin, ...)")
    if not path.is_file():
        raise MissingResourceError(f"checkpoint {path} does not exist")
    state = _load(path)
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):  # an open_clip training checkpoint
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not state:
        raise BankError(f"checkpoint {path} holds no state dict (a mapping of names to tensors)")
    others = [str(k) for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise BankError(f"checkpoint {path} is not a state dict: {_names(others)} are not tensors")
    if all(k.startswith(DDP_PREFIX) for k in state):
        state = {k[len(DDP_PREFIX):]: v for k, v in state.items()}
    return dict(state)


def _load(path: Path) -> object:
    """The file's content; any reading failure becomes one line naming the file."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        if is_torchscript_archive(path):
            return torch.jit.load(str(path), map_location="cpu").state_dict()
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's weights-only reader says why in the middle of its message
        if "Unsupported global" in str(exc):
            raise BankError(f"checkpoint {path} holds pickled Python objects (a whole saved model?), which editkit "
                            "does not unpickle: load it where it was made and save its state_dict()") from exc
        raise BankError(f"checkpoint {path} is truncated or not a torch file") from exc
    except Exception as exc:  # safetensors, zip and torch readers raise their own types
        raise BankError(f"checkpoint {path} is truncated or unreadable: neither safetensors, TorchScript nor a "
                        "torch file") from exc


def module_parameters(path: Path | str, module: nn.Module,
                      role: str) -> tuple[str, dict[str, torch.Tensor], tuple[str, ...]]:
    """(layout, the module's parameters as the checkpoint holds them, parameters its layout has no place for).

    role: how refusals name the file (``fine-tuned``, ``base``). Refuses unknown keys, missing
    parameters, shapes that differ and buffers that are not ``module``'s (see the module docstring).
    """
    state = read_state_dict(path)
    layout = next(layout for layout in LAYOUTS if layout.detect(list(state)))
    tower = layout.read(state)
    where = f"{role} checkpoint {path} ({layout.name} layout)"
    params = dict(module.named_parameters())
    _refuse_misfits(tower, params, dict(module.named_buffers()), where)
    if tower.dropped:
        log.info("%s: %d keys of the rest of the model left out (%s)", where, len(tower.dropped), _names(tower.dropped))
    return layout.name, {k: v for k, v in tower.tensors.items() if k in params}, tower.not_held


def _refuse_misfits(tower: TowerState, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                    where: str) -> None:
    """Refuse, by name, keys the module lacks, parameters the checkpoint lacks (beyond what its layout cannot
    hold), other shapes, and buffers whose values are not the module's."""
    unknown = tower.unknown + [k for k in tower.tensors if k not in params and k not in buffers]
    if unknown:
        raise BankError(f"{where} has {len(unknown)} key(s) the backbone does not: {_names(unknown)}")
    missing = [n for n in params if n not in tower.tensors and n not in tower.not_held]
    if missing:
        raise BankError(f"{where} lacks {len(missing)} of the backbone's parameters: {_names(missing)}")
    reference = {**params, **buffers}
    shapes = [f"{k} {tuple(v.shape)} (backbone {tuple(reference[k].shape)})"
              for k, v in tower.tensors.items() if v.shape != reference[k].shape]
    if shapes:
        raise BankError(f"{where} has tensors of other shapes: {_names(shapes)}")
    changed = first_difference({k: v for k, v in tower.tensors.items() if k in buffers}, buffers)
    if changed:
        raise BankError(f"{where}: buffer {changed} is not the backbone's (BatchNorm statistics updated in "
                        "training?); a task vector holds parameters only, so that model cannot be imported")


def first_difference(given: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> str | None:
    """The name and largest difference of the first tensor of ``given`` whose values are not ``reference``'s once
    those are cast to its dtype (a half-precision copy of the same weights agrees); None when all agree."""
    for key, value in given.items():
        expected = reference[key].detach().to("cpu", value.dtype)
        if not torch.equal(value, expected):
            delta = (value.double() - expected.double()).abs().max().item()
            return f"{key!r} (max |difference| {delta:.3g})"
    return None


# --------------------------------------------------------------------------- import


def import_checkpoint(bank: Bank | Path | str, scenario: str | Path, name: str, finetuned: Path | str, *,
                      base: Path | str | None = None, task: str | None = None,
                      build: BuildOptions | None = None) -> VectorEntry:
    """Bank tau = theta_ft - theta_0 from a fine-tuned checkpoint as the ``nonlinear`` vector ``name``.

    scenario: the scenario whose backbone the checkpoint fine-tunes (built with ``build`` laid over
        its file, as a stream would; recorded so ``add`` / ``negate`` rebuild it).
    base: the checkpoint it was fine-tuned from (default: the scenario backbone's weights); refused
        with :class:`IncompatibleVectorsError` unless it holds the backbone's values.
    task: the scenario task the vector is for (default: ``name``).
    Parameters a layout has no place for (a ``CLIPVisionModel``'s missing projection) get tau = 0.
    Nothing is written when anything is refused.
    """
    spec, task = import_target(scenario, name, task)
    build = build or BuildOptions()
    backbone = build_backbone(spec, build)
    theta0 = {n: p.detach() for n, p in backbone.module.named_parameters()}
    layout, tuned, not_held = module_parameters(finetuned, backbone.module, "fine-tuned")
    sources = {"finetuned": _source(finetuned, layout)}
    start = theta0
    if base is not None:
        base_layout, given, _ = module_parameters(base, backbone.module, "base")
        changed = first_difference(given, theta0)
        if changed:
            raise IncompatibleVectorsError(
                f"base checkpoint {base} is not the weights of scenario {spec.name!r}'s backbone {backbone.name}: "
                f"parameter {changed} differs; a vector taken from it would not belong to this base, nothing "
                "was banked")
        sources["base"] = _source(base, base_layout)
        start = {**theta0, **given}
    tau = {n: tuned[n].to(p.dtype) - start[n].to(p.dtype) if n in tuned else torch.zeros_like(p)
           for n, p in theta0.items()}
    norm = vector_norm(tau)
    provenance = {**scenario_provenance(spec, build), "imported": {**sources, "not_held": list(not_held)}}
    store = bank if isinstance(bank, Bank) else Bank(bank)
    entry = store.append(name, tau, task=task, mode=Mode.NONLINEAR, base=backbone.fingerprint(),
                              scenario=spec.name, metrics={"tau_norm": norm}, provenance=provenance)
    log.info("imported %s (%s, |tau| = %.4g) into %s", name, layout, norm, store.root)
    return entry


def _source(path: Path | str, layout: str) -> dict[str, str]:
    path = Path(path).resolve()
    return {"file": str(path), "sha256": "sha256:" + sha256_file(path), "layout": layout}


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f", ... ({len(names) - NAMES_SHOWN} more)" if len(names) > NAMES_SHOWN else "")
