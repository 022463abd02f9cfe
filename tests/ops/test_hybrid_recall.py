"""Sinks and the sparse cache of the hybrid attention: every execution equals the definition (float64).

(Chunked = naive, values and gradients, with sinks and a sparse cache: test_hybrid_ops.py.)

The oracle below recomputes the rule of ``ops.hybrid_common`` with scalar loops over real-token
indices (windows written out, recall errors from explicit sums, the cache by sorting), so it shares
nothing with the code under test but the feature map.
"""

import math

import pytest
import torch

from retrofitter.ops.hybrid_chunked import hybrid_attention_chunked
from retrofitter.ops.hybrid_common import RecallSettings, outranks, select_top
from retrofitter.ops.hybrid_naive import hybrid_attention_naive
from retrofitter.ops.hybrid_recurrent import HybridRecurrentState, hybrid_recurrent_step, prefill_state
from retrofitter.ops.hybrid_state import recall_scores

from test_hybrid_ops import F64, TOL, hedgehog, left_padding, make_problem


def window_of(kind, window, rn):
    if kind == "sliding":
        return [ri for ri in range(rn + 1) if ri >= rn - window + 1]
    return [ri for ri in range(rn + 1) if ri // window in (rn // window - 1, rn // window)]


def oracle(q, k, v, w_q, w_k, theta, window, kind, mask, linear_weight, sinks, cache):
    b, h, n, dh = q.shape
    groups = h // k.shape[1]
    phi_q, phi_k = hedgehog(w_q)(q), hedgehog(w_k)(k.repeat_interleave(groups, 1))
    y = torch.zeros_like(q)
    for row in range(b):
        real = [i for i in range(n) if mask is None or mask[row, i]]
        # Recall error per kv head and real index: sum over the group's heads of |v - S^T phi / z^T phi|^2.
        errors = {}
        for kv in range(k.shape[1]):
            for ri, pos in enumerate(real):
                total = 0.0
                for head in range(kv * groups, (kv + 1) * groups):
                    num, den = torch.zeros(dh, dtype=F64), torch.zeros((), dtype=F64)
                    for rj in range(sinks, ri):
                        a = phi_k[row, head, pos] @ phi_k[row, head, real[rj]]
                        num, den = num + a * v[row, kv, real[rj]], den + a
                    pred = num / den if den > 0 else torch.zeros(dh, dtype=F64)
                    total = total + ((v[row, kv, pos] - pred) ** 2).sum()
                errors[kv, ri] = float(total)
        for head in range(h):
            gamma = torch.sigmoid(theta[head])
            lam = {"one": 1.0, "one_minus_gamma": 1.0 - gamma, "zero": 0.0}[linear_weight]
            kv = head // groups
            for rn, pos_n in enumerate(real):
                win = window_of(kind, window, rn)
                gone = [ri for ri in range(sinks, rn + 1) if ri not in win]  # left the window, not a sink
                cached = sorted(gone, key=lambda ri: (errors[kv, ri], ri), reverse=True)[:cache]
                exact = sorted(set(win) | set(range(min(sinks, rn + 1))) | set(cached))
                logits = [q[row, head, pos_n] @ k[row, kv, real[ri]] / math.sqrt(dh) for ri in exact]
                c = max(logits)
                num = sum(gamma * torch.exp(s - c) * v[row, kv, real[ri]] for s, ri in zip(logits, exact))
                den = sum(gamma * torch.exp(s - c) for s in logits)
                for ri in range(rn + 1):
                    if ri not in exact:
                        a = lam * (phi_q[row, head, pos_n] @ phi_k[row, head, real[ri]])
                        num, den = num + a * v[row, kv, real[ri]], den + a
                y[row, head, pos_n] = num / den
    return y


def kwargs(w_q, w_k, theta, window, kind, mask=None, linear_weight="one", sinks=0, cache=0):
    return dict(feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k), gamma=torch.sigmoid(theta),
                window=window, window_kind=kind, key_padding_mask=mask, linear_weight=linear_weight,
                recall=RecallSettings(sinks=sinks, sparse_cache=cache))


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("sinks,cache,linear_weight", [(2, 0, "one"), (0, 3, "one"), (2, 3, "one_minus_gamma"),
                                                       (1, 2, "zero")])
