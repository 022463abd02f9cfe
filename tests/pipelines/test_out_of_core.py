"""Out-of-core compression (pipelines/out_of_core.py): one layer resident at a time, the factors and the output
directory of the in-memory path."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import retrofitter
from retrofitter.adapters import UnsupportedArchitectureError
from retrofitter.checkpoint import load_retrofitted
from retrofitter.cli import main
from retrofitter.config import CompressConfig
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.offload import LayerOffload
from retrofitter.pipelines.out_of_core import compress_out_of_core
from tiny_models import SAMPLE_TEXT, TINY_VOCAB, build_tiny, save_tiny_model_dir

CALIBRATION = torch.randint(3, TINY_VOCAB, (8, 16), generator=torch.Generator().manual_seed(1))


def _max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    left, right = a.state_dict(), b.state_dict()
    assert set(left) == set(right)
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


@pytest.mark.parametrize("family,method,shard", [("llama", "asvd-rootcov", None), ("llama", "asvd-rootcov", "20KB"),
                                                 ("opt", "svd-llm", "20KB"), ("gemma3", "latentllm", None)])
def test_out_of_core_equals_in_memory(tmp_path, family, method, shard):
    source = tmp_path / "source"
    build_tiny(family).save_pretrained(source, **({"max_shard_size": shard} if shard else {}))
    assert (source / "model.safetensors.index.json").exists() == (shard is not None)
    config = CompressConfig(ratio=0.3, method=method, allocation="uniform", batch_size=2)
    reference, reference_report = compress_model(build_tiny(family), config, CALIBRATION, progress=False)
    _, report = compress_out_of_core(source, tmp_path / "out", config, CALIBRATION, work_dir=tmp_path / "work",
                                     progress=False)
    loaded = load_retrofitted(tmp_path / "out")
    # bitwise by construction: out of core runs the very loop of compress_model (the same batches, kernels and
    # shapes, in this process), only on layers read from the shards (float32 copies of the same weights)
    assert _max_abs_diff(reference, loaded) == 0.0  # identical factors, biases, pivots
    assert report["ranks"] == reference_report["ranks"]
    info = json.loads((tmp_path / "out" / "retrofitter.json").read_text())
    assert info["ranks"] == reference_report["ranks"] and info["replacements"]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) <= set(loaded.state_dict())
    with torch.no_grad():
        assert torch.equal(reference(CALIBRATION[:2]).logits, loaded(CALIBRATION[:2]).logits)  # same weights: bitwise


class _OneLayerAtATime(LayerOffload):
    """Records, at every read, how many decoder layers hold real (non-meta) tensors."""

    resident: list

    def onload(self, index, layer):
        super().onload(index, layer)
        layers = self.adapter.decoder_layers(self.model)
        self.resident.append(sum(any(not p.is_meta for p in l.parameters()) for l in layers))


def test_only_one_layer_is_resident(tmp_path, monkeypatch):
    import retrofitter.pipelines.out_of_core as out_of_core

    build_tiny("llama").save_pretrained(tmp_path / "source")
    _OneLayerAtATime.resident = []
    monkeypatch.setattr(out_of_core, "LayerOffload", _OneLayerAtATime)
    config = CompressConfig(ratio=0.3, batch_size=2, allocation="uniform")
    model, _ = compress_out_of_core(tmp_path / "source", tmp_path / "out", config,
                                    CALIBRATION, work_dir=tmp_path / "work", progress=False)
    assert _OneLayerAtATime.resident == [1, 1]
    assert all(p.is_meta for p in model.parameters())  # nothing left in memory at the end


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (Linux /proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_read_tensors_are_copies_so_no_mapping_of_the_shard_outlives_the_read(tmp_path):
    from retrofitter.pipelines.offload import SafetensorsCheckpoint

    build_tiny("llama").save_pretrained(tmp_path / "source")  # float32 on disk: a cast would be a no-op
    shard = tmp_path / "source" / "model.safetensors"
    tensors = SafetensorsCheckpoint(tmp_path / "source").read(["model.embed_tokens.weight"], torch.float32)
    pointer = tensors["model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert not any(start <= pointer < end for start, end in _mapped_ranges(shard.resolve()))
    assert _mapped_ranges(shard.resolve()) == []  # the file is unmapped once read


def test_interrupted_run_resumes_to_the_same_model(tmp_path, monkeypatch):
    import retrofitter.pipelines.out_of_core as out_of_core

    build_tiny("llama").save_pretrained(tmp_path / "source")
    config = CompressConfig(ratio=0.3, batch_size=2, allocation="uniform")

    class Interrupted(LayerOffload):
        def onload(self, index, layer):
            if index == 1:
                raise KeyboardInterrupt
            super().onload(index, layer)

    monkeypatch.setattr(out_of_core, "LayerOffload", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        compress_out_of_core(tmp_path / "source", tmp_path / "out", config, CALIBRATION, work_dir=tmp_path / "work",
                             progress=False)
    assert (tmp_path / "work" / "layer_0.safetensors").exists() and not (tmp_path / "out").exists()
    monkeypatch.setattr(out_of_core, "LayerOffload", LayerOffload)
    compress_out_of_core(tmp_path / "source", tmp_path / "out", config, CALIBRATION, work_dir=tmp_path / "work",
                         progress=False)
    reference, _ = compress_model(build_tiny("llama"), config, CALIBRATION, progress=False)
    # layer 0 and its output stream are read back bit for bit; layer 1 replays the in-memory loop's kernels
    assert _max_abs_diff(reference, load_retrofitted(tmp_path / "out")) == 0.0


def test_refusals_name_the_setting(tmp_path):
    build_tiny("phi3").save_pretrained(tmp_path / "phi3")
    with pytest.raises(UnsupportedArchitectureError, match="fused"):
        compress_out_of_core(tmp_path / "phi3", tmp_path / "out", CompressConfig(ratio=0.3, allocation="uniform"),
                             CALIBRATION,
                             work_dir=tmp_path / "work", progress=False)
    with pytest.raises(ValueError, match="--allocation uniform"):
        compress_out_of_core(tmp_path / "phi3", tmp_path / "out", CompressConfig(ratio=0.3, method="latentllm"),
                             CALIBRATION, work_dir=tmp_path / "work", progress=False)


def test_cli_out_of_core_matches_in_memory(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    common = ["compress", str(model_dir), "--ratio", "0.3", "--calib", str(corpus), "--calib-samples", "4",
              "--seq-len", "32", "--no-eval", "--quiet", "--allocation", "uniform"]
    assert main(common + ["--out", str(tmp_path / "memory")]) == 0
    assert main(common + ["--out", str(tmp_path / "ooc"), "--out-of-core", "--json", str(tmp_path / "r.json")]) == 0
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["out_of_core"] is True and record["params"]["total"] > 0
    assert not (tmp_path / ".ooc.partial").exists()
    in_memory, _ = retrofitter.load(tmp_path / "memory")
    out_of_core, _ = retrofitter.load(tmp_path / "ooc")
    assert _max_abs_diff(in_memory, out_of_core) == 0.0  # as above: one loop, one process, one thread count
