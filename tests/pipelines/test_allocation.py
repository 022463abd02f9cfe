"""Global rank allocation: exact budget (±1 rank step) and better calibration loss than uniform."""

import pytest
import torch

from retrofitter.config import CompressConfig
from retrofitter.linalg.ranks import factor_param_count
from retrofitter.pipelines.allocation import RankItem, allocate_ranks
from retrofitter.pipelines.compress import compress_model

from tiny_models import TINY_VOCAB, build_tiny


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


def strong_tiny():
    model = build_tiny("llama")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and ".layers." in name:
                param.mul_(8)
    return model


def test_global_beats_uniform_on_calibration_loss_at_same_budget():
    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    reference = strong_tiny()(tokens).logits
    results = {}
    for allocation in ("uniform", "global"):
        config = CompressConfig(method="latentllm", ratio=0.4, allocation=allocation, batch_size=4)
        model, report = compress_model(strong_tiny(), config, tokens, progress=False)
        with torch.no_grad():
            results[allocation] = (float((model(tokens).logits - reference).pow(2).mean()),
                                   report["targets_params_after"], report)
    dense = results["global"][2]["targets_params_before"]
    assert results["global"][1] <= 0.6 * dense  # same budget: (1 − ratio) of the dense parameters
    assert results["global"][1] >= results["uniform"][1] - 64  # and uses it (uniform rounds ranks down)
    assert results["global"][0] < results["uniform"][0]
