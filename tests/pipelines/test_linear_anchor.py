"""Calibrating the linear anchor of a linearized tiny model (pipelines/linear_anchor.py)."""

import pytest
import torch

from retrofitter.adapters.hybrid_attention import HybridCache, hybrid_attention_modules, set_recall, swap_to_hybrid
from retrofitter.api import load, save
from retrofitter.pipelines.linear_anchor import calibrate_linear_anchor, clear_linear_anchor
from tiny_models import TINY_VOCAB, build_tiny, build_tiny_tokenizer


def hybrid(seed=0):
    model = build_tiny("llama", seed=seed)
    swap_to_hybrid(model, dict(window=4, feature_dim=6))
    set_recall(model, sinks=1, sparse_cache=2)
    return model.eval()


def tokens(n=48, rows=2, seed=0):
    return torch.randint(3, TINY_VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def test_calibration_sets_a_clipped_anchor_from_the_pegged_mix():
    model, ids = hybrid(), tokens()
    pegged = logits(model, ids)
    report = calibrate_linear_anchor(model, ids, progress=False)
    assert set(report["layers"]) == {0, 1} and report["blocks"] == 2 and report["seq_len"] == 48
    for layer, module in hybrid_attention_modules(model).items():
        anchor = module.hybrid.linear_anchor
        assert anchor.shape == (2, module.n_heads) and module.settings["linear_anchor"] is True
        assert ((anchor[0] >= 0) & (anchor[0] <= 1)).all() and report["layers"][layer]["queries"] > 0
    anchored = logits(model, ids)
    assert (anchored - pegged).abs().max() > 1e-4  # the anchor changes what the model computes
    again = calibrate_linear_anchor(model, ids, progress=False)  # fitted on the pegged mix again, not on itself
    assert again["layers"][1]["alpha"] == pytest.approx(report["layers"][1]["alpha"], abs=1e-6)
    clear_linear_anchor(model)
    assert torch.allclose(logits(model, ids), pegged, atol=1e-6, rtol=1e-5)
    assert all("linear_anchor" not in m.settings for m in hybrid_attention_modules(model).values())


def test_anchored_model_saves_loads_and_decodes(tmp_path):
    model, ids = hybrid(seed=1), tokens(seed=1)
    calibrate_linear_anchor(model, ids, progress=False)
    save(model, tmp_path / "anchored", tokenizer=build_tiny_tokenizer())
    loaded, _ = load(tmp_path / "anchored")
    for layer, module in hybrid_attention_modules(loaded).items():
        assert torch.equal(module.hybrid.linear_anchor, hybrid_attention_modules(model)[layer].hybrid.linear_anchor)
    probe = tokens(n=40, rows=1, seed=2)
    full = logits(loaded, probe)
    assert torch.allclose(full, logits(model, probe), atol=1e-6, rtol=1e-5)
    cache = HybridCache(loaded)
    with torch.no_grad():
        steps = [loaded(input_ids=probe[:, :30], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(30, 40):
            steps.append(loaded(input_ids=probe[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    assert torch.allclose(torch.stack(steps[:-1], dim=1), full[:, 29:39], atol=1e-4, rtol=1e-4)


def test_calibration_refuses_a_model_without_hybrid_layers_and_bad_blocks():
    with pytest.raises(ValueError, match="no hybrid attention layers"):
        calibrate_linear_anchor(build_tiny("llama"), tokens(), progress=False)
    with pytest.raises(ValueError, match=r"\[N >= 1, seq_len\]"):
        calibrate_linear_anchor(hybrid(), tokens()[0], progress=False)
