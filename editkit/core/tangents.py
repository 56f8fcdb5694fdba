"""Forward-mode tangents of an exported graph, op by op: the linearized model as a program of plain operations.

f_lin(x) = f(x; theta_0) + J f(x; theta_0) . delta needs the Jacobian-vector product of the whole model. Tracing a
module that calls ``torch.func.jvp`` with ``torch.export`` does not give a program that stands on its own: the
graph keeps forward-mode AD for run time (dual tensors and a dual level the graph enters and leaves, so an input
error leaves the process inside it and ``torch.inference_mode`` refuses it), and tracing it fixes the batch size,
because several forward-mode formulas read concrete sizes (the zero tangent of an input or of a scalar operand,
batch norm, layer norm).

So the tangent is computed here instead, one op at a time, as ordinary operations:

1. the plain model f is exported and lowered to core ATen ops (:func:`core_graph`), shapes left symbolic;
2. :class:`TangentInterpreter` runs that graph, carrying beside every value its tangent (``None`` where it is
   zero: values that do not depend on delta). Parameters named in ``delta`` start with their tangent; every op
   with a tangent input gets its output's tangent from its rule in :data:`RULES` (the op's derivative applied to
   the input tangents);
3. tracing the interpreter (:mod:`editkit.io.program`) records the primal and the tangent ops and
   nothing else: a core-ATen program with a symbolic batch, loaded by ``torch.export.load`` alone.

Rules read an op's operands by position: an operand the graph passes by keyword where the op's schema has a
position for it (``where(c, self=x, other=y)``, ``hardtanh(x, max_val=0.5)``) is moved to that position first
(:func:`by_position`), so only keyword-only arguments (``alpha`` of ``add.Tensor``, ``beta`` of ``addmm``,
``approximate`` of ``gelu``) reach a rule by name; a rule reads those of its op itself (``kwargs.get``).

Each rule is checked against ``torch.func.jvp`` of its op, on a graph of that one op run by the interpreter, with
a tangent that is not zero (``tests/core/test_tangents.py``). An op with a tangent input and no rule is refused by
name (:class:`~editkit.errors.ExportError`); a rule for it can be added to :data:`RULES`
(``RULES[torch.ops.aten.OP.overload] = rule``). A rule that fails on the operands it is given is refused by the
op's name as well, its torch error chained as the cause rather than shown.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from editkit.core.linearize import forward_ad_safe_attention
from editkit.errors import ExportError

aten = torch.ops.aten

#: ``rule(out, args, kwargs, tangents) -> tangent``: ``out`` is the op's result, ``args`` its operands by position
#: (:func:`by_position`) and ``kwargs`` its keyword-only arguments, ``tangents`` the tangents of ``args`` in the
#: same structure (``None``: zero). It returns the tangent of ``out``
#: (a tuple of them for an op of several outputs; ``None`` for zero).
Rule = Callable[[Any, tuple, dict, list], Any]


# --------------------------------------------------------------------------- helpers of the rules


def _plus(*terms: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the terms that are not ``None`` (``None`` when all are)."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for term in present[1:]:
        total = total + term
    return total


def _shaped(tangent: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A tangent broadcast to its output's shape (an operand smaller than the result, e.g. a bias). Shapes are
    compared only where that is known without a guard (a guard on a symbolic size would fix the batch size in
    the program); otherwise ``expand_as`` makes a view."""
    if tangent is None:
        return None
    if tangent.dim() == like.dim() and all(statically_known_true(a == b) for a, b in zip(tangent.shape, like.shape)):
        return tangent
    return tangent.expand_as(like)


