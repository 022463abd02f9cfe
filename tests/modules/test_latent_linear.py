"""LatentLinear: exactness at full rank, junction storage, bias compensation, casting, state_dict."""

import pytest
import torch
from torch import nn

from retrofitter.linalg.svd import proxy_error
from retrofitter.modules.latent_linear import FACTOR_FORMS, LatentLinear, factor_form, with_form


def _linear_and_inputs(d_in=6, d_out=5, bias=True, seed=0, offset=0.0):
    torch.manual_seed(seed)
    linear = nn.Linear(d_in, d_out, bias=bias).double()
    x = torch.randn(3, 10, d_in, dtype=torch.float64) @ torch.randn(d_in, d_in, dtype=torch.float64) + offset
    rows = x.reshape(-1, d_in)
    return linear, x, rows.T @ rows / rows.shape[0], rows.mean(0)


@pytest.mark.parametrize("junction", [True, False])
@pytest.mark.parametrize("shape", [(6, 5), (5, 6)])
def test_full_rank_reproduces_linear(junction, shape):
    linear, x, moment, _ = _linear_and_inputs(*shape)
    full = min(shape)
    module = LatentLinear.from_linear(linear, moment, full, junction=junction)
    torch.testing.assert_close(module(x), linear(x), rtol=0, atol=1e-10)
    torch.testing.assert_close(module.dense_weight(), linear.weight, rtol=0, atol=1e-10)


def test_junction_storage_and_equivalence_to_plain():
    linear, x, moment, _ = _linear_and_inputs(9, 7, seed=1)
    junction = LatentLinear.from_linear(linear, moment, 3, junction=True)
    plain = LatentLinear.from_linear(linear, moment, 3, junction=False)
    weights = {name: p.numel() for name, p in junction.named_parameters() if name != "bias"}
    assert sum(weights.values()) == 3 * (9 + 7) - 9 == junction.num_weight_params()
    assert plain.num_weight_params() == 3 * 16
    torch.testing.assert_close(junction(x), plain(x), rtol=0, atol=1e-10)
    torch.testing.assert_close(junction.dense_weight(), plain.dense_weight(), rtol=0, atol=1e-10)
    assert "rank=3" in repr(junction) and "junction=True" in repr(junction)
    assert proxy_error(linear.weight, plain.up, plain.down, moment) < 1.0


def test_bias_compensation_reduces_output_error():
    linear, x, moment, mean = _linear_and_inputs(8, 6, seed=2, offset=3.0)
    without = LatentLinear.from_linear(linear, moment, 2)
    with_mean = LatentLinear.from_linear(linear, moment, 2, mean=mean)
    target = linear(x)
    error_without = (without(x) - target).pow(2).mean()
    error_with = (with_mean(x) - target).pow(2).mean()
    assert error_with < 0.9 * error_without
    # A bias-free linear layer gains a bias when compensated.
    no_bias, _, _, _ = _linear_and_inputs(8, 6, bias=False, seed=2)
    assert LatentLinear.from_linear(no_bias, moment, 2).bias is None
    assert LatentLinear.from_linear(no_bias, moment, 2, mean=mean).bias is not None


def test_dtype_cast_keeps_index_buffers_long():
    linear, x, moment, _ = _linear_and_inputs(6, 5)
    module = LatentLinear.from_linear(linear.float(), moment, 3)
    assert module.up.dtype == torch.float32
    reference = module(x.float())
    module = module.to(torch.bfloat16)
    assert module.pivot_index.dtype == torch.long and module.rest_index.dtype == torch.long
    assert module.mix.dtype == torch.bfloat16
    out = module(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.1)


def test_state_dict_round_trip_into_empty_module():
    linear, x, moment, mean = _linear_and_inputs(7, 4, seed=3)
    for junction in (True, False):
        module = LatentLinear.from_linear(linear, moment, 3, junction=junction, mean=mean)
        state = module.state_dict()
        expected = {"up", "bias"} | ({"mix", "pivot_index", "rest_index"} if junction else {"down"})
        assert set(state) == expected
        empty = LatentLinear(7, 4, 3, junction=junction, bias=True, dtype=torch.float64)
        empty.load_state_dict(state)
        torch.testing.assert_close(empty(x), module(x), rtol=0, atol=0)  # copied tensors, same forward: bitwise


def test_from_factors_and_errors():
    B = torch.randn(4, 2, dtype=torch.float64)
    A = torch.randn(2, 5, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)
    module = LatentLinear.from_factors(B, A, bias=bias, dtype=torch.float32)
    assert module.up.dtype == torch.float32
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(module(x.float()).double(), x @ (B @ A).T + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 4\]"):
        LatentLinear(5, 4, 5)
    with pytest.raises(ValueError, match="bias must have shape"):
        LatentLinear.from_factors(B, A, bias=torch.zeros(3))


# ---------------------------------------------------------------- factor forms (issue 15 item 2)


@pytest.mark.parametrize("start", FACTOR_FORMS)
@pytest.mark.parametrize("bias", [True, False])
def test_every_factor_form_gives_the_same_outputs(start, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 9, bias=bias, dtype=torch.float64)
    B, A = torch.randn(9, 4, dtype=torch.float64), torch.randn(4, 12, dtype=torch.float64)
    factored = LatentLinear.from_factors(B, A, bias=linear.bias.detach() if bias else None)
    reference = factored(x := torch.randn(5, 3, 12, dtype=torch.float64))
    module = with_form(factored, start)
    assert factor_form(module) == start
    for form in FACTOR_FORMS:
        converted = with_form(module, form)
        assert factor_form(converted) == form
        torch.testing.assert_close(converted(x), reference, rtol=1e-10, atol=1e-10)


def test_dense_to_factored_at_full_rank_is_exact_and_forms_round_trip_save_load(tmp_path):
    from retrofitter.adapters import adapter_for
    from retrofitter.checkpoint import load_retrofitted, save_retrofitted
    from tiny_models import build_tiny

    torch.manual_seed(0)
    wide = torch.nn.Linear(12, 5, dtype=torch.float64)
    x = torch.randn(4, 12, dtype=torch.float64)
    for form in ("plain", "junction"):
        torch.testing.assert_close(with_form(wide, form)(x), wide(x), rtol=1e-10, atol=1e-10)
    model = build_tiny("llama", dtype=torch.float64)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    forms = {"q": "plain", "k": "dense", "o": "junction"}
    for name, form in forms.items():
        factored = LatentLinear.from_linear(adapter.get_linear(layer, name), None, 4, preconditioner="plain")
        adapter.set_linear(layer, name, with_form(factored, form))
    model = model.float()  # saved weights are float32
    ids = torch.randint(3, 90, (1, 7))
    expected = model(ids).logits
    save_retrofitted(model, tmp_path / "m", {})
    loaded = load_retrofitted(tmp_path / "m")
    loaded_layer = adapter_for(loaded).decoder_layers(loaded)[0]
    assert {name: factor_form(adapter.get_linear(loaded_layer, name)) for name in forms} == forms
    # same float32 weights (copied into freshly allocated parameters), same forms and modules, same shapes: bitwise
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
