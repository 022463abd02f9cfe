"""FusedProjection: exact split of fused projections (Phi-3 [q; k; v], GPT-NeoX per-head interleave)."""

import pytest
import torch
from torch import nn

from retrofitter.modules.fused_projection import FusedProjection
from retrofitter.modules.latent_linear import LatentLinear


def fused_linear(out_features=48, in_features=16, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        if bias:
            linear.bias.normal_()
    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("widths, groups", [({"q": 16, "k": 8, "v": 8}, 1), ({"q": 16, "k": 16, "v": 16}, 4)])
def test_dense_split_is_bit_identical_to_the_fused_linear(widths, groups, bias):
    linear = fused_linear(sum(widths.values()), bias=bias)
    split = FusedProjection.split(linear, widths, groups)
    x = torch.randn(3, 5, 16)
    # bitwise by construction, not by BLAS: while every part is a plain nn.Linear the forward re-assembles the
    # fused weight (a permutation back of copied rows: the same values, shape and layout) and runs one F.linear
    # with it, the very call nn.Linear makes; it never compares a small GEMM per part with columns of a big one
    assert torch.equal(split(x), linear(x))
    assert split.in_features == 16 and split.out_features == linear.out_features


def test_per_head_interleave_puts_each_part_where_gpt_neox_reads_it():
    heads, head_dim = 4, 4
    linear = fused_linear(3 * heads * head_dim)
    split = FusedProjection.split(linear, {"q": 16, "k": 16, "v": 16}, groups=heads)
    x = torch.randn(2, 16)
    fused = linear(x).view(2, heads, 3 * head_dim)  # GPT-NeoX: [b, heads, (q_h, k_h, v_h)]
    q, k, v = fused.chunk(3, dim=-1)
    torch.testing.assert_close(split.q(x).view(2, heads, head_dim), q)
    torch.testing.assert_close(split.k(x).view(2, heads, head_dim), k)
    torch.testing.assert_close(split.v(x).view(2, heads, head_dim), v)


@pytest.mark.parametrize("groups", [1, 4])
def test_compressed_or_observed_parts_run_one_by_one_with_the_same_layout(groups):
    linear = fused_linear(48).double()
    split = FusedProjection.split(linear, {"q": 16, "k": 16, "v": 16}, groups)
    x = torch.randn(3, 16, dtype=torch.float64)
    seen = []
    handle = split.k.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    torch.testing.assert_close(split(x), linear(x), rtol=1e-12, atol=1e-12)
    handle.remove()
    assert len(seen) == 1 and seen[0] is x  # hooks on a part fire: pipelines observe parts
    split.k = LatentLinear.from_linear(split.k, None, 16, preconditioner="plain")  # full rank: exact
    torch.testing.assert_close(split(x), linear(x), rtol=1e-10, atol=1e-10)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="do not add up"):
        FusedProjection.split(fused_linear(48), {"q": 16, "k": 16})
    with pytest.raises(ValueError, match="multiples of groups"):
        FusedProjection.split(fused_linear(48), {"q": 16, "k": 16, "v": 16}, groups=3)


def test_spec_keeps_the_fused_order():
    split = FusedProjection.split(fused_linear(32), {"q": 16, "k": 8, "v": 8})
    assert split.spec() == {"parts": [["q", 16], ["k", 8], ["v", 8]], "groups": 1}
