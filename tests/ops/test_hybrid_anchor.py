"""The linear anchor of the hybrid attention (ops.hybrid_common, ops.hybrid_anchor), float64.

Every execution with an anchor equals the naive definition (values, gradients, decode after prefill); a zero
anchor is LoLCATs' pegged mix; with alpha = 1 the mix no longer depends on which exact key is the largest
(the softmax's own normalisation, written out below without c_n); the fit's moments equal explicit loops and
the fit recovers a known line.
"""

import math

import pytest
import torch

from retrofitter.ops.hybrid_anchor import fit_anchor, hybrid_anchor_moments
from retrofitter.ops.hybrid_chunked import hybrid_attention_chunked
from retrofitter.ops.hybrid_naive import hybrid_attention_naive, hybrid_terms_naive
from retrofitter.ops.hybrid_recurrent import HybridRecurrentState, hybrid_recurrent_step

from test_hybrid_ops import F64, TOL, hedgehog, left_padding, make_problem
from test_hybrid_recall import kwargs


def random_anchor(h, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.rand(h, generator=gen, dtype=F64), torch.randn(h, generator=gen, dtype=F64)])


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("sinks,cache,linear_weight", [(0, 0, "one"), (2, 3, "one"), (1, 2, "one_minus_gamma")])
def test_chunked_with_anchor_matches_naive(kind, sinks, cache, linear_weight):
    q, k, v, w_q, w_k, theta = make_problem(n=29)
    mask = left_padding(3, 29, [0, 4, 11])
    kw = {**kwargs(w_q, w_k, theta, 4, kind, mask, linear_weight, sinks, cache), "anchor": random_anchor(4)}
    y_naive, _ = hybrid_attention_naive(q, k, v, **kw)
    y_chunked, _ = hybrid_attention_chunked(q, k, v, **kw)
    assert torch.allclose(y_chunked, y_naive, atol=TOL, rtol=0)
    pegged, _ = hybrid_attention_naive(q, k, v, **{**kw, "anchor": None})
    assert (pegged - y_naive).abs().max() > 1e-3  # the anchor changes the output


def test_chunked_gradients_with_anchor_match_naive():
    q, k, v, w_q, w_k, theta = make_problem(n=19, requires_grad=True)
    grads = []
    for run in (hybrid_attention_naive, hybrid_attention_chunked):
        kw = {**kwargs(w_q, w_k, theta, 3, "sliding", None, "one", 2, 2), "anchor": random_anchor(4)}
        y, _ = run(q, k, v, **kw)
        grads.append(torch.autograd.grad((y * torch.cos(y)).sum(), (q, k, v, w_q, w_k, theta)))
    for naive, chunked in zip(*grads):
        assert torch.allclose(chunked, naive, atol=1e-9, rtol=0)


def test_zero_anchor_is_the_pegged_mix():
    q, k, v, w_q, w_k, theta = make_problem(n=17)
    kw = kwargs(w_q, w_k, theta, 4, "terraced", left_padding(3, 17, [0, 2, 5]), "one", 1, 2)
    for run in (hybrid_attention_naive, hybrid_attention_chunked):
        plain, _ = run(q, k, v, **kw)
        zero, _ = run(q, k, v, **kw, anchor=torch.zeros(2, 4, dtype=F64))
        assert torch.allclose(zero, plain, atol=1e-14, rtol=0)  # e^{0} = 1 exactly: the same arithmetic


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("prefill_len", [0, 7, 16])
def test_decode_with_anchor_matches_naive(kind, prefill_len):
    n, window = 26, 4
    q, k, v, w_q, w_k, theta = make_problem(n=n)
    mask = left_padding(3, n, [0, 2, 10])
    anchor = random_anchor(4, seed=5)
    kw = {**kwargs(w_q, w_k, theta, window, kind, mask, sinks=2, cache=3), "anchor": anchor}
    y_naive, _ = hybrid_attention_naive(q, k, v, **kw)
    if prefill_len:
        sl = slice(0, prefill_len)
        _, state = hybrid_attention_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                            **{**kw, "key_padding_mask": mask[:, sl]}, return_state=True)
    else:
        state = HybridRecurrentState.init(3, 4, 2, 6, 10, window=window, window_kind=kind, recall=kw["recall"],
                                          dtype=F64)
    outputs = []
    for t in range(prefill_len, n):
        sl = slice(t, t + 1)
        y_t, state = hybrid_recurrent_step(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, t],
                                           feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k),
                                           gamma=torch.sigmoid(theta), anchor=anchor)
        outputs.append(y_t)
    assert torch.allclose(torch.cat(outputs, dim=2), y_naive[:, :, prefill_len:], atol=TOL, rtol=0)


