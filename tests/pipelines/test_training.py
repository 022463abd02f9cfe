"""pipelines/training.py: the autocast dtype of the training stages ("auto": bfloat16 only where it is native)."""

import pytest
import torch

import retrofitter.pipelines.training as training_module
from retrofitter.pipelines.heal import HealConfig
from retrofitter.pipelines.mla import MLAConfig
from retrofitter.pipelines.training import autocast_to, resolve_autocast_dtype


def test_auto_is_bfloat16_only_for_float32_weights_where_bfloat16_is_native(monkeypatch):
    single, double = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    for native in (True, False):
        monkeypatch.setattr(training_module, "native_bfloat16", lambda device, native=native: native)
        assert resolve_autocast_dtype("auto", single) == ("bfloat16" if native else "float32")
        assert resolve_autocast_dtype("auto", double) == "float32"  # autocast leaves float64 as it is
        assert resolve_autocast_dtype("auto", single.bfloat16()) == "float32"  # nothing to cast
        for explicit in ("float32", "bfloat16"):
            assert resolve_autocast_dtype(explicit, single) == explicit
    with pytest.raises(ValueError, match="auto"):
        resolve_autocast_dtype("float16", single)
    assert MLAConfig().transfer_dtype == "auto"


def test_autocast_to_casts_matmuls_only_for_bfloat16():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast_to("bfloat16", "cpu"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast_to("float32", "cpu"):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="autocast dtype"):
        autocast_to("auto", "cpu")  # resolve first
