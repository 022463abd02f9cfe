import copy

import pytest
import torch

from retrofitter.modules.hybrid_attention import HybridLinearAttention

F64 = torch.float64
TOL = 1e-10


def make_layer(execution="chunked", window_kind="sliding", dtype=F64, seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = HybridLinearAttention(
        n_heads=4, n_kv_heads=2, head_dim=8, window=4, window_kind=window_kind, feature_dim=6,
        execution=execution, **kwargs,
    ).to(dtype)
    with torch.no_grad():  # move away from the symmetric init so the test is not a special case
        for p in layer.trainable_parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def make_inputs(b=2, n=17, dtype=F64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, n, 8, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(b, 2, n, 8, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(b, 2, n, 8, generator=gen, dtype=F64).to(dtype)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :5] = False
    return q, k, v, mask


@pytest.mark.parametrize("window_kind", ["sliding", "terraced"])
def test_chunked_and_naive_executions_agree(window_kind):
    q, k, v, mask = make_inputs()
    chunked = make_layer("chunked", window_kind)
    naive = make_layer("naive", window_kind)
    y_chunked, state = chunked(q, k, v, key_padding_mask=mask)
    y_naive, _ = naive(q, k, v, key_padding_mask=mask)
    assert state is None
    assert y_chunked.shape == q.shape
    assert torch.allclose(y_chunked, y_naive, atol=TOL, rtol=0)


@pytest.mark.parametrize("window_kind", ["sliding", "terraced"])
def test_prefill_then_single_token_steps_match_full_forward(window_kind):
    q, k, v, mask = make_inputs(n=15)
    layer = make_layer("chunked", window_kind, linear_weight="one_minus_gamma")
    y_full, _ = layer(q, k, v, key_padding_mask=mask)
    split = 9
    _, state = layer(q[:, :, :split], k[:, :, :split], v[:, :, :split], key_padding_mask=mask[:, :split], return_state=True)
    outputs = []
    for t in range(split, 15):
        y_t, state = layer(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state=state)
        assert y_t.shape == (2, 4, 1, 8)
        outputs.append(y_t)
    assert torch.allclose(torch.cat(outputs, dim=2), y_full[:, :, split:], atol=TOL, rtol=0)
    # Multi-token continuation from the same prefill gives the same outputs.
    _, state = layer(q[:, :, :split], k[:, :, :split], v[:, :, :split], key_padding_mask=mask[:, :split], return_state=True)
    y_cont, _ = layer(q[:, :, split:], k[:, :, split:], v[:, :, split:], state=state)
    assert torch.allclose(y_cont, y_full[:, :, split:], atol=TOL, rtol=0)


def test_decoding_from_empty_state_with_left_padding():
    q, k, v, mask = make_inputs(n=11)
    layer = make_layer("naive", "terraced")
    y_full, _ = layer(q, k, v, key_padding_mask=mask)
    y_steps, state = layer(q, k, v, key_padding_mask=mask, state=layer.init_state(2, F64))
    assert torch.allclose(y_steps, y_full, atol=TOL, rtol=0)
    assert state.num_tokens.tolist() == [11, 6]


def test_gradients_reach_all_trainable_parameters():
    layer = make_layer("chunked", "terraced")
    q, k, v, mask = make_inputs()
    y, _ = layer(q, k, v, key_padding_mask=mask)
    y.square().mean().backward()
    params = layer.trainable_parameters()
    assert len(params) == 5  # W, b of both hedgehog maps + theta
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in params)
    assert {id(p) for p in params} == {id(p) for p in layer.parameters()}


def test_init_values():
    layer = HybridLinearAttention(4, 2, 8)
    assert torch.allclose(layer.gamma, torch.full((4,), 0.0998), atol=1e-3)
    assert layer.feature_map_q.output_dim == 128
    assert layer.feature_map_q is not layer.feature_map_k


def test_bfloat16_forward_is_close_to_float32():
    q, k, v, mask = make_inputs(n=20, dtype=torch.float32)
    layer32 = make_layer("chunked", "sliding", dtype=torch.float32)
    layer16 = copy.deepcopy(layer32).to(torch.bfloat16)
    y32, _ = layer32(q, k, v, key_padding_mask=mask)
    y16, state = layer16(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_padding_mask=mask, return_state=True)
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    assert (y16.float() - y32).abs().max() < 0.05
    assert state.kv_state.dtype == torch.float32  # history sums kept in float32
    y_step, _ = layer16(q[:, :, :1].bfloat16(), k[:, :, :1].bfloat16(), v[:, :, :1].bfloat16(), state=state)
    assert y_step.dtype == torch.bfloat16 and torch.isfinite(y_step).all()


def test_bad_arguments_are_reported():
    with pytest.raises(ValueError, match="sliding.*terraced"):
        HybridLinearAttention(4, 2, 8, window_kind="dilated")
    with pytest.raises(ValueError, match="elu.*hedgehog.*t2r"):
        HybridLinearAttention(4, 2, 8, feature_map="performer")
    with pytest.raises(ValueError, match="chunked.*naive"):
        HybridLinearAttention(4, 2, 8, execution="fast")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        HybridLinearAttention(4, 3, 8)
    layer = HybridLinearAttention(4, 2, 8, window=4)
    q, k, v, _ = make_inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="k must be"):
        layer(q, k[:, :1], v)
    other = HybridLinearAttention(4, 2, 8, window=4, window_kind="terraced")
    with pytest.raises(ValueError, match="state was built"):
        layer(q[:, :, :1], k[:, :, :1], v[:, :, :1], state=other.init_state(2, torch.float32))
