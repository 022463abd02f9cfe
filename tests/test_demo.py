"""The demo's code path end to end on a tiny local model (fetch and corpora replaced by local text)."""

import json

import pytest

import retrofitter.data.corpora as corpora
import retrofitter.data.fetch as fetch_module
from retrofitter.demo import run_demo
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir


def test_demo_writes_rows_for_uniform_and_global_allocation_and_a_report(tmp_path, monkeypatch):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 20)
    real_load_text = corpora.load_text
    monkeypatch.setattr(fetch_module, "fetch", lambda names, progress=True: None)
    monkeypatch.setattr(corpora, "load_text", lambda name: real_load_text(str(corpus)))
    out = tmp_path / "demo"
    report = run_demo(out=out, model_name=str(model_dir), ratios=(0.2, 0.4), corpora=(str(corpus),),
                      calib_samples=4, seq_len=32, max_eval_tokens=256, bench=False, progress=False)
    assert report.exists()
    rows = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert {"original", "asvd-rootcov-0.2", "asvd-rootcov-0.4", "rootcov-global-fisher-0.2",
            "rootcov-global-fisher-0.4", "mla-kv0.25"} <= set(rows)
    assert rows["mla-kv0.25"]["kv_bytes_per_token"] == rows["original"]["kv_bytes_per_token"] // 4
    for ratio in (0.2, 0.4):
        uniform, fisher = rows[f"asvd-rootcov-{ratio:g}"], rows[f"rootcov-global-fisher-{ratio:g}"]
        assert fisher["reduction"]["linear"] >= ratio - 0.02  # the same budget
        assert fisher["params"]["linear"] <= (1 - ratio) * rows["original"]["params"]["linear"] + 1
        assert fisher["ppl"] != uniform["ppl"]  # a different model, not a copy
