"""CompressConfig defaults and validation, the per-method options (config/compress.py, config/methods.py)."""

import pytest

from retrofitter.config import COMPRESS_METHODS, CompressConfig


def test_defaults_are_the_measured_best_global_fisher_with_teacher_statistics_for_local_methods():
    default = CompressConfig()
    assert (default.method, default.allocation, default.allocation_weighting) == ("asvd-rootcov", "global", "fisher")
    assert default.statistics == "teacher" and default.refit_within_layer is False  # one pass of the original
    latent = CompressConfig(method="latentllm")
    assert (latent.allocation, latent.statistics, latent.refit_within_layer) == ("global", "compressed", True)
    for method in COMPRESS_METHODS:
        if method != "latentllm":
            assert CompressConfig(method=method).allocation == "global"
            assert CompressConfig(method=method).statistics == "teacher"
    # sequential statistics with global allocation refit within the layer, as measured
    assert CompressConfig(statistics="compressed").refit_within_layer is True
    assert CompressConfig(statistics="compressed", allocation="uniform").refit_within_layer is False


def test_explicit_allocation_is_kept_and_round_trips():
    config = CompressConfig(method="latentllm", allocation="uniform")
    assert config.allocation == "uniform"
    assert CompressConfig.from_dict(config.to_dict()) == config
    assert CompressConfig.from_dict(CompressConfig(method="latentllm").to_dict()).allocation == "global"


def test_bad_allocation_names_the_choices():
    with pytest.raises(ValueError, match="'uniform' or 'global'"):
        CompressConfig(allocation="water")


def test_each_method_has_its_own_options_and_they_round_trip():
    from retrofitter.config import LatentLLMOptions, LocalSVDOptions

    assert type(CompressConfig().options) is LocalSVDOptions
    config = CompressConfig(method="latentllm", options=LatentLLMOptions(joint_vo=True, kv_ratio=0.5))
    assert config.to_dict()["options"]["kv_ratio"] == 0.5 and "kv_ratio" not in config.to_dict()
    assert CompressConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="--method asvd-rootcov takes LocalSVDOptions, got LatentLLMOptions"):
        CompressConfig(options=LatentLLMOptions())


def test_flat_dicts_of_saved_configs_still_read():
    """retrofitter.json and results JSON held every method's fields flat before per-method options."""
    flat = {"ratio": 0.3, "method": "latentllm", "joint_vo": True, "kv_ratio": 0.5, "factor_forms": "junction",
            "budget": "params", "latency_tokens": 512, "statistics": "compressed", "allocation": "global"}
    config = CompressConfig.from_dict(flat)
    assert config.options.joint_vo and config.options.kv_ratio == 0.5
    with pytest.raises(ValueError, match=r"factor_forms \(--factor-forms\) is an option of --method svd"):
        CompressConfig.from_dict({**flat, "factor_forms": "fastest"})  # another method's setting, not its default
    with pytest.raises(ValueError, match="is an option of"):  # the command line refuses it even at its default
        CompressConfig.from_flat({"method": "latentllm", "budget": "params"}, other_defaults_ok=False)
    with pytest.raises(ValueError, match="unknown CompressConfig field 'rank'"):
        CompressConfig.from_dict({"rank": 3})


def test_cross_field_checks_run_at_construction():
    from retrofitter.config import LatentLLMOptions

    with pytest.raises(ValueError, match="mlp_algorithm='auxiliary'"):
        CompressConfig(method="latentllm", statistics="teacher_target",
                       options=LatentLLMOptions(mlp_algorithm="auxiliary"))
    with pytest.raises(ValueError, match="refit_within_layer must be on"):
        CompressConfig(method="latentllm", refit_within_layer=False)
    with pytest.raises(ValueError, match="qk_iterations must be >= 1"):
        LatentLLMOptions(qk_iterations=0)
