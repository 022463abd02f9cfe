"""Global rank allocation: exact budget (±1 rank step) and better calibration loss than uniform."""

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.config import ALLOCATION_WEIGHTINGS, CompressConfig, LatentLLMOptions
from retrofitter.linalg.ranks import factor_param_count
from retrofitter.pipelines.allocation import WEIGHTINGS, RankItem, allocate_ranks
from retrofitter.pipelines.gradient_importance import output_gradient_importance
from retrofitter.pipelines.compress import compress_model

from tiny_models import TINY_VOCAB, strong_tiny


def items():
    generator = torch.Generator().manual_seed(0)
    shapes = [(32, 32), (32, 16), (48, 32), (32, 48)]
    result = {}
    for index, (d_out, d_in) in enumerate(shapes):
        decay = torch.rand(1, generator=generator).item() * 0.5 + 0.05
        energies = torch.exp(-decay * torch.arange(min(d_in, d_out), dtype=torch.float64))
        result[(index, "m")] = RankItem(d_in, d_out, energies)
    return result


@pytest.mark.parametrize("junction", [True, False])
@pytest.mark.parametrize("keep", [0.3, 0.55, 0.8])
def test_plan_meets_budget_within_one_rank_step(junction, keep):
    plan_items = items()
    budget = keep * sum(i.d_in * i.d_out for i in plan_items.values())
    plan = allocate_ranks(plan_items, budget, junction=junction)
    used = sum(factor_param_count(i.d_in, i.d_out, plan[k], junction) for k, i in plan_items.items())
    assert used <= budget
    largest_step = max(i.d_in + i.d_out for i in plan_items.values())
    assert budget - used < largest_step


def test_fast_decaying_spectrum_gets_fewer_ranks():
    flat = torch.ones(32, dtype=torch.float64)
    steep = torch.exp(-torch.arange(32, dtype=torch.float64))
    plan = allocate_ranks({"flat": RankItem(32, 32, flat), "steep": RankItem(32, 32, steep)}, budget=800)
    assert plan["flat"] > plan["steep"]


def test_minimum_ranks_over_budget_raise():
    with pytest.raises(ValueError, match="minimum ranks"):
        allocate_ranks(items(), budget=10, min_ranks={k: 8 for k in items()})
    with pytest.raises(ValueError, match="unknown allocation weighting"):
        allocate_ranks(items(), budget=1e4, weighting="nope")


def test_global_beats_uniform_on_calibration_loss_at_same_budget():
    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    reference = strong_tiny("llama")(tokens).logits
    results = {}
    for allocation in ("uniform", "global"):
        config = CompressConfig(method="latentllm", ratio=0.4, allocation=allocation, batch_size=4)
        model, report = compress_model(strong_tiny("llama"), config, tokens, progress=False)
        with torch.no_grad():
            results[allocation] = (float((model(tokens).logits - reference).pow(2).mean()),
                                   report["targets_params_after"], report)
    dense = results["global"][2]["targets_params_before"]
    assert results["global"][1] <= 0.6 * dense  # same budget: (1 − ratio) of the dense parameters
    assert results["global"][1] >= results["uniform"][1] - 64  # and uses it (uniform rounds ranks down)
    assert results["global"][0] < results["uniform"][0]


def test_weighting_names_match_the_config():
    assert tuple(WEIGHTINGS) == ALLOCATION_WEIGHTINGS
    with pytest.raises(ValueError, match="unknown allocation weighting 'nope'"):
        CompressConfig(allocation_weighting="nope")


