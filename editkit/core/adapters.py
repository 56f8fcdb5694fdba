"""LoRA adapters on a backbone's trainable module: task vectors of a few MB instead of a model's worth.

A full task vector holds one number per trained parameter, and linearizing a model costs a jvp through
all of them. With an adapter the trained parameters are LoRA's factors phi = (A, B) on chosen layers
(``W x + s * B A x``, s = alpha / r, or alpha / sqrt(r) rank-stabilized), attached through PEFT so the
layers, names and files are the ones PEFT users know. theta_0 is then the model *with its adapter at
initialisation*: A random (seeded, so every task of a stream and every later rebuild gets the same A0),
B = 0, so the adapter changes nothing until trained, and the backbone's fingerprint covers it.

Each mode keeps its meaning in phi's space: ``nonlinear`` is plain LoRA; ``linear`` is L-LoRA (the model
linearized in phi around phi_0, Tang et al., ICLR 2024); ``taujp`` is L-LoRA plus the penalty on the
adapter tangent. The task vector is phi - phi_0. At B = 0 the tangent of A is zero (``B dA x``), so a
linearized adapter learns B against the fixed random A0; its vectors sum exactly in phi's space.
A plain-LoRA vector is measured from the *zero* adapter instead, which is theta_0's function too: it
is the adapter itself, (A, B), exactly what PEFT saves. Its factors do not add (``(B1 + B2)(A1 + A2)``
has cross terms): such vectors are scaled and merged as weight updates ``dW = s * B A``
(:class:`LoraWeights`), one layer at a time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from editkit.errors import ConfigError, IncompatibleVectorsError

if TYPE_CHECKING:  # torch is imported where an adapter is attached: recipes and banks are read without it
    import torch
    from torch import nn

#: The adapter kinds a recipe may ask for.
ADAPTERS = ("none", "lora")

#: Where :func:`attach_lora` records what it attached on the module (also how a module is known to carry one).
_ATTACHED = "_editkit_lora"

#: PEFT's name of the one adapter editkit attaches.
ADAPTER_NAME = "default"


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA configuration: what a bank's vectors share, and what PEFT's ``LoraConfig`` is built from."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    rslora: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"LoRA needs rank >= 1, alpha > 0 and 0 <= dropout < 1; got rank {self.rank}, "
                              f"alpha {self.alpha}, dropout {self.dropout}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scaling(self) -> float:
        """s in ``W + s * B A``: alpha / r, or alpha / sqrt(r) rank-stabilized (Kalajdzievski, 2023)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def describe(self) -> str:
        targets = ",".join(self.targets) if self.targets else "default"
        return (f"lora r={self.rank} alpha={self.alpha:g}{' rslora' if self.rslora else ''} dropout={self.dropout:g} "
                f"targets={targets} seed={self.seed}")

    @classmethod
    def from_fields(cls, recipe: Mapping[str, Any]) -> "LoraSpec | None":
        """The spec a recipe's fields (a :class:`~editkit.train.recipe.Recipe` as a dictionary, as banks record
        it) describe, or None when it trains no adapter."""
        if recipe.get("adapter", "none") == "none":
            return None
        return cls(rank=int(recipe["lora_rank"]), alpha=float(recipe["lora_alpha"]),
                   dropout=float(recipe["lora_dropout"]), targets=tuple(recipe["lora_targets"]),
                   rslora=bool(recipe["lora_rslora"]), seed=int(recipe.get("seed", 0)))

    def peft_config(self, targets: tuple[str, ...]) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(targets),
                          use_rslora=self.rslora, bias="none")


def attached(module: nn.Module) -> LoraSpec | None:
    """The spec of the adapter :func:`attach_lora` put on ``module`` (with its targets resolved), or None."""
    return getattr(module, _ATTACHED, None)


