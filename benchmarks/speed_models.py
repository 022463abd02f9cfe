"""Models for the speed benchmarks (bench_compile.py, long_context.py), by spec:

* a name or directory ``load_model`` accepts (``smollm2-135m``, ``runs/bench/asvd-rootcov-0.3``);
* ``METHOD:RATIO`` (``asvd-rootcov:0.3``, ``latentllm:0.3``): the base model compressed in the script on
  ``calib_samples`` blocks of 512 tokens of wiki-calib, saved to ``runs/bench/speed-METHOD-RATIO-cN`` and
  loaded from there by later runs (the compression is not timed);
* ``hybrid`` / ``hybrid:WINDOW``: the base model with every attention swapped for the LoLCATs hybrid
  attention, untrained (speed and memory do not depend on the trained values; quality does).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from retrofitter.adapters.hybrid_attention import swap_to_hybrid
from retrofitter.api import compress, load_model, save
from retrofitter.config import CompressConfig, LinearizeConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench"


def build_model(spec: str, base: str, calib_samples: int, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) for one spec (module docstring)."""
    method, _, value = spec.partition(":")
    if method == "hybrid":
        model, tokenizer = load_model(base, dtype=dtype, device=device)
        settings = LinearizeConfig(**({"window": int(value)} if value else {})).hybrid_settings()
        swap_to_hybrid(model, settings)
        return model.eval(), tokenizer
    if not value:
        return load_model(spec, dtype=dtype, device=device)
    out = RUNS / f"speed-{method}-{value}-c{calib_samples}"
    if not (out / "retrofitter.json").exists():
        model, tokenizer = load_model(base)
        calibration = token_blocks(tokenizer, load_text("wiki-calib"), seq_len=512, max_blocks=calib_samples)
        start = time.perf_counter()
        compress(model, CompressConfig(method=method, ratio=float(value)), calibration, progress=True)
        print(f"compressed {spec} in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
        save(model, out, tokenizer=tokenizer, metadata={"spec": spec, "calib_samples": calib_samples})
    return load_model(str(out), dtype=dtype, device=device)


def build_models(specs: list[str], base: str, calib_samples: int, dtype: str = "float32", device: str = "cpu"):
    """[(spec, model, tokenizer), ...] in the order given."""
    return [(spec, *build_model(spec, base, calib_samples, dtype, device)) for spec in specs]


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def int_list(text: str) -> tuple[int, ...]:
    """``"1,8"`` -> (1, 8)."""
    return tuple(int(part) for part in text.split(",") if part.strip())


def add_decode_bench_flags(parser, default_models: list[str], json_default: Path) -> None:
    """The flags both decode benchmarks share: model specs, their base and calibration, repetitions, output."""
    parser.add_argument("models", nargs="*", default=default_models, help=f"model specs (default {default_models})")
    parser.add_argument("--base", default="smollm2-135m", help="model that METHOD:RATIO and hybrid specs start from")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=json_default)


def report_decode_bench(bench: dict, specs: list[str], out: Path) -> None:
    """Print the decode table and write its JSON (with the model specs in the settings)."""
    from retrofitter.api import write_json
    from retrofitter.eval.bench_table import format_decode_table

    bench["settings"]["model_specs"] = specs
    print(format_decode_table(bench))
    write_json(bench, out)
    print(f"wrote {out}")
