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
    ({"method": "asvd-rootcov"}, LocalSVDStrategy, "uniform"),
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
