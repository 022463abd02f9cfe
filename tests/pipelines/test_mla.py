"""MLA conversion end to end on tiny models of every family it supports (float64 where exactness is claimed):
the full budget reproduces the original logits; the absorbed execution equals the naive one (prefill, left
padding, step-by-step decode through the cache), and so does the decompressed (training) one, gradients
included; save -> load gives the same logits; generate with the cache equals the full forward; the cache holds
r + 2m numbers per token; unsupported families are refused."""

from __future__ import annotations

import pytest
import torch

import retrofitter
from retrofitter.checkpoint import load_retrofitted
from retrofitter.adapters.registry import UnsupportedArchitectureError
from retrofitter.eval.accounting import account
from retrofitter.modules.mla_attention import MLA_EXECUTIONS, MLAAttention
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from greedy import assert_same_greedy, generated
from mla_helpers import CALIBRATION, converted_mla, full_and_stepwise, set_execution
from tiny_models import TINY_VOCAB, strong_tiny

SUPPORTED = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("family", SUPPORTED)
def test_full_budget_reproduces_the_original_logits(family, random_ids):
    original = strong_tiny(family, dtype=torch.float64)
    with torch.no_grad():
        expected = original(random_ids).logits
    # every rotary slot shared (more than one per frequency: "score"), latent of full rank
    model = converted_mla(family, kv_ratio=1.0, selection="score")
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in model.model.layers)
    with torch.no_grad():
        got = model(random_ids).logits
    # float64 end to end; logits of order 10 through two layers of eigen/QR/SVD-based refactoring
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    converted = converted_mla(family, kv_ratio=0.25)
    with torch.no_grad():
        assert float((converted(random_ids).logits - expected).abs().max()) > 1e-3  # a real budget changes them


@pytest.mark.parametrize("family", SUPPORTED)
@pytest.mark.parametrize("dtype, padded, kernel, tolerance", [
    # float64 rounding of logits of order 10 (sdpa: HF's eager kernel takes its softmax in float32)
    (torch.float64, False, "sdpa", 1e-10),
    # HF's eager kernel turns a fully masked (padded) float64 row into NaN, so padding runs in float32:
    # two float32 executions of ~100-term sums, logits of order 10
    (torch.float32, True, "eager", 1e-4)])