def attach_lora(module: nn.Module, spec: LoraSpec) -> LoraSpec:
    """Put LoRA on ``module``'s target layers, in place (every task of a stream shares theta_0); returns the spec
    with its targets resolved. A second call with the same spec changes nothing; with another it is refused.

    A0 is drawn from ``spec.seed`` (the global random state is left as it was), so the same spec on the same
    model always gives the same theta_0 and fingerprint.
    """
    import torch
    from peft import inject_adapter_in_model

    if (present := attached(module)) is not None:
        if present != dataclasses.replace(spec, targets=spec.targets or present.targets):
            raise IncompatibleVectorsError(f"the backbone already carries {present.describe()}, not {spec.describe()}")
        return present
    targets = spec.targets or default_targets(module)
    resolved = dataclasses.replace(spec, targets=targets)
    if not targets:
        raise ConfigError(f"{type(module).__name__} has no layer LoRA can adapt (nn.Linear, or nn.Conv2d without groups)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        try:
            inject_adapter_in_model(resolved.peft_config(targets), module, adapter_name=ADAPTER_NAME)
        except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
            raise ConfigError(f"LoRA targets {list(targets)}: {exc}") from None
    module.requires_grad_(False)
    setattr(module, _ATTACHED, resolved)
    return resolved


def default_targets(module: nn.Module) -> tuple[str, ...]:
    """Every layer LoRA can adapt, by the last part of its name as PEFT matches them: ``nn.Linear`` layers and
    ``nn.Conv2d`` layers without groups (of that class exactly: PEFT builds a convolution's factors with the
    layer's own class, whose constructor a subclass may have changed), except those whose weights are read without calling the layer
    (``nn.MultiheadAttention``'s ``out_proj``: an adapter there would never run). A name shared with a layer
    that cannot be adapted is left out, so a target never catches a wrong layer."""
    from torch import nn

    eligible, other = set(), set()
    skipped = {id(m.out_proj) for m in module.modules() if isinstance(m, nn.MultiheadAttention)}
    for name, layer in module.named_modules():
        leaf = name.rpartition(".")[2]
        if not leaf:
            continue
        adaptable = isinstance(layer, nn.Linear) or (type(layer) is nn.Conv2d and layer.groups == 1)
        (eligible if adaptable and id(layer) not in skipped else other).add(leaf)
    return tuple(sorted(eligible - other))


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def trainable_names(module: nn.Module) -> list[str]:
    """The parameters a task vector covers: the adapter's factors when one is attached, else every parameter."""
    names = [n for n, _ in module.named_parameters()]
    return [n for n in names if is_adapter_parameter(n)] if attached(module) is not None else names


class LoraWeights(Mapping[str, "torch.Tensor"]):
    """A plain-LoRA task vector seen as weight updates: ``...base_layer.weight`` -> s * B A.

    Merge methods are defined on weights, and LoRA factors do not add; this view gives each method the
    updates it expects, computed one layer at a time when read (a method that reads layer by layer holds
    one layer's update per vector). ``vector`` (A and B per layer, as :func:`plain_vector_origin` measures
    them) may read its tensors on demand (a bank's reader).
    """

    def __init__(self, vector: Mapping[str, torch.Tensor], scaling: float) -> None:
        self.vector, self.scaling = vector, scaling
        self.layers = {name.split(".lora_A.")[0] + ".base_layer.weight": name for name in vector if ".lora_A." in name}
        missing = [a for a in self.layers.values() if a.replace(".lora_A.", ".lora_B.") not in vector]
        if missing or not self.layers or len(self.layers) * 2 != len(vector):
            raise IncompatibleVectorsError(f"not a LoRA vector (factors A and B per layer): {sorted(vector)[:4]}")
        shapes = _shapes(vector)
        self.shapes = {weight: (shapes[a.replace(".lora_A.", ".lora_B.")][0], *shapes[a][1:])
                       for weight, a in self.layers.items()}

    def __getitem__(self, weight: str) -> torch.Tensor:
        a_name = self.layers[weight]
        a, b = self.vector[a_name], self.vector[a_name.replace(".lora_A.", ".lora_B.")]
        return (self.scaling * _product(b.double(), a.double())).to(a.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


def _shapes(vector: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    shapes = getattr(vector, "shapes", None)
    return dict(shapes) if shapes is not None else {k: tuple(t.shape) for k, t in vector.items()}


def _product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B A as a weight: (out, r) @ (r, in) for linear layers; for convolutions B is 1x1 and A carries the kernel."""
    if a.dim() == 2:
        return b @ a
    return (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], *a.shape[1:])


def merged_state(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict of a module carrying an adapter, as the plain module's: each adapted layer's weight
    ``W + s * B A`` under the layer's own name (``q_proj.weight``, not ``q_proj.base_layer.weight``), the
    factors dropped. What a model written for users without editkit or PEFT holds."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_parameter(name):
            continue
        if ".base_layer." in name:
            layer, _, leaf = name.partition(".base_layer.")
            a, b = (state.get(f"{layer}.lora_{f}.{ADAPTER_NAME}.weight") for f in ("A", "B"))
            if leaf == "weight" and a is not None and b is not None:
                tensor = tensor + scaling * _product(b.double(), a.double()).to(tensor.dtype)
            name = f"{layer}.{leaf}"
        out[name] = tensor
    return out


def without_adapter(module: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (of ``module``, or of the model it is part of) as the model without the adapter
    :func:`attach_lora` put on ``module`` holds it (:func:`merged_state`); as it is when there is none."""
    spec = attached(module)
    return merged_state(state, spec.scaling) if spec is not None else dict(state)
