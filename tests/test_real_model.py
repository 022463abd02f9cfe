"""End-to-end tests on the real default model, SmolLM2-135M (fetched from PyPI on first use)."""

import json

import pytest
import torch

from retrofitter.cli import main

pytestmark = pytest.mark.real_model


def test_eval_original_contract_and_accounting(tmp_path):
    out = tmp_path / "orig.json"
    assert main(["eval", "smollm2-135m", "--ppl", "wiki-eval", "--seq-len", "512", "--max-eval-tokens", "4096",
                 "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["params"]["total"] == pytest.approx(134.5e6, rel=0.002)
    assert data["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert data["settings"]["eval_tokens"]["wiki-eval"]["tokens"] == 8 * 511
    # a real trained model on clean Wikipedia prose: perplexity in the tens, not thousands
    assert 8 < data["ppl"]["wiki-eval"] < 60


def test_compress_rootcov_keeps_the_model_usable(tmp_path):
    out = tmp_path / "rootcov"
    assert main(["compress", "smollm2-135m", "--method", "asvd-rootcov", "--ratio", "0.1", "--calib", "wiki-calib",
                 "--calib-samples", "16", "--seq-len", "256", "--eval", "wiki-eval", "--max-eval-tokens", "2048",
                 "--out", str(out), "--json", str(tmp_path / "c.json"), "--quiet"]) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["reduction"]["linear"] >= 0.1
    assert data["ppl"]["wiki-eval"] < 80  # the original is ~20; plain SVD at this ratio is in the thousands
    from retrofitter.data.models import resolve_model_source

    original_size = (resolve_model_source("smollm2-135m") / "model.safetensors").stat().st_size
    compressed_size = (out / "model.safetensors").stat().st_size
    # on disk the saving matches the reported parameter reduction (fp32 both)
    assert compressed_size / original_size == pytest.approx(1 - data["reduction"]["total"], abs=0.01)
    import retrofitter

    model, tokenizer = retrofitter.load(out)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert tokens.shape[1] == ids.shape[1] + 4
