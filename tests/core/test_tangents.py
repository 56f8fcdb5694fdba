"""Tangent rules against ``torch.func.jvp``, op by op; linearized graphs of real architectures against
:class:`~editkit.core.linearize.LinearizedModel`; and the program traced from them: a symbolic batch, no
forward-mode AD left in it, the same outputs after ``torch.export.save`` / ``load``.

Ground truth: ``torch.func.jvp`` of the op itself (float64), and for whole models the linearized model editkit
trains and scores (itself checked against finite differences in ``test_linearize.py``). Each op's case runs
through :class:`~editkit.core.tangents.TangentInterpreter` as a graph of that one op, so operands passed by
keyword and the ``getitem`` of an op of several outputs take the interpreter's own path; every case's tangent is
not zero, so a rule that gives none (or zeros) fails its case. EfficientNet-Lite0's,
an open_clip ViT's and a T5's programs are checked end to end against editkit's own logits by
``tests/runs/test_takeaway.py``, ``tests/runs/test_export.py`` and ``tests/cli/test_glue4.py``.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.func import jvp
from torch.fx import Graph, GraphModule

from editkit.core.linearize import LinearizedModel
from editkit.core.tangents import RULES, LinearizedGraph, TangentInterpreter, core_graph, with_aliases
from editkit.errors import ExportError

from helpers import models

aten = torch.ops.aten
D = torch.float64


def g(*shape, seed=0, positive=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)
    return x.abs() + 0.5 if positive else x


def idx(*shape, high=4, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


#: (op, args, kwargs, positions of the differentiated operands: i is args[i], a name is kwargs[name], (i, j) is
#: element j of the list at args[i] or kwargs[i]).
CASES = [
    (aten.view.default, [g(2, 6)], {"size": [3, 4]}, [0]),
    (aten._unsafe_view.default, [g(2, 6), [12]], {}, [0]),
    (aten.reshape.default, [g(2, 6), [4, 3]], {}, [0]),
    (aten.permute.default, [g(2, 3, 4), [2, 0, 1]], {}, [0]),
    (aten.expand.default, [g(1, 3), [4, 3]], {}, [0]),
    (aten.slice.Tensor, [g(5, 3), 0, 1, 4], {}, [0]),
    (aten.select.int, [g(5, 3), 1, 2], {}, [0]),
    (aten.unsqueeze.default, [g(5, 3), 1], {}, [0]),
    (aten.squeeze.dims, [g(5, 1, 3), [1]], {}, [0]),
    (aten.squeeze.dim, [g(5, 1, 3), 1], {}, [0]),
    (aten.squeeze.default, [g(5, 1, 3)], {}, [0]),
    (aten.clone.default, [g(5, 3)], {}, [0]),
    (aten.t.default, [g(5, 3)], {}, [0]),
    (aten.transpose.int, [g(2, 5, 3), 0, 2], {}, [0]),
    (aten.alias.default, [g(5, 3)], {}, [0]),
    (aten.mean.dim, [g(5, 3), [1], True], {}, [0]),
    (aten.mean.default, [g(5, 3)], {}, [0]),
    (aten.sum.dim_IntList, [g(5, 3), [0]], {}, [0]),
    (aten.sum.default, [g(5, 3)], {}, [0]),
    (aten.mul.Scalar, [g(5, 3), 0.3], {}, [0]),
    (aten.div.Scalar, [g(5, 3), 7.0], {}, [0]),
    (aten.neg.default, [g(5, 3)], {}, [0]),
    (aten.index.Tensor, [g(5, 3), [idx(4, high=5)]], {}, [0]),
    (aten.gather.default, [g(5, 3), 1, idx(5, 2, high=3)], {}, [0]),
    (aten.index_select.default, [g(5, 3), 0, idx(4, high=5)], {}, [0]),
    (aten.split_with_sizes.default, [g(5, 3), [2, 3]], {}, [0]),
    (aten.split.Tensor, [g(5, 3), 2], {}, [0]),
    (aten.unbind.int, [g(5, 3), 1], {}, [0]),
    (aten.flip.default, [g(5, 3), [0]], {}, [0]),
    (aten.roll.default, [g(5, 3), [1], [0]], {}, [0]),
    (aten.repeat.default, [g(2, 3), [2, 1]], {}, [0]),
    (aten._adaptive_avg_pool2d.default, [g(2, 3, 6, 6), [2, 2]], {}, [0]),
    (aten.avg_pool2d.default, [g(2, 3, 6, 6), [2, 2]], {}, [0]),
    (aten.narrow.default, [g(5, 3), 0, 1, 2], {}, [0]),
    (aten.flatten.using_ints, [g(2, 3, 4), 1], {}, [0]),
    (aten.add.Tensor, [g(4, 3), g(3, seed=1)], {"alpha": 0.5}, [0, 1]),
    (aten.add.Tensor, [g(4, 3), g(3, seed=1)], {}, [1]),
    (aten.sub.Tensor, [g(4, 3), g(4, 3, seed=1)], {}, [0, 1]),
    (aten.add.Scalar, [g(4, 3), 2.0], {}, [0]),
    (aten.sub.Scalar, [g(4, 3), 2.0], {}, [0]),
    (aten.rsub.Scalar, [g(4, 3), 2.0], {}, [0]),
    (aten.mul.Tensor, [g(4, 3), g(3, seed=1)], {}, [0, 1]),
    (aten.mul.Tensor, [g(4, 1), g(3, seed=1)], {}, [1]),
    (aten.div.Tensor, [g(4, 3), g(3, seed=1, positive=True)], {}, [0, 1]),
    (aten.mm.default, [g(4, 3), g(3, 2, seed=1)], {}, [0, 1]),
    (aten.bmm.default, [g(2, 4, 3), g(2, 3, 2, seed=1)], {}, [0, 1]),
    (aten.addmm.default, [g(2, seed=2), g(4, 3), g(3, 2, seed=1)], {"beta": 0.5, "alpha": 2.0}, [0, 1, 2]),
    (aten.addmm.default, [g(2, seed=2), g(4, 3), g(3, 2, seed=1)], {}, [0]),
    (aten.convolution.default, [g(2, 3, 6, 6), g(4, 3, 3, 3, seed=1), g(4, seed=2), [1, 1], [1, 1], [1, 1],
                                False, [0, 0], 1], {}, [0, 1, 2]),
    (aten.convolution.default, [g(2, 4, 6, 6), g(4, 1, 3, 3, seed=1), None, [2, 2], [0, 0], [1, 1],
                                False, [0, 0], 4], {}, [1]),
    (aten._native_batch_norm_legit_no_training.default,
     [g(2, 3, 4, 4), g(3, seed=1), g(3, seed=2), g(3, seed=3), g(3, seed=4, positive=True), 0.1, 1e-5], {},
     [0, 1, 2]),
    (aten.native_layer_norm.default, [g(2, 5, 6), [6], g(6, seed=1), g(6, seed=2), 1e-5], {}, [0, 2, 3]),
    (aten.native_layer_norm.default, [g(2, 5, 6), [5, 6], None, None, 1e-5], {}, [0]),
    (aten._softmax.default, [g(4, 5), 1, False], {}, [0]),
    (aten._log_softmax.default, [g(4, 5), -1, False], {}, [0]),
    (aten.gelu.default, [g(4, 5)], {}, [0]),
    (aten.gelu.default, [g(4, 5)], {"approximate": "tanh"}, [0]),
    (aten.silu.default, [g(4, 5)], {}, [0]),
    (aten.relu.default, [g(4, 5)], {}, [0]),
    (aten.hardtanh.default, [g(4, 5), 0.0, 0.6], {}, [0]),
    (aten.hardtanh.default, [g(4, 5)], {}, [0]),
    (aten.clamp.default, [g(4, 5), -0.5, 0.5], {}, [0]),
    (aten.tanh.default, [g(4, 5)], {}, [0]),
    (aten.sigmoid.default, [g(4, 5)], {}, [0]),
    (aten.exp.default, [g(4, 5)], {}, [0]),
    (aten.log.default, [g(4, 5, positive=True)], {}, [0]),
    (aten.rsqrt.default, [g(4, 5, positive=True)], {}, [0]),
    (aten.sqrt.default, [g(4, 5, positive=True)], {}, [0]),
    (aten.reciprocal.default, [g(4, 5, positive=True)], {}, [0]),
    (aten.erf.default, [g(4, 5)], {}, [0]),
    (aten.sin.default, [g(4, 5)], {}, [0]),
    (aten.cos.default, [g(4, 5)], {}, [0]),
    (aten.abs.default, [g(4, 5)], {}, [0]),
    (aten.pow.Tensor_Scalar, [g(4, 5, positive=True), 2.5], {}, [0]),
    (aten.where.self, [g(4, 5) > 0, g(4, 5, seed=1), g(5, seed=2)], {}, [1, 2]),
    (aten.where.self, [g(4, 5) > 0, g(4, 5, seed=1), g(5, seed=2)], {}, [2]),
    (aten.max_pool2d_with_indices.default, [g(2, 3, 6, 6), [2, 2], [2, 2]], {}, [0]),
    (aten.cat.default, [[g(2, 3), g(4, 3, seed=1)], 0], {}, [(0, 1)]),
    (aten.cat.default, [[g(2, 3), g(2, 5, seed=1)], 1], {}, [(0, 0), (0, 1)]),
    (aten.constant_pad_nd.default, [g(2, 3), [1, 2], 1.5], {}, [0]),
    (aten._to_copy.default, [g(2, 3)], {"dtype": torch.float32}, [0]),
    (aten.embedding.default, [g(6, 3), idx(2, 4, high=6)], {}, [0]),
    # alpha, by keyword where the schema has it keyword-only and by position where it has a position for it
    (aten.sub.Tensor, [g(4, 3), g(3, seed=1)], {"alpha": -1.5}, [0, 1]),
    (aten.rsub.Scalar, [g(4, 3), 2.0], {"alpha": 3.0}, [0]),
    (aten.rsub.Scalar, [g(4, 3), 2.0, -0.5], {}, [0]),
    (aten.add.Scalar, [g(4, 3), 2.0], {"alpha": 3.0}, [0]),
    (aten.sub.Scalar, [g(4, 3), 2.0, 3.0], {}, [0]),
    # operands the schema takes by position, passed by keyword (moved to their positions before a rule reads them)
    (aten.add.Tensor, [g(4, 3)], {"other": g(3, seed=1), "alpha": 2.0}, [0, "other"]),
    (aten.mul.Tensor, [], {"self": g(4, 3), "other": g(3, seed=1)}, ["self", "other"]),
    (aten.where.self, [g(4, 5) > 0], {"self": g(4, 5, seed=1), "other": g(5, seed=2)}, ["self", "other"]),
    (aten.convolution.default, [g(2, 3, 6, 6)], {"weight": g(4, 3, 3, 3, seed=1), "bias": g(4, seed=2),
                                                 "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
                                                 "transposed": False, "output_padding": [0, 0], "groups": 1},
     [0, "weight", "bias"]),
    (aten.native_layer_norm.default, [g(2, 5, 6), [6]], {"weight": g(6, seed=1), "bias": g(6, seed=2), "eps": 1e-5},
     [0, "weight", "bias"]),
    (aten._softmax.default, [g(4, 5)], {"dim": 0, "half_to_float": False}, [0]),
    (aten.hardtanh.default, [g(4, 5)], {"max_val": 0.6}, [0]),
    (aten.clamp.default, [g(4, 5)], {"max": 0.5}, [0]),
    (aten.cat.default, [], {"tensors": [g(2, 3), g(4, 3, seed=1)], "dim": 0}, [("tensors", 1)]),
]

#: Ops whose result does not depend on their operands' values: no tangent, whatever the inputs'.
CONSTANT_CASES = [
    (aten.full_like.default, [g(2, 3), 1.5], {}),
    (aten.zeros_like.default, [g(2, 3)], {}),
    (aten.ones_like.default, [g(2, 3)], {}),
    (aten.empty_like.default, [g(2, 3)], {}),
    (aten.detach.default, [g(2, 3)], {}),
]


def _get(args, kwargs, position):
    if isinstance(position, tuple):
        return _get(args, kwargs, position[0])[position[1]]
    return kwargs[position] if isinstance(position, str) else args[position]


def _set(args, kwargs, position, value):
    """Copies of ``args`` and ``kwargs`` with ``value`` at ``position`` (see :data:`CASES`)."""
    args, kwargs = [list(a) if isinstance(a, list) else a for a in args], dict(kwargs)
    key, element = position if isinstance(position, tuple) else (position, None)
    container = kwargs if isinstance(key, str) else args
    if element is None:
        container[key] = value
    else:
        container[key] = list(container[key])
        container[key][element] = value
    return args, kwargs


def _case_id(case):
    return str(case[0]).replace("aten.", "")


def _one_op(op, args, kwargs, directions):
    """(output, tangent) of each output of ``op(*args, **kwargs)`` from the interpreter, on a graph of that one call
    (and a ``getitem`` per output of an op of several) whose tensor operands are attributes, those at the positions
    of ``directions`` seeded with their direction."""
    root, graph, seeds = nn.Module(), Graph(), {}

    def read(value, position):
        if isinstance(value, list):
            return [read(v, (position, j)) for j, v in enumerate(value)]
        if not isinstance(value, torch.Tensor):
            return value
        name = f"operand{len(root._buffers)}"
        root.register_buffer(name, value)
        if position in directions:
            seeds[name] = directions[position]
        return graph.get_attr(name)

    call = graph.call_function(op, tuple(read(a, i) for i, a in enumerate(args)),
                               {key: read(v, key) for key, v in kwargs.items()})
    out = op(*args, **kwargs)
    several = isinstance(out, (tuple, list))
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in range(len(out))) if several
                 else (call,))
    return TangentInterpreter(GraphModule(root, graph), seeds).outputs()


def _op_jvp(op, args, kwargs, directions):
    """``torch.func.jvp`` of the op in the operands at the positions of ``directions``: its output's tangents."""

    def call(*values):
        filled = args, kwargs
        for position, value in zip(directions, values):
            filled = _set(*filled, position, value)
        return op(*filled[0], **filled[1])

    _, tangent = jvp(call, tuple(_get(args, kwargs, p) for p in directions), tuple(directions.values()))
    return list(tangent) if isinstance(tangent, (tuple, list)) else [tangent]


