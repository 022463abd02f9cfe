"""The teacher-moment store between the rank plan and the fits (pipelines/moment_spill.py)."""

import pytest
import torch

from retrofitter.linalg.moments import SecondMomentAccumulator
from retrofitter.linalg.svd import output_side_svd, weighted_svd
from retrofitter.pipelines.moment_spill import MomentSpill


def _accumulator(dim, seed):
    accumulator = SecondMomentAccumulator(dim)
    accumulator.update(torch.randn(3, 7, dim, generator=torch.Generator().manual_seed(seed)))
    return accumulator


def test_round_trip_is_bit_exact_and_keeps_shared_inputs_shared(tmp_path):
    shared, down = _accumulator(6, 0), _accumulator(10, 1)
    with MomentSpill(tmp_path) as spill:
        spill.put(3, {"q_proj": shared, "k_proj": shared, "down_proj": down})
        assert list(spill) == [3] and len(spill) == 1 and spill.bytes_written > 0
        loaded = spill[3]
        assert loaded["q_proj"] is loaded["k_proj"]  # one eigendecomposition per distinct input downstream
        assert loaded["q_proj"] is not loaded["down_proj"]
        for name, original in (("q_proj", shared), ("down_proj", down)):
            assert torch.equal(loaded[name].second_moment, original.second_moment)
            assert torch.equal(loaded[name].mean, original.mean)
            assert loaded[name].count == original.count == 21
        with pytest.raises(KeyError, match="layer 0"):
            spill[0]
        path = spill.path
        assert path.parent == tmp_path and path.exists()
    assert not path.exists()  # removed on leaving the block


def test_non_finite_moments_are_refused_with_the_layer_named(tmp_path):
    bad = SecondMomentAccumulator(4)
    bad.update(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]))
    with MomentSpill(tmp_path) as spill, pytest.raises(ValueError, match="layer 2"):
        spill.put(2, {"o_proj": bad})


def test_state_dict_round_trip_and_inconsistent_state():
    original = _accumulator(5, 2)
    copy = SecondMomentAccumulator.from_state_dict(original.state_dict())
    # copied sums, the same computation on them: bitwise
    assert torch.equal(copy.covariance(), original.covariance()) and copy.count == original.count
    copy.update(torch.ones(2, 5))  # the copy owns its sums
    assert copy.count == original.count + 2
    state = original.state_dict()
    state["weighted_sum"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="inconsistent moment state"):
        SecondMomentAccumulator.from_state_dict(state)


def test_weighted_svds_round_trip_bit_exact(tmp_path):
    shared, down = _accumulator(6, 0), _accumulator(10, 1)
    generator = torch.Generator().manual_seed(3)
    q, k, d = (torch.randn(*shape, generator=generator) for shape in ((6, 6), (3, 6), (6, 10)))
    svds = {"q_proj": weighted_svd(q, shared.second_moment), "k_proj": weighted_svd(k, shared.second_moment),
            "down_proj": output_side_svd(d, down.second_moment)}
    with MomentSpill(tmp_path) as spill:
        spill.put(0, {"q_proj": shared, "k_proj": shared, "down_proj": down}, svds)
        spill.put(1, {"q_proj": shared})  # no SVDs: an empty mapping back
        loaded = spill.weighted_svds(0)
        assert sorted(loaded) == ["down_proj", "k_proj", "q_proj"] and spill.weighted_svds(1) == {}
        for name, original in svds.items():
            for part in ("U", "S", "A"):
                assert torch.equal(getattr(loaded[name], part), getattr(original, part)), (name, part)
            for rank in (1, 3):
                for got, want in zip(loaded[name].factors(rank), original.factors(rank)):
                    assert torch.equal(got, want)  # slices and one elementwise product of copies: bitwise
        with pytest.raises(KeyError, match="layer 2"):
            spill.weighted_svds(2)
