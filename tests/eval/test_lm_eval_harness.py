"""lm-eval wrapper on a tiny model with a local task YAML + JSON-lines data (offline); skipped without lm-eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from retrofitter.eval.lm_eval_harness import _clean_metrics, _resolve_tasks, lm_eval_available
from tiny_models import build_tiny, build_tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
TASK_YAML = FIXTURES / "retrofitter_tiny_choice.yaml"
needs_lm_eval = pytest.mark.skipif(not lm_eval_available(), reason="lm-eval is not installed (extra 'lm-eval')")


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    """No hub access; dataset cache in tmp; run from the fixture dir so the YAML's relative data_files resolve."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "datasets")), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(FIXTURES)
    torch.set_num_threads(1)


def _expected_accuracy(model, tokenizer) -> float:
    """Our own multiple-choice scoring: argmax over choices of sum log p(choice | question), no BOS."""
    docs = [json.loads(line) for line in (FIXTURES / "retrofitter_tiny_choice.jsonl").read_text().splitlines()]
    correct = 0
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            context = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
            whole = tokenizer(doc["question"] + choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logprobs = model(ids).logits.log_softmax(-1)[0]
            # token t is predicted at position t-1
            scores.append(sum(logprobs[t - 1, whole[t]].item() for t in range(len(context), len(whole))))
        # lm-eval scores the choices in padded batches (other shapes): its sums differ from these by float32
        # rounding (~1e-5), while the two choices of every fixture document differ by >= 0.5 in this model,
        # so the argmaxes, hence the accuracies, agree
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    return correct / len(docs)


@needs_lm_eval
def test_run_lm_eval_matches_our_own_multiple_choice_scoring(offline_datasets):
    from retrofitter.eval.lm_eval_harness import run_lm_eval

    model, tokenizer = build_tiny("llama", seed=3), build_tiny_tokenizer()
    result = run_lm_eval(model, tokenizer, [str(TASK_YAML)], batch_size=2)
    metrics = result["tasks"]["retrofitter_tiny_choice"]
    assert result["n_samples"]["retrofitter_tiny_choice"] == 6
    assert metrics["acc"] == pytest.approx(_expected_accuracy(model, tokenizer))
    assert result["settings"]["max_length"] == 256 and result["settings"]["lm_eval"]
    json.dumps(result)


def test_resolve_tasks_reads_the_yaml_name_and_directory():
    names, include, all_local = _resolve_tasks([str(TASK_YAML)], None)
    assert names == ["retrofitter_tiny_choice"] and include == [str(FIXTURES.resolve())] and all_local
    names, include, all_local = _resolve_tasks(["hellaswag"], "/some/dir")
    assert names == ["hellaswag"] and include == ["/some/dir"] and not all_local


def test_resolve_tasks_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        _resolve_tasks([str(tmp_path / "missing.yaml")], None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    with pytest.raises(ValueError, match="no 'task:' name"):
        _resolve_tasks([str(bad)], None)


def test_clean_metrics_drops_filters_and_non_finite_values():
    raw = {"alias": "x", "acc,none": 0.5, "acc_stderr,none": float("nan"), "exact_match,strict": 1.0}
    assert _clean_metrics(raw) == {"acc": 0.5, "acc_stderr": None, "exact_match,strict": 1.0}


def test_run_lm_eval_rejects_an_empty_task_list():
    from retrofitter.eval.lm_eval_harness import run_lm_eval

    with pytest.raises(ValueError, match="at least one task"):
        run_lm_eval(build_tiny("llama"), build_tiny_tokenizer(), [])


@needs_lm_eval
def test_eval_cli_adds_lm_eval_results(offline_datasets, tmp_path, capsys):
    from retrofitter.cli import main
    from tiny_models import SAMPLE_TEXT, save_tiny_model_dir

    model_dir = save_tiny_model_dir(tmp_path / "model", "llama")
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE_TEXT)
    out = tmp_path / "eval.json"
    code = main(["eval", str(model_dir), "--ppl", str(text), "--seq-len", "32", "--max-eval-tokens", "128",
                 "--tasks", str(TASK_YAML), "--tasks-limit", "3", "--json", str(out), "--quiet"])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["lm_eval"]["n_samples"] == {"retrofitter_tiny_choice": 3}
    assert 0.0 <= results["lm_eval"]["tasks"]["retrofitter_tiny_choice"]["acc"] <= 1.0
    assert results["ppl"]  # perplexity still there
    assert "lm-eval retrofitter_tiny_choice: " in capsys.readouterr().out
