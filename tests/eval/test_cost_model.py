"""The factor-form cost model on synthetic timing tables, and the cached micro-benchmark (no real timing)."""

import json

import pytest
import torch

from retrofitter.eval import form_cost
from retrofitter.eval.cost_model import FormCostModel, form_macs, kernel_of, rank_grid
from retrofitter.modules.latent_linear import LatentLinear


def table(d_in=32, d_out=48, dense=1.0, plain=(0.2, 1.4), junction=(0.1, 1.2)):
    """Linear curves between rank 1 and rank 31 (seconds), dense flat."""
    def curve(low_high):
        return {1: low_high[0], 16: (low_high[0] + low_high[1]) / 2, 31: low_high[1]}
    return {(d_in, d_out, "dense"): {0: dense}, (d_in, d_out, "plain"): curve(plain),
            (d_in, d_out, "junction_gather"): curve(junction), (d_in, d_out, "junction_slice"): curve((0.0, 0.9))}


def test_interpolation_between_timed_ranks_and_flat_beyond():
    model = FormCostModel(table())
    assert model.seconds(32, 48, "plain", 1) == pytest.approx(0.2)
    assert model.seconds(32, 48, "plain", 16) == pytest.approx(0.8)
    assert model.seconds(32, 48, "plain", 8) == pytest.approx(0.2 + 0.6 * 7 / 15)
    assert model.seconds(32, 48, "plain", 40) == pytest.approx(1.4)
    assert model.seconds(32, 48, "dense", 7) == 1.0
    assert model.seconds(32, 48, "junction", 31, pivots_lead=True) == pytest.approx(0.9)


def test_noisy_timings_get_a_non_decreasing_envelope():
    model = FormCostModel({(8, 8, "plain"): {1: 0.5, 4: 0.3, 7: 0.6}})
    times = [model.seconds(8, 8, "plain", r) for r in range(1, 8)]
    assert times == sorted(times)
    assert times[0] == 0.5


def test_fastest_picks_dense_where_factored_is_slower():
    model = FormCostModel(table())
    assert model.fastest(32, 48, 4, ("dense", "plain", "junction"))[0] == "junction"
    form, seconds = model.fastest(32, 48, 30, ("dense", "plain", "junction"))
    assert form == "dense" and seconds == 1.0
    assert model.fastest(32, 48, 30, ("dense", "plain", "junction"), pivots_lead=True)[0] == "junction"


def test_missing_shape_is_named():
    with pytest.raises(KeyError, match="16x8"):
        FormCostModel({}).seconds(8, 16, "plain", 2)


def test_macs_and_kernels_and_grid():
    assert form_macs(10, 20, 3, "dense", tokens=2) == 400
    assert form_macs(10, 20, 3, "plain") == 90
    assert form_macs(10, 20, 3, "junction") == 81
    assert kernel_of("junction", True) == "junction_slice" and kernel_of("junction") == "junction_gather"
    grid = rank_grid(576, 192)
    assert grid[0] == 1 and grid[-1] == 191 and grid == sorted(set(grid))


@pytest.mark.parametrize("kernel", ["dense", "plain", "junction_gather", "junction_slice"])
def test_timed_modules_have_the_kernel_layout(kernel):
    module = form_cost.kernel_module(12, 8, 3, kernel, torch.float32, "cpu")
    if kernel == "dense":
        assert isinstance(module, torch.nn.Linear)
    else:
        assert isinstance(module, LatentLinear)
        assert module.pivots_lead() == (kernel == "junction_slice")
        assert module(torch.randn(5, 12)).shape == (5, 8)


def test_cache_is_written_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RETROFITTER_CACHE", str(tmp_path))
    calls = []
    def fake_time(d_in, d_out, rank, kernel, *args):
        calls.append(kernel)
        return 1e-3 * (rank + 1)

    monkeypatch.setattr(form_cost, "time_kernel", fake_time)
    requests = form_cost.shape_requests([(8, 6)], [(6, 8)])
    model = form_cost.measure_timings(requests, tokens=16, progress=False)
    first = len(calls)
    assert first == 2 * (1 + 2 * len(rank_grid(8, 6)))  # dense once, plain and one junction layout on the grid
    assert model.seconds(8, 6, "plain", 1) == pytest.approx(2e-3)
    again = form_cost.measure_timings(requests, tokens=16, progress=False)
    assert len(calls) == first and again.timings == model.timings
    path = form_cost.timings_path(form_cost.machine_key(torch.float32, "cpu"))
    data = json.loads(path.read_text())
    assert data["machine"]["threads"] == torch.get_num_threads() and "16" in data["tokens"]
    assert form_cost.load_timings(16).timings == model.timings


def test_time_kernel_returns_a_positive_median():
    assert 0 < form_cost.time_kernel(8, 6, 2, "junction_gather", tokens=4, repeats=3, warmup=1) < 1