def _is_zero(tangent):
    """No tangent at all: torch's own jvp gives exact zeros (or none) for an output that does not follow the
    operands (the statistics of batch and layer norm, max pool's indices)."""
    return tangent is None or not tangent.is_floating_point() or not tangent.any()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_rule_gives_the_ops_jvp(case):
    op, args, kwargs, differentiated = case
    directions = {p: torch.randn_like(_get(args, kwargs, p), generator=torch.Generator().manual_seed(7 + i))
                  for i, p in enumerate(differentiated)}
    expected = _op_jvp(op, args, kwargs, directions)
    got = [tangent for _, tangent in _one_op(op, args, kwargs, directions)]
    assert max(e.abs().max() for e in expected if not _is_zero(e)) > 1e-3  # the case compares a tangent
    for e, t in zip(expected, got, strict=True):
        if _is_zero(e):
            assert _is_zero(t)
        else:
            assert t is not None, f"{op} gives no tangent where jvp gives one"
            torch.testing.assert_close(t, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CONSTANT_CASES, ids=_case_id)
def test_constant_ops_have_no_tangent(case):
    op, args, kwargs = case
    directions = {0: torch.ones_like(args[0])}
    assert _is_zero(_op_jvp(op, args, kwargs, directions)[0])
    (_, tangent), = _one_op(op, args, kwargs, directions)
    assert tangent is None


