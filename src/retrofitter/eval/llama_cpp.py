"""Measurements of an exported GGUF inside the real llama.cpp build (engines/llama_cpp.py), and the same
scoring on the PyTorch side so the two compare like with like.

``llama-perplexity`` tokenizes the whole file (a BOS first when the vocabulary says so), cuts it into
``n_chunk = n_tokens // n_ctx`` windows, puts the BOS at the start of each window (when add_bos) and scores
only the second half: the logits at positions ``first = n_ctx/2 … n_ctx − 2`` predicting the next token
(tools/perplexity/perplexity.cpp). ``reference_perplexity`` is that rule over token ids in PyTorch.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch
from torch import nn

from ..data.blocks import tokenize_text
from ..engines.llama_cpp import EngineBuildError, run_tool

__all__ = ["gguf_metadata", "gguf_bos_id", "text_ids", "llama_perplexity", "reference_perplexity", "llama_generate",
           "llama_bench", "llama_kv_cache_mib", "chunk_nlls", "cache_bytes_per_token"]

_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_RUNNING_PPL = re.compile(r"\[(\d+)\]([0-9.]+),")
_KV = re.compile(r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells.*K \((\w+)\):\s*([0-9.]+) MiB, "
                 r"V \((\w+)\):\s*([0-9.]+) MiB")


def gguf_metadata(path) -> dict:
    """The scalar key/values of a GGUF file (``general.architecture``, ``<arch>.attention.kv_lora_rank``, ...)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    out = {}
    for name, field in reader.fields.items():
        if not field.types or field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        out[name] = (bytes(value).decode("utf-8") if field.types[0] == GGUFValueType.STRING else value.item())
    return out


def llama_perplexity(gguf, text_file, n_ctx: int, chunks: int | None = None, threads: int | None = None,
                     cache_type: str = "f32", flash_attn: str | None = None) -> dict:
    """``llama-perplexity`` on ``text_file``: {"ppl", "ppl_stderr", "chunks", "chunk_nll", "kv_cache", "seconds"}.

    The KV cache in ``cache_type`` (f32 by default, so the comparison with float32 PyTorch is not an f16-cache
    one; a quantized V cache needs ``flash_attn="on"``, llama.cpp's ``-fa``, None leaves its default).
    ``chunk_nll`` [chunks]: each window's mean NLL (``chunk_nlls``); ``kv_cache``: the cache llama.cpp
    allocated (``llama_kv_cache_mib``'s entry)."""
    args = ["-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx), "-ctk", cache_type,
            "-ctv", cache_type, "-v"]  # -v: the cache allocation line is logged only at full verbosity
    if flash_attn is not None:
        args += ["-fa", flash_attn]
    if chunks is not None:
        args += ["--chunks", str(chunks)]
    if threads is not None:
        args += ["-t", str(threads)]
    start = time.perf_counter()
    result = run_tool("llama-perplexity", args)
    match = _PPL.search(result.stdout + result.stderr)
    if match is None:
        raise EngineBuildError("llama-perplexity printed no final estimate")
    counted = re.search(r"computing over (\d+) chunks|calculating perplexity over (\d+) chunks", result.stderr)
    n_chunks = int(next(g for g in counted.groups() if g)) if counted else None
    running = [float(value) for _, value in _RUNNING_PPL.findall(result.stdout)]
    kv = llama_kv_cache_mib(result.stderr)
    return {"ppl": float(match.group(1)), "ppl_stderr": float(match.group(2)), "chunks": n_chunks, "n_ctx": n_ctx,
            "cache_type": cache_type, "chunk_nll": chunk_nlls(running), "kv_cache": kv[-1] if kv else None,
            "seconds": round(time.perf_counter() - start, 2)}


def chunk_nlls(running_ppl: list[float]) -> list[float]:
    """Each window's mean NLL from llama-perplexity's running estimate after each window ``[k]ppl_k``.

    Every window scores the same n_ctx/2 − 1 tokens, so log ppl_k = (1/k) Σ_{j≤k} nll_j and
    nll_k = k·log ppl_k − (k − 1)·log ppl_{k−1}. The estimates are printed to 4 decimals, so nll_k carries an
    error of at most (2k − 1)·0.5e-4 / ppl nats (6e-4 at k = 100, ppl = 17)."""
    out, previous = [], 0.0
    for k, ppl in enumerate(running_ppl, start=1):
        total = k * math.log(ppl)
        out.append(total - previous)
        previous = total
    return out


