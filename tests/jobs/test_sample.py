"""``retrofitter sample`` on a tiny local model: the file, its use as calibration text, resume and refusals."""

import json

import pytest
import torch

import retrofitter.jobs.sample as sample_module
from retrofitter.cli import main
from retrofitter.data.corpora import load_text
from retrofitter.jobs.sample import partial_paths


def _argv(model_dir, corpus, out, *extra):
    return ["sample", str(model_dir), "--prompts", str(corpus), "--samples", "5", "--prompt-tokens", "8",
            "--new-tokens", "24", "--batch-size", "2", "--out", str(out), "--quiet", *extra]


def test_sample_writes_texts_that_calibrate_a_conversion(workspace, capsys):
    tmp, model_dir, corpus = workspace
    out = tmp / "samples.txt"
    assert main(_argv(model_dir, corpus, out, "--json", str(tmp / "s.json"))) == 0
    texts = out.read_text().split("\n\n")
    assert texts[-1] == "" and len([t for t in texts if t.strip()]) >= 5  # a sample may hold a blank line itself
    report = json.loads((tmp / "s.json").read_text())
    assert report["samples"] == 5 and report["tokens"] == 5 * 32 and report["resumed_from"] == 0
    assert report["settings"]["prompts"] == str(corpus) and report["settings"]["new_tokens"] == 24
    assert "wrote" in capsys.readouterr().out
    assert not any(p.exists() for p in partial_paths(out))
    assert main(_argv(model_dir, corpus, out)) == 2  # an existing file is not replaced silently
    assert "pass --overwrite" in capsys.readouterr().err
    joined = f"{corpus},{out}"
    assert load_text(joined).startswith(load_text(corpus).strip("\n")) and load_text(joined).endswith(
        out.read_text().strip("\n"))
    assert main(["mla", str(model_dir), "--kv-ratio", "0.5", "--calib", joined, "--calib-samples", "4",
                 "--seq-len", "32", "--out", str(tmp / "m"), "--no-eval", "--quiet"]) == 0


def _integer_batches(model, prompts, config, bos_id, pad_id, start=0):
    """``sample_batches``' contract (batches from ``start``, each prompt followed by ``new_tokens`` ids depending on
    the seed ``config.seed + first``) in integer arithmetic: the same ids on every CPU, so the test below checks the
    job's resume and file assembly exactly (the real sampling is tested in tests/pipelines/test_sample_text.py)."""
    vocab = model.config.vocab_size
    for first in range(start, prompts.shape[0], config.batch_size):
        batch = prompts[first:first + config.batch_size]                                   # [b, P] int64
        new = (batch.sum(1, keepdim=True) + config.seed + first + torch.arange(config.new_tokens)) % (vocab - 3) + 3
        yield first, torch.cat([batch, new], dim=1)                                        # [b, P + N]


@pytest.mark.parametrize("stop_after, done", [(1, 2), (3, 5)])  # batches of 2, 2, 1; 3: all written, not renamed
def test_an_interrupted_sample_resumes_to_the_same_file(workspace, monkeypatch, stop_after, done):
    tmp, model_dir, corpus = workspace
    monkeypatch.setattr(sample_module, "sample_batches", _integer_batches)
    whole = tmp / "whole.txt"
    assert main(_argv(model_dir, corpus, whole)) == 0
    batches = sample_module.sample_batches

    def one_batch_then_stop(*args, **kwargs):
        for count, item in enumerate(batches(*args, **kwargs), 1):
            yield item
            if count == stop_after:
                raise KeyboardInterrupt

    out = tmp / "resumed.txt"
    monkeypatch.setattr(sample_module, "sample_batches", one_batch_then_stop)
    assert main(_argv(model_dir, corpus, out)) == 130
    partial, note = partial_paths(out)
    assert not out.exists() and json.loads(note.read_text())["samples"] == done
    assert main(_argv(model_dir, corpus, out, "--seed", "7")) == 2  # other settings: refused, nothing lost
    assert partial.exists()
    monkeypatch.setattr(sample_module, "sample_batches", batches)
    assert main(_argv(model_dir, corpus, out, "--json", str(tmp / "r.json"))) == 0
    assert json.loads((tmp / "r.json").read_text())["resumed_from"] == done
    assert out.read_text() == whole.read_text()
    assert not partial.exists() and not note.exists()
