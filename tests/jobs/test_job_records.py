"""The jobs' results records hold exactly the keys they held when each job built its own dict."""

from retrofitter.config import CompressConfig, EvalConfig
from retrofitter.jobs import compress_job, mla_job
from retrofitter.pipelines.mla import MLAConfig
from tiny_models import SAMPLE_TEXT, save_tiny_model_dir

MEASURED = {"model", "method", "ratio", "ppl", "params", "bytes", "macs_per_token", "attention_macs_per_token",
            "kv_bytes_per_token", "state_bytes_per_sequence", "settings", "timings_s", "peak_rss_mb",
            "params_before", "reduction"}
EVAL_SETTINGS = ["seq_len", "max_eval_tokens", "batch_size", "dtype", "quantize", "eval_tokens", "threads"]


def test_compress_and_mla_records_have_the_keys_of_before(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    evaluation = EvalConfig(corpora=(str(corpus),), seq_len=32)
    compressed = compress_job(str(model_dir), tmp_path / "c", CompressConfig(ratio=0.4), evaluation, calib=str(corpus),
                              calib_samples=4, seq_len=32, measure_cost=True, progress=False)
    assert set(compressed) == MEASURED | {"out", "processes", "calibration", "compress_peak_rss_mb", "cost",
                                          "allocation", "layers"}
    assert list(compressed["settings"]) == EVAL_SETTINGS + ["calib", "calib_samples", "calib_seq_len",
                                                             "compress_config"]
    assert list(compressed["timings_s"]) == [f"eval_{corpus}", "load", "calibration_forward", "compress", "save",
                                             "compress_breakdown"]
    assert set(compressed["cost"]) == {"compress_over_calibration_forward", "fp32_model_mb", "rss_mb",
                                       "peak_rss_above_floor_over_fp32_model", "peak_rss_over_fp32_model",
                                       "statistics_spill_bytes"}
    assert compressed["out"] == str(tmp_path / "c") and compressed["processes"] == 1
    assert not (tmp_path / ".c.partial").exists() and not (tmp_path / ".c.lock").exists()
    converted = mla_job(str(model_dir), tmp_path / "m", MLAConfig(), evaluation, calib=str(corpus), calib_samples=2,
                        seq_len=32, progress=False)
    assert set(converted) == MEASURED | {"out", "mla", "layers"}
    assert list(converted["settings"]) == EVAL_SETTINGS + ["calib", "calib_samples", "calib_seq_len", "mla_config"]
    assert list(converted["timings_s"]) == [f"eval_{corpus}", "total", "convert"]