@pytest.mark.parametrize("fold", [False, True], ids=["up-projections", "folded"])
def test_absorbed_equals_naive_prefill_and_through_the_cache(family, dtype, padded, kernel, tolerance, fold):
    model = converted_mla(family, kv_ratio=0.25, dtype=dtype, fold=fold)
    assert (model.model.layers[0].self_attn.k_up is None) is fold
    model.config._attn_implementation = kernel
    ids = torch.randint(3, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding
    valid = mask.bool()
    outputs = {}
    for execution in MLA_EXECUTIONS:
        set_execution(model, execution)
        full, stepwise = full_and_stepwise(model, ids, mask)
        torch.testing.assert_close(stepwise[valid], full[valid], rtol=tolerance, atol=tolerance)
        outputs[execution] = full
    for execution in ("absorbed", "decompressed"):
        torch.testing.assert_close(outputs[execution][valid], outputs["naive"][valid], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("family", SUPPORTED)
@pytest.mark.parametrize("execution", ["decompressed", "absorbed"])
def test_training_gradients_equal_the_naive_ones(family, execution):
    """The transfer's executions' gradients (every parameter the logits depend on) are the reference's, in float64,
    on the module the transfer trains (up-projections not yet folded)."""
    model = converted_mla(family, kv_ratio=0.25, fold=False)
    ids = torch.randint(3, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = {}
    for run in ("naive", execution):
        set_execution(model, run)
        model.zero_grad(set_to_none=True)
        model(ids).logits.pow(2).mean().backward()
        grads[run] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert any("k_up" in name for name in grads["naive"]) and grads["naive"].keys() == grads[execution].keys()
    for name, grad in grads["naive"].items():
        # float64 sums of ~100 terms: rounding far below 1e-10 of gradients of order 1
        torch.testing.assert_close(grads[execution][name], grad, rtol=1e-9, atol=1e-10)


def test_an_unknown_execution_is_refused(random_ids):
    model = converted_mla("llama")
    set_execution(model, "flash")
    with pytest.raises(ValueError, match="execution must be one of"):
        model(random_ids)


@pytest.mark.parametrize("family", SUPPORTED)
def test_save_load_generate_and_cache_bytes(family, tmp_path):
    model = converted_mla(family, kv_ratio=0.25, dtype=torch.float32)
    ids = torch.randint(3, TINY_VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    retrofitter.save(model, tmp_path / "mla", metadata={"method": "mla"})
    loaded = load_retrofitted(tmp_path / "mla")
    with torch.no_grad():
        # float32 weights copied (load_state_dict) into torch-allocated parameters of the same modules and
        # shapes on both sides, one process, one thread: the same kernels on the same bytes, so bitwise
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        out = loaded.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, output_logits=True,
                              return_dict_in_generate=True)
        tokens, logits = ids, []
        for _ in range(6):  # the reference: a full forward without any cache at every step
            logits.append(loaded(tokens, use_cache=False).logits[:, -1:])
            tokens = torch.cat([tokens, logits[-1].argmax(-1)], 1)
    # the cache and the full forward are different computations (other attention shapes): float32 logits of
    # magnitude < 10 through two layers with inner dimensions <= 48 agree to a few 1e-6; equal tokens follow
    # from the margins (tests/greedy.py)
    assert_same_greedy(*generated(out, ids.shape[1]), tokens[:, ids.shape[1]:], torch.cat(logits, 1),
                       rtol=1e-5, atol=1e-5)
    attention = loaded.model.layers[0].self_attn
    per_layer = attention.kv_rank + attention.rope_dim
    assert per_layer == 8  # 0.25 of 2·2·8
    assert account(loaded).kv_bytes_per_token == len(loaded.model.layers) * per_layer * 4
    with torch.no_grad():
        cache = loaded(ids, use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == ids.shape[1] * len(loaded.model.layers) * per_layer * 4  # measured on the cache tensors


@pytest.mark.parametrize("family, reason", [("opt", "rotary position embeddings"), ("qwen3", "q/k norms"),
                                            ("gemma2", "soft-caps"), ("phi3", "partial rotary"),
                                            ("gpt_neox", "partial rotary")])
def test_unsupported_families_are_refused_before_any_work(family, reason):
    model = strong_tiny(family)
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        convert_to_mla(model, MLAConfig(), CALIBRATION, progress=False)


def test_config_is_checked_when_built():
    with pytest.raises(ValueError, match="--kv-ratio"):
        MLAConfig(kv_ratio=1.5)
    with pytest.raises(ValueError, match="rope_fraction"):
        MLAConfig(rope_fraction=-0.1)
    assert MLAConfig.from_dict(MLAConfig(kv_ratio=0.5).to_dict()) == MLAConfig(kv_ratio=0.5)
    model = strong_tiny("llama")  # the default progression holds one rotary slot per frequency: 8 dims here
    with pytest.raises(ValueError, match="asks 16: lower --rope-fraction or use --rope-selection score"):
        convert_to_mla(model, MLAConfig(kv_ratio=1.0, rope_fraction=0.5), CALIBRATION, progress=False)
    assert not any(isinstance(m, MLAAttention) for m in model.modules())


def test_heal_adapts_the_mla_tensors_and_merges_exactly(tmp_path):
    from retrofitter.config import HealConfig
    from retrofitter.pipelines.heal import heal_model, heal_targets

    model = converted_mla("llama", kv_ratio=0.25, dtype=torch.float32, fold=False)
    teacher = strong_tiny("llama")
    names = {t.short for t in heal_targets(model)}
    assert {"self_attn.k_up", "self_attn.v_up", "self_attn.kv_a_proj.weight", "self_attn.q_proj.weight",
            "mlp.down_proj.weight"} <= names
    ids = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
    healed, report = heal_model(model, teacher, CALIBRATION, HealConfig(tokens=6 * 32, seq_len=32, lr=1e-2),
                                progress=False)
    assert report["steps"] > 0 and all(isinstance(layer.self_attn, MLAAttention) for layer in healed.model.layers)
    with torch.no_grad():
        after = healed(ids).logits
    assert float((after - before).abs().max()) > 1e-4  # the merged LoRA changed the model
    retrofitter.save(healed, tmp_path / "healed", metadata={"method": "mla+heal"})
    loaded = load_retrofitted(tmp_path / "healed")
    saved = healed.state_dict()
    # merged: plain tensors, saved bitwise; the logits agree to float32 rounding (the same GEMMs on differently
    # aligned buffers may round differently, e.g. MKL on AMD)
    assert loaded.state_dict().keys() == saved.keys()
    # bitwise by construction: safetensors stores and reads back the float32 bytes, no arithmetic in between
    assert all(torch.equal(tensor, saved[name]) for name, tensor in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, after, rtol=1e-5, atol=1e-6)


def test_progression_uses_one_step_for_every_layer_so_one_rope_base_holds_them():
    model = strong_tiny("llama", dtype=torch.float64)
    _, report = convert_to_mla(model, MLAConfig(kv_ratio=0.25, rope_fraction=0.5), CALIBRATION, progress=False)
    step = report["rope_step"]
    for layer in model.model.layers:
        freqs = sorted(int(f) for f in layer.self_attn.freq_index)
        assert freqs == [j * step for j in range(len(freqs))]
    _, forced = convert_to_mla(strong_tiny("llama"), MLAConfig(kv_ratio=0.25, rope_fraction=0.5, rope_step=3),
                               CALIBRATION, progress=False)
    assert forced["rope_step"] == 3
    with pytest.raises(ValueError, match="--rope-step 4 does not fit"):
        convert_to_mla(strong_tiny("llama"), MLAConfig(kv_ratio=0.25, rope_fraction=0.5, rope_step=4), CALIBRATION,
                       progress=False)


@pytest.mark.parametrize("family, fit", [(family, "attention") for family in SUPPORTED] + [("llama", "uniform")])
def test_unrotated_fit_changes_only_the_query_side_and_lowers_the_score_error(family, fit):
    settings = dict(kv_ratio=0.5, rope_fraction=0.25, damping=1e-9, fit_blocks=4, fit_queries=16,
                    fold_up_projections=False)
    fitted, plain = strong_tiny(family, dtype=torch.float64), strong_tiny(family, dtype=torch.float64)
    _, report = convert_to_mla(fitted, MLAConfig(**settings, unrotated_fit=fit), CALIBRATION, progress=False)
    _, plain_report = convert_to_mla(plain, MLAConfig(**settings, unrotated_fit="none"), CALIBRATION, progress=False)
    errors = [layer["unrotated_score_error"] for layer in report["layers"]]
    assert all(e["fitted"] <= e["identity"] * (1 + 1e-9) for e in errors)
    assert any(e["fitted"] < 0.95 * e["identity"] for e in errors)
    assert all(layer["unrotated_score_error"] is None for layer in plain_report["layers"])
    first, first_plain = fitted.model.layers[0].self_attn, plain.model.layers[0].self_attn  # same input stream
    for name in ("kv_a_proj.weight", "k_up", "v_up", "k_pe_proj.weight"):
        torch.testing.assert_close(first.get_parameter(name), first_plain.get_parameter(name), rtol=0, atol=1e-10)
    assert not torch.allclose(first.q_proj.weight, first_plain.q_proj.weight)


@pytest.mark.parametrize("family", SUPPORTED)
@pytest.mark.parametrize("kv_ratio, folds", [(0.5, {"k_up": True, "v_up": True}),    # r = r' = dh = 8
                                             (0.25, {"k_up": True, "v_up": False})])  # r = r' = 4 < dh
def test_folding_the_up_projections_keeps_the_function_and_drops_their_work(family, kv_ratio, folds, tmp_path):
    model = converted_mla(family, kv_ratio=kv_ratio, fold=False)
    ids = torch.randint(3, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids).logits
    before = {name: p.numel() for name, p in model.named_parameters()}
    macs_before = account(model).macs_per_token
    attentions = [layer.self_attn for layer in model.model.layers]
    saved = sum(a.n_heads * a.kv_rank * (a.qk_nope_dim * folds["k_up"] + a.head_dim * folds["v_up"])
                for a in attentions)
    assert [a.fold_up_projections() for a in attentions] == [folds] * len(attentions)
    assert [a.fold_up_projections() for a in attentions] == [folds] * len(attentions)  # once: a no-op after
    after = {name: p.numel() for name, p in model.named_parameters()}
    gone = {name for name in before if name.endswith(("k_up", "v_up"))
            and folds[name.rsplit(".", 1)[-1]]}
    assert before.keys() - after.keys() == gone and all(after[name] == before[name] for name in after)
    assert macs_before - account(model).macs_per_token == saved > 0
    for execution in MLA_EXECUTIONS:
        set_execution(model, execution)
        with torch.no_grad():
            got = model(ids).logits
        # float64: the fold reassociates a product of three matrices (q_proj, K_up; V_up, o_proj): rounding
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    set_execution(model, "absorbed")
    model.float()  # saved and loaded as a user's float32 model (load rebuilds its rotary tables in float32)
    retrofitter.save(model, tmp_path / "folded", metadata={"method": "mla"})
    loaded = load_retrofitted(tmp_path / "folded")
    assert loaded.model.layers[0].self_attn.spec() == attentions[0].spec()
    assert attentions[0].spec()["k_up_folded"] is True and attentions[0].spec()["v_up_folded"] is folds["v_up"]
    with torch.no_grad():
        # the same float32 weights in the same modules: equal up to kernel rounding of logits of order 10
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_conversion_keeps_the_up_projections_and_heal_folds_them_after_merging(monkeypatch):
    from retrofitter.config import HealConfig
    from retrofitter.pipelines import heal as heal_pipeline

    def converted():
        model = strong_tiny("llama", dtype=torch.float32)
        _, report = convert_to_mla(model, MLAConfig(kv_ratio=0.5, rope_fraction=0.5), CALIBRATION, progress=False)
        return model, report

    def healed(model):
        return heal_pipeline.heal_model(model, strong_tiny("llama"), CALIBRATION,
                                        HealConfig(tokens=6 * 32, seq_len=32, lr=1e-2), progress=False)

    model, report = converted()
    assert all(layer["folded"] == {"k_up": False, "v_up": False} for layer in report["layers"])
    names = {t.short for t in heal_pipeline.heal_targets(model)}
    assert {"self_attn.k_up", "self_attn.v_up", "self_attn.q_proj.weight", "self_attn.o_proj.weight"} <= names
    model, heal_report = healed(model)
    assert heal_report["folded_up_projections"] == 2 * len(model.model.layers)
    assert all(layer.self_attn.k_up is None and layer.self_attn.v_up is None for layer in model.model.layers)
    monkeypatch.setattr(heal_pipeline, "fold_mla_up_projections", lambda m: 0)  # the same heal, left unfolded
    unfolded, unfolded_report = healed(converted()[0])
    assert unfolded_report["folded_up_projections"] == 0 and unfolded.model.layers[0].self_attn.k_up is not None
    ids = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        # the same training on the same machine; the fold after the merge reassociates float32 products (rounding)
        torch.testing.assert_close(model(ids).logits, unfolded(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_quantized_partner_keeps_its_up_projection():
    """A quantized q_proj / o_proj's weight is not the map it applies: folding into it would be wrong, so it stays."""
    from retrofitter.modules.quantize import quantize_model

    model = quantize_model(converted_mla("llama", kv_ratio=0.5, dtype=torch.float32, fold=False), "int8-weight")
    ids = torch.randint(3, TINY_VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = model(ids).logits
    assert [layer.self_attn.fold_up_projections() for layer in model.model.layers] == [
        {"k_up": False, "v_up": False}] * len(model.model.layers)
    with torch.no_grad():
        # nothing was touched: the same forward again (1e-6: a kernel may reorder a sum between calls)
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-6, atol=1e-6)