def test_alpha_one_is_the_unshifted_mix():
    """alpha = 1: y = (sum_E gamma e^{s} v + e^b lam phi.phi v) / (...), with no c_n anywhere."""
    q, k, v, w_q, w_k, theta = make_problem(b=1, h=2, g=1, n=15, dh=4, f=3)
    b_row = torch.tensor([0.7, -1.3], dtype=F64)
    anchor = torch.stack([torch.ones(2, dtype=F64), b_row])
    kw = kwargs(w_q, w_k, theta, 3, "sliding", None, "one", 1, 2)
    y, _ = hybrid_attention_naive(q, k, v, **kw, anchor=anchor)
    terms = hybrid_terms_naive(q, k, v=v, **kw)
    exact = torch.sigmoid(theta).view(1, 2, 1, 1) * torch.exp(terms["logits"]) * terms["in_exact"]
    linear = torch.exp(b_row).view(1, 2, 1, 1) * terms["linear"]
    weights = exact + linear
    expected = (weights @ terms["values"]) / weights.sum(dim=-1, keepdim=True)
    assert torch.allclose(y, expected, atol=TOL, rtol=0)


def test_moments_equal_explicit_sums():
    q, k, v, w_q, w_k, theta = make_problem(b=2, h=2, g=1, n=13, dh=3, f=2)
    mask = left_padding(2, 13, [0, 3])
    kw = kwargs(w_q, w_k, theta, 3, "sliding", mask, "one_minus_gamma", 1, 2)
    moments = hybrid_anchor_moments(q, k, v, **kw)
    terms = hybrid_terms_naive(q, k, v=v, **kw)
    for head in range(2):
        gamma = torch.sigmoid(theta[head]).item()
        rows = []
        for row in range(2):
            for n in range(13):
                history = [i for i in range(13) if terms["in_linear"][row, 0, n, i]]
                if not mask[row, n] or not history:
                    continue
                exact = [i for i in range(13) if terms["in_exact"][row, 0, n, i]]
                s = lambda i: (q[row, head, n] @ k[row, 0, i]).item() / math.sqrt(3)
                c = max(s(i) for i in exact)
                linear = sum(terms["linear"][row, head, n, i].item() for i in history)
                y = math.log(sum(math.exp(s(i)) for i in history)) - c + math.log(gamma) - math.log(linear)
                rows.append((c, y))
        expected = [len(rows), sum(c for c, _ in rows), sum(y for _, y in rows), sum(c * c for c, _ in rows),
                    sum(c * y for c, y in rows)]
        assert moments[:, head].tolist() == pytest.approx(expected, rel=1e-9, abs=1e-9)


def line_moments(c, y):
    return torch.stack([torch.tensor(float(len(c)), dtype=F64), c.sum(), y.sum(), (c * c).sum(), (c * y).sum()])


def test_fit_recovers_a_line_and_clips_the_slope():
    c = torch.linspace(-2.0, 5.0, 50, dtype=F64)
    columns = [line_moments(c, 1.5 - 0.6 * c), line_moments(c, 2.0 - 3.0 * c), line_moments(c, 0.5 + 0.4 * c),
               line_moments(torch.full((4,), 2.0, dtype=F64), torch.full((4,), -1.0, dtype=F64)),
               torch.zeros(5, dtype=F64)]
    anchor = fit_anchor(torch.stack(columns, dim=1))
    alpha, b = anchor.double()
    assert alpha.tolist() == pytest.approx([0.6, 1.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert b[0].item() == pytest.approx(1.5, abs=1e-5)
    # clipped slopes: b is the best intercept for the clipped alpha (mean of y + alpha c)
    assert b[1].item() == pytest.approx(float((2.0 - 3.0 * c + c).mean()), abs=1e-5)
    assert b[2].item() == pytest.approx(float((0.5 + 0.4 * c).mean()), abs=1e-5)
    assert b[3].item() == pytest.approx(-1.0) and b[4].item() == 0.0  # constant c: alpha 0; empty: 0


def test_bad_anchor_shape_is_refused():
    q, k, v, w_q, w_k, theta = make_problem(n=9)
    with pytest.raises(ValueError, match=r"\[2, h=4\]"):
        hybrid_attention_chunked(q, k, v, **kwargs(w_q, w_k, theta, 3, "sliding"), anchor=torch.zeros(4))