def test_fisher_weighting_gives_ranks_to_the_matrix_the_loss_is_sensitive_to():
    spectrum = torch.exp(-0.2 * torch.arange(32, dtype=torch.float64))
    plan = allocate_ranks({"sensitive": RankItem(32, 32, spectrum, importance=10.0),
                           "insensitive": RankItem(32, 32, spectrum, importance=0.1)}, budget=1000, weighting="fisher")
    assert plan["sensitive"] > plan["insensitive"]


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_output_gradient_importance_matches_autograd_reference(family):
    """f_m from backward hooks == Σ‖∂L/∂y_m‖² / (T d'_m) computed with retain_grad on every output (float64)."""
    torch.manual_seed(0)
    model = strong_tiny(family, dtype=torch.float64)
    adapter = adapter_for(model)
    tokens = torch.randint(3, TINY_VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    targets = list(adapter.linear_names)
    fast = output_gradient_importance(model, adapter, tokens, targets, n_blocks=2)  # layers recomputed in backward
    assert all("forward" not in layer.__dict__ for layer in adapter.decoder_layers(model))  # restored after
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # no weight gradient, flags kept

    outputs, handles = {}, []
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in targets:
            def keep(_module, _args, output, key=(index, name)):
                output.retain_grad()
                outputs.setdefault(key, []).append(output)
            handles.append(adapter.get_linear(layer, name).register_forward_hook(keep))
    for p in model.parameters():
        p.requires_grad_(True)  # the reference differentiates through the weights instead
    for row in tokens[:2]:
        ids = row.unsqueeze(0)
        logits = model(input_ids=ids).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                          reduction="sum").backward()
    for handle in handles:
        handle.remove()
    n_tokens = 2 * 15
    for key, tensors in outputs.items():
        d_out = tensors[0].shape[-1]
        reference = sum(float(t.grad.pow(2).sum()) for t in tensors) / (n_tokens * d_out)
        assert fast[key] == pytest.approx(reference, rel=1e-9), key
    assert all(not p.requires_grad or p.grad is not None for p in model.parameters())


def test_fisher_allocation_compresses_within_budget_and_sets_ranks_non_uniformly():
    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    config = CompressConfig(method="asvd-rootcov", ratio=0.4, allocation="global", allocation_weighting="fisher",
                            allocation_gradient_blocks=2, batch_size=4)
    model, report = compress_model(strong_tiny("llama"), config, tokens, progress=False)
    assert report["targets_params_after"] <= 0.6 * report["targets_params_before"]
    importance = report["allocation"]["output_gradient_importance"]
    assert all(value > 0 for value in importance.values())
    ranks = report["ranks"]
    assert len(set(ranks.values())) > 2
    assert len(report["allocation"]["keep_fraction_by_layer"]) == len(adapter_for(model).decoder_layers(model))


def test_local_method_with_global_allocation_is_not_silently_uniform():
    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    uniform = compress_model(strong_tiny("llama"), CompressConfig(method="asvd-rootcov", ratio=0.4, batch_size=4,
                                                                  allocation="uniform"),
                             tokens, progress=False)[1]
    global_ = compress_model(strong_tiny("llama"), CompressConfig(method="asvd-rootcov", ratio=0.4, allocation="global",
                                                                 batch_size=4), tokens, progress=False)[1]
    uniform_ranks = {f"{r['layer']}.{n}": e["rank"] for r in uniform["layers"] for n, e in r["matrices"].items()}
    global_ranks = {f"{r['layer']}.{n}": e["rank"] for r in global_["layers"] for n, e in r["matrices"].items()}
    assert uniform_ranks.keys() == global_ranks.keys() and uniform_ranks != global_ranks
    assert global_["method"] == "asvd-rootcov"


def test_spectra_from_cached_svds_equal_the_stream_spectra_and_drive_a_global_plan():
    from retrofitter.pipelines.allocation import plan_from_items, weighted_spectra
    from retrofitter.pipelines.compress import collect_teacher_moments, compress_with_moments, weighted_spectra_from_cache

    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    original = strong_tiny("llama")
    adapter = adapter_for(original)
    moments = collect_teacher_moments(original, tokens, batch_size=4, progress=False)
    config = CompressConfig(method="asvd-rootcov", ratio=0.4, statistics="teacher")
    cache: dict = {}
    compress_with_moments(strong_tiny("llama"), config, moments, svd_cache=cache)
    items = weighted_spectra_from_cache(original, config, cache)
    for (index, name), item in items.items():
        linear = adapter.get_linear(adapter.decoder_layers(original)[index], name)
        direct = weighted_spectra(linear.weight, moments[index][name].second_moment, config.damping)
        torch.testing.assert_close(item.energies, direct, rtol=1e-8, atol=1e-10)
    plan, report = plan_from_items(items, CompressConfig(method="asvd-rootcov", ratio=0.4, allocation="global",
                                                         allocation_weighting="relative"))
    model, summary = compress_with_moments(strong_tiny("llama"), config, moments, svd_cache=cache, plan=plan)
    assert summary["targets_params_after"] <= 0.6 * summary["targets_params_before"]
    assert {f"{r['layer']}.{n}": e["rank"] for r in summary["layers"] for n, e in r["matrices"].items()} == \
        {f"{i}.{n}": rank for (i, n), rank in plan.items()}
    with pytest.raises(KeyError, match="no cached SVD"):
        weighted_spectra_from_cache(original, CompressConfig(method="svd"), cache)
    from retrofitter.pipelines.compress import teacher_global_plan

    global_config = CompressConfig(method="asvd-rootcov", ratio=0.4, allocation="global", statistics="teacher",
                                   allocation_weighting="relative")
    assert teacher_global_plan(original, global_config, moments, cache)[0] == plan
    fisher_config = CompressConfig(method="asvd-rootcov", ratio=0.4, allocation="global", statistics="teacher",
                                   allocation_weighting="fisher", allocation_gradient_blocks=2)
    with pytest.raises(ValueError, match="needs the calibration"):
        teacher_global_plan(original, fisher_config, moments, cache)
    fisher_plan, fisher_report = teacher_global_plan(original, fisher_config, moments, cache, tokens)
    assert teacher_global_plan(original, fisher_config, moments, cache, importance=fisher_report["importance"])[0] \
        == fisher_plan


