"""LoLCATs pipeline on tiny models: stage 1 lowers the transfer MSE, block-wise resume, LoRA, save/load, CLI."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retrofitter.adapters.hybrid_attention import HybridCache, hybrid_attention_modules
from retrofitter.api import load, save
from retrofitter.config import LinearizeConfig
from retrofitter.eval.perplexity import block_nll
from retrofitter.pipelines.linearize import attention_transfer, linearize_model, swap_attention, transfer_mse
from retrofitter.pipelines.lora import lora_finetune
from tiny_models import SAMPLE_TEXT, TINY_VOCAB, build_tiny, save_tiny_model_dir, strong_tiny

SRC = Path(__file__).resolve().parents[2] / "src"


def config(**overrides):
    base = dict(window=4, feature_dim=8, transfer_tokens=256, lora_tokens=256, seq_len=32, batch_size=2,
                transfer_epochs=3, transfer_lr=1e-2, lora_lr=1e-3, grad_clip=0.0)
    return LinearizeConfig(**{**base, **overrides})


def blocks(n=8, length=32, seed=0):
    return torch.randint(3, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def swapped(cfg, seed=0):
    model = build_tiny("llama", seed=seed)
    swap_attention(model, cfg)
    return model


def hybrid_state(model):
    return {f"{layer}.{k}": v.clone() for layer, m in hybrid_attention_modules(model).items()
            for k, v in m.hybrid.state_dict().items()}


def test_attention_transfer_lowers_every_layers_mse_and_trains_only_feature_maps_and_mix():
    cfg = config(transfer_epochs=4)
    model = swapped(cfg)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if ".hybrid." not in k}
    report = attention_transfer(model, blocks(), cfg, progress=False)
    for layer, entry in report["layers"].items():
        assert entry["mse_after"] < 0.9 * entry["mse_before"], (layer, entry)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    assert transfer_mse(model, blocks()[:2]) == pytest.approx({k: v["mse_after"] for k, v in report["layers"].items()})


def test_blockwise_transfer_matches_joint_and_resumes_skipping_done_layers(tmp_path):
    joint = swapped(config())
    attention_transfer(joint, blocks(), config(), progress=False)
    cfg = config(transfer_mode="blockwise")
    first = swapped(cfg)
    report = attention_transfer(first, blocks(), cfg, progress=False, work_dir=tmp_path)
    assert report["resumed_layers"] == []
    # Layers are independent given teacher inputs: the same updates as the joint run (no clipping).
    for key, value in hybrid_state(joint).items():
        assert torch.allclose(value, hybrid_state(first)[key], atol=1e-5), key
    # Simulate an interruption after layer 0: layer 1 is retrained, layer 0 is loaded from disk.
    progress = json.loads((tmp_path / "progress.json").read_text())
    del progress["state"]["done_layers"]["1"]
    (tmp_path / "progress.json").write_text(json.dumps(progress))
    resumed = swapped(cfg)
    report = attention_transfer(resumed, blocks(), cfg, progress=False, work_dir=tmp_path)
    assert report["resumed_layers"] == [0]
    for key, value in hybrid_state(first).items():
        assert torch.allclose(value, hybrid_state(resumed)[key], atol=1e-6), key
    with pytest.raises(ValueError, match="different run"):
        attention_transfer(swapped(cfg), blocks(seed=1), cfg, progress=False, work_dir=tmp_path)


def _kl_to(model, teacher, ids):
    from retrofitter.pipelines.distill import kl_divergence_sum

    with torch.no_grad():
        return float(kl_divergence_sum(model(ids).logits, teacher(ids).logits))


@pytest.mark.parametrize("lora_loss", ["next_token", "kl"])
def test_lora_stage_trains_merges_and_leaves_feature_maps_alone(lora_loss):
    cfg = config(lora_lr=1e-2 if lora_loss == "next_token" else 3e-3, lora_loss=lora_loss)
    teacher = strong_tiny("llama")  # the model before the swap (strong: its attention matters)
    model = strong_tiny("llama")
    swap_attention(model, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        nll_before = float(block_nll(model, blocks()).sum())
    kl_before = _kl_to(model, teacher, blocks())
    merged, report = lora_finetune(model, blocks(), cfg, progress=False, teacher=teacher)
    after = merged.state_dict()
    assert set(after) == set(before)  # merged: no LoRA tensors remain
    assert report["steps"] == 4 and report["targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for k in changed)
    if lora_loss == "next_token":
        with torch.no_grad():
            assert float(block_nll(merged, blocks()).sum()) < nll_before  # it fits its training data better
    else:
        assert _kl_to(merged, teacher, blocks()) < 0.95 * kl_before  # it is closer to the original (4 steps)
        assert report["loss"] == "kl"


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_chunked_next_token_loss_equals_hf_labels_loss_with_gradients(family):
    from retrofitter.pipelines.lora import ChunkedNextTokenLoss

    model = build_tiny(family).to(torch.float64)
    ids = blocks(2, 29)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # float64 end to end
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    reference_grad = torch.autograd.grad(reference, model.get_output_embeddings().weight)[0]
    chunked = ChunkedNextTokenLoss(model, chunk_tokens=5)(ids)  # 28 targets: 5 full chunks + 3
    chunked_grad = torch.autograd.grad(chunked, model.get_output_embeddings().weight)[0]
    torch.testing.assert_close(chunked, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_grad, reference_grad, rtol=1e-10, atol=1e-12)
    hf_loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF computes it in float32
    assert float(chunked.detach()) == pytest.approx(float(hf_loss.detach()), rel=1e-6)


def test_lora_with_gradient_checkpointing_gives_the_same_weights_as_without():
    """Checkpointing only recomputes activations: the merged weights agree (float64) with the stored-activation run."""
    results = {}
    for checkpointing in (False, True):
        cfg = config(lora_lr=1e-2, gradient_checkpointing=checkpointing)
        model = swapped(cfg).to(torch.float64)
        merged, _ = lora_finetune(model, blocks(), cfg, progress=False)
        results[checkpointing] = merged.state_dict()
        assert not merged.is_activation_checkpointing  # switched off again after training
    for key, value in results[False].items():
        torch.testing.assert_close(results[True][key], value, rtol=1e-9, atol=1e-11)


def test_linearize_save_load_round_trip_gives_identical_logits_and_generates(tmp_path):
    cfg = config(keep_softmax_layers=(0,))
    model, report = linearize_model(build_tiny("llama"), cfg, blocks(), blocks(seed=2), progress=False)
    assert report["replaced_layers"] == [1] and {"transfer", "lora"} <= set(report)
    save(model, tmp_path / "out", metadata={"method": "lolcats"})
    with pytest.raises(FileExistsError):
        save(model, tmp_path / "out")
    from retrofitter.checkpoint import load_retrofitted

    loaded = load_retrofitted(tmp_path / "out")
    tokens = blocks(2, 20, seed=5)
    with torch.no_grad():
        # same float32 weights (copied into freshly allocated parameters), same modules, same shapes: bitwise
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
        assert loaded.generate(input_ids=tokens[:, :6], max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (2, 10)
    assert list(hybrid_attention_modules(loaded)) == [1]


def test_cli_linearize_then_eval(tmp_path):
    from retrofitter.cli import main

    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "train.txt"
    text.write_text(SAMPLE_TEXT)
    out, results = tmp_path / "lin", tmp_path / "lin.json"
    argv = ["linearize", str(model_dir), "--train-corpus", str(text), "--eval", str(text), "--seq-len", "64",
            "--transfer-tokens", "256", "--lora-tokens", "256", "--window", "8", "--feature-dim", "8",
            "--transfer-mode", "blockwise", "--keep-softmax-layers", "0", "--out", str(out), "--json", str(results),
            "--quiet"]
    assert main(argv) == 0
    data = json.loads(results.read_text())
    assert data["method"] == "lolcats" and set(data["ppl"]) == {str(text)}
    assert data["kv_bytes_per_token"] == 2 * 2 * 8 * 4  # only the kept softmax layer grows: 2·g·dh fp32
    assert set(data["transfer_mse"]) == {"1"} and data["peak_rss_mb"] > 0
    assert main(argv) == 2  # refuses the existing --out without --overwrite
    assert main(["eval", str(out), "--ppl", str(text), "--seq-len", "64", "--quiet"]) == 0
    model, tokenizer = load(out)
    assert len(hybrid_attention_modules(model)) == 1


WORKER = textwrap.dedent("""
    import json, sys, torch
    from accelerate import Accelerator
    from safetensors.torch import save_file
    sys.path.insert(0, sys.argv[2])
    from tiny_models import TINY_VOCAB, build_tiny
    from retrofitter.config import LinearizeConfig
    from retrofitter.pipelines.linearize import swap_attention
    from retrofitter.pipelines.lora import lora_finetune

    accelerator = Accelerator(cpu=True)
    cfg = LinearizeConfig(window=4, feature_dim=8, seq_len=32, batch_size=2, lora_lr=1e-3)
    model = build_tiny("llama")
    swap_attention(model, cfg)
    data = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    merged, report = lora_finetune(model, data, cfg, accelerator, progress=False, teacher=build_tiny("llama"))
    rank = accelerator.process_index
    save_file({k: v.contiguous() for k, v in merged.state_dict().items()}, f"{sys.argv[1]}/rank{rank}.safetensors")
    json.dump({"processes": report["processes"], "steps": report["steps"]}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
""")


@pytest.mark.slow
def test_two_process_gloo_lora_run_keeps_ranks_in_sync(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    tests_dir = str(Path(__file__).resolve().parents[1])
    processes = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(SRC), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), tests_dir], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1] == {"processes": 2, "steps": 2}  # 8 blocks, 2 ranks, batch 2
    weights = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    base = build_tiny("llama").state_dict()
    # both ranks apply the same all-reduced gradients with the same kernels to the same weights: bitwise
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def test_keep_softmax_top_restores_the_worst_transfer_layers_exactly_and_round_trips(tmp_path):
    original = build_tiny("llama")
    tokens = blocks(2, 20, seed=5)
    with torch.no_grad():
        reference = original(input_ids=tokens).logits
    every = config(keep_softmax_top=2, lora_tokens=0)
    restored_all, report = linearize_model(build_tiny("llama"), every, blocks(), None, progress=False)
    assert report["restored_softmax_layers"] == [0, 1] and not hybrid_attention_modules(restored_all)
    with torch.no_grad():  # every layer back to softmax: the original modules and weights, bit for bit
        assert torch.equal(restored_all(input_ids=tokens).logits, reference)

    model, report = linearize_model(build_tiny("llama"), config(keep_softmax_top=1, lora_tokens=0), blocks(), None,
                                    progress=False)
    errors = {layer: entry["mse_after"] for layer, entry in report["transfer"]["layers"].items()}
    worst = max(errors, key=errors.get)
    assert report["restored_softmax_layers"] == [worst] == report["kept_softmax_layers"]
    assert list(hybrid_attention_modules(model)) == [1 - worst]
    save(model, tmp_path / "out", metadata={"method": "lolcats"})
    from retrofitter.checkpoint import load_retrofitted

    loaded = load_retrofitted(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)  # a round trip: bitwise
    assert list(hybrid_attention_modules(loaded)) == [1 - worst]


def test_keep_softmax_top_refuses_more_layers_than_hybrid_ones_and_a_run_without_stage_1():
    with pytest.raises(ValueError, match="exceeds the 2 hybrid layers"):
        linearize_model(build_tiny("llama"), config(keep_softmax_top=3, lora_tokens=0), blocks(), None, progress=False)
    with pytest.raises(ValueError, match="needs stage 1"):
        config(keep_softmax_top=1, transfer_tokens=0)


def test_swa_sinks_preset_trains_nothing_and_attends_window_plus_sinks(tmp_path):
    from retrofitter.config import LinearizeConfig

    cfg = LinearizeConfig.preset("swa-sinks", window=8)
    assert (cfg.transfer_tokens, cfg.lora_tokens, cfg.sinks, cfg.linear_weight) == (0, 0, 4, "zero")
    original = build_tiny("llama")
    model, report = linearize_model(build_tiny("llama"), cfg, blocks(), blocks(seed=2), progress=False)
    assert "transfer" not in report and "lora" not in report
    tokens = blocks(2, 24, seed=5)
    with torch.no_grad():
        hybrid = model(input_ids=tokens).logits
        # The same function as the original with a sliding window + sinks mask (all softmax, no linear part).
        n = tokens.shape[1]
        pos = torch.arange(n)
        allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - 8) | (pos[None, :] < 4))
        mask = torch.zeros(2, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        reference = original(input_ids=tokens, attention_mask=mask).logits
        assert torch.allclose(hybrid, reference, atol=1e-4, rtol=1e-4)
        assert (hybrid - original(input_ids=tokens).logits).abs().max() > 1e-3  # past the window it differs


def test_swa_sinks_cache_preset_adds_a_read_sparse_cache_and_decodes_like_its_forward(tmp_path):
    """swa-sinks-cache: nothing trained, no linear part in the output; the cached keys change what is attended
    (it differs from swa-sinks), a token-by-token decode equals the full forward, and save -> load keeps it."""
    cfg = LinearizeConfig.preset("swa-sinks-cache", window=4, sparse_cache=3)
    assert (cfg.transfer_tokens, cfg.lora_tokens, cfg.sinks, cfg.linear_weight) == (0, 0, 4, "zero")
    assert LinearizeConfig.preset("swa-sinks-cache").sparse_cache == 256
    model, report = linearize_model(build_tiny("llama", dtype=torch.float64), cfg, blocks(), blocks(seed=2),
                                    progress=False)
    assert "transfer" not in report and "lora" not in report
    plain, _ = linearize_model(build_tiny("llama", dtype=torch.float64), LinearizeConfig.preset("swa-sinks", window=4),
                               blocks(), blocks(seed=2), progress=False)
    tokens = blocks(2, 20, seed=5)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        assert (full - plain(input_ids=tokens, use_cache=False).logits).abs().max() > 1e-3  # the cache is read
        cache = HybridCache(model)
        stepped = [model(input_ids=tokens[:, :7], cache=cache, use_cache=True).logits]
        for t in range(7, tokens.shape[1]):
            stepped.append(model(input_ids=tokens[:, t:t + 1], cache=cache, use_cache=True).logits)
        assert torch.allclose(torch.cat(stepped, dim=1), full, atol=1e-9, rtol=0)
        save(model, tmp_path / "m", metadata={"method": "lolcats"})
        from retrofitter.checkpoint import load_retrofitted

        loaded = load_retrofitted(tmp_path / "m", dtype=torch.float64)  # rebuilt in float32, then cast: 1e-7 rounding
        assert [m.hybrid.recall for m in hybrid_attention_modules(loaded).values()] == [
            m.hybrid.recall for m in hybrid_attention_modules(model).values()]
        assert torch.allclose(loaded(input_ids=tokens, use_cache=False).logits, full, atol=1e-6, rtol=0)


TRAINED_PRESETS = ("cpu-small", "quality", "gpu-small", "paper")


@pytest.mark.parametrize("name", ["cpu-small", "gpu-small"])  # blockwise and joint stage 1
def test_trained_presets_train_with_their_sinks_and_sparse_cache_in_place(name, tmp_path):
    """Every trained preset carries 4 sinks and a 64-key sparse cache; its recipe (stage 1 blockwise for the CPU
    presets, joint for the GPU ones; then LoRA), scaled to a tiny model, fits the layers as they will run (sinks
    and cache read in training) and lowers every layer's attention-output error, stage 2 runs, and the trained
    model decodes like its forward."""
    assert all((LinearizeConfig.preset(p).sinks, LinearizeConfig.preset(p).sparse_cache) == (4, 64)
               for p in TRAINED_PRESETS)
    preset = LinearizeConfig.preset(name)
    cfg = LinearizeConfig.preset(name, window=4, feature_dim=8, sparse_cache=3, transfer_tokens=512, lora_tokens=256,
                                 seq_len=32, batch_size=2, transfer_epochs=2, gradient_checkpointing=False)
    model, report = linearize_model(build_tiny("llama"), cfg, blocks(16), blocks(8, seed=3), progress=False,
                                    work_dir=tmp_path)
    assert report["transfer"]["mode"] == preset.transfer_mode
    layers = [m.hybrid for m in hybrid_attention_modules(model).values()]
    assert layers and all((m.recall.sinks, m.recall.sparse_cache) == (4, 3) for m in layers)
    assert all(v["mse_after"] < v["mse_before"] for v in report["transfer"]["layers"].values()), report["transfer"]
    assert report["lora"]["steps"] > 0
    tokens = blocks(1, 32, seed=7)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        cache = HybridCache(model)
        stepped = [model(input_ids=tokens[:, :5], cache=cache, use_cache=True).logits]
        for t in range(5, tokens.shape[1]):
            stepped.append(model(input_ids=tokens[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(stepped, 1), full, atol=1e-4, rtol=1e-4)
