"""Synthetic passkey retrieval: prompt construction, scoring, and a real generate() on a tiny hybrid model."""

import pytest
import torch
from torch import nn

from retrofitter.eval.passkey import QUESTION, passkey_accuracy, passkey_prompt
from tiny_models import build_tiny, build_tiny_tokenizer


class _Oracle(nn.Module):
    """Answers with the first 5-digit number of the prompt (or a wrong one): tests the scoring only."""

    def __init__(self, tokenizer, wrong: bool = False):
        super().__init__()
        self.tokenizer, self.wrong = tokenizer, wrong
        self.anchor = nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, max_new_tokens, **_):
        import re

        text = self.tokenizer.decode(input_ids[0], skip_special_tokens=True).replace(" ", "")
        key = re.search(r"\d{5}", text).group(0)
        answer = "00000" if self.wrong else key
        new = torch.tensor([self.tokenizer.encode(" " + answer + ".", add_special_tokens=False)])
        return torch.cat([input_ids, new[:, :max_new_tokens]], dim=1)


def test_prompt_hides_the_key_at_the_requested_depth_and_length():
    tokenizer = build_tiny_tokenizer()
    early, late = (passkey_prompt(tokenizer, 400, depth, "12345") for depth in (0.0, 1.0))
    assert early.endswith(QUESTION) and "12345" in early
    assert early.index("12345") < 200 < late.index("12345")
    assert abs(len(tokenizer.encode(late, add_special_tokens=False)) - 400) < 100
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tokenizer, 400, 1.5, "12345")


def test_accuracy_scores_correct_and_wrong_answers():
    tokenizer = build_tiny_tokenizer()
    right = passkey_accuracy(_Oracle(tokenizer), tokenizer, context_lengths=(200, 300), depths=(0.2, 0.8), trials=2)
    wrong = passkey_accuracy(_Oracle(tokenizer, wrong=True), tokenizer, context_lengths=(200,), depths=(0.5,))
    assert right["accuracy"] == 1.0 and right["by_context"] == {"200": 1.0, "300": 1.0}
    assert len(right["trials"]) == 8 and wrong["accuracy"] == 0.0


def test_runs_on_a_tiny_hybrid_model_with_real_generate():
    from retrofitter.adapters.hybrid_attention import swap_to_hybrid

    model = build_tiny("llama")
    swap_to_hybrid(model, dict(window=8, feature_dim=8))
    result = passkey_accuracy(model, build_tiny_tokenizer(), context_lengths=(120,), depths=(0.5,), trials=1,
                              max_new_tokens=3)
    assert 0.0 <= result["accuracy"] <= 1.0 and result["trials"][0]["prompt_tokens"] > 100
