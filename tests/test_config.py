"""CompressConfig defaults and validation (config.py)."""

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
