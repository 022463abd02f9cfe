"""Softmax layers kept by their measured effect on retrieval (pipelines/recall_layers.py), on tiny models."""

import pytest
import torch

from retrofitter.adapters.hybrid_attention import hybrid_attention_modules, swap_to_hybrid
from retrofitter.eval.passkey import QUESTION, retrieval_probes
from retrofitter.pipelines.recall_layers import (answer_logprob, keep_softmax_for_recall, recall_gains, retrieval_scores,
                                                take_in_turn)
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
    for ids, answer_start, needle_start, needle_end in made:
        assert ids.shape[1] == 160
        text = tokenizer.decode(ids[0, answer_start:]).replace(" ", "")
        assert text[:-1].isdigit() and len(text[:-1]) == 5  # the answer: the 5 digits and a full stop
        needle = tokenizer.decode(ids[0, needle_start:needle_end]).replace(" ", "")
        assert needle.startswith("Thepasskeyis") and text[:-1] in needle  # the span holds the key asked for
        assert QUESTION.replace(" ", "") in tokenizer.decode(ids[0, :answer_start]).replace(" ", "")
    assert len({tuple(probe.ids[0].tolist()) for probe in made}) == 4
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


def test_softmax_weights_are_the_rows_softmax_attention_multiplies_v_with():
    torch.manual_seed(0)
    model = build_tiny("llama").double()
    swap_to_hybrid(model, dict(window=4, feature_dim=6))
    module = hybrid_attention_modules(model)[0]
    b, n = 2, 12
    q = torch.randn(b, module.n_heads, n, module.head_dim, dtype=torch.float64)
    k, v = (torch.randn(b, module.n_kv_heads, n, module.head_dim, dtype=torch.float64) for _ in range(2))
    rows = torch.tensor([0, 5, 11])
    weights = module.softmax_weights(q[:, :, rows], k, rows).double()  # [b, h, 3, n]
    groups = module.n_heads // module.n_kv_heads
    expected = module.softmax_attention(q, k, v, None)[:, :, rows]  # [b, h, 3, dh]
    # the weights were computed in float32: the product agrees to float32 rounding
    assert torch.allclose(weights @ v.repeat_interleave(groups, dim=1), expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-6)
    assert weights[:, :, 1, 6:].abs().max() == 0  # causal


def test_retrieval_score_is_the_answer_rows_attention_on_the_needle():
    model, made = hybrid(seed=2), probes(count=2)
    result = retrieval_scores(model, made, progress=False)
    assert set(result["scores"]) == {0, 1} and all(len(h) == 4 for h in result["head_scores"].values())
    assert all(m.mode == "hybrid" and m.score_hook is None for m in hybrid_attention_modules(model).values())
    # by hand for layer 1: capture its q, k in softmax mode and read the needle columns of the answer rows
    module, captured, expected, reach = hybrid_attention_modules(model)[1], {}, 0.0, 0.0
    for probe in made:
        for m in hybrid_attention_modules(model).values():
            m.mode = "softmax"
        module.score_hook = lambda mod, q, k: captured.update(q=q, k=k)
        with torch.no_grad():
            model(input_ids=probe.ids[:, :-1], use_cache=False)
        rows = torch.arange(probe.answer_start - 1, probe.ids.shape[1] - 1)
        weights = module.softmax_weights(captured["q"][:, :, rows], captured["k"], rows)
        expected += float(weights[..., probe.needle_start:probe.needle_end].sum(-1).mean()) / len(made)
        keys = torch.arange(probe.ids.shape[1] - 1)
        outside = (keys[None, :] <= rows[:, None] - 4) & (keys[None, :] >= module.hybrid.recall.sinks)  # window 4
        reach += float((weights[0] * outside).sum(-1).mean()) / len(made)
    module.score_hook = None
    assert result["scores"][1] == pytest.approx(expected, rel=1e-5)
    assert 0 < result["scores"][1] < 1
    assert result["reach"][1] == pytest.approx(reach, rel=1e-5) and 0 < reach < 1


def test_keep_softmax_by_retrieval_restores_the_highest_scoring_layer():
    model, made = hybrid(seed=3), probes()
    report = keep_softmax_for_recall(model, made, 1, progress=False, by="retrieval")
    best = max(report["scores"], key=report["scores"].get)
    assert report["by"] == "retrieval" and report["restored_softmax_layers"] == [best]
    assert list(hybrid_attention_modules(model)) == [1 - best]
    report = keep_softmax_for_recall(hybrid(seed=3), made, 1, progress=False, by="reach")
    assert report["restored_softmax_layers"] == [max(report["reach"], key=report["reach"].get)]
    report = keep_softmax_for_recall(hybrid(seed=3), made, 2, progress=False, by="retrieval+reach")
    assert report["by"] == "retrieval+reach" and sorted(report["restored_softmax_layers"]) == [0, 1]
    with pytest.raises(ValueError, match="unknown ranking 'mse'"):
        keep_softmax_for_recall(model, made, 1, progress=False, by="mse")


def test_linearize_ranks_by_retrieval_before_stage_1_and_without_training():
    from retrofitter.config import LinearizeConfig
    from retrofitter.pipelines.linearize import linearize_model

    blocks = torch.randint(3, TINY_VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    cfg = LinearizeConfig(window=4, feature_dim=6, transfer_tokens=128, lora_tokens=0, seq_len=32,
                          keep_softmax_top=1, keep_softmax_by="retrieval")
    model, report = linearize_model(build_tiny("llama"), cfg, blocks, None, progress=False, recall_probes=probes())
    kept = report["restored_softmax_layers"]
    assert len(kept) == 1 and report["kept_softmax_layers"] == kept
    assert set(report["transfer"]["layers"]) == {1 - kept[0]}  # stage 1 trained only the layer left hybrid
    free = LinearizeConfig(window=4, transfer_tokens=0, lora_tokens=0, keep_softmax_top=1, keep_softmax_by="retrieval")
    model, report = linearize_model(build_tiny("llama"), free, None, None, progress=False, recall_probes=probes())
    assert len(hybrid_attention_modules(model)) == 1 and "transfer" not in report
    with pytest.raises(ValueError, match="needs stage 1"):
        LinearizeConfig(transfer_tokens=0, keep_softmax_top=1, keep_softmax_by="mse")
    with pytest.raises(ValueError, match="probe_tokens must be 0"):
        LinearizeConfig(probe_tokens=10)


def test_take_in_turn_alternates_the_rankings_and_skips_a_layer_already_chosen():
    retrieval = {0: 0.9, 1: 0.5, 2: 0.1, 3: 0.0}
    reach = {0: 0.95, 1: 0.0, 2: 0.9, 3: 0.8}
    assert take_in_turn([retrieval, reach], 3) == [0, 2, 1]  # reach's best (0) is taken: its next, 2
    assert take_in_turn([retrieval, reach], 4) == [0, 2, 1, 3]
    assert take_in_turn([retrieval], 2) == [0, 1]
    assert take_in_turn([retrieval, reach], 9) == [0, 2, 1, 3]  # no more than the layers
    assert take_in_turn([{0: 1.0, 1: 0.5, 2: 0.0}, {0: 0.0, 1: 0.5, 2: 1.0}], 9) == [0, 2, 1]


def test_the_config_accepts_exactly_the_rankings_the_pipeline_implements():
    from retrofitter.config.linearize import KEEP_SOFTMAX_RANKINGS
    from retrofitter.pipelines.recall_layers import RANKINGS

    assert set(KEEP_SOFTMAX_RANKINGS) == {"mse", *RANKINGS}  # config sits below pipelines and keeps its own list
