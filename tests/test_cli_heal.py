"""``retrofitter heal`` and ``compress --heal-tokens`` on a tiny local model and corpus (no download)."""

import json

import pytest
import torch

import retrofitter
from retrofitter.cli import main
from retrofitter.jobs import original_model_of
from retrofitter.modules.latent_linear import LatentLinear
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir


@pytest.fixture
def compressed_dir(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    out = tmp_path / "c"
    assert main(["compress", str(model_dir), "--ratio", "0.4", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--out", str(out), "--no-eval", "--quiet"]) == 0
    return tmp_path, model_dir, corpus, out


def test_heal_command_reports_before_after_and_control_and_saves_a_loadable_model(compressed_dir, capsys):
    tmp, model_dir, corpus, compressed = compressed_dir
    assert original_model_of(compressed) == str(model_dir)
    out = tmp / "healed"
    argv = ["heal", str(compressed), "--tokens", "512", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2",
            "--lora-rank", "4", "--train-corpus", str(corpus), "--eval", str(corpus), "--control", "--out", str(out),
            "--quiet", "--json", str(tmp / "h.json")]
    assert main(argv) == 0
    data = json.loads((tmp / "h.json").read_text())
    key = str(corpus)
    assert data["method"] == "asvd-rootcov+heal" and data["heal"]["steps"] == 8 and data["heal"]["tokens"] == 512
    assert data["ppl"][key] < data["before"]["ppl"][key]
    assert data["ppl_over_original"]["after"][key] < data["ppl_over_original"]["before"][key]
    assert data["ppl_over_original"]["control"][key] == pytest.approx(1.0, abs=0.02)
    assert data["params"] == data["before"]["params"]  # same ranks: healing costs no parameters
    assert "asvd-rootcov+heal" in capsys.readouterr().out
    model, _ = retrofitter.load(out)
    assert any(isinstance(m, LatentLinear) for m in model.modules())
    info = json.loads((out / "retrofitter.json").read_text())
    assert info["heal"]["tokens"] == 512 and info["source_model"] == str(model_dir) and info["method"] == "asvd-rootcov"
    assert not (tmp / ".healed.heal").exists()  # the work dir goes once the model is saved
    assert main(argv) == 2  # refuses the existing --out
    assert main(["report", str(tmp / "h.json"), "--out", str(tmp / "report")]) == 0
    report = (tmp / "report" / "report.md").read_text()
    assert "## Healing" in report and "| asvd-rootcov+heal |" in report and "(1.000x)" in report


def test_heal_refuses_a_plain_model_dir(compressed_dir, capsys):
    tmp, model_dir, corpus, _ = compressed_dir
    assert main(["heal", str(model_dir), "--tokens", "64", "--out", str(tmp / "x"), "--no-eval", "--quiet"]) == 2
    assert "not a saved retrofitter model" in capsys.readouterr().err


def test_compress_with_heal_tokens_saves_the_healed_model(compressed_dir):
    tmp, model_dir, corpus, _ = compressed_dir
    out = tmp / "ch"
    assert main(["compress", str(model_dir), "--ratio", "0.4", "--calib", str(corpus), "--calib-samples", "4",
                 "--seq-len", "32", "--heal-tokens", "256", "--out", str(out), "--eval", str(corpus), "--quiet",
                 "--json", str(tmp / "ch.json")]) == 0
    data = json.loads((tmp / "ch.json").read_text())
    assert data["heal"]["tokens"] > 0 and set(data["ppl_over_original"]) == {"before", "after"}
    plain, _ = retrofitter.load(tmp / "c")
    healed, _ = retrofitter.load(out)
    assert any(not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), healed.state_dict().values()))


@pytest.mark.parametrize("targets", ["gate,up,down", "q,o,gate,up,down"])
def test_compressed_mlps_with_linearized_attention_then_one_distillation(compressed_dir, targets):
    """compress (MLPs, optionally q/o) -> linearize the compressed directory -> heal all projections from the original."""
    from retrofitter.adapters.hybrid_attention import hybrid_attention_modules

    tmp, model_dir, corpus, _ = compressed_dir
    mlp_only, linear, healed = tmp / "mlp", tmp / "mlp-lin", tmp / "mlp-lin-heal"
    assert main(["compress", str(model_dir), "--ratio", "0.4", "--targets", targets, "--calib", str(corpus),
                 "--calib-samples", "4", "--seq-len", "32", "--out", str(mlp_only), "--no-eval", "--quiet",
                 "--allocation", "uniform", "--statistics", "compressed"]) == 0
    assert main(["linearize", str(mlp_only), "--transfer-tokens", "256", "--lora-tokens", "0", "--window", "8",
                 "--feature-dim", "8", "--seq-len", "32", "--batch-size", "2", "--train-corpus", str(corpus),
                 "--out", str(linear), "--no-eval", "--quiet"]) == 0
    info = json.loads((linear / "retrofitter.json").read_text())
    assert info["original_model"] == str(model_dir) and info["method"] == "asvd-rootcov+lolcats"
    assert original_model_of(linear) == str(model_dir)
    assert main(["heal", str(linear), "--tokens", "512", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3",
                 "--train-corpus", str(corpus), "--eval", str(corpus), "--out", str(healed), "--quiet",
                 "--json", str(tmp / "lh.json")]) == 0
    data = json.loads((tmp / "lh.json").read_text())
    q_tensor = "self_attn.q_proj.up" if "q" in targets else "self_attn.q_proj.weight"
    assert set(data["heal"]["targets"]) >= {q_tensor, "self_attn.k_proj.weight", "mlp.down_proj.up", "mlp.down_proj.mix"}
    assert data["ppl"][str(corpus)] < data["before"]["ppl"][str(corpus)]
    model, tokenizer = retrofitter.load(healed)
    assert len(hybrid_attention_modules(model)) == 2
    assert type(model.model.layers[0].mlp.up_proj) is LatentLinear
    assert type(model.model.layers[0].self_attn.q_proj) is (LatentLinear if "q" in targets else torch.nn.Linear)
    again, _ = retrofitter.load(healed)
    with torch.no_grad():
        ids = torch.randint(3, 60, (2, 40), generator=torch.Generator().manual_seed(0))
        assert torch.equal(again(ids).logits, model(ids).logits)  # one directory loaded twice: same kernels, bitwise
    ids = tokenizer("a truth", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5


@pytest.mark.slow
def test_torchrun_heal_command_writes_once_and_equals_the_one_process_run(compressed_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tmp, _, corpus, compressed = compressed_dir
    common = ["heal", str(compressed), "--tokens", "256", "--seq-len", "32", "--lr", "1e-2", "--lora-rank", "4",
              "--train-corpus", str(corpus), "--no-eval", "--quiet"]
    # one process at batch 4, and two processes at batch 2 each: the same blocks per step (rank r reads the
    # r-th half of the step's blocks) and the same mean gradient
    assert main([*common, "--batch-size", "4", "--out", str(tmp / "one")]) == 0
    src = Path(retrofitter.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               "-m", "retrofitter", *common, "--batch-size", "2", "--out", str(tmp / "two")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for out in ("one", "two"):  # 256 tokens = 8 blocks of 32 = 2 steps of 4 blocks (one process or two)
        assert json.loads((tmp / out / "retrofitter.json").read_text())["heal"]["steps"] == 2
    one, _ = retrofitter.load(tmp / "one")
    two, _ = retrofitter.load(tmp / "two")
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference, logits = one(ids).logits, two(ids).logits
    # the same 2 steps; the two-process gradient is an all-reduced sum of two halves, the one-process one a sum
    # over all four blocks: float32 rounding of a different summation order, through 2 Adam steps at lr 1e-2
    torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3 * float(reference.abs().max()))
    assert not any(p.name.startswith((".two.", ".one.")) for p in tmp.iterdir())  # no lock, tmp or work dir left
