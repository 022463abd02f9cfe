"""Markdown for the engine records: ``"kind": "engines"`` (benchmarks/engines.py: parity of the exported model in
transformers and llama.cpp, and llama.cpp decode speed and KV cache per context) and
``"kind": "engine_kv_quantization"`` (benchmarks/engine_kv_quantization.py: MLA conversions and llama.cpp's
quantized caches on one axis of KV bytes per token, with perplexity and speed)."""

from __future__ import annotations

__all__ = ["ENGINES_KIND", "ENGINE_KV_KIND", "ENGINE_KINDS", "engine_section", "engine_kv_table"]

ENGINES_KIND = "engines"
ENGINE_KV_KIND = "engine_kv_quantization"
ENGINE_KINDS = (ENGINES_KIND, ENGINE_KV_KIND)


def _parity_lines(record: dict) -> list[str]:
    lines = ["| check | value |", "|---|---|"]
    hf = record.get("transformers_parity", {})
    if hf:
        lines.append(f"| transformers (DeepSeek-V3 export): logits max rel. error over {hf['tokens']} tokens | "
                     f"{hf['max_rel_error']:.2e} |")
        lines.append(f"| transformers: greedy {hf['greedy_tokens']} tokens equal to retrofitter's | "
                     f"{'yes' if hf['greedy_equal'] else 'no'} (min top-2 margin {hf['greedy_min_margin']:.3f}) |")
    for name, p in record.get("llama_cpp_parity", {}).items():
        lines.append(f"| llama.cpp {name}: perplexity at {p['n_ctx']} ({p['chunks']} windows, second halves) vs "
                     f"retrofitter | {p['llama_cpp_ppl']:.4f} vs {p['retrofitter_ppl']:.4f} "
                     f"({p['ppl_rel_diff']:+.1e}) |")
        lines.append(f"| llama.cpp {name}: greedy text equal to transformers' | "
                     f"{'yes' if p['greedy_text_equal'] else 'no'} |")
    return lines


def _speed_lines(record: dict) -> list[str]:
    lines = ["| weights | context | original tok/s | MLA tok/s | MLA speed | original KV MiB | MLA KV MiB | KV ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for outtype, by_depth in record.get("llama_cpp_speed", {}).items():
        for depth, pair in sorted(by_depth.items(), key=lambda item: int(item[0])):  # JSON keys sort as text
            o, m = pair["original"], pair["mla"]
            kv_o, kv_m = (o.get("kv_cache") or {}).get("mib"), (m.get("kv_cache") or {}).get("mib")
            ratio = f"{kv_m / kv_o:.3f}×" if kv_o and kv_m else "?"
            lines.append(f"| {outtype} | {depth} | {o['tokens_per_s']:.2f} ± {o['stddev']:.2f} | "
                         f"{m['tokens_per_s']:.2f} ± {m['stddev']:.2f} | {m['tokens_per_s'] / o['tokens_per_s']:.2f}× | "
                         f"{kv_o if kv_o is not None else '?'} | {kv_m if kv_m is not None else '?'} | {ratio} |")
    return lines


_SPEED_SCHEMES = {"rounds": "the median over rounds that each time every row once",
                  "row after row": "each row timed in one go, the rows one after another (drift between rows enters "
                                   "the ratios)"}


def engine_kv_table(record: dict) -> list[str]:
    """One row per model and cache type: bytes per token, perplexity and the paired ratio to the reference row
    (the original, f16 cache) per corpus, then decode and prefill time per token × the reference's."""
    settings = record["settings"]
    rows = list(record["rows"].values())
    corpora = list(rows[0]["corpora"])
    depths, prefill = settings.get("depths") or [], settings.get("prefill") or []
    head = ["model", "cache", "KV bytes per token", "× original f16"]
    head += [f"{c.rsplit('/', 1)[-1]} {what}" for c in corpora for what in ("perplexity", "× original [95 %]")]
    head += [f"decode step at {d}" for d in depths] + [f"prefill {n}" for n in prefill]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["model"], row["cache_type"], str(row["bytes_per_token"]), f"{row['bytes_ratio']:.3f}×"]
        for corpus in corpora:
            result = row["corpora"][corpus]
            p = result["paired"]
            cells += [f"{result['ppl']:.3f}", f"{p['ratio']:.3f}× [{p['low']:.3f}, {p['high']:.3f}]" if p else "1"]
        cells += [f"{row['decode'][str(d)]['time_ratio']:.3f}×" for d in depths]
        cells += [f"{row['prefill'][str(n)]['time_ratio']:.3f}×" for n in prefill]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def engine_section(record: dict) -> list[str]:
    """Markdown lines of one engine record (either kind)."""
    settings = record.get("settings", {})
    if record.get("kind") == ENGINE_KV_KIND:
        return [f"### `{record.get('_source', 'engine_kv_quantization')}.json`", "",
                f"KV cache bytes against perplexity in llama.cpp {record['llama_cpp']['tag']}: `{settings['model']}` "
                f"and its MLA conversions, each cache type with flash attention; windows of {settings['n_ctx']} "
                f"(second halves scored), {settings['threads']} threads; speed as time per token × the original "
                f"with an f16 cache, {_SPEED_SCHEMES[record.get('speed_scheme', 'row after row')]}.", "",
                *engine_kv_table(record), ""]
    lines = [f"### `{record.get('_source', 'engines')}.json`", "",
             f"MLA model `{settings.get('mla', '?')}` against `{settings.get('model', '?')}`; llama.cpp "
             f"{record.get('llama_cpp', {}).get('tag', '?')}, {settings.get('threads', '?')} threads.", "",
             *_parity_lines(record), ""]
    if record.get("llama_cpp_speed"):
        lines += [f"llama-bench: {settings.get('n_gen', '?')} decode tokens after the context, "
                  f"{settings.get('repeats', '?')} repetitions, f16 KV cache, the two models alternating.", "",
                  *_speed_lines(record), ""]
    return lines
