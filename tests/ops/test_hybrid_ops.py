"""The three executions of the LoLCATs hybrid attention agree (float64), gradients included.

Feature maps here are plain closures over tensors (hedgehog-shaped), so these tests depend on
nothing but ``retrofitter.ops``.
"""

import math

import pytest
import torch

from retrofitter.ops.hybrid_chunked import hybrid_attention_chunked
from retrofitter.ops.hybrid_common import WINDOW_KINDS, RecallSettings, get_window_kind
from retrofitter.ops.hybrid_naive import hybrid_attention_naive
from retrofitter.ops.hybrid_recurrent import HybridRecurrentState, hybrid_recurrent_step, prefill_state

F64 = torch.float64
TOL = 1e-10


def hedgehog(weight):
    """phi(x) = [softmax(xW), softmax(-xW)] with W [h, dh, f]."""

    def phi(x):
        u = torch.einsum("bhnd,hdf->bhnf", x, weight.to(x.dtype))
        return torch.cat([u.softmax(-1), (-u).softmax(-1)], dim=-1)

    return phi


def make_problem(b=3, h=4, g=2, n=21, dh=6, f=5, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64).requires_grad_(requires_grad)
    q, k, v = t(b, h, n, dh), t(b, g, n, dh), t(b, g, n, dh)
    w_q, w_k, theta = t(h, dh, f), t(h, dh, f), t(h)
    return q, k, v, w_q, w_k, theta


def left_padding(b, n, pads):
    mask = torch.ones(b, n, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, :pad] = False
    return mask


def op_kwargs(w_q, w_k, theta, window, kind, mask=None, linear_weight="one", sinks=0, cache=0):
    return dict(
        feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k), gamma=torch.sigmoid(theta),
        window=window, window_kind=kind, key_padding_mask=mask, linear_weight=linear_weight,
        recall=RecallSettings(sinks=sinks, sparse_cache=cache),
    )


