"""`retrofitter recall` on a tiny linearized model: sinks, a sparse cache and kept softmax layers, saved and loaded."""

import json

import pytest
import torch

from retrofitter.adapters.hybrid_attention import hybrid_attention_modules
from retrofitter.api import load
from retrofitter.cli import main
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir


def test_recall_command_sets_sinks_cache_and_kept_layers(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "train.txt"
    text.write_text(SAMPLE_TEXT * 4)
    lin, out = tmp_path / "lin", tmp_path / "recall"
    assert main(["linearize", str(model_dir), "--train-corpus", str(text), "--seq-len", "64", "--transfer-tokens",
                 "128", "--lora-tokens", "0", "--window", "8", "--feature-dim", "8", "--no-eval", "--out", str(lin),
                 "--quiet"]) == 0
    assert main(["recall", str(model_dir), "--out", str(tmp_path / "x"), "--no-eval", "--quiet"]) == 2  # not linearized
    results = tmp_path / "recall.json"
    argv = ["recall", str(lin), "--sinks", "2", "--sparse-cache", "3", "--keep-softmax-top", "1", "--probe-corpus",
            str(text), "--probe-tokens", "160", "--eval", str(text), "--eval-seq-len", "64", "--out", str(out), "--json",
            str(results), "--quiet"]
    assert main(argv) == 0
    data = json.loads(results.read_text())
    kept = data["recall"]["kept_softmax_layers"]
    assert len(kept) == 1 and data["recall"]["hybrid_layers"] == [1 - kept[0]]
    assert set(data["recall_ranking"]["gains"]) == {"0", "1"}  # JSON keys
    assert main(argv) == 2  # the existing --out is not replaced without --overwrite
    model, _ = load(out)
    (module,) = hybrid_attention_modules(model).values()
    assert (module.hybrid.recall.sinks, module.hybrid.recall.sparse_cache) == (2, 3)
    tokens = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        generated = model.generate(input_ids=tokens, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 44)
    scores = tmp_path / "passkey.json"
    assert main(["eval", str(out), "--ppl", str(text), "--seq-len", "64", "--passkey", "220", "--passkey-trials", "1",
                 "--passkey-depths", "0.2,0.8", "--passkey-keys", "2", "--json", str(scores), "--quiet"]) == 0
    record = json.loads(scores.read_text())
    assert set(record["passkey"]["by_context_depth"]) == {"220@0.2", "220@0.8"}
    assert record["multikey"]["settings"]["keys"] == 2 and len(record["multikey"]["trials"]) == 2
    with pytest.raises(SystemExit) as refused:  # argparse: one line, exit status 2
        main(["eval", str(out), "--passkey", "220", "--passkey-depths", "1.5", "--quiet"])
    assert refused.value.code == 2


def test_recall_command_keeps_layers_by_retrieval_score(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "train.txt"
    text.write_text(SAMPLE_TEXT * 4)
    lin, results = tmp_path / "lin", tmp_path / "recall.json"
    assert main(["linearize", str(model_dir), "--train-corpus", str(text), "--seq-len", "64", "--transfer-tokens", "0",
                 "--lora-tokens", "0", "--window", "8", "--no-eval", "--out", str(lin), "--quiet"]) == 0
    assert main(["recall", str(lin), "--keep-softmax-top", "1", "--keep-softmax-by", "retrieval", "--probe-corpus",
                 str(text), "--probe-tokens", "160", "--no-eval", "--out", str(tmp_path / "out"), "--json",
                 str(results), "--quiet"]) == 0
    data = json.loads(results.read_text())
    ranking = data["recall_ranking"]
    assert ranking["by"] == "retrieval" and set(ranking["scores"]) == {"0", "1"}
    assert data["recall"]["kept_softmax_layers"] == [int(max(ranking["scores"], key=ranking["scores"].get))]


def test_linearize_preset_swa_sinks_recall_keeps_ranked_layers_without_training(tmp_path, capsys):
    from retrofitter.config import LinearizeConfig

    preset = LinearizeConfig.preset("swa-sinks-recall")
    assert (preset.transfer_tokens, preset.lora_tokens, preset.keep_softmax_top, preset.keep_softmax_by,
            preset.probe_tokens, preset.sparse_cache) == (0, 0, 5, "retrieval+reach", 4096, 256)
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "train.txt"
    text.write_text(SAMPLE_TEXT * 4)
    out, results = tmp_path / "lin", tmp_path / "lin.json"
    argv = ["linearize", str(model_dir), "--preset", "swa-sinks-recall", "--keep-softmax-top", "1", "--train-corpus",
            str(text), "--seq-len", "64", "--window", "8", "--sparse-cache", "3", "--no-eval", "--out", str(out), "--json", str(results),
            "--quiet"]
    assert main([*argv[:-5], "--probe-tokens", "100000", *argv[-5:]]) == 2  # beyond the model's positions: refused
    assert "--probe-tokens 100000 exceeds" in capsys.readouterr().err
    assert main([*argv[:-5], "--probe-tokens", "160", *argv[-5:]]) == 0
    model, _ = load(out)
    (module,) = hybrid_attention_modules(model).values()
    assert (module.hybrid.recall.sinks, module.hybrid.recall.sparse_cache) == (4, 3)
    assert len([layer for layer in model.model.layers if layer.self_attn is not module]) == 1  # one kept softmax
    data = json.loads(results.read_text())
    kept = data["recall_ranking"]["restored_softmax_layers"]
    assert data["recall_ranking"]["by"] == "retrieval+reach" and kept == [1 - module.layer_idx]
    metadata = json.loads((out / "retrofitter.json").read_text())
    assert (metadata["kept_softmax_layers"], metadata["replaced_layers"]) == (kept, [module.layer_idx])
