"""Today's compression reproduces the reference factors written before the single-loop refactor."""

import pytest
import torch
from safetensors.torch import load_file

import retrofitter

from golden_cases import CASES, GOLDEN_DIR, run_case


@pytest.mark.parametrize("case", sorted(CASES))
def test_factors_equal_the_reference(case):
    expected = load_file(str(GOLDEN_DIR / f"{case}.safetensors"))
    actual = run_case(case, lambda m, c, t: retrofitter.compress(m, c, t, progress=False))
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