def cache_bytes_per_token(meta: dict, cache_type: str) -> int:
    """Bytes llama.cpp's KV cache holds per token, all layers, for a GGUF's metadata ``meta`` (``gguf_metadata``)
    and a cache type (f32, f16, q8_0, q4_0, ...: ggml's block size and bytes per block).

    llama:      n_layers · n_kv · (key_length + value_length) numbers (key/value length: head_dim by default)
    deepseek2:  n_layers · (kv_lora_rank + rope_dim) numbers: its MLA cache holds the latent and the rotary key
                in K, and V is a view of K's latent part (V allocates nothing)
    bytes = numbers / block_size · block_bytes. llama.cpp quantizes each head's row in whole blocks, so it
    refuses a type whose block does not divide a head's key or value width; so does this."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    if arch == "deepseek2" and f"{arch}.attention.kv_lora_rank" in meta:
        kv_rank, rope_dim = int(meta[f"{arch}.attention.kv_lora_rank"]), int(meta[f"{arch}.rope.dimension_count"])
        heads = {"key": kv_rank + rope_dim, "value": kv_rank}  # one latent head; its value is K's first kv_rank
        numbers = kv_rank + rope_dim
    else:
        head_dim = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
        n_kv = int(meta.get(f"{arch}.attention.head_count_kv", meta[f"{arch}.attention.head_count"]))
        heads = {"key": int(meta.get(f"{arch}.attention.key_length", head_dim)),
                 "value": int(meta.get(f"{arch}.attention.value_length", head_dim))}
        numbers = n_kv * (heads["key"] + heads["value"])
    for part, width in heads.items():
        if width % block_size:
            raise ValueError(f"a {cache_type} cache quantizes in blocks of {block_size}, which do not divide this "
                             f"model's {part} head width {width}")
    return layers * numbers // block_size * block_bytes


@torch.no_grad()
def reference_perplexity(model: nn.Module, ids: torch.Tensor, n_ctx: int, bos_id: int | None = None,
                         chunks: int | None = None) -> dict:
    """llama-perplexity's scoring of the token ids ``ids`` [n] (module docstring); ``bos_id`` when the
    vocabulary adds a BOS (``ids`` then start with it, as llama.cpp's tokenization does). ``chunk_nll``: each
    window's mean NLL (every window scores n_ctx/2 − 1 tokens, so their mean is the log perplexity)."""
    n_chunk = ids.numel() // n_ctx
    if chunks is not None:
        n_chunk = min(n_chunk, chunks)
    if n_chunk < 1 or ids.numel() < 2 * n_ctx:
        raise ValueError(f"llama-perplexity needs at least {2 * n_ctx} tokens for a context of {n_ctx}")
    device = next(model.parameters()).device
    first = n_ctx // 2
    chunk_nll, count = [], 0
    for i in range(n_chunk):
        window = ids[i * n_ctx:(i + 1) * n_ctx].clone()
        if bos_id is not None:
            window[0] = bos_id
        logits = model(window[None].to(device)).logits[0].double().cpu()  # [n_ctx, V]
        logp = torch.log_softmax(logits[first:n_ctx - 1], dim=-1)
        target = ids[i * n_ctx + first + 1:(i + 1) * n_ctx]
        chunk_nll.append(-float(logp.gather(1, target[:, None]).mean()))
        count += target.numel()
    return {"ppl": math.exp(sum(chunk_nll) / n_chunk), "chunks": n_chunk, "n_ctx": n_ctx, "scored_tokens": count,
            "chunk_nll": chunk_nll}


def llama_generate(gguf, prompt: str, n_tokens: int) -> str:
    """Greedy continuation of ``prompt`` by ``llama-simple`` (its printed text after the prompt's pieces)."""
    result = run_tool("llama-simple", ["-m", str(gguf), "-n", str(n_tokens), prompt])
    text = result.stdout.removesuffix("\n")
    if not text.startswith(prompt):
        raise EngineBuildError("llama-simple's output does not start with the prompt: " + text[:80])
    return text[len(prompt):]


def llama_kv_cache_mib(log: str) -> list[dict]:
    """The ``llama_kv_cache: size = …`` lines of a llama.cpp log: [{"mib", "cells", "k_type", "k_mib", ...}]."""
    return [{"mib": float(m[0]), "cells": int(m[1]), "k_type": m[2], "k_mib": float(m[3]), "v_type": m[4],
             "v_mib": float(m[5])} for m in _KV.findall(log)]


def llama_bench(gguf, depths: list[int], n_gen: int = 32, repetitions: int = 3, threads: int | None = None,
                cache_type: str = "f16", flash_attn: str | None = None, n_prompt: int = 0) -> list[dict]:
    """``llama-bench`` decode speed after ``depth`` tokens of context, one entry per depth: {"depth", "n_gen",
    "n_prompt", "tokens_per_s", "stddev", "threads", "kv_cache"}; ``kv_cache`` is the last ``llama_kv_cache_mib``
    entry of its log (the cache llama.cpp allocated for that context), None when the log has none. With
    ``n_prompt`` > 0 and ``n_gen`` = 0 it is the prefill speed of an ``n_prompt``-token prompt instead."""
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError(f"llama_bench times decoding (n_gen > 0) or a prefill (n_prompt > 0), one of them; got "
                         f"n_gen={n_gen}, n_prompt={n_prompt}")
    out = []
    for depth in depths:
        args = ["-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth), "-r", str(repetitions),
                "-o", "json", "-ctk", cache_type, "-ctv", cache_type, "-v"]
        if threads is not None:
            args += ["-t", str(threads)]
        if flash_attn is not None:
            args += ["-fa", flash_attn]
        result = run_tool("llama-bench", args)
        rows = json.loads(result.stdout)
        kv = llama_kv_cache_mib(result.stderr)
        out.append({"depth": depth, "n_gen": n_gen, "n_prompt": n_prompt, "tokens_per_s": float(rows[0]["avg_ts"]),
                    "stddev": float(rows[0]["stddev_ts"]), "threads": int(rows[0]["n_threads"]),
                    "kv_cache": kv[-1] if kv else None})
    return out


def gguf_bos_id(gguf) -> int | None:
    """The BOS id llama.cpp puts first (None when the vocabulary does not add one)."""
    meta = gguf_metadata(gguf)
    if not meta.get("tokenizer.ggml.add_bos_token", False):
        return None
    return int(meta["tokenizer.ggml.bos_token_id"])


def text_ids(tokenizer, text_file, bos_id: int | None) -> torch.Tensor:
    """The ids llama-perplexity scores for ``text_file``: the tokenizer's ids, a BOS first when added."""
    ids = tokenize_text(tokenizer, Path(text_file).read_text(encoding="utf-8"))
    return torch.tensor(([bos_id] if bos_id is not None else []) + ids, dtype=torch.long)
