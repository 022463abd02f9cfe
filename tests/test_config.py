"""CompressConfig defaults and validation (config.py)."""

import pytest

from retrofitter.config import COMPRESS_METHODS, CompressConfig


def test_allocation_default_is_global_for_latentllm_and_uniform_for_local_methods():
    assert CompressConfig(method="latentllm").allocation == "global"
    for method in COMPRESS_METHODS:
        if method != "latentllm":
            assert CompressConfig(method=method).allocation == "uniform"


def test_explicit_allocation_is_kept_and_round_trips():
    config = CompressConfig(method="latentllm", allocation="uniform")
    assert config.allocation == "uniform"
    assert CompressConfig.from_dict(config.to_dict()) == config
    assert CompressConfig.from_dict(CompressConfig(method="latentllm").to_dict()).allocation == "global"


def test_bad_allocation_names_the_choices():
    with pytest.raises(ValueError, match="'uniform' or 'global'"):
        CompressConfig(allocation="water")
