"""Adapter conformance on tiny random models of every supported family."""

import pytest
import torch
from torch import nn

from retrofitter.adapters import UnsupportedArchitectureError, adapter_for, supported_architectures
from tiny_models import FAMILIES, build_tiny


def test_every_projection_is_a_linear_with_layout_shapes(tiny_model):
    adapter = adapter_for(tiny_model)
    layout = adapter.attention_layout(tiny_model)
    layers = adapter.decoder_layers(tiny_model)
    assert len(layers) == tiny_model.config.get_text_config().num_hidden_layers
    d, h, g, dh = layout.hidden_size, layout.n_heads, layout.n_kv_heads, layout.head_dim
    for layer in layers:
        q, k, v, o = (adapter.get_linear(layer, n) for n in ("q", "k", "v", "o"))
        assert all(isinstance(m, nn.Linear) for m in (q, k, v, o))
        assert q.weight.shape == (h * dh, d)
        assert k.weight.shape == (g * dh, d) and v.weight.shape == (g * dh, d)
        assert o.weight.shape == (d, h * dh)
        names = adapter.linear_names
        assert set(names) == set(adapter.linear_paths)
        assert callable(adapter.mlp_activation(layer))


def test_linear_groups_share_their_input(tiny_model, random_ids):
    """Projections grouped together must see the very same input tensor."""
    adapter = adapter_for(tiny_model)
    layer = adapter.decoder_layers(tiny_model)[0]
    seen = {}
    hooks = [adapter.get_linear(layer, n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, a[0]))
             for n in adapter.linear_names]
    with torch.no_grad():
        tiny_model(random_ids)
    for h in hooks:
        h.remove()
    for group in adapter.linear_groups:
        for name in group[1:]:
            # one tensor handed to every projection of the group (no arithmetic between them): bitwise
            assert torch.equal(seen[group[0]].reshape(-1), seen[name].reshape(-1)), (group, name)


def test_set_linear_replaces_module(tiny_model, random_ids):
    adapter = adapter_for(tiny_model)
    layer = adapter.decoder_layers(tiny_model)[1]
    old = adapter.get_linear(layer, "o")
    new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    adapter.set_linear(layer, "o", new)
    assert adapter.get_linear(layer, "o") is new
    assert tiny_model.get_submodule(adapter.linear_path_in_model(1, "o")) is new


def test_first_layer_capture_reproduces_the_model(tiny_model, random_ids):
    """Running the captured layer-0 inputs through every layer + final norm/head gives the logits."""
    adapter = adapter_for(tiny_model)
    with torch.no_grad():
        hidden, kwargs = adapter.capture_first_layer_inputs(tiny_model, random_ids)
        for layer in adapter.decoder_layers(tiny_model):
            hidden = layer(hidden, **kwargs)
        expected = tiny_model(random_ids, output_hidden_states=True).hidden_states[-1]
        # hidden_states[-1] is after the final norm in HF; compare before it through the model's norm
        final = adapter.final_hidden(tiny_model, hidden)
    torch.testing.assert_close(final, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_names_the_supported_ones():
    class Strange(nn.Module):
        pass

    with pytest.raises(UnsupportedArchitectureError) as info:
        adapter_for(Strange())
    assert "Strange" in str(info.value)
    for name in supported_architectures():
        assert name in str(info.value)


def test_the_tiny_model_table_has_one_row_per_supported_architecture():
    built = sorted(type(build_tiny(family)).__name__ for family in FAMILIES)
    assert built == supported_architectures()


def test_family_facts_come_from_the_adapter_and_the_model(tiny_model):
    adapter = adapter_for(tiny_model)
    attention = adapter.attention(adapter.decoder_layers(tiny_model)[0])
    output = getattr(attention, adapter.attention_output_name)
    assert output is adapter.get_linear(adapter.decoder_layers(tiny_model)[0], "o")
    rotary = adapter.rotary_embedding_class(tiny_model)
    assert adapter.uses_rope == adapter.attention_layout(tiny_model).uses_rope == (rotary is not None)
    if rotary is not None:
        assert rotary is type(tiny_model.get_submodule(adapter.rotary_path))
    # has_bias describes the real projections (Qwen2: q/k/v biases whatever config.attention_bias says)
    q = adapter.get_linear(adapter.decoder_layers(tiny_model)[0], "q")
    assert adapter.attention_layout(tiny_model).has_bias == (q.bias is not None)


def test_missing_capability_names_the_architectures_that_have_it():
    with pytest.raises(UnsupportedArchitectureError) as info:
        adapter_for(build_tiny("opt"), capability="linearize")
    assert "OPTForCausalLM" in str(info.value)
    assert supported_architectures("linearize") == [
        "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
        "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    for name in supported_architectures("linearize"):
        assert name in str(info.value)
    assert supported_architectures("latent_attention") == supported_architectures()
    with pytest.raises(ValueError, match="unknown capability"):
        supported_architectures("teleport")


def test_head_logits_are_the_model_logits(tiny_model, random_ids):
    """The contract for chunked losses: head_logits(head_inputs) = the model's logits (Gemma 2: soft-capped)."""
    adapter = adapter_for(tiny_model)
    with torch.no_grad():
        expected = tiny_model(random_ids, use_cache=False).logits
        actual = adapter.head_logits(tiny_model, adapter.head_inputs(tiny_model, random_ids))
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_splitting_fused_projections_keeps_the_model_bit_identical(tiny_model, random_ids):
    """Phi-3 / GPT-NeoX: decoder_layers splits qkv (gate_up) into parts in place, same function bit for bit."""
    adapter = adapter_for(tiny_model)
    with torch.no_grad():
        before = tiny_model(random_ids, use_cache=False).logits
        layers = adapter.decoder_layers(tiny_model)
        layers = adapter.decoder_layers(tiny_model)  # idempotent
        after = tiny_model(random_ids, use_cache=False).logits
    # bitwise by construction: unhooked dense parts run as one F.linear with the re-assembled fused weight (the
    # original values, shape and layout: tests/modules/test_fused_projection.py), the call the fused nn.Linear made
    assert torch.equal(before, after)
    for fused in adapter.fused:
        assert list(layers[0].get_submodule(fused.path).part_names) == list(fused.parts)


def test_sliding_windows_are_per_layer():
    gemma = build_tiny("gemma2")
    adapter = adapter_for(gemma)
    windows = [adapter.sliding_window(adapter.attention(layer)) for layer in adapter.decoder_layers(gemma)]
    assert windows == [6, None]  # layer_types: sliding, full
    phi3 = build_tiny("phi3")
    assert {adapter_for(phi3).sliding_window(adapter_for(phi3).attention(layer))
            for layer in adapter_for(phi3).decoder_layers(phi3)} == {8}
