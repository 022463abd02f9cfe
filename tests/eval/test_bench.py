"""Speed/memory bench on tiny models: structure, measured cache bytes, skips, ratios, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from retrofitter.cli import main
from retrofitter.eval.bench import bench_models, cache_nbytes, unique_labels
from retrofitter.eval.bench_table import format_bench_table, format_bytes
from tiny_models import build_tiny, build_tiny_tokenizer, save_tiny_model_dir


@pytest.fixture(autouse=True)
def _one_thread():
    # Timing tiny models with several OpenMP threads on a busy 2-core machine is mostly spin-waiting.
    torch.set_num_threads(1)


def _check_summary(summary: dict, samples: int, warmup: int) -> None:
    assert len(summary["samples"]) == samples and len(summary["warmup"]) == warmup
    assert summary["min"] <= summary["median"] <= summary["max"]
    assert all(math.isfinite(v) and v > 0 for v in summary["samples"])


@pytest.fixture(scope="module")
def two_model_bench():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test thread setting
    tokenizer = build_tiny_tokenizer()
    models = [("llama", build_tiny("llama"), tokenizer), ("opt", build_tiny("opt"), tokenizer)]
    yield bench_models(models, prefill_len=16, contexts=(8, 24, 300), decode_tokens=3, repeats=2, warmup=1)
    torch.set_num_threads(threads)


def test_bench_structure_and_summaries(two_model_bench):
    bench = two_model_bench
    assert bench["kind"] == "bench"
    assert bench["settings"]["contexts"] == [8, 24, 300] and bench["settings"]["repeats"] == 2
    machine = bench["machine"]
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == 1 and machine["cpu"]
    assert [entry["label"] for entry in bench["models"]] == ["llama", "opt"]
    for entry in bench["models"]:
        _check_summary(entry["prefill"]["latency_s"], samples=2, warmup=1)
        assert entry["prefill"]["tokens"] == 16
        assert sorted(entry["decode"]) == ["24", "8"]
        for decode in entry["decode"].values():
            _check_summary(decode["tokens_per_s"], samples=2, warmup=1)
        assert sorted(entry["peak_memory_mb"]) == ["decode_24", "decode_8", "prefill"]
        assert all(v >= 0 for v in entry["peak_memory_mb"].values())
    json.dumps(bench)  # the whole dict is JSON-serialisable as is


def test_context_beyond_max_positions_is_skipped_with_a_note(two_model_bench):
    for entry in two_model_bench["models"]:
        assert entry["max_position_embeddings"] == 256
        assert "300" not in entry["decode"]
        assert "max_position_embeddings 256" in entry["skipped"]["300"]
    assert "llama: skipped 300" in format_bench_table(two_model_bench)


def test_measured_cache_bytes_equal_context_times_kv_bytes_per_token(two_model_bench):
    for entry in two_model_bench["models"]:
        kv = entry["kv_bytes_per_token"]
        assert kv > 0
        for n, decode in entry["decode"].items():
            assert decode["cache_bytes"] == int(n) * kv  # standard attention: K and V of every layer, every token
        assert entry["decode"]["24"]["cache_bytes"] > entry["decode"]["8"]["cache_bytes"]
    # llama: 2 layers x 2 KV heads x 8 dims x 2 (K,V) x 4 B; opt has 4 KV heads (no GQA): twice as much
    llama, opt = two_model_bench["models"]
    assert llama["kv_bytes_per_token"] == 2 * 2 * 8 * 2 * 4
    assert opt["ratios"]["cache_bytes"] == {"8": 2.0, "24": 2.0}
    assert opt["ratios"]["kv_bytes_per_token"] == 2.0


def test_ratios_are_against_the_first_model(two_model_bench):
    llama, opt = two_model_bench["models"]
    assert llama["ratios"]["prefill_latency"] == 1.0
    assert llama["ratios"]["decode_tokens_per_s"] == {"8": 1.0, "24": 1.0}
    expected = opt["prefill"]["latency_s"]["median"] / llama["prefill"]["latency_s"]["median"]
    assert opt["ratios"]["prefill_latency"] == pytest.approx(expected)
    expected = opt["decode"]["24"]["tokens_per_s"]["median"] / llama["decode"]["24"]["tokens_per_s"]["median"]
    assert opt["ratios"]["decode_tokens_per_s"]["24"] == pytest.approx(expected)


def test_table_has_median_spread_and_ratio_rows(two_model_bench):
    table = format_bench_table(two_model_bench, markdown=True)
    assert table.splitlines()[0] == "| model | measure | median | min–max | vs first |"
    assert "| opt | cache bytes @ 24 | 12 KiB |  | ×2.000 |" in table
    assert table.index("decode tok/s @ 8") < table.index("decode tok/s @ 24")


def test_bfloat16_cache_is_half_of_float32():
    tokenizer = build_tiny_tokenizer()
    bench = bench_models([("bf16", build_tiny("qwen3", dtype=torch.bfloat16), tokenizer)], prefill_len=8,
                         contexts=(16,), decode_tokens=2, repeats=1, warmup=0)
    entry = bench["models"][0]
    assert bench["settings"]["dtype"] == "bfloat16"
    assert entry["kv_bytes_per_token"] == 2 * 2 * 8 * 2 * 2
    assert entry["decode"]["16"]["cache_bytes"] == 16 * entry["kv_bytes_per_token"]


def test_prefill_longer_than_max_positions_is_skipped():
    tokenizer = build_tiny_tokenizer()
    bench = bench_models([("llama", build_tiny("llama"), tokenizer)], prefill_len=512, contexts=(8,),
                         decode_tokens=2, repeats=1, warmup=0)
    entry = bench["models"][0]
    assert entry["prefill"] is None and "prefill_len 512" in entry["skipped"]["prefill"]
    assert "8" in entry["decode"]


class _SlotState:
    __slots__ = ("state", "meta")

    def __init__(self, state, meta):
        self.state, self.meta = state, meta


def test_cache_nbytes_walks_any_structure_and_counts_each_storage_once():
    keys = torch.zeros(2, 3, 4)  # 96 B
    values = torch.zeros(5, dtype=torch.float64)  # 40 B
    layer = nn.Linear(100, 100)  # a referenced module's weights are not cache
    cache = {"layers": [(keys, values), (keys[0], values[1:])],  # views share storage: counted once
             "extra": _SlotState(torch.zeros(3, dtype=torch.int8), {"step": 3, "owner": layer}),
             "empty": torch.empty(0)}
    cache["self"] = cache  # cycles are fine
    assert cache_nbytes(cache) == 96 + 40 + 3
    assert cache_nbytes(None) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"repeats": 0}, "repeats must be >= 1"),
    ({"decode_tokens": 0}, "decode_tokens must be >= 1"),
    ({"contexts": ()}, "contexts"),
    ({"contexts": (8, -1)}, "contexts"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench_models([("a", build_tiny("llama"), build_tiny_tokenizer())], **kwargs)


def test_duplicate_labels_and_no_models_are_errors():
    model, tokenizer = build_tiny("llama"), build_tiny_tokenizer()
    with pytest.raises(ValueError, match="unique"):
        bench_models([("a", model, tokenizer), ("a", model, tokenizer)])
    with pytest.raises(ValueError, match="at least one"):
        bench_models([])


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(45 * 2**20) == "45 MiB"


def test_bench_cli_on_saved_model_dirs(tmp_path, capsys):
    first = save_tiny_model_dir(tmp_path / "llama", "llama")
    second = save_tiny_model_dir(tmp_path / "qwen2", "qwen2")
    out = tmp_path / "bench.json"
    code = main(["bench", str(first), str(second), "--json", str(out), "--prefill-len", "8", "--contexts", "8,16",
                 "--decode-tokens", "2", "--repeats", "1", "--warmup", "0", "--threads", "1", "--quiet"])
    assert code == 0
    bench = json.loads(out.read_text())
    assert bench["kind"] == "bench" and [e["label"] for e in bench["models"]] == [str(first), str(second)]
    assert bench["models"][1]["decode"]["16"]["cache_bytes"] == 16 * bench["models"][1]["kv_bytes_per_token"]
    printed = capsys.readouterr().out
    assert "decode tok/s @ 16" in printed and "vs first" in printed


def test_bench_cli_quantize_reports_stored_bytes(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "llama", "llama")
    out = tmp_path / "bench.json"
    code = main(["bench", str(model_dir), "--json", str(out), "--prefill-len", "8", "--contexts", "8",
                 "--decode-tokens", "2", "--repeats", "1", "--warmup", "0", "--threads", "1", "--quiet",
                 "--quantize", "int8-dynamic"])
    assert code == 0
    entry = json.loads(out.read_text())["models"][0]
    assert entry["quantize"] == "int8-dynamic"
    assert entry["decode"]["8"]["tokens_per_s"]["median"] > 0
    assert entry["stored_bytes"] < 4 * entry["params"]["total"]  # int8 projections, float embeddings


def test_bench_cli_rejects_bad_contexts(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", str(tmp_path), "--contexts", "8,abc"])


def test_unique_labels_allow_benching_a_model_against_itself():
    assert unique_labels(["a", "b", "a", "a"]) == ["a", "b", "a#2", "a#3"]