def loop_oracle(q, k, v, w_q, w_k, theta, window, kind, mask, linear_weight):
    """Scalar loops over the spec's sets, independent of hybrid_common's window functions."""
    b, h, n, dh = q.shape
    groups = h // k.shape[1]
    phi_q, phi_k = hedgehog(w_q)(q), hedgehog(w_k)(k.repeat_interleave(groups, 1))
    y = torch.zeros_like(q)
    for row in range(b):
        real = [i for i in range(n) if mask[row, i]]
        for head in range(h):
            gamma = torch.sigmoid(theta[head])
            lam = 1.0 if linear_weight == "one" else 1.0 - gamma
            kv = head // groups
            for rn, pos_n in enumerate(real):
                if kind == "sliding":
                    win = [ri for ri in range(rn + 1) if ri >= rn - window + 1]
                else:
                    win = [ri for ri in range(rn + 1) if ri // window in (rn // window - 1, rn // window)]
                lin = [ri for ri in range(rn + 1) if ri not in win]
                logits = [q[row, head, pos_n] @ k[row, kv, real[ri]] / math.sqrt(dh) for ri in win]
                c = max(logits)
                num = sum(gamma * torch.exp(s - c) * v[row, kv, real[ri]] for s, ri in zip(logits, win))
                den = sum(gamma * torch.exp(s - c) for s in logits)
                for ri in lin:
                    a = lam * (phi_q[row, head, pos_n] @ phi_k[row, head, real[ri]])
                    num, den = num + a * v[row, kv, real[ri]], den + a
                y[row, head, pos_n] = num / den
    return y


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("linear_weight", ["one", "one_minus_gamma"])
def test_naive_matches_scalar_loop_oracle(kind, linear_weight):
    q, k, v, w_q, w_k, theta = make_problem(b=2, h=2, g=1, n=11, dh=3, f=2)
    mask = left_padding(2, 11, [0, 4])
    y, _ = hybrid_attention_naive(q, k, v, **op_kwargs(w_q, w_k, theta, 3, kind, mask, linear_weight))
    expected = loop_oracle(q, k, v, w_q, w_k, theta, 3, kind, mask, linear_weight)
    assert torch.allclose(y, expected, atol=TOL, rtol=0)
    assert torch.all(y[1, :, :4] == 0)


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("pads", [None, [0, 3, 13]])
@pytest.mark.parametrize("window,n,sinks,cache", [(4, 21, 0, 0), (5, 20, 0, 0), (8, 5, 0, 0), (1, 6, 0, 0),
                                                  (4, 29, 2, 3), (5, 26, 0, 4), (3, 8, 4, 2), (1, 9, 1, 1),
                                                  (4, 30, 3, 0)])
def test_chunked_matches_naive(kind, heads, pads, window, n, sinks, cache):
    """With and without sinks / a sparse cache (the rule: test_hybrid_recall.py)."""
    h, g = heads
    q, k, v, w_q, w_k, theta = make_problem(h=h, g=g, n=n)
    mask = left_padding(3, n, [min(p, n - 1) for p in pads]) if pads else None
    kw = op_kwargs(w_q, w_k, theta, window, kind, mask, "one_minus_gamma" if window == 5 else "one", sinks, cache)
    y_naive, _ = hybrid_attention_naive(q, k, v, **kw)
    y_chunked, _ = hybrid_attention_chunked(q, k, v, **kw)
    assert torch.isfinite(y_chunked).all()
    assert torch.allclose(y_chunked, y_naive, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("n,window,sinks,cache", [(14, 4, 0, 0), (19, 3, 2, 2)])
def test_chunked_gradients_match_naive(kind, n, window, sinks, cache):
    inputs = make_problem(b=2, h=4, g=2, n=n, requires_grad=True)
    mask = left_padding(2, n, [0, 5])
    grads = {}
    for name, run in (("naive", hybrid_attention_naive), ("chunked", hybrid_attention_chunked)):
        q, k, v, w_q, w_k, theta = inputs
        y, _ = run(q, k, v, **op_kwargs(w_q, w_k, theta, window, kind, mask, sinks=sinks, cache=cache))
        target = torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)
        grads[name] = torch.autograd.grad((y * target).sum(), inputs)
    for i, (gn, gc) in enumerate(zip(grads["naive"], grads["chunked"])):
        assert gn.abs().max() > 0, f"input {i} got no gradient"
        assert torch.allclose(gc, gn, atol=TOL, rtol=0), f"gradient of input {i} differs"


def decode(state, q, k, v, mask, w_q, w_k, theta, start):
    outputs = []
    for t in range(start, q.shape[2]):
        sl = slice(t, t + 1)
        valid = mask[:, t] if mask is not None else None
        y_t, state = hybrid_recurrent_step(
            state, q[:, :, sl], k[:, :, sl], v[:, :, sl], valid,
            feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k), gamma=torch.sigmoid(theta),
        )
        outputs.append(y_t)
    return torch.cat(outputs, dim=2), state


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("prefill_len", [0, 1, 7, 8])
def test_decode_after_prefill_matches_naive(kind, prefill_len):
    n, window = 20, 4
    q, k, v, w_q, w_k, theta = make_problem(n=n)
    mask = left_padding(3, n, [0, 2, 9])  # row 2 is still padding after a 7/8-token prefill
    kw = op_kwargs(w_q, w_k, theta, window, kind, mask)
    y_naive, _ = hybrid_attention_naive(q, k, v, **kw)
    sl = slice(0, prefill_len)
    if prefill_len == 0:
        state = HybridRecurrentState.init(3, 4, 2, 6, 10, window=window, window_kind=kind, dtype=F64)
    else:
        y_pre, state = hybrid_attention_chunked(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], **{**kw, "key_padding_mask": mask[:, sl]}, return_state=True
        )
        assert torch.allclose(y_pre, y_naive[:, :, sl], atol=TOL, rtol=0)
    y_dec, state = decode(state, q, k, v, mask, w_q, w_k, theta, prefill_len)
    assert torch.allclose(y_dec, y_naive[:, :, prefill_len:], atol=TOL, rtol=0)
    assert state.num_tokens.tolist() == mask.sum(-1).tolist()


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
def test_prefill_state_equals_stepped_state(kind):
    q, k, v, w_q, w_k, theta = make_problem(n=13)
    mask = left_padding(3, 13, [0, 1, 6])
    kw = dict(feature_map_k=hedgehog(w_k), n_heads=4, window=3, window_kind=kind)
    from_prefill = prefill_state(k, v, mask, **kw)
    empty = HybridRecurrentState.init(3, 4, 2, 6, 10, window=3, window_kind=kind, dtype=F64)
    _, from_steps = decode(empty, q, k, v, mask, w_q, w_k, theta, 0)
    for name, tensor in from_steps.tensors().items():
        other = from_prefill.tensors()[name]
        assert tensor.shape == other.shape and tensor.dtype == other.dtype, name
        assert torch.allclose(tensor.double(), other.double(), atol=TOL, rtol=0), name


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
def test_state_size_independent_of_context_length(kind):
    sizes = []
    for n in (100, 1000):
        q, k, v, w_q, w_k, theta = make_problem(b=1, h=2, g=1, n=n + 1, dh=4, f=3)
        _, state = hybrid_attention_chunked(
            q[:, :, :n], k[:, :, :n], v[:, :, :n], **op_kwargs(w_q, w_k, theta, 8, kind), return_state=True
        )
        _, state = decode(state, q, k, v, None, w_q, w_k, theta, n)
        sizes.append(state.nbytes())
        assert int(state.num_tokens) == n + 1
    assert sizes[0] == sizes[1]


