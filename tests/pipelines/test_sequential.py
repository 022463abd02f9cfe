"""The one layer loop: every method and allocation runs through it; resume policy."""

import pytest
import torch

import retrofitter.pipelines.compress as compress_module
from retrofitter.config import CompressConfig
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.latentllm import LatentLLMStrategy
from retrofitter.pipelines.local_svd import LocalSVDStrategy
from retrofitter.pipelines.resume import ResumeMismatchError

from tiny_models import TINY_VOCAB, build_tiny


def tokens(seed=1):
    return torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fields, strategy, allocation", [
    ({"method": "asvd-rootcov", "allocation": "uniform"}, LocalSVDStrategy, "uniform"),
    ({"method": "asvd-rootcov"}, LocalSVDStrategy, "global"),
    ({"method": "asvd-cov", "allocation": "global", "allocation_weighting": "relative"}, LocalSVDStrategy, "global"),
    ({"method": "latentllm"}, LatentLLMStrategy, "global"),
    ({"method": "latentllm", "allocation": "uniform"}, LatentLLMStrategy, "uniform"),
])
def test_every_method_and_allocation_runs_the_one_loop(monkeypatch, fields, strategy, allocation):
    seen = []
    loop = compress_module.run_sequential

    def spy(model, config, layer_strategy, planner, **kwargs):
        seen.append(type(layer_strategy))
        return loop(model, config, layer_strategy, planner, **kwargs)

    monkeypatch.setattr(compress_module, "run_sequential", spy)
    _, report = compress_model(build_tiny("llama"), CompressConfig(ratio=0.3, batch_size=4, **fields), tokens(),
                               progress=False)
    assert seen == [strategy]
    assert report["allocation"]["allocation"] == allocation
    assert len(report["ranks"]) == 2 * 7


def test_a_work_directory_of_another_run_is_refused_and_kept(tmp_path, monkeypatch):
    from retrofitter.pipelines.resume import RunDirectory

    calls = {"n": 0}
    save = RunDirectory.save_progress

    def interrupt(self, state):
        save(self, state)
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(RunDirectory, "save_progress", interrupt)
    with pytest.raises(KeyboardInterrupt):
        compress_model(build_tiny("llama"), CompressConfig(ratio=0.3), tokens(), progress=False,
                       checkpoint_dir=tmp_path / "work")
    monkeypatch.setattr(RunDirectory, "save_progress", save)
    before = sorted(p.name for p in (tmp_path / "work").iterdir())
    with pytest.raises(ResumeMismatchError, match="different run"):
        compress_model(build_tiny("llama"), CompressConfig(ratio=0.2), tokens(), progress=False,
                       checkpoint_dir=tmp_path / "work")
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == before  # nothing deleted


def test_teacher_target_equals_the_plain_fit_where_both_streams_agree():
    """Layer 0's q/k/v see the same input in both streams: their factors equal the plain fit's; later
    projections differ (they are corrected towards the original outputs)."""
    config = dict(ratio=0.3, batch_size=4, allocation="uniform", refit_within_layer=True)
    plain, _ = compress_model(build_tiny("llama"), CompressConfig(**config), tokens(), progress=False)
    target, report = compress_model(build_tiny("llama"), CompressConfig(statistics="teacher_target", **config),
                                    tokens(), progress=False)
    plain_state, target_state = plain.state_dict(), target.state_dict()
    first = [k for k in plain_state if k.startswith("model.layers.0.self_attn.") and k.split(".")[4] in
             ("q_proj", "k_proj", "v_proj")]
    assert first
    for key in first:
        torch.testing.assert_close(target_state[key], plain_state[key], rtol=1e-6, atol=1e-6)
    later = [k for k in plain_state if k.startswith("model.layers.1.") and "proj" in k]
    assert any(not torch.allclose(plain_state[k], target_state[k], atol=1e-4) for k in later)
    assert {e["method"] for r in report["layers"] for e in r["matrices"].values()} == {"teacher_target"}


def test_teacher_target_brings_the_outputs_closer_to_the_original_and_resumes(tmp_path, monkeypatch):
    from tiny_models import strong_tiny
    from retrofitter.pipelines.resume import RunDirectory

    ids = tokens()
    with torch.no_grad():
        reference = strong_tiny("llama")(ids).logits
    errors = {}
    for statistics in ("compressed", "teacher_target"):
        config = CompressConfig(ratio=0.4, batch_size=4, statistics=statistics, refit_within_layer=True)
        model, _ = compress_model(strong_tiny("llama"), config, ids, progress=False)
        with torch.no_grad():
            errors[statistics] = float((model(ids).logits - reference).pow(2).mean())
    assert errors["teacher_target"] < errors["compressed"]
    # interrupted after layer 0, resumed: the same model (both streams were checkpointed)
    config = CompressConfig(ratio=0.4, batch_size=4, statistics="teacher_target", refit_within_layer=True)
    full, _ = compress_model(strong_tiny("llama"), config, ids, progress=False)
    save = RunDirectory.save_progress

    def interrupt(self, state):
        save(self, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunDirectory, "save_progress", interrupt)
    with pytest.raises(KeyboardInterrupt):
        compress_model(strong_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "w")
    monkeypatch.setattr(RunDirectory, "save_progress", save)
    resumed, _ = compress_model(strong_tiny("llama"), config, ids, progress=False, checkpoint_dir=tmp_path / "w")
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids).logits, full(ids).logits, rtol=1e-5, atol=1e-5)
