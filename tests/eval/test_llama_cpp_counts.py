"""What eval/llama_cpp.py reads from llama.cpp without running it: per-window NLLs from the running estimate,
and the KV cache's bytes per token from a GGUF's metadata (the real allocation is checked against it in
tests/engines/test_llama_cpp.py)."""

from __future__ import annotations

import math

import pytest
import torch

from retrofitter.eval.llama_cpp import cache_bytes_per_token, chunk_nlls, llama_bench

LLAMA = {"general.architecture": "llama", "llama.block_count": 30, "llama.embedding_length": 576,
         "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3}
DEEPSEEK2 = {"general.architecture": "deepseek2", "deepseek2.block_count": 30, "deepseek2.embedding_length": 576,
             "deepseek2.attention.head_count": 9, "deepseek2.attention.head_count_kv": 1,
             "deepseek2.attention.key_length": 96, "deepseek2.attention.value_length": 64,
             "deepseek2.attention.kv_lora_rank": 64, "deepseek2.rope.dimension_count": 32}


def test_window_nlls_come_back_from_the_printed_running_estimate():
    nll = (2.5 + torch.rand(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)).tolist()
    running = [round(math.exp(sum(nll[:k]) / k), 4) for k in range(1, len(nll) + 1)]  # "[k]%.4f" as printed
    recovered = chunk_nlls(running)
    ppl = min(running)
    bound = [(2 * k - 1) * 0.5e-4 / ppl for k in range(1, len(nll) + 1)]  # the docstring's bound, per window
    assert all(abs(a - b) <= e for a, b, e in zip(recovered, nll, bound))
    assert math.exp(sum(recovered) / len(nll)) == pytest.approx(running[-1], abs=0.5e-4)


def test_cache_bytes_per_token_counts_keys_and_values_or_the_mla_latent():
    # SmolLM2-135M: 30 layers × 3 kv heads × (64 + 64); its MLA form at 0.25×: 30 × (64 + 32), nothing for V
    assert cache_bytes_per_token(LLAMA, "f16") == 30 * 384 * 2
    assert cache_bytes_per_token(LLAMA, "f32") == 30 * 384 * 4
    assert cache_bytes_per_token(LLAMA, "q8_0") == 30 * 2 * (192 // 32) * 34
    assert cache_bytes_per_token(LLAMA, "q4_0") == 30 * 2 * (192 // 32) * 18
    assert cache_bytes_per_token(DEEPSEEK2, "f16") == 30 * 96 * 2
    assert cache_bytes_per_token(DEEPSEEK2, "q8_0") == 30 * (96 // 32) * 34
    assert cache_bytes_per_token(DEEPSEEK2, "f16") / cache_bytes_per_token(LLAMA, "f16") == 0.25


def test_a_head_that_does_not_fill_whole_blocks_is_refused_as_llama_cpp_does():
    meta = dict(DEEPSEEK2, **{"deepseek2.attention.kv_lora_rank": 48})  # key 48 + 32 = 80, value 48
    assert cache_bytes_per_token(meta, "f16") == 30 * 80 * 2
    with pytest.raises(ValueError, match="blocks of 32, which do not divide this model's key head width 80"):
        cache_bytes_per_token(meta, "q4_0")
    meta = dict(DEEPSEEK2, **{"deepseek2.attention.kv_lora_rank": 16, "deepseek2.rope.dimension_count": 16})
    with pytest.raises(ValueError, match="value head width 16"):  # key 32 would do; the latent (V) is 16
        cache_bytes_per_token(meta, "q8_0")
    small_heads = dict(LLAMA, **{"llama.embedding_length": 144})  # head_dim 16: 3 × 32 numbers a row, still refused
    with pytest.raises(ValueError, match="key head width 16"):
        cache_bytes_per_token(small_heads, "q8_0")


@pytest.mark.parametrize("n_gen, n_prompt", [(0, 0), (32, 512)])
def test_llama_bench_times_a_decode_or_a_prefill_not_both(n_gen, n_prompt):
    with pytest.raises(ValueError, match="one of them"):
        llama_bench("unused.gguf", [0], n_gen=n_gen, n_prompt=n_prompt)
