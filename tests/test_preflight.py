"""Checks made before any work: the memory ``retrofitter mla`` will hold (preflight.check_mla_memory)."""

from __future__ import annotations

import gc

import pytest
import torch

from retrofitter import preflight
from retrofitter.cli import main
from retrofitter.eval.bench import cache_nbytes
from retrofitter.pipelines import mla as mla_pipeline
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from tiny_models import SAMPLE_TEXT, TINY_VOCAB, save_tiny_model_dir, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))


def _stream_storages(hidden: int, length: int) -> int:
    """Bytes of the distinct storages of every live float32 tensor shaped like a stream batch [b, length, hidden]."""
    gc.collect()
    return cache_nbytes([t for t in gc.get_objects() if type(t) is torch.Tensor and t.dim() == 3
                         and t.shape[1:] == (length, hidden) and t.dtype == torch.float32])


@pytest.mark.parametrize("settings", [dict(), dict(transfer_kl=1.0), dict(transfer_target="teacher"),
                                      dict(transfer_target="converted"),
                                      dict(transfer_target="converted", transfer_kl=1.0),
                                      dict(transfer_target="converted", mlp_transfer_lr=1e-3)])
def test_the_stream_copies_are_what_a_layers_transfer_holds(monkeypatch, settings):
    """The count the check uses equals the stream-shaped tensors alive when layer 1 trains (the streams, the
    layer's inputs and targets, the KL reference), measured on the real tensors."""
    model = strong_tiny("llama", dtype=torch.float32)
    config = MLAConfig(kv_ratio=0.25, transfer_epochs=1, transfer_batch=2, **settings)
    held = []
    real = mla_pipeline.transfer_attention

    def measuring(module, batches, **kwargs):
        held.append(_stream_storages(model.config.hidden_size, CALIBRATION.shape[1]))
        return real(module, batches, **kwargs)

    monkeypatch.setattr(mla_pipeline, "transfer_attention", measuring)
    convert_to_mla(model, config, CALIBRATION, progress=False)
    copy = CALIBRATION.numel() * model.config.hidden_size * 4
    assert held[1] == preflight.mla_stream_copies(config) * copy


def test_an_mla_run_whose_activations_do_not_fit_is_refused(monkeypatch):
    model = strong_tiny("llama", dtype=torch.float32)
    config = MLAConfig(kv_ratio=0.25, transfer_epochs=4)
    need = 4 * CALIBRATION.numel() * model.config.hidden_size * 4
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: need)
    preflight.check_mla_memory(config, model, CALIBRATION)  # exactly enough
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"--calib-samples 6 of 32 tokens: mla would hold 4 copies .* lower "
                                         r"--calib-samples"):
        preflight.check_mla_memory(config, model, CALIBRATION)
    assert preflight.mla_stream_copies(MLAConfig(kv_ratio=0.25)) == 2  # training-free: the stream in and out


def test_available_memory_is_positive():
    assert preflight.available_memory_bytes("cpu") > 0


def test_the_cli_refuses_it_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: 1024)
    out = tmp_path / "mla"
    capsys.readouterr()  # the tiny model's own saving
    assert main(["mla", str(model_dir), "--transfer-epochs", "1", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--out", str(out), "--no-eval", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mla would hold 4 copies of the calibration stream" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "tiny"]  # no output, no partial directory
