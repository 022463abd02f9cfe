"""Data-parallel calibration (pipelines/distributed.py): 2 processes under torchrun (gloo) give the model of 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import retrofitter
from retrofitter.cli import main
from retrofitter.linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator
from retrofitter.pipelines.distributed import SINGLE_PROCESS, DataParallel, backend_for
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir


def test_shard_keeps_whole_batches_and_covers_every_block():
    blocks = torch.arange(10).view(10, 1)
    shards = [DataParallel(rank, 2).shard(blocks, batch_size=3) for rank in range(2)]  # batches 0-1 | 2-3
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert SINGLE_PROCESS.shard(blocks, 3) is blocks
    with pytest.raises(ValueError, match="--calib-samples"):
        DataParallel(0, 4).shard(blocks, batch_size=4)  # 3 batches for 4 processes


def test_synchronized_moments_equal_one_pass_over_all_rows():
    """Two accumulators over halves of the rows, summed as all_reduce would, equal one over all rows."""
    x = torch.randn(50, 6, dtype=torch.float64)
    whole, halves = SecondMomentAccumulator(6), [SecondMomentAccumulator(6), SecondMomentAccumulator(6)]
    whole.update(x)
    halves[0].update(x[:20])
    halves[1].update(x[20:])
    other = halves[1]

    def fake_all_reduce(tensor):  # rank 0's view: its tensors plus rank 1's, in the order of synchronize
        tensor += fake_all_reduce.pending.pop(0)

    fake_all_reduce.pending = [other.mean * other.count, other.second_moment * other.count,
                               torch.tensor([other.count], dtype=torch.float64)]
    halves[0].synchronize(fake_all_reduce)
    assert halves[0].count == 50
    torch.testing.assert_close(halves[0].second_moment, whole.second_moment, rtol=1e-14, atol=1e-14)
    cross = CrossMomentAccumulator(6, 6)
    cross.update(x, x)
    assert cross.synchronize(lambda t: None).count == 50  # one process: unchanged
    assert backend_for("cpu") == "gloo" and backend_for("cuda:0") == "nccl"


def _max_abs_diff(a, b) -> float:
    left, right = a.state_dict(), b.state_dict()
    assert set(left) == set(right)
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


def _torchrun(args, processes: int, cwd: Path):
    """``python -m torch.distributed.run --standalone --nproc_per_node N -m retrofitter ARGS`` (gloo on CPU)."""
    source = str(Path(retrofitter.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "retrofitter", *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("flags", [
    # global fisher allocation: all-reduced moments and gradient prices; q/k/v... fits spread over the processes
    ["--method", "asvd-rootcov", "--allocation", "global", "--allocation-gradient-blocks", "4"],
    # out of core, latentllm: joint fits on all-reduced moments, streaming MLP statistics all-reduced
    ["--method", "latentllm", "--allocation", "uniform", "--out-of-core"],
], ids=["global-fisher", "latentllm-out-of-core"])
def test_two_processes_give_the_model_of_one(tmp_path, flags):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    common = ["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "8",
              "--seq-len", "32", "--batch-size", "2", "--no-eval", "--quiet", *flags]
    assert main(common + ["--out", str(tmp_path / "one"), "--json", str(tmp_path / "one.json")]) == 0
    _torchrun(common + ["--out", str(tmp_path / "two"), "--json", str(tmp_path / "two.json")], 2, tmp_path)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["allocation"].get("keep_fraction_by_layer") == one["allocation"].get("keep_fraction_by_layer")
    single, _ = retrofitter.load(tmp_path / "one")
    double, _ = retrofitter.load(tmp_path / "two")
    assert _max_abs_diff(single, double) < 1e-4
    assert not list(tmp_path.glob(".*.partial")) and not list(tmp_path.glob(".*.lock"))