def test_every_rule_is_checked_here():
    checked = {case[0] for case in CASES} | {case[0] for case in CONSTANT_CASES}
    assert set(RULES) - checked == set()


def test_no_rule_takes_a_tensor_by_keyword_only():
    """Rules are given the tangents of positional operands alone (keyword ones are moved to their positions first):
    an op whose schema takes a tensor by keyword only would have that tensor's tangent ignored."""
    keyword_tensors = {str(op): [a.name for a in op._schema.arguments if a.kwarg_only and "Tensor" in str(a.type)]
                       for op in RULES}
    assert {op: names for op, names in keyword_tensors.items() if names} == {}


# --------------------------------------------------------------------------- whole models


def _compare(module: nn.Module, inputs: tuple, dynamic, tol: float, other: tuple | None = None) -> None:
    """The linearized graph of ``module`` and the program traced from it against ``LinearizedModel``."""
    module.eval()
    delta = {n: 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype)
             for n, p in module.named_parameters()}
    reference = LinearizedModel(module)
    reference.load_task_vector(delta)
    lin = LinearizedGraph(core_graph(module, inputs, dynamic), with_aliases(module, delta))
    with torch.no_grad():
        expected = reference(*inputs)
        torch.testing.assert_close(lin(*inputs), expected, rtol=tol, atol=tol)
        program = torch.export.export(lin, inputs, dynamic_shapes=(dynamic,))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("dual" in op for op in ops), ops  # forward-mode AD is gone from the program
    loaded = program.module()
    for batch in (inputs,) + ((other,) if other is not None else ()):
        with torch.inference_mode():
            got = loaded(*batch)
        with torch.no_grad():
            torch.testing.assert_close(got, reference(*batch), rtol=tol, atol=tol)


