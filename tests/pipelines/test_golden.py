"""Today's compression reproduces the reference factors written before the single-loop refactor."""

import pytest
import torch
from safetensors.torch import load_file

import retrofitter

from golden_cases import CASES, GOLDEN_DIR, run_case

# The factors come from float32 eigen/SVD solves whose rounding differs between CPUs (SIMD width,
# BLAS kernel choice): across machines they agree to ~5e-6 in relative Frobenius norm, elementwise
# to ~1e-5. Any change of the algorithm (a rank, a metric, a bias term) moves them by >= 1e-3.
RELATIVE_TOLERANCE = 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_factors_equal_the_reference(case):
    expected = load_file(str(GOLDEN_DIR / f"{case}.safetensors"))
    actual = run_case(case, lambda m, c, t: retrofitter.compress(m, c, t, progress=False))
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].shape == tensor.shape and actual[key].dtype == tensor.dtype, key
        if not tensor.is_floating_point():
            # pivot indices: discrete choices made on float values, equal unless a near-tie in the pivoting
            # criterion falls inside the CPUs' rounding, which would also move the float factors by O(1)
            assert torch.equal(actual[key], tensor), key
            continue
        error = (actual[key].double() - tensor.double()).norm()
        scale = tensor.double().norm().clamp_min(1e-12)
        assert error <= RELATIVE_TOLERANCE * scale, f"{key}: relative error {(error / scale).item():.2e}"
