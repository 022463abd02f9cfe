"""ops.matvec: the multiply-and-sum form of a linear map equals F.linear (float64), and ReductionMatvec routes
exactly the calls it names, only while torch.compile traces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from retrofitter.ops import matvec as matvec_module
from retrofitter.ops.matvec import ReductionMatvec, is_plain_float, matvec_reduction, plain_float_linear


@pytest.mark.parametrize("shape", [(7,), (1, 7), (1, 1, 7), (3, 7), (2, 1, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reduction_equals_linear_in_float64(shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    weight = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    bias = torch.randn(5, generator=generator, dtype=torch.float64) if with_bias else None
    out = matvec_reduction(x, weight, bias)
    assert out.shape == (*shape[:-1], 5)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-13, atol=1e-13)


def _traced_graph(fn, *inputs):
    """The FX graph dynamo traces for ``fn(*inputs)`` and the traced function's result."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    return graphs[0], out


def _calls_linear(gm) -> bool:
    return any(node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear) for node in gm.graph.nodes)


@pytest.mark.parametrize("rows, max_rows, routed", [(1, 1, True), (2, 1, False), (2, 2, True), (4, 2, False)])
def test_mode_routes_traced_calls_of_at_most_max_rows(rows, max_rows, routed):
    linear = nn.Linear(7, 5).double()
    x = torch.randn(rows, 1, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def fn(inputs):
        with ReductionMatvec(max_rows):
            return linear(inputs)

    gm, out = _traced_graph(fn, x)
    assert _calls_linear(gm) is not routed
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-13, atol=1e-13)


def test_mode_leaves_eager_calls_alone(monkeypatch):
    linear = nn.Linear(7, 5)
    x = torch.randn(1, 7, generator=torch.Generator().manual_seed(2))
    routed = []
    monkeypatch.setattr(matvec_module, "matvec_reduction", lambda *args: routed.append(args) or matvec_reduction(*args))
    with ReductionMatvec(1):
        eager = linear(x)
    assert routed == []  # not traced: F.linear itself ran
    # float32 products of 7 terms of order 1: rounding below 7 · 2⁻²⁴ of Σ|x_k W_jk|
    torch.testing.assert_close(eager, F.linear(x, linear.weight, linear.bias), rtol=1e-6, atol=1e-6)


def test_mode_refuses_zero_rows():
    with pytest.raises(ValueError, match="max_rows >= 1"):
        ReductionMatvec(0)


def test_plain_float_weights_only():
    linear = nn.Linear(7, 5)
    assert is_plain_float(linear.weight) and is_plain_float(torch.zeros(3)) and plain_float_linear(linear)
    assert not is_plain_float(torch.zeros(3, dtype=torch.int8))
    assert not plain_float_linear(nn.Embedding(4, 3)) and not plain_float_linear(type("Wrapped", (nn.Linear,), {})(7, 5))
