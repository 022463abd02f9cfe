"""Factor forms chosen by a cost model, and the latency budget, on tiny models with a synthetic timing table
(nothing is timed here: ``form_choice.measure_timings`` is replaced by the table)."""

import json

import pytest
import torch
from torch import nn

from retrofitter.adapters import adapter_for
from retrofitter.config import CompressConfig
from retrofitter.eval.cost_model import FormCostModel, rank_grid
from retrofitter.modules.latent_linear import LatentLinear, factor_form, with_form
from retrofitter.pipelines import form_choice
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.latency_allocation import allocate_time

from tiny_models import TINY_VOCAB, build_tiny

US = 1e-6


def synthetic_table(slow_factored_out=16, plain_faster_in=None):
    """Seconds ≈ MACs per token (μs), plus a fixed cost per factored call: 600 μs (slower than any dense
    tiny matrix) for matrices with d_out = ``slow_factored_out`` (k, v), else 20 μs; the junction gathers
    cost 0.5 μs more, and any junction 400 μs more for inputs of width ``plain_faster_in``."""
    def build(requests, tokens=512, *args, **kwargs):
        timings = {}
        for (d_in, d_out), kernels in requests.items():
            fixed = 600 if d_out == slow_factored_out else 20
            for kernel in kernels:
                if kernel == "dense":
                    timings[(d_in, d_out, kernel)] = {0: d_in * d_out * US}
                    continue
                extra = {"plain": 0, "junction_gather": 0.5, "junction_slice": 0}[kernel]
                extra += 400 if d_in == plain_faster_in and kernel != "plain" else 0
                timings[(d_in, d_out, kernel)] = {
                    r: (fixed + extra + r * (d_in + d_out - (r if kernel != "plain" else 0))) * US
                    for r in rank_grid(d_in, d_out)}
        return FormCostModel(timings, tokens)
    return build


def calibration(n=8, seq=32, seed=1):
    return torch.randint(3, TINY_VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _modules(model):
    adapter = adapter_for(model)
    return {(i, n): adapter.get_linear(layer, n) for i, layer in enumerate(adapter.decoder_layers(model))
            for n in adapter.linear_names}


def test_fastest_forms_give_the_outputs_of_the_fitted_forms(monkeypatch):
    """--no-junction with fastest: the same fits, re-expressed (float64: exact), junction where it is faster."""
    monkeypatch.setattr(form_choice, "measure_timings", synthetic_table(plain_faster_in=48))
    ids = calibration()
    base = CompressConfig(ratio=0.3, junction=False, batch_size=4)
    fitted, base_report = compress_model(build_tiny("llama", dtype=torch.float64), base, ids, progress=False)
    chosen, report = compress_model(build_tiny("llama", dtype=torch.float64),
                                    CompressConfig.from_flat(dict(ratio=0.3, junction=False, batch_size=4, factor_forms="fastest")),
                                    ids, progress=False)
    torch.testing.assert_close(_logits(chosen, ids), _logits(fitted, ids), rtol=1e-9, atol=1e-9)
    forms = {key: factor_form(m) for key, m in _modules(chosen).items()}
    assert {form for (i, n), form in forms.items() if n == "down"} == {"plain"}  # plain is faster there
    assert {form for (i, n), form in forms.items() if n != "down"} == {"junction"}  # the junction elsewhere
    assert report["ranks"] == base_report["ranks"]  # same plan
    assert report["targets_params_after"] < base_report["targets_params_after"]  # junction stores r² fewer
    assert report["targets_params_after"] == sum(m.num_weight_params() for m in _modules(chosen).values())
    assert report["factor_forms"]["counts"] == {"junction": 12, "plain": 2}


def test_fastest_with_a_junction_plan_keeps_the_junction(monkeypatch):
    """Under a parameter budget priced with junctions, plain (r² more parameters) is not allowed."""
    monkeypatch.setattr(form_choice, "measure_timings", synthetic_table(plain_faster_in=32))
    ids = calibration()
    model, report = compress_model(build_tiny("llama"), CompressConfig.from_flat(dict(ratio=0.3, factor_forms="fastest")), ids,
                                   progress=False)
    assert all(factor_form(m) == "junction" for m in _modules(model).values())
    default, default_report = compress_model(build_tiny("llama"), CompressConfig(ratio=0.3), ids, progress=False)
    # the junction everywhere = no re-forming: the default's fits (test_compress: one pass = two passes bit for
    # bit), the same modules and kernels: bitwise
    torch.testing.assert_close(_logits(model, ids), _logits(default, ids), rtol=0, atol=0)
    assert "factor_forms" not in default_report and "form" not in default_report["layers"][0]["matrices"]["q"]


def test_latency_plan_keeps_slow_factored_matrices_dense_within_the_time_budget(monkeypatch):
    monkeypatch.setattr(form_choice, "measure_timings", synthetic_table())
    ids = calibration()
    config = CompressConfig.from_flat(dict(ratio=0.3, budget="latency", factor_forms="fastest", batch_size=4))
    original = build_tiny("llama")
    originals = {key: m.weight.detach().clone() for key, m in _modules(original).items()}
    model, report = compress_model(original, config, ids, progress=False)
    modules = _modules(model)
    allocation = report["allocation"]
    assert {"0.k", "0.v", "1.k", "1.v"} <= set(allocation["dense_kept"])  # factored slower at every rank
    for (index, name), module in modules.items():
        if f"{index}.{name}" in allocation["dense_kept"]:  # kept, with the original weights
            assert type(module) is nn.Linear
            if name in ("k", "v"):  # (gate/up rows may be permuted by adapters.mlp_permutation, exactly)
                assert torch.equal(module.weight, originals[(index, name)])
        else:
            assert isinstance(module, LatentLinear)
    assert allocation["time_used_s"] <= allocation["time_budget_s"] * (1 + 1e-12)
    assert report["targets_params_after"] == sum(m.weight.numel() if type(m) is nn.Linear else m.num_weight_params()
                                                 for m in modules.values())
    assert report["targets_params_before"] == sum(w.numel() for w in originals.values())
    summary = report["factor_forms"]
    assert summary["modelled_targets_s_after"] == pytest.approx(allocation["time_used_s"])
    assert summary["counts"]["dense"] == len(allocation["dense_kept"])
    assert torch.isfinite(_logits(model, ids)).all()


def test_latency_run_resumes_with_its_forms(monkeypatch, tmp_path):
    monkeypatch.setattr(form_choice, "measure_timings", synthetic_table(plain_faster_in=48))
    ids = calibration()
    config = CompressConfig.from_flat(dict(ratio=0.3, budget="latency", factor_forms="fastest", batch_size=4))
    full, _ = compress_model(build_tiny("llama"), config, ids, progress=False)
    from retrofitter.pipelines.resume import RunDirectory

    original_save = RunDirectory.save_progress

    def interrupt(self, *args, **kwargs):
        original_save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunDirectory, "save_progress", interrupt)
    with pytest.raises(KeyboardInterrupt):
        compress_model(build_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "progress.json").read_text())["state"]["layers_done"] == 1
    monkeypatch.setattr(RunDirectory, "save_progress", original_save)
    resumed, _ = compress_model(build_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "ckpt")
    forms = {k: factor_form(m) for k, m in _modules(full).items()}
    assert {k: factor_form(m) for k, m in _modules(resumed).items()} == forms and "dense" in forms.values()
    torch.testing.assert_close(_logits(resumed, ids), _logits(full, ids), rtol=1e-5, atol=1e-5)