def _or_zeros(tangent: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if tangent is None else tangent


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """Where a per-channel vector sits against an ``(N, C, ...)`` tensor."""
    return (1, -1) + (1,) * (x.dim() - 2)


# --------------------------------------------------------------------------- the rules


def linear_in_first(op: Callable) -> Rule:
    """Ops linear in their first operand whose other operands are not differentiated (views, reductions, index
    reads, scalar scaling): the tangent is the op applied to the first operand's tangent."""

    def rule(out, args, kwargs, tangents):
        return None if tangents[0] is None else op(tangents[0], *args[1:], **kwargs)

    return rule


def constant(out, args, kwargs, tangents):
    """Ops whose value does not depend on their tensor operands' values (``zeros_like``, ``full``...)."""
    return None


def pointwise(derivative: Callable[..., torch.Tensor]) -> Rule:
    """Elementwise functions of their first operand: tangent * f'(x); ``derivative(out, *args, **kwargs)``."""

    def rule(out, args, kwargs, tangents):
        return None if tangents[0] is None else tangents[0] * derivative(out, *args, **kwargs)

    return rule


def _add(sign: float) -> Rule:
    def rule(out, args, kwargs, tangents):
        other = tangents[1] if len(tangents) > 1 else None
        scale = sign * kwargs.get("alpha", 1)
        if other is not None and scale != 1:
            other = other * scale
        return _shaped(_plus(tangents[0], other), out)

    return rule


def _mul(out, args, kwargs, tangents):
    (a, b), (ta, tb) = args, tangents
    return _shaped(_plus(None if ta is None else ta * b, None if tb is None else a * tb), out)


def _div(out, args, kwargs, tangents):
    (_, b), (ta, tb) = args, tangents
    return _shaped(_plus(None if ta is None else ta / b, None if tb is None else -(out * tb) / b), out)


def _bilinear(op: Callable) -> Rule:
    """Products linear in each operand (``mm``, ``bmm``)."""

    def rule(out, args, kwargs, tangents):
        (a, b), (ta, tb) = args[:2], tangents[:2]
        return _plus(None if ta is None else op(ta, b), None if tb is None else op(a, tb))

    return rule


def _addmm(out, args, kwargs, tangents):
    bias, a, b = args
    tbias, ta, tb = tangents
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    product = _plus(None if ta is None else aten.mm(ta, b), None if tb is None else aten.mm(a, tb))
    if product is not None and alpha != 1:
        product = product * alpha
    if tbias is not None and beta != 1:
        tbias = tbias * beta
    return _shaped(_plus(product, tbias), out)


def _convolution(out, args, kwargs, tangents):
    x, weight, bias, *rest = args
    tx, tw, tb = tangents[:3]
    through_input = None if tx is None else aten.convolution(tx, weight, None, *rest)
    through_weight = None if tw is None else aten.convolution(x, tw, None, *rest)
    through_bias = None if tb is None else tb.reshape(_channel_shape(out))
    return _shaped(_plus(through_input, through_weight, through_bias), out)


def _batch_norm_eval(out, args, kwargs, tangents):
    """``_native_batch_norm_legit_no_training``: y = (x - mean) * invstd * w + b with fixed statistics."""
    x, weight, bias, running_mean, running_var, _momentum, eps = args
    tx, tw, tb = tangents[:3]
    shape = _channel_shape(x)
    invstd = torch.rsqrt(running_var + eps)
    scale = invstd if weight is None else invstd * weight
    through_input = None if tx is None else tx * scale.reshape(shape)
    through_weight = None if tw is None else (x - running_mean.reshape(shape)) * (invstd * tw).reshape(shape)
    through_bias = None if tb is None else tb.reshape(shape)
    return (_shaped(_plus(through_input, through_weight, through_bias), out[0]), None, None)


def _layer_norm(out, args, kwargs, tangents):
    """``native_layer_norm`` -> (y, mean, rstd): y = xhat * w + b, xhat = (x - mean) * rstd."""
    x, normalized_shape, weight, bias = args[:4]
    tx, tw, tb = tangents[0], tangents[2], tangents[3]
    y, mean, rstd = out
    dims = tuple(range(-len(normalized_shape), 0))
    xhat = (x - mean) * rstd
    through_input = None
    if tx is not None:
        txhat = rstd * (tx - tx.mean(dims, keepdim=True) - xhat * (xhat * tx).mean(dims, keepdim=True))
        through_input = txhat if weight is None else txhat * weight
    through_weight = None if tw is None else xhat * tw
    return (_shaped(_plus(through_input, through_weight, tb), y), None, None)


def _softmax(out, args, kwargs, tangents):
    t, dim = tangents[0], args[1]
    return None if t is None else out * (t - (out * t).sum(dim, keepdim=True))


def _log_softmax(out, args, kwargs, tangents):
    t, dim = tangents[0], args[1]
    return None if t is None else t - (torch.exp(out) * t).sum(dim, keepdim=True)


def _gelu_derivative(out, x, approximate="none"):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = torch.tanh(k * (x + 0.044715 * x * x * x))
        return 0.5 * (1 + inner) + 0.5 * x * (1 - inner * inner) * k * (1 + 3 * 0.044715 * x * x)
    return 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2)))) + x * torch.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))