def test_naive_matches_scalar_oracle(kind, sinks, cache, linear_weight):
    q, k, v, w_q, w_k, theta = make_problem(b=2, h=4, g=2, n=14, dh=3, f=2)
    mask = left_padding(2, 14, [0, 3])
    kw = kwargs(w_q, w_k, theta, 3, kind, mask, linear_weight, sinks, cache)
    y, _ = hybrid_attention_naive(q, k, v, **kw)
    expected = oracle(q, k, v, w_q, w_k, theta, 3, kind, mask, linear_weight, sinks, cache)
    assert torch.allclose(y, expected, atol=TOL, rtol=0)
    plain, _ = hybrid_attention_naive(q, k, v, **kwargs(w_q, w_k, theta, 3, kind, mask, linear_weight))
    assert (y - plain).abs().max() > 1e-4  # the recall terms change the output


def test_recall_scores_match_oracle_sums():
    q, k, v, w_q, w_k, theta = make_problem(b=2, h=4, g=2, n=37, dh=3, f=2)
    mask = left_padding(2, 37, [0, 5])
    got = recall_scores(k, v, mask, feature_map_k=hedgehog(w_k), n_heads=4, sinks=2, chunk=8)
    phi = hedgehog(w_k)(k.repeat_interleave(2, 1))
    for row, pad in enumerate([0, 5]):
        for kv in range(2):
            for ri in range(37 - pad):
                total = 0.0
                for head in (2 * kv, 2 * kv + 1):
                    rows = range(2 + pad, pad + ri)  # S_{<i}: the non-sink keys before i (sinks = 2)
                    a = torch.stack([phi[row, head, pad + ri] @ phi[row, head, j] for j in rows]) if ri > 2 else None
                    pred = (a @ v[row, kv, list(rows)]) / a.sum() if a is not None else 0.0
                    total += float(((v[row, kv, pad + ri] - pred) ** 2).sum())
                assert got[row, kv, pad + ri].item() == pytest.approx(total, rel=1e-10, abs=1e-12)
    assert torch.all(got[1, :, :5] == 0)


def test_select_top_is_the_pairwise_rank():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (3, 2, 9), generator=gen).double()  # many ties: positions break them
    positions = torch.randperm(9, generator=gen).expand(3, 2, 9)
    eligible = torch.rand(3, 2, 9, generator=gen) > 0.3
    for size in (0, 1, 3, 9):
        keep = select_top(scores, positions, eligible, size)
        ahead = outranks(scores[..., :, None], positions[..., :, None], scores[..., None, :], positions[..., None, :])
        count = (eligible[..., :, None] & ahead).sum(dim=-2)
        # Bool masks on both sides (scores are small integers, exact in float64): compare them as lists.
        assert keep.dtype == torch.bool and keep.tolist() == (eligible & (count < size)).tolist()


def decode(state, q, k, v, mask, w_q, w_k, theta, start, linear_weight="one"):
    outputs = []
    for t in range(start, q.shape[2]):
        sl = slice(t, t + 1)
        y_t, state = hybrid_recurrent_step(
            state, q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, t] if mask is not None else None,
            feature_map_q=hedgehog(w_q), feature_map_k=hedgehog(w_k), gamma=torch.sigmoid(theta),
            linear_weight=linear_weight,
        )
        outputs.append(y_t)
    return torch.cat(outputs, dim=2), state


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("prefill_len", [0, 1, 9, 16])
@pytest.mark.parametrize("sinks,cache,linear_weight", [(2, 3, "one"), (0, 2, "one"), (3, 0, "one"), (2, 3, "zero"),
                                                       (3, 0, "zero")])
def test_decode_after_prefill_matches_naive(kind, prefill_len, sinks, cache, linear_weight):
    n, window = 30, 4
    q, k, v, w_q, w_k, theta = make_problem(n=n)
    mask = left_padding(3, n, [0, 2, 12])  # row 2 is still padding after a 9-token prefill
    kw = kwargs(w_q, w_k, theta, window, kind, mask, linear_weight=linear_weight, sinks=sinks, cache=cache)
    y_naive, _ = hybrid_attention_naive(q, k, v, **kw)
    recall = RecallSettings(sinks=sinks, sparse_cache=cache)
    if prefill_len == 0:
        state = HybridRecurrentState.init(3, 4, 2, 6, 10, window=window, window_kind=kind, recall=recall, dtype=F64,
                                          linear_state=linear_weight != "zero")
    else:
        sl = slice(0, prefill_len)
        y_pre, state = hybrid_attention_chunked(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                **{**kw, "key_padding_mask": mask[:, sl]}, return_state=True)
        assert torch.allclose(y_pre, y_naive[:, :, sl], atol=TOL, rtol=0)
    y_dec, state = decode(state, q, k, v, mask, w_q, w_k, theta, prefill_len, linear_weight)
    assert torch.allclose(y_dec, y_naive[:, :, prefill_len:], atol=TOL, rtol=0)
    assert state.num_tokens.tolist() == mask.sum(-1).tolist()
    assert state.kv_state.shape[2] == (0 if linear_weight == "zero" else 10)  # no S, z without a linear part
    if cache:
        assert (state.sparse_positions >= 0).all()  # the cache is full: 30 tokens, window 4


