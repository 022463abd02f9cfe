"""Softmax layers kept by their measured effect on retrieval (pipelines/recall_layers.py), on tiny models."""

import pytest
import torch

from retrofitter.adapters.hybrid_attention import hybrid_attention_modules, swap_to_hybrid
from retrofitter.eval.passkey import QUESTION, retrieval_probes
from retrofitter.pipelines.recall_layers import answer_logprob, keep_softmax_for_recall, recall_gains
from tiny_models import TINY_VOCAB, build_tiny, build_tiny_tokenizer


def hybrid(seed=0):
    model = build_tiny("llama", seed=seed)
    swap_to_hybrid(model, dict(window=4, feature_dim=6))
    return model.eval()


def probes(count=3, length=160):
    tokenizer = build_tiny_tokenizer()
    haystack = torch.randint(3, TINY_VOCAB, (500,), generator=torch.Generator().manual_seed(0))
    return retrieval_probes(tokenizer, haystack, count, length)


def test_probes_hide_a_key_in_the_haystack_and_end_with_its_answer():
    tokenizer = build_tiny_tokenizer()
    made = probes(count=4, length=160)
    for ids, answer_start in made:
        assert ids.shape[1] == 160
        text = tokenizer.decode(ids[0, answer_start:]).replace(" ", "")
        assert text[:-1].isdigit() and len(text[:-1]) == 5  # the answer: the 5 digits and a full stop
        assert QUESTION.replace(" ", "") in tokenizer.decode(ids[0, :answer_start]).replace(" ", "")
    assert len({tuple(ids[0].tolist()) for ids, _ in made}) == 4
    with pytest.raises(ValueError, match="haystack tokens"):
        retrieval_probes(tokenizer, torch.arange(10), 1, 200)


def test_gain_is_the_likelihood_change_of_one_softmax_layer():
    model, made = hybrid(), probes()
    ranking = recall_gains(model, made, progress=False)
    assert set(ranking["gains"]) == {0, 1}
    assert all(m.mode == "hybrid" for m in hybrid_attention_modules(model).values())  # modes restored
    module = hybrid_attention_modules(model)[1]
    module.mode = "softmax"
    expected = answer_logprob(model, made) - ranking["baseline"]
    module.mode = "hybrid"
    assert ranking["gains"][1] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert abs(ranking["gains"][0]) + abs(ranking["gains"][1]) > 0


def test_keep_softmax_for_recall_restores_the_layer_with_the_largest_gain():
    model, made = hybrid(seed=3), probes()
    report = keep_softmax_for_recall(model, made, 1, progress=False)
    best = max(report["gains"], key=report["gains"].get)
    assert report["restored_softmax_layers"] == [best]
    assert list(hybrid_attention_modules(model)) == [1 - best]
    with pytest.raises(ValueError, match="count must lie in 1..1"):
        keep_softmax_for_recall(model, made, 2, progress=False)


def test_linearize_with_keep_softmax_by_recall():
    from retrofitter.config import LinearizeConfig
    from retrofitter.pipelines.linearize import linearize_model

    cfg = LinearizeConfig(window=4, feature_dim=6, transfer_tokens=128, lora_tokens=0, seq_len=32,
                          keep_softmax_top=1, keep_softmax_by="recall")
    blocks = torch.randint(3, TINY_VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="needs retrieval probes"):
        linearize_model(build_tiny("llama"), cfg, blocks, None, progress=False)
    model, report = linearize_model(build_tiny("llama"), cfg, blocks, None, progress=False, recall_probes=probes())
    assert len(report["restored_softmax_layers"]) == 1 and len(hybrid_attention_modules(model)) == 1
    assert set(report["recall_ranking"]["gains"]) == {0, 1}