def test_kv_budget_is_met_and_binding_and_the_parameter_budget_still_holds():
    from retrofitter.pipelines.allocation import RankItem, allocate_ranks, kept_gain

    g = torch.Generator().manual_seed(0)
    items = {(layer, name): RankItem(24, 16 if name in ("k", "v") else 24,
                                     torch.rand(16 if name in ("k", "v") else 24, generator=g,
                                                dtype=torch.float64).sort(descending=True).values * (3 if name in ("k", "v") else 1))
             for layer in range(3) for name in ("q", "k", "v", "o")}
    budget = 0.6 * sum(i.d_in * i.d_out for i in items.values())
    kv_keys = frozenset(k for k in items if k[1] in ("k", "v"))
    free = allocate_ranks(items, budget, True, "relative")
    assert allocate_ranks(items, budget, True, "relative", kv_keys=kv_keys) == free  # no KV budget: unchanged
    free_kv = sum(free[k] for k in kv_keys)
    kv_budget = free_kv // 2
    for price in (0.0, 5.0, 50.0):
        plan = allocate_ranks(items, budget, True, "relative", kv_keys=kv_keys, kv_budget=kv_budget, kv_price=price)
        assert sum(plan[k] for k in kv_keys) <= kv_budget
        used = sum(factor_param_count(items[k].d_in, items[k].d_out, r, True) for k, r in plan.items())
        assert used <= budget
    plan = allocate_ranks(items, budget, True, "relative", kv_keys=kv_keys, kv_budget=kv_budget)
    assert sum(plan[k] for k in kv_keys) == kv_budget  # binding: the free plan wanted more
    assert kept_gain(items, plan, "relative") <= kept_gain(items, free, "relative")


def test_kv_ratio_bounds_the_latent_cache_of_a_compressed_model():
    from tiny_models import build_tiny

    model = build_tiny("llama")
    layout = adapter_for(model).attention_layout(model)
    layers = len(adapter_for(model).decoder_layers(model))
    full = 2 * layout.n_kv_heads * layout.head_dim * layers
    ids = torch.randint(3, 90, (8, 32), generator=torch.Generator().manual_seed(1))
    config = CompressConfig.from_flat(dict(method="latentllm", ratio=0.3, kv_ratio=0.5, allocation_weighting="relative", batch_size=4))
    model, report = compress_model(model, config, ids, progress=False)
    assert report["cache_numbers_per_token"] <= 0.5 * full
    assert report["allocation"]["kv_used_numbers"] == report["cache_numbers_per_token"]
    assert report["allocation"]["allocation_used"] <= report["allocation"]["allocation_budget"]
    with pytest.raises(ValueError, match="--allocation global"):
        CompressConfig.from_flat(dict(method="latentllm", ratio=0.3, kv_ratio=0.5, allocation="uniform"))
    with pytest.raises(ValueError, match="--targets must include k and v"):  # at construction, before any pass
        CompressConfig(method="latentllm", targets=("q", "k", "o"), options=LatentLLMOptions(kv_ratio=0.5))
    with pytest.raises(ValueError, match="is an option of --method latentllm, not of asvd-rootcov"):
        CompressConfig.from_flat(dict(method="asvd-rootcov", ratio=0.3, kv_ratio=0.5))
