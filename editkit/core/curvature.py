"""Data-free tauJp: each task's curvature at theta_0, and the penalty it gives later vectors without their inputs.

For a linearized model the drift a vector tau causes on task t's inputs is E_x ||J_x tau||^2, a quadratic form
tau^T C_t tau whose matrix C_t = E_x[J_x^T J_x] (the Gauss-Newton matrix of a squared loss on the backbone's
features) does not depend on tau. It is computed once, at theta_0, on task t's own inputs, kept beside its
vector, and later tasks are penalised by it: the penalty needs no input of an earlier task (Porrello et al.,
"Dataless Weight Disentanglement in Task Arithmetic via Kronecker-Factored Approximate Curvature", ICLR 2026).

C_t is approximated per layer (blocks of different layers are taken as independent):

- A layer that multiplies a weight with its input, ``linear`` or ``conv2d`` (grouped and depthwise convolutions
  per group; a convolution's input is its patches, as in KFC, Grosse & Martens 2016), gets Kronecker factors:
  ``A`` = E[a a^T] over the layer's inputs a (a ones-entry appended where the bias is trained) and ``G`` = E[g g^T]
  over the gradients g of s . f at the layer's output, s ~ N(0, I) on the features (E_s[s s^T] = I, so E[g g^T]
  is the Gram matrix of the layer's output Jacobian; one draw per example, as TAK does). Its term is
  tr(G dW A dW^T). For a single linear layer on the features this is the exact quadratic form.
- A normalization's scale and shift (``batch_norm``, ``layer_norm``) get the exact 2 x 2 block of C_t per
  element (scale_i and shift_i move only output i), from per-example gradients: the rows of one batched backward.
- Every other edited parameter (embeddings, anything used outside those calls) gets the diagonal of C_t,
  E[(d(s . f)/dtheta_i)^2], from per-example gradients: one example at a time.

The layers are found by what the module *calls*, not by what classes it holds (a torch function mode sees each
``linear`` / ``conv2d`` / norm call with its weight): a package's own convolution class with its own padding is
factored on the padded input it really convolves. A fused attention (``nn.MultiheadAttention``) calls its
projections inside one function that the mode sees whole; for self-attention (query, key and value one tensor,
the packed in-projection: a transformer's blocks, CLIP's) the mode runs that function itself as its two
``linear`` calls around scaled dot-product attention, so the fused in-projection (q, k and v: one block) and the
out-projection are factored. Any other use of it (separate key / value, ``bias_k``, dropout while training) runs
as it is and its weights take the diagonal.

Positions (a convolution's spatial positions, a sequence's tokens) are summed in G and averaged in A, so the
product counts each position once, as in KFC.

What the penalty measures of the features' drift sets the probes' covariance M (:data:`MEASURES`, the recipe's
``penalty_on``): ``features``, the identity; through a language model's fixed linear head W, ``logits`` W^T W / V
(s = W^T z, z ~ N(0, I / V) on the V logits: the input penalty averages over the vocabulary) and
``distribution`` W^T (diag p - p p^T) W, the second-order KL of theta_0's next-token distribution p
(s = W^T (e_y - p) with y ~ p: the Fisher's sampled label, as K-FAC draws it).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from editkit.core.batching import Batching, TensorBatching
from editkit.errors import ConfigError

FORMAT = "kfac-1"
COMBINES = ("sum", "apart")
#: The dtypes a step may hold the Kronecker factors in (its products accumulate in fp32 either way).
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: What a curvature measures of the features' drift (the recipe's ``penalty_on``): the last two through a head.
MEASURES = ("features", "logits", "distribution")


@dataclass
class KroneckerBlock:
    """One layer's factors A = R_A R_A^T and G = R_G R_G^T, kept as their roots: ``A`` (groups, d_in [+1], r_A) and
    ``G`` (groups, d_out, r_G), one per group of the weight viewed as (groups, d_out, d_in) (a linear layer and an
    ungrouped convolution have one group). Estimated on n examples, a factor has rank at most n times its
    positions, often far below its side: the roots hold the eigenvectors that carry its trace, so the term costs
    r_G (d_out d_in + d_in r_A) products, not d_out^2 d_in + d_out d_in^2 (where the ranks are near the sides, the
    step multiplies the factors out instead: :class:`_Packed`)."""

    weight: str
    bias: str | None
    groups: int
    A: torch.Tensor
    G: torch.Tensor

    def term(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """tr(G dW A dW^T) = ||R_G^T dW R_A||^2 summed over groups, dW the vector's weight (and bias column) in
        this block's view."""
        return (self.G.transpose(1, 2) @ self.view(tau) @ self.A).square().sum()

    def view(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _view(tau, self.weight, self.bias, self.groups).to(self.A.dtype)


def factor_root(matrix: torch.Tensor, energy: float = 1.0) -> torch.Tensor:
    """R with R R^T = ``matrix`` (groups, d, d; symmetric positive semi-definite) on the eigenvectors that carry its
    trace: those above 1e-7 of the largest eigenvalue (numerically the whole matrix), and with ``energy`` < 1 only
    as many, largest first, as hold that fraction of the trace (the cheaper, lossy variant). Columns past a
    group's own rank are zero, so every group has the block's rank."""
    values, vectors = torch.linalg.eigh(matrix.double())
    values, vectors = values.flip(-1).clamp_min(0), vectors.flip(-1)  # largest first
    tiny = torch.finfo(torch.float64).tiny
    keep = values > 1e-7 * values[..., :1].clamp_min(tiny)
    if energy < 1.0:  # an eigenvector is kept while the larger ones before it hold less than that share
        before = (values.cumsum(-1) - values) / values.sum(-1, keepdim=True).clamp_min(tiny)
        keep &= before < energy
    rank = max(1, int(keep.sum(-1).max()))
    root = vectors[..., :rank] * (values[..., :rank] * keep[..., :rank]).sqrt().unsqueeze(-2)
    return root.float().contiguous()


@dataclass
class Curvature:
    """A task's curvature at theta_0: Kronecker blocks by weight name, diagonals by parameter name, and the number
    of examples they were estimated on."""

    blocks: dict[str, KroneckerBlock] = field(default_factory=dict)
    diagonal: dict[str, torch.Tensor] = field(default_factory=dict)
    examples: int = 0
    #: A norm's scale with its shift: per element the exact 2 x 2 block of (scale, shift), shaped (*scale, 2, 2),
    #: by scale name, with the shift's name.
    pairs: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    #: What it measures of the features' drift (:data:`MEASURES`).
    measure: str = "features"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def quadratic(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """tau^T C tau under this approximation (0-d; differentiable in tau)."""
        terms = [block.term(tau) for block in self.blocks.values()]
        terms += [(d * tau[n].to(d.dtype).square()).sum() for n, d in self.diagonal.items()]
        for scale, (shift, block) in self.pairs.items():
            v = torch.stack([tau[scale], tau[shift]], dim=-1).to(block.dtype)
            terms.append((v.unsqueeze(-2) @ block @ v.unsqueeze(-1)).sum())
        return torch.stack(terms).sum()

    def describe(self) -> dict[str, Any]:
        """What ``bank show`` and a manifest entry say of it."""
        return {"format": FORMAT, "measure": self.measure, "kronecker_layers": len(self.blocks),
                "norm_layers": len(self.pairs), "diagonal_parameters": len(self.diagonal), "examples": self.examples,
                "bytes": self.nbytes}

    # -- files: tensors plus a header, so a bank stores it as safetensors
    def to_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for key, block in self.blocks.items():
            tensors[f"A/{key}"], tensors[f"G/{key}"] = block.A.contiguous(), block.G.contiguous()
        tensors.update({f"diag/{name}": d.contiguous() for name, d in self.diagonal.items()})
        tensors.update({f"pair/{scale}": m.contiguous() for scale, (_, m) in self.pairs.items()})
        return tensors

    def header(self) -> dict[str, str]:
        layers = {k: {"weight": b.weight, "bias": b.bias, "groups": b.groups} for k, b in self.blocks.items()}
        shifts = {scale: shift for scale, (shift, _) in self.pairs.items()}
        return {"format": FORMAT, "measure": self.measure, "examples": str(self.examples),
                "layers": json.dumps(layers, sort_keys=True), "pairs": json.dumps(shifts, sort_keys=True)}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> Curvature:
        """Read back :meth:`to_tensors` / :meth:`header`; refuses another format by name. A header without a
        measure was written before curvatures measured anything but the features."""
        if header.get("format") != FORMAT:
            raise ConfigError(f"curvature format {header.get('format')!r} is not {FORMAT!r}: it was written by "
                              "another editkit; compute the factors again")
        layers = json.loads(header["layers"])
        blocks = {k: KroneckerBlock(v["weight"], v["bias"], int(v["groups"]), tensors[f"A/{k}"], tensors[f"G/{k}"])
                  for k, v in layers.items()}
        diagonal = {k[len("diag/"):]: t for k, t in tensors.items() if k.startswith("diag/")}
        pairs = {scale: (shift, tensors[f"pair/{scale}"]) for scale, shift in json.loads(header["pairs"]).items()}
        measure = header.get("measure", "features")
        if measure not in MEASURES:
            raise ConfigError(f"curvature measure {measure!r} is not one of {', '.join(MEASURES)}")
        return cls(blocks, diagonal, int(header["examples"]), pairs, measure)

    def check_fits(self, shapes: Mapping[str, Sequence[int]], what: str) -> None:
        """Refuse, naming the first layer, factors whose shapes do not match a model's parameters ``shapes``."""
        for key, block in self.blocks.items():
            shape = shapes.get(block.weight)
            if shape is None:
                raise ConfigError(f"{what}: layer {block.weight} has curvature but the model has no such parameter")
            d_out, d_in = shape[0] // block.groups, math.prod(shape[1:]) + (block.bias is not None)
            if block.A.shape[:2] != (block.groups, d_in) or block.G.shape[:2] != (block.groups, d_out):
                raise ConfigError(f"{what}: layer {block.weight}'s factors are {tuple(block.A.shape)} and "
                                  f"{tuple(block.G.shape)}, its weight {tuple(shape)} wants ({block.groups}, {d_in}, "
                                  f"rank) and ({block.groups}, {d_out}, rank)")
        sizes = {name: tuple(d.shape) for name, d in self.diagonal.items()}
        for scale, (shift, block) in self.pairs.items():
            sizes[scale] = sizes[shift] = tuple(block.shape[:-2])
        for name, size in sizes.items():
            if tuple(shapes.get(name, ())) != size:
                raise ConfigError(f"{what}: parameter {name}'s curvature is {size}, the model's "
                                  f"{tuple(shapes[name]) if name in shapes else 'absent'}")


def mean_curvature(curvatures: Sequence[Curvature], energy: float = 1.0) -> Curvature:
    """One factor set for many tasks (TAK's Eq. 8, constant memory and cost): per layer mean A (x) mean G (their
    roots again, of at most the summed ranks), mean diagonal and norm blocks. Not the mean of the products: it
    also counts task i's inputs against task j's output gradients."""
    first = same_measure(curvatures)
    blocks = {k: KroneckerBlock(b.weight, b.bias, b.groups, _mean_root([c.blocks[k].A for c in curvatures], energy),
                                _mean_root([c.blocks[k].G for c in curvatures], energy))
              for k, b in first.blocks.items()}
    diagonal = {k: _mean([c.diagonal[k] for c in curvatures]) for k in first.diagonal}
    pairs = {k: (shift, _mean([c.pairs[k][1] for c in curvatures])) for k, (shift, _) in first.pairs.items()}
    return Curvature(blocks, diagonal, sum(c.examples for c in curvatures), pairs, first.measure)


def same_measure(curvatures: Sequence[Curvature]) -> Curvature:
    """The first of ``curvatures``, after refusing a set that measures different things (their quadratic forms are
    not on one scale, and their sum is no penalty the recipe asked for)."""
    measures = sorted({c.measure for c in curvatures})
    if len(measures) > 1:
        raise ConfigError(f"curvatures measuring {' and '.join(measures)} cannot be combined into one penalty")
    return curvatures[0]


def _mean_root(roots: list[torch.Tensor], energy: float) -> torch.Tensor:
    """The root of the mean of R R^T over ``roots``."""
    if len(roots) == 1:
        return roots[0]
    return factor_root(torch.stack([(r.double() @ r.double().transpose(1, 2)) for r in roots]).mean(0), energy)


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).mean(0)


# --------------------------------------------------------------------------- computing it


class _Calls(TorchFunctionMode):
    """Sees every ``linear``, ``conv2d``, ``batch_norm`` and ``layer_norm`` call whose weight is an edited
    parameter: adds its inputs to A at once, and its output gradients to G (a norm's per-example gradients to the
    diagonal) from a hook on the call's output, at each backward of a probe."""

    def __init__(self, names: Mapping[int, str], sums: _Sums | None) -> None:
        super().__init__()
        self.names, self.sums = names, sums
        self.covered: set[str] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            watched = _self_attention(self, {**_MHA_DEFAULTS, **dict(zip(_MHA_DEFAULTS, args)), **kwargs})
            if watched is not None:
                return watched
        out = func(*args, **kwargs)
        signature = _SIGNATURES.get(func)
        if signature is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        bound = {**dict(zip(signature, args)), **kwargs}
        name = self.names.get(id(bound.get("weight")))
        if name is None:
            return out
        bias = self.names.get(id(bound.get("bias"))) if bound.get("bias") is not None else None
        self.covered |= {name, bias} - {None}
        if self.sums is None:  # only finding out which parameters the calls cover
            return out
        if func in (F.batch_norm, F.layer_norm):
            normalized = _normalized(func, bound)
            per_channel = func is F.batch_norm
            out.register_hook(lambda g: self.sums.add_norm(name, bias, normalized, g, per_channel))
        else:
            conv = func is not F.linear
            rows, groups = _layer_inputs(bound, conv, bias is not None)
            self.sums.add_inputs(name, bias, groups, rows)
            out.register_hook(lambda g: self.sums.add_gradients(name, groups, g, conv))
        return out


_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
#: The calls whose weights are factored (or, for norms, whose diagonal comes from one batched backward), with
#: their arguments' names in order.
_SIGNATURES: dict[Callable, tuple[str, ...]] = {
    F.linear: ("input", "weight", "bias"), torch.conv2d: _CONV, F.conv2d: _CONV,
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps")}


#: ``F.multi_head_attention_forward``'s arguments in order, with their defaults (``inspect.Parameter.empty``
#: where it has none).
_MHA_DEFAULTS = {name: p.default for name, p in inspect.signature(F.multi_head_attention_forward).parameters.items()}


def _self_attention(calls: _Calls, bound: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A fused self-attention as the mode's own two ``linear`` calls (so both projections are factored) around
    scaled dot-product attention, computed as ``F.multi_head_attention_forward`` computes it; None where the call
    is not one (separate key / value or projections, extra key / value biases, zero attention, dropout while
    training, unbatched input, or neither projection edited): it then runs as it is."""
    query, weight = bound["query"], bound["in_proj_weight"]
    edited = id(weight) in calls.names or id(bound["out_proj_weight"]) in calls.names
    if not (edited and query is bound["key"] is bound["value"] and query.dim() == 3
            and not bound["use_separate_proj_weight"] and bound["bias_k"] is None and bound["bias_v"] is None
            and not bound["add_zero_attn"] and (bound["dropout_p"] == 0.0 or not bound["training"])
            and bound["static_k"] is None and bound["static_v"] is None):
        return None
    length, batch, width = query.shape  # sequence first, as nn.MultiheadAttention hands it over
    heads = bound["num_heads"]

    def split(t: torch.Tensor) -> torch.Tensor:  # (length, batch, width) -> (batch * heads, length, width / heads)
        return t.reshape(length, batch * heads, width // heads).transpose(0, 1)

    def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        # batch first for the mode, which reads a call's first dimension as its examples
        return calls.__torch_function__(F.linear, (), (x.transpose(0, 1), w, b)).transpose(0, 1)

    q, k, v = project(query, weight, bound["in_proj_bias"]).chunk(3, dim=-1)
    scores = split(q) @ split(k).transpose(1, 2) / math.sqrt(width // heads) + _attention_mask(bound, query, heads)
    weights = scores.softmax(dim=-1)
    mixed = (weights @ split(v)).transpose(0, 1).reshape(length, batch, width)
    out = project(mixed, bound["out_proj_weight"], bound["out_proj_bias"])
    if not bound["need_weights"]:
        return out, None
    weights = weights.view(batch, heads, length, length)
    return out, weights.mean(dim=1) if bound["average_attn_weights"] else weights


def _attention_mask(bound: Mapping[str, Any], query: torch.Tensor, heads: int) -> torch.Tensor | float:
    """The additive mask of ``attn_mask`` ((L, S) or (batch * heads, L, S)) and ``key_padding_mask`` ((batch, S)),
    a boolean one's True entries as -inf, as ``F.multi_head_attention_forward`` reads them."""

    def additive(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(mask, float("-inf"))
        return mask.to(query.dtype)

    total: torch.Tensor | float = 0.0
    if bound["attn_mask"] is not None:
        total = additive(bound["attn_mask"])
    if bound["key_padding_mask"] is not None:
        padding = additive(bound["key_padding_mask"])  # (batch, S) -> (batch * heads, 1, S)
        total = total + padding[:, None, None, :].expand(-1, heads, 1, -1).reshape(-1, 1, padding.shape[-1])
    return total


def _layer_inputs(bound: Mapping[str, Any], conv: bool, with_bias: bool) -> tuple[torch.Tensor, int]:
    """The layer's inputs as (examples, positions, groups, d_in [+1]) and its groups."""
    x, weight = bound["input"].detach(), bound["weight"]
    if not conv:
        groups, rows = 1, x.reshape(x.shape[0], -1, x.shape[-1])
    else:
        groups, padding = bound.get("groups", 1), bound.get("padding", 0)
        if isinstance(padding, str):
            raise ConfigError(f"a convolution with padding={padding!r} ({tuple(weight.shape)}) cannot be factored; "
                              "give its padding as numbers")
        patches = F.unfold(x, weight.shape[2:], dilation=bound.get("dilation", 1), padding=padding,
                           stride=bound.get("stride", 1))  # (N, C k k, L): channel-major, as the weight's view
        rows = patches.transpose(1, 2)
    n, positions = rows.shape[:2]
    rows = rows.reshape(n, positions, groups, -1)
    if with_bias:
        rows = torch.cat([rows, rows.new_ones(n, positions, groups, 1)], dim=3)
    return rows, groups


def _normalized(func: Callable, bound: Mapping[str, Any]) -> torch.Tensor:
    """A norm's input normalized without its scale and shift: what its per-example scale gradient multiplies."""
    x = bound["input"].detach()
    if func is F.batch_norm:
        return F.batch_norm(x, bound["running_mean"], bound["running_var"], None, None, False, 0.0,
                            bound.get("eps", 1e-5))
    return F.layer_norm(x, bound["normalized_shape"], None, None, bound.get("eps", 1e-5))


class _Sums:
    """Running sums of a task's factors over examples (A) and over examples and probes (G, diagonals), in float64."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.A: dict[str, torch.Tensor] = {}
        self.G: dict[str, torch.Tensor] = {}
        self.layout: dict[str, tuple[str | None, int]] = {}  # weight -> (bias, groups)
        self.diagonal: dict[str, torch.Tensor] = {}
        self.pairs: dict[str, torch.Tensor] = {}
        self.shift: dict[str, str] = {}

    def add_inputs(self, name: str, bias: str | None, groups: int, rows: torch.Tensor) -> None:
        """A += sum over examples of the mean over positions of a a^T, per group."""
        flat = rows.permute(2, 0, 1, 3).reshape(groups, -1, rows.shape[3]).double()
        self.add(self.A, name, flat.transpose(1, 2) @ flat / rows.shape[1])
        self.layout[name] = (bias, groups)

    def add_gradients(self, name: str, groups: int, g: torch.Tensor, conv: bool) -> None:
        """G += sum over examples and positions of g g^T, per group (a convolution's channels are on axis 1)."""
        if conv:
            g = g.flatten(2).transpose(1, 2)
        flat = g.reshape(-1, groups, g.shape[-1] // groups).transpose(0, 1).double()
        self.add(self.G, name, flat.transpose(1, 2) @ flat)

    def add_norm(self, weight: str, bias: str | None, normalized: torch.Tensor, g: torch.Tensor,
                 per_channel: bool) -> None:
        """A norm's scale and shift diagonals from its per-example gradients (the rows of one batched backward):
        ``batch_norm`` (``per_channel``) sums over a channel's positions (axes 2...), ``layer_norm`` over the
        positions before its normalized shape."""
        dims = tuple(range(2, g.dim())) if per_channel else tuple(range(1, g.dim() - len(self.shapes[weight])))
        per_weight, per_bias = g * normalized, g
        if dims:
            per_weight, per_bias = per_weight.sum(dims), per_bias.sum(dims)
        if bias is None:
            self.add(self.diagonal, weight, per_weight.double().square().sum(0))
            return
        v = torch.stack([per_weight, per_bias], dim=-1).double()  # (N, *scale, 2)
        self.add(self.pairs, weight, (v.unsqueeze(-1) * v.unsqueeze(-2)).sum(0))
        self.shift[weight] = bias

    def add_squared_gradient(self, name: str, grad: torch.Tensor) -> None:
        self.add(self.diagonal, name, grad.double().square())

    @staticmethod
    def add(table: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        table[key] = table[key] + value if key in table else value

    def curvature(self, examples: int, energy: float, measure: str) -> Curvature:
        blocks = {n: KroneckerBlock(n, *self.layout[n], factor_root(a / examples, energy),
                                    factor_root(self.G[n] / examples, energy)) for n, a in self.A.items()}
        pairs = {n: (self.shift[n], (m / examples).float()) for n, m in self.pairs.items()}
        diagonal = {n: (self.diagonal[n] / examples).float() if n in self.diagonal
                    else torch.zeros(self.shapes[n]) for n in self.shapes if n not in self._blocked()}
        return Curvature(blocks, diagonal, examples, pairs, measure)

    def _blocked(self) -> set[str]:
        """The parameters a Kronecker or a norm's 2 x 2 block holds (the rest have a diagonal)."""
        return (set(self.A) | {bias for bias, _ in self.layout.values() if bias} | set(self.pairs)
                | set(self.shift.values()))


def compute_curvature(module: nn.Module, batches: Iterable[Any], *, names: Sequence[str] | None = None,
                      batching: Batching | None = None, seed: int = 0, exact: bool = False,
                      energy: float = 1.0, measure: str = "features",
                      head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Curvature:
    """The curvature of ``module`` (theta_0, left unchanged) at its parameters ``names`` (default: every parameter),
    estimated on ``batches`` (of the ``batching``'s kind: tensors by default).

    One probe per example on the features, seeded, of the covariance ``measure`` asks for (:class:`_Probes`;
    ``logits`` and ``distribution`` through ``head``, the fixed linear map from features to logits); ``exact``
    backpropagates every column of the covariance's root instead (the factors are then exact sums over them: for
    tests on tiny models). ``energy`` < 1 keeps of each Kronecker factor only the eigenvectors that hold that share
    of its trace (:func:`factor_root`). Examples run one at a time where batching them would mix them: sequences
    (their padding would enter A), and models with parameters outside the factored calls (their diagonal needs
    per-example gradients). A parameter that never reaches the features has a zero diagonal.
    """
    batching = batching or TensorBatching()
    if measure not in MEASURES:
        raise ConfigError(f"unknown curvature measure {measure!r}: expected one of {', '.join(MEASURES)}")
    if measure != "features" and head is None:
        raise ConfigError(f"a curvature measuring {measure} needs the head that maps the features to logits")
    params = dict(module.named_parameters())
    names = list(names) if names is not None else list(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise ConfigError(f"the model has no parameter(s) {missing[:5]} to compute the curvature of")
    sums = _Sums({n: tuple(params[n].shape) for n in names})
    generator = torch.Generator().manual_seed(seed)
    flags, was_training = {n: p.requires_grad for n, p in params.items()}, module.training
    module.eval()
    examples, one_at_a_time = 0, None
    probes = _Probes(generator, exact, measure, head)
    try:
        for p in params.values():
            p.requires_grad_(False)
        for n in names:
            params[n].requires_grad_(True)
        for batch in batches:
            if one_at_a_time is None:
                one_at_a_time = not isinstance(batching, TensorBatching) or not _all_factored(module, batch, batching,
                                                                                              params, names)
            for part in ([batch[i:i + 1] for i in range(len(batch))] if one_at_a_time else [batch]):
                _accumulate(module, part, batching, params, names, sums, probes)
                examples += len(part)
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
            p.grad = None
        module.train(was_training)
    if not examples:
        raise ConfigError("no examples to compute the curvature on")
    return sums.curvature(examples, energy, measure)


def _all_factored(module: nn.Module, batch: Any, batching: Batching, params: Mapping[str, nn.Parameter],
                  names: Sequence[str]) -> bool:
    """Whether the watched calls cover every parameter in ``names`` (a forward of one example, nothing summed)."""
    calls = _Calls({id(params[n]): n for n in names}, None)
    with calls:
        batching.run(module, batch[:1])
    return calls.covered >= set(names)


def _accumulate(module: nn.Module, batch: Any, batching: Batching, params: Mapping[str, nn.Parameter],
                names: Sequence[str], sums: _Sums, probes: _Probes) -> None:
    """Forward ``batch`` with the calls watched and backpropagate its probes; parameters the calls did not cover
    add their squared gradients to the diagonal (``batch`` is then one example)."""
    calls = _Calls({id(params[n]): n for n in names}, sums)
    with calls:
        features = batching.run(module, batch)
    rest = {n: params[n] for n in names if n not in calls.covered}
    for probe in probes(features, batching.output_mask(batch)):
        for p in rest.values():
            p.grad = None
        torch.autograd.backward(features, probe.to(features.dtype), retain_graph=True)
        for n, p in rest.items():
            if p.grad is not None:
                sums.add_squared_gradient(n, p.grad)


@dataclass
class _Probes:
    """The probes s backpropagated from the features: one draw per example with E[s s^T] = M, M the metric the
    penalty measures the features' drift with (see the module docstring), or, ``exact``, the columns of a root
    L L^T = M one at a time; zero at padded positions."""

    generator: torch.Generator
    exact: bool
    measure: str = "features"
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, features: torch.Tensor, mask: torch.Tensor | None) -> Iterable[torch.Tensor]:
        keep = (torch.ones(features.shape[:1], dtype=torch.bool) if mask is None else mask.bool().cpu())
        keep = keep.reshape(*keep.shape, *(1,) * (features.dim() - keep.dim())).to(features.device)
        if self.measure == "features":
            draws = self._columns(features.shape, features.device) if self.exact else [self._normal(features.shape)]
            return (s.to(features.device) * keep for s in draws)
        logits, transpose = self._through_head(features)
        return (transpose(z) * keep for z in self._logit_probes(logits))

    def _logit_probes(self, logits: torch.Tensor) -> Iterable[torch.Tensor]:
        """z on the logits with E[z z^T] = I / V (``logits``) or diag p - p p^T (``distribution``), per position."""
        if self.measure == "logits":
            scale = logits.shape[-1] ** -0.5
            yield from (c * scale for c in (self._columns(logits.shape, logits.device) if self.exact
                                             else [self._normal(logits.shape).to(logits.device)]))
            return
        p = logits.float().softmax(-1)
        if not self.exact:  # e_y - p, y ~ p at each position
            drawn = torch.multinomial(p.reshape(-1, p.shape[-1]).cpu(), 1, generator=self.generator)
            onehot = torch.zeros(p.reshape(-1, p.shape[-1]).shape).scatter_(1, drawn, 1.0)
            yield onehot.reshape(p.shape).to(p.device) - p
            return
        for column in self._columns(p.shape, p.device):  # column (position, v) of L: sqrt(p_v) (e_v - p) there
            at = column.sum(-1, keepdim=True)  # 1 at the column's position
            yield (column - p * at) * (p * column).sum(-1, keepdim=True).sqrt()

    def _through_head(self, features: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """theta_0's logits, and z -> W^T z: the head is linear, so its transpose is its vector-Jacobian product."""
        with torch.enable_grad():
            at = features.detach().requires_grad_(True)
            logits = self.head(at)

        def transpose(z: torch.Tensor) -> torch.Tensor:
            return torch.autograd.grad(logits, at, z.to(logits.dtype), retain_graph=True)[0]

        return logits.detach(), transpose

    def _normal(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator)

    @staticmethod
    def _columns(shape: torch.Size, device: torch.device) -> Iterable[torch.Tensor]:
        """Each per-example coordinate's indicator in turn (the columns of the identity)."""
        per_example = math.prod(shape[1:])
        for k in range(per_example):
            column = torch.zeros(shape[0], per_example, device=device)
            column[:, k] = 1.0
            yield column.reshape(shape)


def source_curvature(module: nn.Module, source: Any, *, examples: int, batching: Batching | None = None,
                     names: Sequence[str] | None = None, seed: int = 0, energy: float = 1.0,
                     device: torch.device | str | None = None, chunk: int = 64, measure: str = "features",
                     head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Curvature:
    """:func:`compute_curvature` on the first ``examples`` inputs an :class:`~editkit.core.taujp.UnlabeledSource`
    draws (its seeded order; fewer where it holds fewer), loaded ``chunk`` at a time, on ``device``. The source is
    restarted before and after, so its draws elsewhere are what they would have been."""
    source.restart()
    count = min(examples, len(source))
    sizes = [min(chunk, count - start) for start in range(0, count, chunk)]
    batches = (source.next_batch(size).to(device) if device is not None else source.next_batch(size)
               for size in sizes)
    try:
        return compute_curvature(module, batches, names=names, batching=batching, seed=seed, energy=energy,
                                 measure=measure, head=head)
    finally:
        source.restart()


# --------------------------------------------------------------------------- the penalty


class CurvatureRegularizer:
    """The data-free penalty: lambda * tau^T C tau (``squared``) or lambda * sqrt(tau^T C tau), C the curvature of
    the tasks seen so far, and no input of theirs (so a step draws no reg rows).

    combine: ``sum`` keeps one factor set, the tasks' mean (constant memory and cost however many tasks; TAK's
    Eq. 8); ``apart`` keeps every task's and averages their quadratic forms (TAK's Eq. 7: cost grows with tasks).
    The square root is tauJp's norm on the mean squared drift (its gradient at tau = 0 is taken as zero, as a
    norm's is), so lambda weighs it as tauJp's lambda weighs the mean norm.
    """

    needs_inputs = False
    lazy = False
    rows_per_step = 0

    def __init__(self, curvatures: Sequence[Curvature], *, lam: float, squared: bool = False,
                 combine: str = "sum", energy: float = 1.0, precision: str = "fp32") -> None:
        if combine not in COMBINES:
            raise ConfigError(f"unknown curvature combine {combine!r}: expected one of {', '.join(COMBINES)}")
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown curvature precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        self.lam, self.squared, self.combine, self.precision = lam, squared, combine, precision
        self.tasks = len(curvatures)
        if curvatures:
            same_measure(curvatures)
        self.curvatures = ([mean_curvature(curvatures, energy)] if combine == "sum" and curvatures
                           else list(curvatures))
        self._device: torch.device | None = None
        self._packed: _Packed | None = None

    @property
    def active(self) -> bool:
        return self.lam > 0 and self.tasks > 0

    @property
    def sources(self) -> list:
        """No input source: what a step would draw reg rows from, empty."""
        return []

    def batches(self, step: int) -> list:
        return []

    def prepare(self, steps: int) -> None:
        """Nothing to encode ahead: the penalty reads no input."""

    def skip(self, steps: int) -> None:
        """Nothing to skip: no source is drawn from."""

    def quadratic(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The mean over the seen tasks of tau^T C_t tau under ``combine``'s approximation."""
        device = next(iter(tau.values())).device
        if self._device != device:
            self._packed, self._device = _Packed(self.curvatures, device, PRECISIONS[self.precision]), device
        return self._packed.quadratic(tau)

    def loss_of(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        value = self.quadratic(tau)
        return self.lam * (value if self.squared else value.clamp_min(1e-20).sqrt())


class _Packed:
    """The seen tasks' curvatures laid out for the step: the mean of their quadratic forms in a handful of kernels.
    Kronecker blocks of one shape are stacked over layers and tasks and multiplied as one batch (ViT-B/32's 24 MLP
    layers are two batches); diagonals and norm blocks, linear in their tasks, are averaged once into flat tensors
    over all their parameters. Launched layer by layer and task by task, the products cost more than their
    arithmetic on a GPU (ViT-B/32, batch 128, an H200).

    A batch of blocks takes the cheaper of two routes, counted in multiply-adds for the form and its gradient:

    - *roots*: ||R_G^T dW R_A||^2, in the cheaper order of its two products, a task's roots padded with zero columns
      to the batch's rank; autograd's backward adds two more products. Cheap where the factors' ranks are low
      (few examples, ``curvature_energy`` below 1).
    - *dense*: G and A multiplied out once, and the gradient 2 G dW A from the same two products that give the
      value, <dW, G dW A> (:class:`_DenseForm`): half the roots' work at full rank, which a convolution's
      positions make the common case.

    ``dtype`` is what the Kronecker factors are held and multiplied in (the vector's view is cast to it each step,
    every term summed in fp32): bfloat16 runs the products several times faster where it is native, for about
    1e-3 of the form. Diagonals and norm blocks are elementwise and stay fp32."""

    def __init__(self, curvatures: Sequence[Curvature], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        first = curvatures[0]
        by_shape: dict[tuple, list[str]] = {}
        for key, block in first.blocks.items():
            by_shape.setdefault((block.groups, block.G.shape[1], block.A.shape[1], block.bias is not None),
                                []).append(key)
        self.kron = []
        for (groups, d_out, d_in, _), keys in by_shape.items():
            blocks = [[c.blocks[k] for c in curvatures] for k in keys]
            g_t = _padded([[b.G.transpose(1, 2) for b in per_task] for per_task in blocks], rows=True).to(device)
            a = _padded([[b.A for b in per_task] for per_task in blocks], rows=False).to(device)
            rank_g, rank_a = g_t.shape[-2], a.shape[-1]
            g_first = rank_g * d_out * d_in + rank_g * d_in * rank_a  # the roots' two products, G's first
            a_first = d_out * d_in * rank_a + rank_g * d_out * rank_a
            names = [(first.blocks[k].weight, first.blocks[k].bias) for k in keys]
            if d_out * d_out * d_in + d_out * d_in * d_in < 2 * min(g_first, a_first):  # backward: two more
                g, a = _symmetric(g_t.transpose(-1, -2) @ g_t), _symmetric(a @ a.transpose(-1, -2))
                self.kron.append(("dense", names, groups, g.to(dtype), a.to(dtype)))
            else:  # g_t (layers, tasks, groups, r_G, d_out)
                self.kron.append(("G first" if g_first <= a_first else "A first", names, groups, g_t.to(dtype),
                                  a.to(dtype)))
        self.tasks = len(curvatures)
        self.diagonal_names = list(first.diagonal)
        self.diagonal = (_mean([torch.cat([c.diagonal[n].reshape(-1) for n in self.diagonal_names])
                                for c in curvatures]).to(device) if first.diagonal else None)
        self.pair_names = [(scale, shift) for scale, (shift, _) in first.pairs.items()]
        self.pairs = (_mean([torch.cat([c.pairs[n][1].reshape(-1, 4) for n, _ in self.pair_names]) for c in curvatures])
                      .T.to(device) if first.pairs else None)  # (4, elements): m00, m01, m10, m11

    def quadratic(self, tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The mean over the tasks of tau^T C_t tau."""
        terms = []
        for route, names, groups, g, a in self.kron:
            w = torch.stack([_view(tau, weight, bias, groups) for weight, bias in names]).unsqueeze(1).to(a.dtype)
            if route == "dense":
                terms.append(_DenseForm.apply(w, g, a).float() / self.tasks)
                continue
            product = (g @ w) @ a if route == "G first" else g @ (w @ a)
            terms.append(product.float().square().sum() / self.tasks)
        if self.diagonal is not None:
            flat = torch.cat([tau[n].reshape(-1) for n in self.diagonal_names]).float()
            terms.append((self.diagonal * flat.square()).sum())
        if self.pairs is not None:
            scale = torch.cat([tau[n].reshape(-1) for n, _ in self.pair_names]).float()
            shift = torch.cat([tau[n].reshape(-1) for _, n in self.pair_names]).float()
            m00, m01, m10, m11 = self.pairs
            terms.append((m00 * scale.square() + (m01 + m10) * scale * shift + m11 * shift.square()).sum())
        return torch.stack(terms).sum()


class _DenseForm(torch.autograd.Function):
    """sum over the batch of tr(G dW A dW^T) = <dW, G dW A>, and its gradient 2 G dW A (G, A symmetric) from the
    same product, where autograd would multiply twice more. ``w`` (layers, 1, groups, d_out, d_in) against ``g``
    (layers, tasks, groups, d_out, d_out) and ``a`` (layers, tasks, groups, d_in, d_in): the tasks' forms summed."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        half = g @ w @ a
        if half.shape[1] > 1:
            half = half.sum(1, keepdim=True)
        ctx.save_for_backward(half)
        return (w * half).sum(dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (half,) = ctx.saved_tensors
        return 2 * grad * half, None, None


def _symmetric(m: torch.Tensor) -> torch.Tensor:
    """R R^T made exactly symmetric (its rounding is not), as the dense route's gradient 2 G dW A assumes."""
    return (m + m.transpose(-1, -2)) / 2


def _padded(roots: list[list[torch.Tensor]], *, rows: bool) -> torch.Tensor:
    """Roots by [layer][task], each (groups, ., rank) (``rows``: transposed, (groups, rank, .)), stacked to (layers,
    tasks, groups, ...) with zero columns (rows) up to the largest rank: a zero column adds nothing to R R^T."""
    axis = -2 if rows else -1
    rank = max(r.shape[axis] for per_task in roots for r in per_task)

    def pad(r: torch.Tensor) -> torch.Tensor:
        missing = rank - r.shape[axis]
        return torch.nn.functional.pad(r, (0, 0, 0, missing) if rows else (0, missing))

    return torch.stack([torch.stack([pad(r) for r in per_task]) for per_task in roots])


def _view(tau: Mapping[str, torch.Tensor], weight: str, bias: str | None, groups: int) -> torch.Tensor:
    """A layer's weight (and bias column) in its Kronecker block's view: (groups, d_out, d_in [+1])."""
    w = tau[weight]
    w = w.reshape(groups, w.shape[0] // groups, -1)
    if bias is not None:
        w = torch.cat([w, tau[bias].reshape(groups, -1, 1)], dim=2)
    return w