def sorted_sparse(state):
    order = torch.argsort(state.sparse_positions, dim=-1)
    pick = lambda t: t.gather(2, order[..., None].expand_as(t) if t.dim() == 4 else order)
    return {name: pick(getattr(state, name)) for name in ("sparse_keys", "sparse_values", "sparse_scores",
                                                          "sparse_positions")}


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
@pytest.mark.parametrize("linear_weight", ["one", "zero"])
def test_prefill_state_equals_stepped_state(kind, linear_weight):
    q, k, v, w_q, w_k, theta = make_problem(n=23)
    mask = left_padding(3, 23, [0, 1, 9])
    recall = RecallSettings(sinks=2, sparse_cache=3)
    linear = linear_weight != "zero"
    from_prefill = prefill_state(k, v, mask, feature_map_k=hedgehog(w_k), n_heads=4, window=3, window_kind=kind,
                                 recall=recall, linear_state=linear)
    empty = HybridRecurrentState.init(3, 4, 2, 6, 10, window=3, window_kind=kind, recall=recall, dtype=F64,
                                      linear_state=linear)
    _, from_steps = decode(empty, q, k, v, mask, w_q, w_k, theta, 0, linear_weight)
    sparse_steps, sparse_prefill = sorted_sparse(from_steps), sorted_sparse(from_prefill)
    for name, tensor in from_steps.tensors().items():
        other = from_prefill.tensors()[name]
        if name in sparse_steps:  # slot order is free: compare sorted by position
            tensor, other = sparse_steps[name], sparse_prefill[name]
        assert tensor.shape == other.shape and tensor.dtype == other.dtype, name
        assert torch.allclose(tensor.double(), other.double(), atol=TOL, rtol=0), name


@pytest.mark.parametrize("kind", ["sliding", "terraced"])
def test_state_is_bounded(kind):
    sizes = []
    recall = RecallSettings(sinks=4, sparse_cache=5)
    for n in (60, 400):
        q, k, v, w_q, w_k, theta = make_problem(b=1, h=2, g=1, n=n + 1, dh=4, f=3)
        kw = kwargs(w_q, w_k, theta, 8, kind, sinks=4, cache=5)
        _, state = hybrid_attention_chunked(q[:, :, :n], k[:, :, :n], v[:, :, :n], **kw, return_state=True)
        _, state = decode(state, q, k, v, None, w_q, w_k, theta, n)
        sizes.append(state.nbytes())
    empty = HybridRecurrentState.init(1, 2, 1, 4, 6, window=8, window_kind=kind, recall=recall, dtype=F64)
    assert sizes[0] == sizes[1] == empty.nbytes()


def test_state_without_linear_part_is_refused_by_a_linear_step():
    q, k, v, w_q, w_k, theta = make_problem(n=3)
    empty = HybridRecurrentState.init(3, 4, 2, 6, 10, window=3, recall=RecallSettings(sinks=1), dtype=F64,
                                      linear_state=False)
    assert empty.kv_state.shape == (3, 4, 0, 6) and empty.k_state.shape == (3, 4, 0)
    with pytest.raises(ValueError, match="without a linear part"):
        decode(empty, q, k, v, None, w_q, w_k, theta, 0, "one")


def test_zero_linear_weight_is_window_plus_sinks_softmax():
    """swa-sinks: no linear part, so the output is a plain softmax over the window and the sinks."""
    q, k, v, w_q, w_k, theta = make_problem(b=1, h=2, g=1, n=12, dh=4, f=3)
    y, _ = hybrid_attention_chunked(q, k, v, **kwargs(w_q, w_k, theta, 3, "sliding", linear_weight="zero", sinks=2))
    pos = torch.arange(12)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - 3) | (pos[None, :] < 2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 2, 12, 4), v.expand(1, 2, 12, 4),
                                                                attn_mask=allowed)
    assert torch.allclose(y, expected, atol=TOL, rtol=0)
