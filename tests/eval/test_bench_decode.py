"""bench_decode: structure, interleaving, ratios and the net-of-floor ratios; compiled once per shape (tiny models)."""

from __future__ import annotations

import pytest
import torch

from retrofitter.adapters.hybrid_attention import swap_to_hybrid
from retrofitter.config import LinearizeConfig
from retrofitter.eval.bench_decode import FLOOR_LABEL, bench_decode
from retrofitter.eval.bench_table import format_decode_table
from tiny_models import build_tiny


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _hybrid():
    model = build_tiny("llama", seed=1)
    swap_to_hybrid(model, LinearizeConfig(window=4).hybrid_settings())
    return model


def test_bench_decode_structure_ratios_and_one_trace_per_shape():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    models = [("a", build_tiny("llama")), ("h", _hybrid())]
    bench = bench_decode(models, batch_sizes=(1, 2), contexts=(8, 24), prefill_len=6, decode_tokens=3,
                         fill_prefill=6, repeats=2, warmup=1, backend="aot_eager",
                         matvec={"a": "reduction", "h": "blas"})
    assert bench["kind"] == "bench_decode" and bench["settings"]["labels"] == ["a", "h", FLOOR_LABEL]
    assert bench["settings"]["matvec"] == {"a": "reduction", "h": "blas"}
    assert bench["results"]["compiled"]["2"]["a"]["matvec"] == {"matvec": "reduction", "blas_ms": None,
                                                                "reduction_ms": None}
    assert bench["results"]["compiled"]["1"]["h"]["matvec"]["matvec"] == "blas"
    assert "matvec" not in bench["results"]["eager"]["2"]["a"]
    for mode in ("eager", "compiled"):
        for b in ("1", "2"):
            entries = bench["results"][mode][b]
            assert set(entries) == {"a", "h", FLOOR_LABEL}
            for label, entry in entries.items():
                assert len(entry["prefill"]["samples"]) == 2
                for n in ("8", "24"):
                    decode = entry["decode"][n]
                    assert len(decode["step_s"]["samples"]) == 2 and decode["cache_bytes"] > 0
                    assert decode["tokens_per_s"]["median"] > 0
            assert entries["a"]["ratios"]["decode"]["8"] == {"step": 1.0, "step_net": 1.0}
            step = entries["h"]["decode"]["24"]["step_s"]["median"]
            base = entries["a"]["decode"]["24"]["step_s"]["median"]
            floor = entries[FLOOR_LABEL]["decode"]["24"]["step_s"]["median"]
            assert entries["h"]["ratios"]["decode"]["24"]["step"] == pytest.approx(step / base)
            assert entries["h"]["ratios"]["decode"]["24"]["step_net"] == pytest.approx((step - floor) / (base - floor))
    # the hybrid's state is constant; the static softmax cache is preallocated per context
    entries = bench["results"]["eager"]["1"]
    assert entries["h"]["decode"]["8"]["cache_bytes"] == entries["h"]["decode"]["24"]["cache_bytes"]
    assert entries["a"]["decode"]["24"]["cache_bytes"] > entries["a"]["decode"]["8"]["cache_bytes"]
    # compiled: no graph break, at most one prefill graph per (model, batch) and one decode graph per
    # (model, batch, context): the timed repetitions reuse the warm-up's graphs
    assert not torch._dynamo.utils.counters["graph_break"]
    assert 0 < torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3 * 2 + 3 * 2 * 2
    table = format_decode_table(bench)
    assert "overhead floor" in table and "compiled" in table and "net" in table


def test_bench_decode_refuses_compiled_dynamic_cache_and_reserved_label():
    model = build_tiny("llama")
    with pytest.raises(ValueError, match="static cache"):
        bench_decode([("a", model)], cache="dynamic")
    with pytest.raises(ValueError, match="reserved"):
        bench_decode([(FLOOR_LABEL, model)])
    with pytest.raises(ValueError, match="modes"):
        bench_decode([("a", model)], modes=("jit",))
    with pytest.raises(ValueError, match="matvec must be one of"):
        bench_decode([("a", model)], matvec="gemv")
    with pytest.raises(ValueError, match="per model label"):
        bench_decode([("a", model), ("b", model)], matvec={"a": "blas"})


@pytest.mark.slow
def test_bench_cli_compile_mode(tmp_path, capsys):
    import json

    from retrofitter.cli import main
    from tiny_models import save_tiny_model_dir

    torch._dynamo.reset()
    model_dir = save_tiny_model_dir(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    code = main(["bench", str(model_dir), "--compile", "--no-floor", "--json", str(out), "--prefill-len", "8",
                 "--contexts", "8", "--decode-tokens", "2", "--repeats", "1", "--warmup", "1", "--threads", "1",
                 "--quiet"])
    assert code == 0
    bench = json.loads(out.read_text())
    assert bench["kind"] == "bench_decode" and set(bench["results"]) == {"eager", "compiled"}
    compiled = bench["results"]["compiled"]["1"][str(model_dir)]
    assert compiled["decode"]["8"]["tokens_per_s"]["median"] > 0
    assert compiled["matvec"]["matvec"] in ("blas", "reduction") and compiled["matvec"]["blas_ms"] > 0  # auto measured
    out = capsys.readouterr().out
    assert "decode step @ 8" in out and "decode linear maps" in out


def test_inductor_cache_is_retrofitters_unless_the_user_chose_one(monkeypatch, tmp_path):
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from retrofitter.data.cache import cache_dir
    from retrofitter.eval.bench_decode import persistent_inductor_cache

    ours = str(cache_dir() / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert persistent_inductor_cache() == ours == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torchao leaves behind
    assert persistent_inductor_cache() == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert persistent_inductor_cache() == str(tmp_path / "mine")
