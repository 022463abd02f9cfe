"""report.md + PNG plots from synthetic results/bench JSONs, and the ``report`` CLI."""

from __future__ import annotations

import json

import pytest

from retrofitter.api import write_json
from retrofitter.cli import main
from retrofitter.eval.report import collect_runs, format_cost_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(method, ratio, ppl_wiki, ppl_austen, total, cost=False):
    result = {"model": "smollm2-135m", "method": method, "ratio": ratio,
              "ppl": {"wiki-eval": ppl_wiki, "austen-eval": ppl_austen},
              "params": {"total": total, "linear": total - 28_000_000, "embedding": 28_000_000},
              "kv_bytes_per_token": 46080, "settings": {"seq_len": 512, "threads": 2},
              "timings_s": {"eval_wiki-eval": 12.5}, "peak_rss_mb": 900.0}
    if cost:
        result["timings_s"].update({"compress": 300.0, "calibration_forward": 20.0})
        result["cost"] = {"peak_rss_over_fp32_model": 2.5, "compress_over_calibration_forward": 15.0,
                          "peak_rss_above_floor_over_fp32_model": 1.75}
        result["compress_peak_rss_mb"] = 1290.0
        result["reduction"] = {"linear": ratio, "total": ratio * 0.8}
    return result


def _bench():
    def summary(median):
        return {"median": median, "min": median * 0.9, "max": median * 1.1, "samples": [median], "warmup": [median]}

    def entry(label, tok_s, kv):
        return {"label": label, "model": label, "params": {"total": 134_515_008}, "kv_bytes_per_token": kv,
                "skipped": {"4096": "context 4096 + 33 new tokens exceeds max_position_embeddings 2048"},
                "prefill": {"tokens": 512, "latency_s": summary(0.8)},
                "decode": {str(n): {"context": n, "decode_tokens": 32, "tokens_per_s": summary(tok_s / (1 + n / 2048)),
                                    "cache_bytes": n * kv, "cache_bytes_per_token": kv} for n in (256, 1024)},
                "peak_memory_mb": {"prefill": 60.0, "decode_256": 12.0},
                "ratios": {"prefill_latency": 1.0, "kv_bytes_per_token": kv / 46080, "params_total": 1.0,
                           "decode_tokens_per_s": {"256": 1.0, "1024": 1.0}, "cache_bytes": {"256": 1.0, "1024": 1.0}}}

    return {"kind": "bench", "settings": {"prefill_len": 512, "contexts": [256, 1024, 4096], "decode_tokens": 32,
                                          "repeats": 3, "warmup": 1, "dtype": "float32",
                                          "memory_measure": "rss_delta_sampled"},
            "machine": {"date": "2026-01-01T00:00:00+00:00", "cpu": "Test CPU", "torch_threads": 2,
                        "torch": "2.13.0", "transformers": "5.24.0"},
            "models": [entry("original", 40.0, 46080), entry("asvd-0.3", 45.0, 30720)]}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    write_json(_result("original", None, 25.0, 30.0, 134_515_008), run / "original.json")
    for ratio, wiki in ((0.1, 27.0), (0.3, 40.0), (0.5, 120.0)):
        write_json(_result("asvd-rootcov", ratio, wiki, wiki * 1.2, int(134e6 * (1 - ratio * 0.8)), cost=True),
                   run / f"asvd-{ratio}.json")
    for ratio, wiki in ((0.3, 35.0), (0.5, 80.0)):
        write_json(_result("joint", ratio, wiki, wiki * 1.1, int(134e6 * (1 - ratio * 0.8))), run / f"joint-{ratio}.json")
    write_json(_bench(), run / "bench.json")
    (run / "config.json").write_text(json.dumps({"model_type": "llama"}))  # e.g. a saved model's config: skipped
    (run / "broken.json").write_text("{not json")
    return run


def test_collect_runs_tells_results_bench_and_other_files_apart(run_dir):
    data = collect_runs([run_dir])
    assert len(data.results) == 6
    assert len(data.benches) == 1 and data.benches[0]["_source"] == "bench"
    assert sorted(s.split(":")[0].rsplit("/", 1)[-1] for s in data.skipped) == ["broken.json", "config.json"]


