import pytest
import torch

from retrofitter.modules.feature_maps import FEATURE_MAPS, HedgehogFeatureMap, build_feature_map


def spearman(a, b):
    """Rank correlation along the last axis."""
    ra, rb = (x.argsort(-1).argsort(-1).double() for x in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


@pytest.mark.parametrize("name,expected_dim", [("hedgehog", 10), ("t2r", 5), ("elu", 8)])
def test_shapes_and_positivity(name, expected_dim):
    fmap = build_feature_map(name, n_heads=3, head_dim=8, feature_dim=5)
    x = torch.randn(2, 3, 7, 8)
    out = fmap(x)
    assert fmap.output_dim == expected_dim
    assert out.shape == (2, 3, 7, expected_dim)
    assert (out >= 0).all()


def test_hedgehog_halves_are_distributions_and_mirror_each_other():
    fmap = build_feature_map("hedgehog", 2, 4, 6)
    with torch.no_grad():
        fmap.bias.normal_()
    x = torch.randn(1, 2, 5, 4)
    out = fmap(x)
    pos, neg = out[..., :6], out[..., 6:]
    assert torch.allclose(pos.sum(-1), torch.ones(1, 2, 5))
    assert torch.allclose(neg.sum(-1), torch.ones(1, 2, 5))
    # softmax(u) and softmax(-u) rank features in opposite orders.
    assert torch.equal(pos.argmax(-1), neg.argmin(-1))


@pytest.mark.parametrize("feature_dim", [4, 6, 3])  # equal to, wider than, narrower than head_dim
def test_projection_init_is_identity_like(feature_dim):
    fmap = build_feature_map("t2r", 2, 4, feature_dim)
    expected = torch.eye(4, feature_dim).expand(2, 4, feature_dim)
    assert torch.equal(fmap.weight.detach(), expected)
    assert torch.equal(fmap.bias.detach(), torch.zeros(2, feature_dim))
    x = torch.randn(1, 2, 3, 4)
    width = min(4, feature_dim)
    assert torch.allclose(fmap(x)[..., :width], torch.relu(x[..., :width]))


def test_hedgehog_identity_init_ranks_keys_like_dot_product():
    torch.manual_seed(0)
    heads, dim, n_keys = 4, 16, 300
    q, k = torch.randn(1, heads, 8, dim), torch.randn(1, heads, n_keys, dim)
    exact = q @ k.transpose(-1, -2)  # [1, h, 8, n_keys]
    identity = HedgehogFeatureMap(heads, dim, dim)
    approx = identity(q) @ identity(k).transpose(-1, -2)
    rho = spearman(exact, approx).mean()
    assert rho > 0.8
    random_map = HedgehogFeatureMap(heads, dim, dim)
    with torch.no_grad():
        random_map.weight.normal_()
    assert rho > spearman(exact, random_map(q) @ random_map(k).transpose(-1, -2)).mean() + 0.2


def test_parameters_are_per_head_and_follow_input_dtype():
    fmap = build_feature_map("hedgehog", 3, 4, 4).to(torch.bfloat16)
    assert fmap.weight.shape == (3, 4, 4) and fmap.bias.shape == (3, 4)
    out = fmap(torch.randn(1, 3, 2, 4, dtype=torch.float32))  # ops run maps in float32 for bf16 models
    assert out.dtype == torch.float32
    assert len(list(build_feature_map("elu", 3, 4, 4).parameters())) == 0


def test_errors_name_the_options_and_shapes():
    with pytest.raises(ValueError) as info:
        build_feature_map("cosformer", 2, 4, 4)
    for name in FEATURE_MAPS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="h=2"):
        build_feature_map("hedgehog", 2, 4, 4)(torch.randn(1, 3, 5, 4))
    with pytest.raises(ValueError, match=">= 1"):
        build_feature_map("t2r", 2, 4, 0)
