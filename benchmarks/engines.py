"""A model converted to MLA, exported, measured in the engines users serve with: plain transformers and llama.cpp.

One run, on the same machine and the same llama.cpp build (b11434, engines/llama_cpp.py):

1. exports: the MLA model as a DeepSeek-V3 transformers directory and as a ``deepseek2`` GGUF, the original
   as a GGUF of its own architecture (``--outtypes``, f32 first: the parity checks use it);
2. transformers parity: logits of the exported directory (``AutoModelForCausalLM``, no retrofitter code)
   against retrofitter's MLA model on the first ``--parity-tokens`` of wiki-eval, and greedy decoding of
   ``--greedy-tokens`` tokens from a wiki-eval prompt (equal tokens, with the smallest top-2 margin seen);
3. llama.cpp parity: ``llama-perplexity`` at ``--n-ctx`` (f32 KV cache) against the same scoring in PyTorch
   (eval/llama_cpp.py: second half of each window), for both models; greedy text of ``llama-simple``
   against transformers' for ``--engine-greedy-tokens`` tokens;
4. llama.cpp speed: ``llama-bench`` decode tokens/s after 512 / 4096 / 8192 tokens of context and the KV
   cache llama.cpp allocates (its log), original and MLA alternating per context, same threads.

    python benchmarks/engines.py --mla runs/export/mla-0.25-prog-healed --out runs/engines
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

import retrofitter
from retrofitter.data.corpora import load_text
from retrofitter.engines.llama_cpp import llama_cpp_dir
from retrofitter.eval.engine_table import ENGINES_KIND
from retrofitter.eval.llama_cpp import (gguf_bos_id, llama_bench, llama_generate, llama_perplexity,
                                        reference_perplexity, text_ids)
from retrofitter.pipelines.export import export_gguf, export_hf

ROOT = Path(__file__).resolve().parents[1]


def _export(args, original, mla, tokenizer) -> dict:
    paths = {"hf": args.out / "mla-hf"}
    if not paths["hf"].exists():
        export_hf(mla, paths["hf"], tokenizer, metadata={"source_model": str(args.mla)})
    for outtype in args.outtypes:
        for name, model in (("original", original), ("mla", mla)):
            path = paths[f"{name}-{outtype}"] = args.out / f"{name}-{outtype}.gguf"
            if not path.exists():
                export_gguf(model, path, tokenizer, outtype=outtype, verify=False)
    return {name: str(path) for name, path in paths.items()}


@torch.no_grad()
def _transformers_parity(args, mla, tokenizer, ids) -> dict:
    exported = transformers.AutoModelForCausalLM.from_pretrained(args.out / "mla-hf", dtype=torch.float32).eval()
    window = ids[None, :args.parity_tokens]
    reference, logits = mla(window).logits, exported(window).logits
    rel = float((logits - reference).abs().max() / reference.abs().max())
    prompt = ids[None, :32]
    kwargs = dict(max_new_tokens=args.greedy_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    ours, theirs = mla.generate(prompt, **kwargs), exported.generate(prompt, **kwargs)
    top2 = torch.stack(ours.logits, 1).topk(2, dim=-1).values
    return {"tokens": args.parity_tokens, "max_rel_error": rel, "greedy_tokens": args.greedy_tokens,
            "greedy_equal": bool(torch.equal(ours.sequences, theirs.sequences)),
            "greedy_min_margin": float((top2[..., 0] - top2[..., 1]).min())}


@torch.no_grad()
def _llama_cpp_parity(args, models, tokenizer, gguf, text_file) -> dict:
    out = {}
    prompt_text = Path(text_file).read_text()[:200].rsplit(" ", 1)[0]
    for name, model in models.items():
        path = gguf[f"{name}-f32"]
        bos = gguf_bos_id(path)
        ours = reference_perplexity(model, text_ids(tokenizer, text_file, bos), args.n_ctx, bos_id=bos,
                                    chunks=args.ppl_chunks)
        theirs = llama_perplexity(path, text_file, args.n_ctx, chunks=args.ppl_chunks, threads=args.threads)
        prompt = tokenizer(prompt_text, return_tensors="pt").input_ids
        generated = model.generate(prompt, max_new_tokens=args.engine_greedy_tokens, do_sample=False)
        hf_text = tokenizer.decode(generated[0, prompt.shape[1]:])
        engine_text = llama_generate(path, prompt_text, args.engine_greedy_tokens)
        out[name] = {"retrofitter_ppl": ours["ppl"], "llama_cpp_ppl": theirs["ppl"],
                     "ppl_rel_diff": theirs["ppl"] / ours["ppl"] - 1, "chunks": ours["chunks"], "n_ctx": args.n_ctx,
                     "llama_cpp_seconds": theirs["seconds"], "greedy_text_equal": hf_text == engine_text,
                     "transformers_text": hf_text, "llama_cpp_text": engine_text}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the original model")
    parser.add_argument("--mla", type=Path, required=True, help="its MLA conversion (retrofitter mla [+ heal])")
    parser.add_argument("--out", type=Path, default=Path("runs/engines"))
    parser.add_argument("--outtypes", default="f32,bf16", help="GGUF weight types to export and bench (f32 first)")
    parser.add_argument("--contexts", default="512,4096,8192")
    parser.add_argument("--n-gen", type=int, default=32, help="decode tokens per llama-bench measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--ppl-chunks", type=int, default=8)
    parser.add_argument("--parity-tokens", type=int, default=512)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--engine-greedy-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "engines.json")
    args = parser.parse_args()
    args.outtypes = [t for t in args.outtypes.split(",") if t]
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    original, tokenizer = retrofitter.load_model(args.model)
    mla, _ = retrofitter.load(args.mla)
    original.eval(), mla.eval()
    text_file = args.out / "wiki-eval-head.txt"  # enough text for the scored windows, not the whole corpus
    text_file.write_text(load_text("wiki-eval")[:12 * args.n_ctx * args.ppl_chunks])
    ids = text_ids(tokenizer, text_file, None)
    gguf = _export(args, original, mla, tokenizer)
    record = {"kind": ENGINES_KIND, "llama_cpp": json.loads((llama_cpp_dir() / "build.json").read_text()),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "files": gguf,
              "gguf_bytes": {k: Path(v).stat().st_size for k, v in gguf.items() if k != "hf"}}
    record["transformers_parity"] = _transformers_parity(args, mla, tokenizer, ids)
    record["llama_cpp_parity"] = _llama_cpp_parity(args, {"original": original, "mla": mla}, tokenizer, gguf,
                                                   text_file)
    del original, mla
    speed = {}
    for outtype in args.outtypes:
        for depth in (int(c) for c in args.contexts.split(",")):
            for name in ("original", "mla"):  # alternating: the two see the same machine state
                row, = llama_bench(gguf[f"{name}-{outtype}"], [depth], n_gen=args.n_gen, repetitions=args.repeats,
                                   threads=args.threads)
                speed.setdefault(outtype, {}).setdefault(str(depth), {})[name] = row
                print(f"{outtype} depth {depth} {name}: {row['tokens_per_s']:.2f} tok/s, KV "
                      f"{row['kv_cache']['mib'] if row['kv_cache'] else '?'} MiB", flush=True)
    record["llama_cpp_speed"] = speed
    record["seconds"] = round(time.perf_counter() - start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    p = record["transformers_parity"]
    print(f"transformers: logits max rel error {p['max_rel_error']:.2e}, greedy {p['greedy_tokens']} tokens equal: "
          f"{p['greedy_equal']} (min margin {p['greedy_min_margin']:.3f})")
    for name, q in record["llama_cpp_parity"].items():
        print(f"llama.cpp {name}: ppl {q['llama_cpp_ppl']:.4f} vs retrofitter {q['retrofitter_ppl']:.4f} "
              f"({q['ppl_rel_diff']:+.2e}); greedy {args.engine_greedy_tokens} tokens equal: {q['greedy_text_equal']}")
    print(f"{'type':<5} {'context':>7} {'orig tok/s':>10} {'MLA tok/s':>10} {'speed-up':>8} {'orig KV MiB':>11} "
          f"{'MLA KV MiB':>10} {'KV ratio':>8}")
    for outtype, by_depth in speed.items():
        for depth, pair in by_depth.items():
            o, m = pair["original"], pair["mla"]
            kv_o, kv_m = (o["kv_cache"] or {}).get("mib"), (m["kv_cache"] or {}).get("mib")
            kv_ratio = f"{kv_m / kv_o:.3f}" if kv_o and kv_m else "?"
            print(f"{outtype:<5} {depth:>7} {o['tokens_per_s']:>10.2f} {m['tokens_per_s']:>10.2f} "
                  f"{m['tokens_per_s'] / o['tokens_per_s']:>7.2f}x {kv_o or 0:>11.1f} {kv_m or 0:>10.1f} {kv_ratio:>8}")


if __name__ == "__main__":
    main()