def _silu_derivative(out, x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def gated(inside: Callable[..., torch.Tensor]) -> Rule:
    """Piecewise-linear functions of their first operand (relu, hardtanh, clamp): the tangent where
    ``inside(x, *args)`` holds (slope 1), zero elsewhere; a selection, not a product with a 0/1 mask."""

    def rule(out, args, kwargs, tangents):
        t = tangents[0]
        if t is None:
            return None
        return torch.where(inside(*args, **kwargs), t, 0.0)

    return rule


def _within(x, low=None, high=None, *, closed: bool = False) -> torch.Tensor:
    """Where ``x`` lies between the bounds (``closed``: bounds included, as clamp's derivative counts them)."""
    inside = torch.ones_like(x, dtype=torch.bool) if low is None and high is None else None
    if low is not None:
        inside = (x >= low) if closed else (x > low)
    if high is not None:
        above = (x <= high) if closed else (x < high)
        inside = above if inside is None else inside & above
    return inside


def _where(out, args, kwargs, tangents):
    condition = args[0]
    ta, tb = tangents[1], tangents[2]
    if ta is None and tb is None:
        return None
    return aten.where.self(condition, _or_zeros(ta, out), _or_zeros(tb, out))


def _max_pool(out, args, kwargs, tangents):
    """``max_pool2d_with_indices`` -> (values, indices): the tangent at each window's maximum."""
    t = tangents[0]
    if t is None:
        return None
    values, indices = out
    return (t.flatten(-2).gather(-1, indices.flatten(-2)).view_as(values), None)


def _cat(out, args, kwargs, tangents):
    tensors, parts = args[0], tangents[0]
    if all(t is None for t in parts):
        return None
    return aten.cat([_or_zeros(t, x) for t, x in zip(parts, tensors)], *args[1:], **kwargs)


def _pad(out, args, kwargs, tangents):
    return None if tangents[0] is None else aten.constant_pad_nd(tangents[0], args[1], 0.0)


def _to_copy(out, args, kwargs, tangents):
    return None if tangents[0] is None or not out.is_floating_point() else aten._to_copy(tangents[0], **kwargs)


def _embedding(out, args, kwargs, tangents):
    """``embedding(weight, indices, ...)``: the rows of the weight's tangent the indices pick."""
    return None if tangents[0] is None else aten.embedding(tangents[0], *args[1:], **kwargs)


def _pow_scalar(out, x, exponent):
    return exponent * torch.pow(x, exponent - 1)


#: Linear in the first operand, nothing else differentiated.
LINEAR_OPS = (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dims, aten.squeeze.dim,
    aten.squeeze.default, aten.clone.default, aten.t.default, aten.transpose.int, aten.alias.default,
    aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.sum.default, aten.mul.Scalar, aten.div.Scalar,
    aten.neg.default, aten.index.Tensor, aten.gather.default, aten.index_select.default,
    aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int, aten.flip.default, aten.roll.default,
    aten.repeat.default, aten._adaptive_avg_pool2d.default, aten.avg_pool2d.default, aten.narrow.default,
    aten.flatten.using_ints,
)
#: Values that do not depend on their tensor operands' values (ops of no tensor operand need no rule).
CONSTANT_OPS = (
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.detach.default,
)

#: aten op -> its tangent rule (see :data:`Rule`).
RULES: dict[Any, Rule] = {
    **{op: linear_in_first(op) for op in LINEAR_OPS},
    **{op: constant for op in CONSTANT_OPS},
    aten.add.Tensor: _add(1), aten.sub.Tensor: _add(-1),
    aten.add.Scalar: linear_in_first(lambda t, *_: t), aten.sub.Scalar: linear_in_first(lambda t, *_: t),
    aten.rsub.Scalar: linear_in_first(lambda t, other, alpha=1: t * -alpha),  # other - alpha * x
    aten.mul.Tensor: _mul, aten.div.Tensor: _div,
    aten.mm.default: _bilinear(aten.mm), aten.bmm.default: _bilinear(aten.bmm), aten.addmm.default: _addmm,
    aten.convolution.default: _convolution,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval,
    aten.native_layer_norm.default: _layer_norm,
    aten._softmax.default: _softmax, aten._log_softmax.default: _log_softmax,
    aten.gelu.default: pointwise(_gelu_derivative),
    aten.silu.default: pointwise(_silu_derivative),
    aten.relu.default: gated(lambda x: x > 0),
    aten.hardtanh.default: gated(lambda x, low=-1.0, high=1.0: _within(x, low, high)),
    aten.clamp.default: gated(lambda x, low=None, high=None: _within(x, low, high, closed=True)),
    aten.tanh.default: pointwise(lambda out, x: 1 - out * out),
    aten.sigmoid.default: pointwise(lambda out, x: out * (1 - out)),
    aten.exp.default: pointwise(lambda out, x: out),
    aten.log.default: pointwise(lambda out, x: 1 / x),
    aten.rsqrt.default: pointwise(lambda out, x: -0.5 * out / x),
    aten.sqrt.default: pointwise(lambda out, x: 0.5 / out),
    aten.reciprocal.default: pointwise(lambda out, x: -out * out),
    aten.erf.default: pointwise(lambda out, x: (2 / math.sqrt(math.pi)) * torch.exp(-x * x)),
    aten.sin.default: pointwise(lambda out, x: torch.cos(x)),
    aten.cos.default: pointwise(lambda out, x: -torch.sin(x)),
    aten.abs.default: pointwise(lambda out, x: torch.sign(x)),
    aten.pow.Tensor_Scalar: pointwise(_pow_scalar),
    aten.where.self: _where, aten.max_pool2d_with_indices.default: _max_pool, aten.cat.default: _cat,
    aten.constant_pad_nd.default: _pad, aten._to_copy.default: _to_copy, aten.embedding.default: _embedding,
}


# --------------------------------------------------------------------------- the interpreter


def _floating(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, (list, tuple)):
        return any(_floating(v) for v in value)
    return False


def _any(tangent: Any) -> bool:
    if isinstance(tangent, (list, tuple)):
        return any(_any(t) for t in tangent)
    return tangent is not None


def by_position(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """A call's ``args`` and ``kwargs`` with every operand ``op``'s schema takes by position at its position: one
    passed by keyword is moved there, and the defaults of those it skips over are filled in. Rules read operands
    by position (their tangents are carried beside ``args``); what stays in ``kwargs`` is keyword-only."""
    schema = getattr(op, "_schema", None)
    if schema is None or not kwargs:
        return tuple(args), dict(kwargs)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    end = max((i + 1 for i, a in enumerate(positional) if a.name in kwargs), default=0)
    rest = dict(kwargs)
    moved = tuple(rest.pop(a.name) if a.name in rest else a.default_value for a in positional[len(args):end])
    return tuple(args) + moved, rest


class TangentInterpreter(Interpreter):
    """Runs a core-ATen graph module and, beside each value, its tangent (see the module docstring).

    tangents: the tangent of each parameter the graph reads (``get_attr`` target -> tensor); others are zero.
    """

    def __init__(self, module: GraphModule, tangents: Mapping[str, torch.Tensor]) -> None:
        super().__init__(module)
        self.extra_traceback = False  # torch.fx would append its node dump to an ExportError's one line
        self.seeds = tangents
        self.tangent: dict[Node, Any] = {}

    def run_node(self, node: Node) -> Any:
        out = super().run_node(node)
        if node.op == "get_attr":
            self.tangent[node] = self.seeds.get(str(node.target))
        elif node.op == "call_function":
            self.tangent[node] = self._tangent_of_call(node, out)
        return out

    def tangent_of(self, value: Any) -> Any:
        """The tangent of a node (``None``: zero), or of each node in a list or tuple of them."""
        if isinstance(value, Node):
            return self.tangent.get(value)
        if isinstance(value, (list, tuple)):
            return [self.tangent_of(v) for v in value]
        return None

    def _tangent_of_call(self, node: Node, out: Any) -> Any:
        if not _floating(out):
            return None
        if node.target is operator.getitem:
            whole = self.tangent_of(node.args[0])
            return None if whole is None else whole[node.args[1]]
        arg_nodes, kwarg_nodes = by_position(node.target, node.args, node.kwargs)
        tangents = [self.tangent_of(a) for a in arg_nodes]
        if not (_any(tangents) or _any(self.tangent_of(list(kwarg_nodes.values())))):
            return None
        rule = RULES.get(node.target)
        if rule is None:
            raise ExportError(f"no tangent rule for {node.target} (in the model's graph at {node.name}): the "
                              "linearized model cannot be written as a program; add one to "
                              "editkit.core.tangents.RULES")
        args, kwargs = self.map_nodes_to_values(arg_nodes, node), self.map_nodes_to_values(kwarg_nodes, node)
        try:
            return rule(out, args, kwargs, tangents)
        except Exception as exc:  # torch's words describe the rule's ops, not the model: say which op failed
            raise ExportError(f"the tangent rule for {node.target} failed (in the model's graph at {node.name}, "
                              f"{type(exc).__name__}): the linearized model cannot be written as a program; the "
                              "rule in editkit.core.tangents.RULES does not cover this use of the op") from exc

    def outputs(self, *inputs: torch.Tensor) -> list[tuple[Any, Any]]:
        """(primal, tangent) of each output of the graph on ``inputs`` (flat, as its placeholders take them)."""
        primals = self.run(*inputs)
        nodes = self.module.graph.output_node().args[0]
        nodes = nodes if isinstance(nodes, (list, tuple)) else [nodes]
        primals = primals if isinstance(primals, (list, tuple)) else [primals]
        return [(p, self.tangent_of(n)) for p, n in zip(primals, nodes)]


def core_graph(module: nn.Module, example: Sequence[torch.Tensor], dynamic_shapes: Any) -> GraphModule:
    """``module`` exported and lowered to core ATen ops, its parameters held as attributes (read by ``get_attr``
    under their names in ``module``); attention through kernels forward-mode AD has rules for."""
    with forward_ad_safe_attention():
        exported = torch.export.export(module, tuple(example), dynamic_shapes=dynamic_shapes)
    return exported.run_decompositions().module()


def with_aliases(module: nn.Module, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``delta`` under every name its parameters have in ``module``: a tied weight (an LM head sharing the input
    embedding) is read by the graph under each of its names, and its tangent is the same under all of them."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    params = dict(module.named_parameters(remove_duplicate=False))
    return {alias: value for name, value in delta.items() for alias in by_tensor[id(params[name])]}


class LinearizedGraph(nn.Module):
    """f_lin on a core-ATen graph of f: its output is f(x; theta_0) + J f . delta (:class:`TangentInterpreter`).

    graph: :func:`core_graph` of the model at theta_0; delta: tangent per parameter, by the graph's ``get_attr``
    names (:func:`with_aliases` of the model's); held as buffers so the program written from this module carries
    them.
    """

    def __init__(self, graph: GraphModule, delta: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.graph_module = graph
        self.delta_names = list(delta)
        for index, name in enumerate(self.delta_names):
            self.register_buffer(f"delta_{index}", delta[name].detach().clone().contiguous())

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        seeds = {name: getattr(self, f"delta_{i}") for i, name in enumerate(self.delta_names)}
        (primal, tangent), = TangentInterpreter(self.graph_module, seeds).outputs(*inputs)
        return primal if tangent is None else primal + tangent
