"""The results record: ``to_dict`` is the JSON the jobs wrote before the record existed; only named sections."""

import pytest
import torch

from retrofitter.api import evaluate, evaluate_record
from retrofitter.config import EvalConfig
from retrofitter.eval.accounting import account
from retrofitter.eval.record import ABSENT, ResultsRecord

# the keys api.evaluate wrote for a model with a baseline (before the record existed), and its settings
MEASURED_KEYS = ["model", "method", "ratio", "ppl", "params", "bytes", "macs_per_token", "attention_macs_per_token",
                 "kv_bytes_per_token", "state_bytes_per_sequence", "settings", "timings_s", "peak_rss_mb",
                 "params_before", "reduction"]
SETTINGS_KEYS = ["seq_len", "max_eval_tokens", "batch_size", "dtype", "quantize", "eval_tokens", "threads"]


@pytest.fixture
def record(tiny_llama, random_ids):
    config = EvalConfig(corpora=("wiki-eval",), seq_len=24)
    return evaluate_record(tiny_llama, None, config, progress=False, blocks={"wiki-eval": random_ids}, name="tiny",
                           method="svd", ratio=0.3, baseline=account(tiny_llama))


def test_to_dict_has_the_keys_the_jobs_wrote_in_their_order(record, tiny_llama, random_ids):
    data = record.to_dict()
    assert list(data) == MEASURED_KEYS
    assert list(data["settings"]) == SETTINGS_KEYS
    assert list(data["timings_s"]) == ["eval_wiki-eval"]
    assert (data["model"], data["method"], data["ratio"]) == ("tiny", "svd", 0.3)
    assert data["reduction"] == {"linear": 0.0, "total": 0.0}
    assert data["settings"]["eval_tokens"]["wiki-eval"]["blocks"] == random_ids.shape[0]
    config = EvalConfig(corpora=("wiki-eval",), seq_len=24)
    plain = evaluate(tiny_llama, None, config, progress=False, blocks={"wiki-eval": random_ids})
    assert list(plain) == [k for k in MEASURED_KEYS if k not in ("params_before", "reduction")]
    assert plain["ppl"] == pytest.approx(data["ppl"])


def test_sections_settings_and_timings_join_the_dict_absent_ones_stay_out(record):
    original = ResultsRecord(**{k: v for k, v in vars(record).items() if v is not ABSENT})
    record.add_settings(calib="wiki-calib", calib_samples=4)
    record.add_timings(compress=1.5, compress_breakdown={"total": 1.4})
    record.add_sections(out="runs/x", calibration=None, original=original)
    data = record.to_dict()
    assert list(data) == MEASURED_KEYS + ["out", "calibration", "original"]
    assert data["calibration"] is None  # None is a value; only ABSENT is left out
    assert data["original"] == original.to_dict() and isinstance(data["original"], dict)
    assert data["settings"]["calib_samples"] == 4 and data["timings_s"]["compress_breakdown"] == {"total": 1.4}
    assert "heal" not in data and "passkey" not in data


def test_a_section_the_record_does_not_name_is_refused(record):
    with pytest.raises(ValueError, match="no section 'perplexity'"):
        record.add_sections(perplexity={"wiki-eval": 1.0})
    with pytest.raises(ValueError, match="no section 'ppl'"):  # a measured figure is not a section
        record.add_sections(ppl={})
    record.add_sections(out="a")
    with pytest.raises(ValueError, match="already holds section 'out'"):
        record.add_sections(out="b")
    with pytest.raises(ValueError, match="already holds setting 'seq_len'"):
        record.add_settings(seq_len=1)
    with pytest.raises(ValueError, match="already holds timing 'eval_wiki-eval'"):
        record.add_timings(**{"eval_wiki-eval": 0.0})
    assert record.to_dict()["out"] == "a"


def test_to_dict_copies_settings_and_timings(record):
    data = record.to_dict()
    data["settings"]["calib"] = "x"
    data["timings_s"]["x"] = 1.0
    assert "calib" not in record.settings and "x" not in record.timings_s
    assert torch.isfinite(torch.tensor(data["ppl"]["wiki-eval"]))
