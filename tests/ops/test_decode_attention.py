import pytest
import torch

from retrofitter.ops.decode_attention import split_kv_decode_attention
from retrofitter.ops.decode_attention_naive import decode_attention_naive


def _inputs(batch, rows, total, width, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, 1, rows, width, generator=generator, dtype=dtype)
    key = torch.randn(batch, 1, total, width, generator=generator, dtype=dtype)
    return query, key


@pytest.mark.parametrize("total, splits", [(64, 2), (67, 2), (67, 3), (100, 7), (5, 8), (33, 1)])
@pytest.mark.parametrize("masking", ["none", "bool", "additive"])
def test_split_equals_naive_in_float64(total, splits, masking):
    query, key = _inputs(2, 9, total, 16, torch.float64)
    value = key  # the absorbed layout: the key serves as the value
    mask = None
    if masking != "none":
        allowed = torch.ones(2, 1, 1, total, dtype=torch.bool)
        allowed[1, ..., :total // 2 + 1] = False  # left padding: whole stretches masked in row 1
        mask = allowed if masking == "bool" else torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, float("-inf"))
    got = split_kv_decode_attention(query, key, value, mask, 0.25, splits)
    expected = decode_attention_naive(query, key, value, mask, 0.25)
    # float64: sums of ≤ 100 terms of order 1
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_split_equals_naive_on_a_strided_cache_view_in_float32():
    # a static cache holds [c, k_pe] for more slots than are filled; the step reads a prefix view of it
    query, key = _inputs(1, 9, 4100, 96, torch.float32, seed=1)
    key = key[:, :, :4097]
    mask = torch.ones(1, 1, 1, 4097, dtype=torch.bool)
    got = split_kv_decode_attention(query, key, key, mask, 96 ** -0.5, 2)
    expected = decode_attention_naive(query.double(), key.double(), key.double(), mask, 96 ** -0.5)
    # float32 accumulation over 4097 keys of weights summing to 1, values of order 1
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