def test_missing_run_dir_and_empty_dir_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        collect_runs([tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="no results, bench or engines JSON"):
        write_report([tmp_path])


def test_report_writes_markdown_with_tables_and_all_plots(run_dir, tmp_path):
    out = tmp_path / "report"
    report = write_report([run_dir], out)
    text = report.read_text()
    for name in ("ppl_vs_ratio", "ppl_vs_params", "decode_speed", "cache_bytes"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
        assert f"](plots/{name}.png)" in text
    assert "| ppl austen-eval | ppl wiki-eval |" in text  # the shared results table (write_json sorts keys)
    assert "| asvd-0.3 | decode tok/s @ 1024 |" in text  # the bench table, contexts in numeric order:
    assert text.index("| original | decode tok/s @ 256 |") < text.index("| original | decode tok/s @ 1024 |")
    assert "skipped 4096" in text
    assert "15.0×" in text and "2.50×" in text and "1.75×" in text  # compression cost figures
    assert "Test CPU" in text and "Generated " in text
    assert "config.json: neither a results, bench nor engines JSON" in text


def test_cost_table_only_lists_results_with_cost():
    table = format_cost_table([_result("original", None, 25.0, 30.0, 1), _result("asvd", 0.3, 30.0, 33.0, 1, cost=True)])
    assert len(table.splitlines()) == 3 and "300.0" in table and "20.0" in table


def test_report_without_bench_writes_only_quality_plots(tmp_path):
    write_json(_result("original", None, 25.0, 30.0, 100), tmp_path / "a.json")
    write_json(_result("asvd", 0.3, 30.0, 33.0, 80), tmp_path / "b.json")
    write_report([tmp_path], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "plots").iterdir()) == ["ppl_vs_params.png", "ppl_vs_ratio.png"]


def test_kv_frontier_plot_needs_two_kv_sizes_and_draws_one_line_per_method_and_ratio(tmp_path):
    from retrofitter.eval.plots import plot_ppl_vs_kv_bytes

    original = _result("original", None, 25.0, 30.0, 100)
    same_kv = [original, _result("latentllm", 0.3, 50.0, 60.0, 80)]
    assert plot_ppl_vs_kv_bytes(same_kv, [], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    frontier = [original] + [{**_result("latentllm", 0.3, ppl, ppl, 80), "kv_bytes_per_token": kv}
                             for kv, ppl in ((41064, 50.0), (23160, 63.0), (16000, 90.0))]
    png = plot_ppl_vs_kv_bytes(frontier, [], tmp_path / "kv.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    for name, result in (("kv_ratio_a", frontier[1]), ("kv_ratio_b", frontier[2]), ("original", original)):
        write_json(result, tmp_path / "runs" / f"{name}.json")
    text = write_report([tmp_path / "runs"], tmp_path / "out").read_text()
    assert "](plots/ppl_vs_kv_bytes.png)" in text


def test_a_linearized_model_without_ratio_is_not_drawn_as_the_original(tmp_path):
    from retrofitter.eval.plots import is_original_model

    linearized = {**_result("lolcats", None, 23.0, 36.0, 136_000_000), "kv_bytes_per_token": 0}
    assert not is_original_model(linearized) and is_original_model(_result("original", None, 1, 1, 1))
    write_json(_result("original", None, 19.0, 30.0, 134_000_000), tmp_path / "runs" / "original.json")
    write_json(linearized, tmp_path / "runs" / "lin.json")
    write_json(_result("asvd", 0.2, 30.0, 43.0, 113_000_000), tmp_path / "runs" / "asvd.json")
    write_report([tmp_path / "runs"], tmp_path / "out")  # ppl_vs_ratio skips the ratio-less model
    assert (tmp_path / "out" / "plots" / "ppl_vs_ratio.png").exists()


def test_passkey_table_lists_accuracy_per_context():
    from retrofitter.eval.report import format_passkey_table

    measured = {**_result("hybrid", None, 25.0, 30.0, 1),
                "passkey": {"accuracy": 0.5, "by_context": {"2048": 1.0, "4096": 0.0},
                            "settings": {"depths": [0.1, 0.5, 0.9], "trials": 2}}}
    table = format_passkey_table([_result("original", None, 25.0, 30.0, 1), measured])
    assert table.splitlines()[0] == "| model | method | ratio | 2048 tokens | 4096 tokens | trials per length |"
    assert table.splitlines()[2].endswith("| 100% | 0% | 6 |") and len(table.splitlines()) == 3
    assert format_passkey_table([_result("original", None, 25.0, 30.0, 1)]) == ""


def test_report_cli(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "report.md").is_file()
    assert "report.md" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_an_engines_record_becomes_its_own_section(tmp_path):
    speed = {"original": {"tokens_per_s": 20.0, "stddev": 0.5, "kv_cache": {"mib": 180.0}},
             "mla": {"tokens_per_s": 26.0, "stddev": 0.4, "kv_cache": {"mib": 45.0}}}
    record = {"kind": "engines", "llama_cpp": {"tag": "b11434"},
              "settings": {"mla": "runs/mla", "model": "smollm2-135m", "threads": 2, "n_gen": 32, "repeats": 3},
              "transformers_parity": {"tokens": 512, "max_rel_error": 3e-6, "greedy_tokens": 64, "greedy_equal": True,
                                      "greedy_min_margin": 0.02},
              "llama_cpp_parity": {"mla": {"n_ctx": 512, "chunks": 8, "llama_cpp_ppl": 20.1, "retrofitter_ppl": 20.0,
                                           "ppl_rel_diff": 0.005, "greedy_text_equal": False}},
              "llama_cpp_speed": {"f32": {"8192": speed, "512": speed}}}
    (tmp_path / "engines.json").write_text(json.dumps(record))
    text = write_report([tmp_path], tmp_path / "out").read_text()
    assert "## Exported models in other engines" in text and "llama.cpp b11434" in text
    assert "| f32 | 8192 | 20.00 ± 0.50 | 26.00 ± 0.40 | 1.30× | 180.0 | 45.0 | 0.250× |" in text
    assert text.index("| f32 | 512 |") < text.index("| f32 | 8192 |")  # contexts in numeric order
    assert "20.1000 vs 20.0000 (+5.0e-03)" in text and "greedy text equal to transformers' | no |" in text


def test_an_engine_kv_record_becomes_a_table_of_bytes_perplexity_and_speed(tmp_path):
    def row(model, cache_type, nbytes, ratio, ppl, paired, step, prefill):
        return {"model": model, "cache_type": cache_type, "bytes_per_token": nbytes, "bytes_ratio": ratio,
                "corpora": {"wiki-eval": {"ppl": ppl, "paired": paired}},
                "decode": {"4096": {"time_ratio": step}}, "prefill": {"512": {"time_ratio": prefill}}}
    record = {"kind": "engine_kv_quantization", "llama_cpp": {"tag": "b11434"},
              "settings": {"model": "smollm2-135m", "n_ctx": 512, "threads": 2, "depths": [4096], "prefill": [512]},
              "rows": {"original f16": row("original", "f16", 23040, 1.0, 17.5, None, 1.0, 1.0),
                       "mla q8_0": row("mla", "q8_0", 3060, 0.1328, 21.6, {"ratio": 1.23, "low": 1.2, "high": 1.26},
                                       0.61, 1.04)}}
    (tmp_path / "kv.json").write_text(json.dumps(record))
    text = write_report([tmp_path], tmp_path / "out").read_text()
    assert "## Exported models in other engines" in text and "llama.cpp b11434" in text
    assert "| original | f16 | 23040 | 1.000× | 17.500 | 1 | 1.000× | 1.000× |" in text
    assert "| mla | q8_0 | 3060 | 0.133× | 21.600 | 1.230× [1.200, 1.260] | 0.610× | 1.040× |" in text
    assert "the rows one after another (drift between rows enters the ratios)" in text  # a record without rounds
    (tmp_path / "kv.json").write_text(json.dumps(dict(record, speed_scheme="rounds")))
    assert "the median over rounds" in write_report([tmp_path], tmp_path / "out2").read_text()