BATCH = torch.export.Dim("batch", min=1)
LENGTH = torch.export.Dim("length", min=2, max=64)


def test_a_conv_net_with_batch_norm_and_max_pool():
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU6(), nn.MaxPool2d(2),
                        nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(1), nn.Linear(16, 5)).double()
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 1.5)
    _compare(net, (g(3, 3, 8, 8),), ({0: BATCH},), 1e-10, (g(7, 3, 8, 8, seed=4),))


def test_a_bert_encoder_with_padding_and_pooling():
    encoder = models.bert(pooling=False, num_hidden_layers=2)

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, ids, mask):
            hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * weights).sum(1) / weights.sum(1)

    ids, mask = idx(3, 7, high=50), torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    other_ids, other_mask = idx(5, 11, high=50, seed=1), torch.ones(5, 11, dtype=torch.long)
    other_mask[0, 2:] = 0
    _compare(Pooled(), (ids, mask), ({0: BATCH, 1: LENGTH}, {0: BATCH, 1: LENGTH}), 2e-5, (other_ids, other_mask))


def test_a_llama_decoder():
    lm = models.llama()

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    _compare(Logits(), (idx(2, 6, high=50),), ({0: BATCH, 1: LENGTH},), 2e-5, (idx(3, 9, high=50, seed=2),))


