"""int8 quantization (torchao) of nn.Linear weights and LatentLinear factors: wiring, error bounds, bytes, refusals.

Bounds used here:
* per element, a symmetric per-row int8 weight is within half a step of the float one:
  |Ŵ_nk − W_nk| ≤ max_k |W_nk| / 255 (step = max_k |W_nk| / 127.5); we allow /254;
* a quantized LatentLinear on random factors: relative output error ‖ŷ − y‖ / ‖y‖ < 2e-2 (observed
  0.7–1.2 %, both schemes: about the int8 rounding of two factors);
* a whole tiny model (``strong_tiny``: decoder weights ×8, so two layers amplify the rounding): relative
  logit error < 0.1 (observed 2–5 %), original and compressed.
"""

import copy

import pytest
import torch
from torch import nn

from retrofitter.checkpoint import save_retrofitted
from retrofitter.config import CompressConfig
from retrofitter.eval.accounting import stored_bytes
from retrofitter.modules.latent_attention import LatentAttention
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.modules.quantize import QUANTIZE_SCHEMES, check_scheme, quantize_model, quantized_scheme
from retrofitter.pipelines.compress import compress_model
from tiny_models import TINY_VOCAB, strong_tiny

SCHEMES = sorted(QUANTIZE_SCHEMES)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _is_int8(tensor) -> bool:
    return hasattr(tensor, "qdata") and tensor.qdata.dtype == torch.int8


def _random_latent(junction: bool, pivots_lead: bool, d_in=24, d_out=20, rank=6) -> LatentLinear:
    torch.manual_seed(0)
    module = LatentLinear(d_in, d_out, rank, junction=junction)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        if junction and not pivots_lead:
            perm = torch.randperm(d_in)
            module.pivot_index.copy_(perm[:rank])
            module.rest_index.copy_(perm[rank:])
            module.refresh_layout()
    assert module.pivots_lead() == (junction and pivots_lead)
    return module


LAYOUTS = [(True, True), (True, False), (False, False)]  # junction with slices / with gathers, plain


@pytest.mark.parametrize("junction, pivots_lead", LAYOUTS)
def test_int8_weight_latent_linear_computes_with_its_rounded_factors(junction, pivots_lead):
    module = _random_latent(junction, pivots_lead)
    reference = copy.deepcopy(module)
    quantize_model(module, "int8-weight")
    assert list(module.state_dict()) == list(reference.state_dict())  # keys and order unchanged
    rounded = copy.deepcopy(reference)
    for name in ("up", "mix" if junction else "down"):
        weight, original = getattr(module, name), getattr(reference, name).detach()
        assert _is_int8(weight), name
        dequantized = weight.dequantize()
        half_step = original.abs().amax(dim=1, keepdim=True) / 254
        assert ((dequantized - original).abs() <= half_step).all(), name
        setattr(rounded, name, nn.Parameter(dequantized))
    assert module.bias is not None and not _is_int8(module.bias)
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        out, exact = module(x), rounded(x)
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
        assert 0 < _relative(out, reference(x)) < 2e-2


@pytest.mark.parametrize("junction, pivots_lead", LAYOUTS)
def test_int8_dynamic_latent_linear_error_is_bounded(junction, pivots_lead):
    module = _random_latent(junction, pivots_lead)
    reference = copy.deepcopy(module)
    quantize_model(module, "int8-dynamic")
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        assert 0 < _relative(module(x), reference(x)) < 2e-2


def _calibration():
    return torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def models():
    """Float models: llama and phi3 (fused projections) originals, llama asvd-rootcov 0.3, OPT latentllm 0.3
    (absorbed LatentAttention)."""
    config = CompressConfig(ratio=0.3, batch_size=4)
    return {
        "llama": strong_tiny("llama"),
        "phi3": strong_tiny("phi3"),
        "llama-compressed": compress_model(strong_tiny("llama"), config, _calibration(), progress=False)[0],
        "opt-latentllm": compress_model(strong_tiny("opt"), CompressConfig(method="latentllm", ratio=0.3, batch_size=4),
                                        _calibration(), progress=False)[0],
    }


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", ["llama", "phi3", "llama-compressed", "opt-latentllm"])
def test_quantized_model_runs_close_to_float(models, name, scheme):
    model = models[name]
    quantized = quantize_model(copy.deepcopy(model), scheme)
    ids = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference, logits = model(ids).logits, quantized(ids).logits
        assert 0 < _relative(logits, reference) < 0.1
        assert quantized.generate(ids[:, :8], max_new_tokens=3, do_sample=False).shape == (2, 11)
    assert quantized_scheme(quantized) == scheme and quantized_scheme(model) is None
    assert list(quantized.state_dict()) == list(model.state_dict())
    head, embeddings = quantized.get_output_embeddings(), quantized.get_input_embeddings()
    assert not _is_int8(head.weight) and not _is_int8(embeddings.weight)
    latent = [m for m in quantized.modules() if isinstance(m, LatentLinear)]
    linears = [m for m in quantized.modules() if isinstance(m, nn.Linear) and m is not head]
    keep = {id(t) for m in quantized.modules() if isinstance(m, LatentAttention) for t in m.directly_read_weights()}
    assert all(_is_int8(m.weight) for m in linears if id(m.weight) not in keep)
    assert all(_is_int8(m.mix) for m in latent if m.mix.shape[1] > 1)
    assert all(_is_int8(m.up) or id(m.up) in keep or m.up.shape[1] == 1 for m in latent)
    if name == "opt-latentllm":  # absorbed attention reads B_k, B_v through views: they stay float
        assert keep and not any(_is_int8(t) for m in quantized.modules() if isinstance(m, LatentAttention)
                                for t in m.directly_read_weights())


def _component_bytes(tensor) -> int:
    """Bytes of a tensor read off its parts by hand: int8 qdata + scale + zero_point, or a plain tensor."""
    if not _is_int8(tensor):
        return tensor.nbytes
    parts = [tensor.qdata, tensor.scale, tensor.zero_point]
    return sum(part.nbytes for part in parts if part is not None)


@pytest.mark.parametrize("name", ["llama", "llama-compressed"])
def test_stored_bytes_equal_the_quantized_tensors(models, name):
    model = models[name]
    quantized = quantize_model(copy.deepcopy(model), "int8-weight")
    tensors = {id(t): t for t in quantized.state_dict(keep_vars=True).values()}.values()
    assert stored_bytes(quantized) == sum(_component_bytes(t) for t in tensors)
    # n·k int8 + n float32 scales + n int8 zero points per quantized [n, k] weight, instead of 4·n·k
    saved = sum(4 * t.numel() - (t.numel() + 5 * t.shape[0]) for t in tensors if _is_int8(t))
    assert any(_is_int8(t) for t in tensors)
    assert stored_bytes(quantized) == stored_bytes(model) - saved


def test_shared_weight_is_quantized_once():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model[1].weight = model[0].weight
    quantize_model(model, "int8-weight")
    assert _is_int8(model[0].weight) and model[1].weight is model[0].weight


def test_unknown_scheme_unsupported_device_and_double_quantization_are_refused():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="unknown quantize scheme 'int4'; choose from int8-dynamic, int8-weight"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="does not run on mps; schemes for mps: none"):
        check_scheme("int8-weight", "mps")
    quantize_model(model, "int8-weight")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8-dynamic")


def test_saving_a_quantized_model_is_refused(models, tmp_path):
    quantized = quantize_model(copy.deepcopy(models["llama"]), "int8-weight")
    with pytest.raises(ValueError, match="cannot save a quantized model"):
        save_retrofitted(quantized, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()