def test_padding_does_not_change_real_outputs_terraced():
    # Tiles count real tokens, so a left-padded row computes what the unpadded row computes.
    q, k, v, w_q, w_k, theta = make_problem(b=1, n=15)
    pad = 3
    padded = [torch.cat([torch.randn(*x.shape[:2], pad, x.shape[3], dtype=F64), x], dim=2) for x in (q, k, v)]
    mask = left_padding(1, 15 + pad, [pad])
    y_ref, _ = hybrid_attention_chunked(q, k, v, **op_kwargs(w_q, w_k, theta, 4, "terraced"))
    y_pad, _ = hybrid_attention_chunked(*padded, **op_kwargs(w_q, w_k, theta, 4, "terraced", mask))
    assert torch.allclose(y_pad[:, :, pad:], y_ref, atol=TOL, rtol=0)
    assert torch.all(y_pad[:, :, :pad] == 0)


def test_window_kinds_differ_and_history_matters():
    q, k, v, w_q, w_k, theta = make_problem(n=16)
    y_slide, _ = hybrid_attention_chunked(q, k, v, **op_kwargs(w_q, w_k, theta, 4, "sliding"))
    y_terr, _ = hybrid_attention_chunked(q, k, v, **op_kwargs(w_q, w_k, theta, 4, "terraced"))
    assert (y_slide - y_terr).abs().max() > 1e-3
    v_changed = v.clone()
    v_changed[:, :, 0] += 1.0  # far outside the last query's window: only the linear state sees it
    y_changed, _ = hybrid_attention_chunked(q, k, v_changed, **op_kwargs(w_q, w_k, theta, 4, "sliding"))
    assert (y_changed[:, :, -1] - y_slide[:, :, -1]).abs().max() > 1e-4
    assert (y_changed[:, :, 1:4] - y_slide[:, :, 1:4]).abs().max() > 1e-4  # key 0 still in those windows


@pytest.mark.parametrize("kind", sorted(WINDOW_KINDS))
@pytest.mark.parametrize("window", [1, 3, 4])
def test_window_kind_properties_the_executions_rely_on(kind, window):
    rule = get_window_kind(kind)
    pos = torch.arange(6 * window)
    inside = rule.contains(pos[:, None], pos[None, :], window)  # [query, key]
    assert inside.diagonal().all()
    assert not torch.triu(inside, diagonal=1).any()  # causal
    # Monotone: once a key left the window it never returns.
    left = (~inside) & (pos[None, :] <= pos[:, None])
    assert not (left[:-1] & inside[1:]).any()
    # Chunked premise: window within chunks j-1, j; the ring buffer covers it.
    chunk_q, chunk_k = pos[:, None] // window, pos[None, :] // window
    assert not (inside & (chunk_k < chunk_q - 1)).any()
    assert inside.sum(-1).max() <= rule.buffer_size(window)
    assert not rule.contains(torch.tensor(0), torch.tensor(-1), window)  # empty slots are never in
    # The recurrent step only looks at eviction_slots: every key leaving at step L must be there.
    size = rule.buffer_size(window)
    candidates = rule.eviction_slots(pos, window)  # [L, e]
    for step in range(1, len(pos)):
        leaving = (inside[step - 1] & ~inside[step]).nonzero().flatten()
        assert set((leaving % size).tolist()) <= set(candidates[step].tolist()), (kind, step)


def test_bad_names_list_the_options():
    q, k, v, w_q, w_k, theta = make_problem(n=4)
    with pytest.raises(ValueError, match="sliding.*terraced"):
        hybrid_attention_chunked(q, k, v, **op_kwargs(w_q, w_k, theta, 2, "diagonal"))
    with pytest.raises(ValueError, match="one_minus_gamma"):
        hybrid_attention_naive(q, k, v, **op_kwargs(w_q, w_k, theta, 2, "sliding", linear_weight="half"))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        hybrid_attention_chunked(q[:, :3], k, v, **op_kwargs(w_q[:3], w_k[:3], theta[:3], 2, "sliding"))
    with pytest.raises(ValueError, match="window must be >= 1"):
        hybrid_attention_chunked(q, k, v, **op_kwargs(w_q, w_k, theta, 0, "sliding"))


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
def test_step_leaves_its_input_state_intact(kind):
    """Steps with and without evictions (terraced: only at tile starts) never write into an older state."""
    q, k, v, w_q, w_k, theta = make_problem(n=12)
    mask = left_padding(3, 12, [0, 1, 5])
    state = HybridRecurrentState.init(3, 4, 2, 6, 10, window=4, window_kind=kind, dtype=F64)
    snapshots = []
    for t in range(12):
        snapshots.append((state, {name: tensor.clone() for name, tensor in state.tensors().items()}))
        _, state = hybrid_recurrent_step(
            state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], mask[:, t],
            feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k), gamma=torch.sigmoid(theta),
        )
    for old, saved in snapshots:
        for name, tensor in old.tensors().items():
            assert torch.equal(tensor, saved[name]), name