def test_an_op_without_a_rule_is_refused_by_name(monkeypatch):
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).double().eval()
    graph = core_graph(net, (g(2, 3),), ({0: BATCH},))
    monkeypatch.delitem(RULES, aten.tanh.default)
    with pytest.raises(ExportError, match="no tangent rule for aten.tanh.default") as refused:
        TangentInterpreter(graph, {"0.weight": g(4, 3)}).outputs(g(2, 3))
    assert "\n" not in str(refused.value)  # one line: torch.fx's "While executing ..." notes are not added to it


def test_a_rule_that_fails_is_refused_by_name_not_in_torchs_words(monkeypatch):
    """Traced by torch.export, as an exported program is: neither torch.fx nor torch.export adds to the line."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).double().eval()
    lin = LinearizedGraph(core_graph(net, (g(2, 3),), ({0: BATCH},)), {"0.weight": g(4, 3)})
    monkeypatch.setitem(RULES, aten.tanh.default, lambda out, args, kwargs, tangents: aten.mm(out, out))
    with pytest.raises(ExportError, match="tangent rule for aten.tanh.default failed") as refused:
        torch.export.export(lin, (g(2, 3),), dynamic_shapes=(({0: BATCH},),))
    cause = refused.value.__cause__
    assert isinstance(cause, RuntimeError)  # kept for a traceback, not shown
    assert str(cause).splitlines()[0] not in str(refused.value) and "\n" not in str(refused.value)


def test_parameters_without_a_tangent_give_the_plain_model():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x = g(5, 3)
    graph = core_graph(net, (x,), ({0: BATCH},))
    (primal, tangent), = TangentInterpreter(graph, {}).outputs(x)
    assert tangent is None
    torch.testing.assert_close(primal, net(x))