def test_allocate_time_meets_the_budget_and_prefers_dense_when_faster():
    gains = {"a": [4.0, 2.0, 1.0, 0.5], "b": [3.0, 1.0, 0.1, 0.01], "c": [1.0, 1.0, 1.0, 1.0]}
    factored = {"a": [0.0, 1.0, 2.0, 3.0, 4.0], "b": [0.0, 1.0, 1.5, 2.0, 2.5], "c": [0.0, 5.0, 6.0, 7.0, 8.0]}
    dense = {"a": 10.0, "b": 2.2, "c": 4.0}  # c: dense beats every factored rank; b: dense from rank 4
    for budget in (7.0, 9.0, 12.0, 20.0):
        plan, kept = allocate_time(gains, factored, dense, budget)
        assert "c" in kept
        used = sum(dense[k] for k in kept) + sum(factored[k][r] for k, r in plan.items())
        assert used <= budget
    assert allocate_time(gains, factored, dense, 20.0) == ({}, {"a", "b", "c"})  # everything dense fits
    plan, kept = allocate_time(gains, factored, dense, 12.0)
    assert kept == {"b", "c"} and plan == {"a": 4}  # b at rank 3 (2.0 s) → dense (2.2 s) for all its error
    with pytest.raises(ValueError, match="minimum ranks"):
        allocate_time(gains, factored, dense, 1.0)


def test_config_refuses_latency_without_global_allocation_and_latentllm():
    with pytest.raises(ValueError, match="allocation global"):
        CompressConfig.from_flat(dict(budget="latency", allocation="uniform"))
    with pytest.raises(ValueError, match="is an option of --method svd, asvd-hessian"):
        CompressConfig.from_flat(dict(method="latentllm", factor_forms="fastest"))
    with pytest.raises(ValueError, match="budget must be"):
        CompressConfig.from_flat(dict(budget="time"))


def test_with_form_keeps_outputs_float64():
    torch.manual_seed(0)
    module = LatentLinear.from_factors(torch.randn(7, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64),
                                       bias=torch.randn(7, dtype=torch.float64), junction=False)
    x = torch.randn(4, 5, dtype=torch.float64)
    for form in ("dense", "junction", "plain"):
        torch.testing.assert_close(with_form(module, form)(x), module(x), rtol=1e-12, atol=1e-12)
