"""Sequential compression pipeline on tiny random models (Llama with GQA, OPT with biases)."""

import json

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.config import CompressConfig
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.allocation import uniform_plan
from retrofitter.pipelines.compress import CalibrationError, compress_model

from tiny_models import TINY_VOCAB, build_tiny


def calibration(n=8, seq=32, seed=1):
    return torch.randint(3, TINY_VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_every_target_replaced_and_parameters_reduced(family):
    model = build_tiny(family)
    model, report = compress_model(model, CompressConfig(ratio=0.3, batch_size=4), calibration(), progress=False)
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        for name in adapter.linear_names:
            assert isinstance(adapter.get_linear(layer, name), LatentLinear)
    assert report["targets_reduction"] >= 0.3 - 1e-9
    assert report["targets_reduction"] < 0.45
    assert all(0 <= e["proxy_error"] < 1 for r in report["layers"] for e in r["matrices"].values())
    assert torch.isfinite(_logits(model, calibration(2, 16, seed=5))).all()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_rootcov_beats_plain_svd_on_calibration_loss(family):
    ids = calibration(8, 32)
    reference = _logits(build_tiny(family), ids)
    errors = {}
    for method in ("svd", "asvd-rootcov"):
        model, _ = compress_model(build_tiny(family), CompressConfig(ratio=0.4, method=method, batch_size=8), ids,
                                  progress=False)
        errors[method] = float((_logits(model, ids) - reference).pow(2).mean())
    assert errors["asvd-rootcov"] < errors["svd"]


def test_teacher_statistics_mode_runs_and_differs():
    ids = calibration()
    a, _ = compress_model(build_tiny("llama"), CompressConfig(ratio=0.3, statistics="teacher"), ids, progress=False)
    b, _ = compress_model(build_tiny("llama"), CompressConfig(ratio=0.3, statistics="compressed"), ids, progress=False)
    la, lb = _logits(a, ids), _logits(b, ids)
    # layer 0 sees identical statistics in both modes; later layers differ
    assert not torch.allclose(la, lb)


def test_targets_restrict_compression():
    model, report = compress_model(build_tiny("llama"), CompressConfig(ratio=0.3, targets=("v", "o")), calibration(),
                                   progress=False)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    assert isinstance(adapter.get_linear(layer, "v"), LatentLinear)
    assert isinstance(adapter.get_linear(layer, "q"), torch.nn.Linear)
    with pytest.raises(ValueError, match="unknown targets"):
        compress_model(build_tiny("llama"), CompressConfig(targets=("fc1",)), calibration(), progress=False)


def test_nan_weights_name_the_layer():
    model = build_tiny("llama")
    with torch.no_grad():
        adapter_for(model).get_linear(adapter_for(model).decoder_layers(model)[1], "up").weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer 1 projection 'up'"):
        compress_model(model, CompressConfig(), calibration(), progress=False)


def test_nan_statistics_name_the_layer():
    model = build_tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    ids = calibration()
    ids[0, 3] = 5
    with pytest.raises(ValueError, match=r"layer 0 input of 'q'"):
        compress_model(model, CompressConfig(allocation="uniform"), ids, progress=False)
    # the default global fisher plan meets the NaN first, in its backward pass, and names the layer too
    with pytest.raises(FloatingPointError, match=r"layer 0 'q'"):
        compress_model(model, CompressConfig(), ids, progress=False)


def test_short_calibration_is_refused():
    with pytest.raises(CalibrationError, match="fewer than the widest projection input"):
        compress_model(build_tiny("llama"), CompressConfig(), calibration(1, 8), progress=False)


def test_impossible_ratio_and_rank():
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        CompressConfig(ratio=1.0)
    with pytest.raises(ValueError, match="layer 0"):
        model = build_tiny("llama")
        adapter = adapter_for(model)
        uniform_plan(model, adapter, CompressConfig(ratio=0.999), list(adapter.linear_names))


def test_resume_after_interruption_gives_the_same_model(tmp_path, monkeypatch):
    ids = calibration()
    config = CompressConfig(ratio=0.3)
    full, _ = compress_model(build_tiny("llama"), config, ids, progress=False)

    from retrofitter.pipelines.resume import RunDirectory

    calls = {"n": 0}
    original_save = RunDirectory.save_progress

    def interrupt_after_first(self, *args, **kwargs):
        original_save(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDirectory, "save_progress", interrupt_after_first)
    with pytest.raises(KeyboardInterrupt):
        compress_model(build_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "ckpt")
    progress = json.loads((tmp_path / "ckpt" / "progress.json").read_text())
    assert progress["state"]["layers_done"] == 1
    resumed, report = compress_model(build_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "ckpt")
    assert calls["n"] == 2  # only the second layer was computed again
    assert len(report["layers"]) == 2
    torch.testing.assert_close(_logits(resumed, ids), _logits(full, ids), rtol=1e-5, atol=1e-5)
    assert not (tmp_path / "ckpt").exists()


def test_shared_teacher_moments_equal_the_teacher_pipeline():
    from retrofitter.pipelines.compress import collect_teacher_moments, compress_with_moments

    ids = calibration()
    config = CompressConfig(ratio=0.3, statistics="teacher", method="asvd-rootcov", allocation="uniform")
    direct, _ = compress_model(build_tiny("opt"), config, ids, progress=False)
    moments = collect_teacher_moments(build_tiny("opt"), ids, batch_size=config.batch_size, progress=False)
    shared, report = compress_with_moments(build_tiny("opt"), config, moments)
    torch.testing.assert_close(_logits(shared, ids), _logits(direct, ids), rtol=1e-5, atol=1e-5)
    assert report["targets_reduction"] >= 0.3


def test_svd_cache_across_ratios_gives_the_same_models():
    from retrofitter.pipelines.compress import collect_teacher_moments, compress_with_moments

    ids = calibration()
    moments = collect_teacher_moments(build_tiny("opt"), ids, progress=False)
    cache: dict = {}
    for ratio in (0.2, 0.4):
        config = CompressConfig(ratio=ratio, statistics="teacher", allocation="uniform")
        cached, _ = compress_with_moments(build_tiny("opt"), config, moments, cache)
        fresh, _ = compress_with_moments(build_tiny("opt"), config, moments)
        torch.testing.assert_close(_logits(cached, ids), _logits(fresh, ids), rtol=1e-6, atol=1e-6)
    assert len(cache) == 2 * 6  # one SVD per matrix, reused by the second ratio


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_default_fits_read_the_plans_statistics_and_equal_the_two_pass_loop(family, monkeypatch, tmp_path):
    import retrofitter.pipelines.compress as compress_module

    ids = calibration()
    config = CompressConfig(ratio=0.3, batch_size=4)  # the default: teacher statistics, global fisher plan
    assert compress_module.reuses_plan_statistics(config)

    def refused(*args, **kwargs):
        raise AssertionError("the fits recomputed a preconditioner or an SVD the plan had made")

    with monkeypatch.context() as patch:  # the fits only truncate the plan's weighted SVDs
        patch.setattr("retrofitter.pipelines.input_statistics.cheapest_weighted_svd", refused)
        patch.setattr("retrofitter.pipelines.input_statistics.weighted_svd", refused)
        patch.setattr("retrofitter.pipelines.local_svd.build_preconditioner", refused)
        one_pass, report = compress_model(build_tiny(family), config, ids, progress=False,
                                          checkpoint_dir=tmp_path / "work")
    assert report["statistics_passes"] == 1 and all(layer["passes"] == 0 for layer in report["layers"])
    assert report["statistics_spill_bytes"] > 0
    assert list(tmp_path.iterdir()) == []  # the store and the work directory are gone
    monkeypatch.setattr(compress_module, "reuses_plan_statistics", lambda *args, **kwargs: False)
    two_pass, report = compress_model(build_tiny(family), config, ids, progress=False)
    assert all(layer["passes"] == 1 for layer in report["layers"])
    expected = two_pass.state_dict()
    for key, tensor in one_pass.state_dict().items():
        # the same sums (one pass, same batches and order), then the same functions on them (the plan's SVD is
        # "the fit's own computation", pipelines/allocation.py), in this process: the same factors bit for bit
        assert torch.equal(tensor, expected[key]), key
