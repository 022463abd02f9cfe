"""Synthetic passkey retrieval: prompt construction, scoring, and a real generate() on a tiny hybrid model."""

import pytest
import torch
from torch import nn

from retrofitter.eval.passkey import QUESTION, multikey_prompt, passkey_accuracy, passkey_prompt
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


class _FirstKeyOracle(_Oracle):
    """Answers the key that follows the label the question asks for (or, when ``wrong``, the first needle's)."""

    def generate(self, input_ids, max_new_tokens, **_):
        import re

        spaced = self.tokenizer.decode(input_ids[0], skip_special_tokens=True)  # the tiny tokenizer spaces characters
        text = re.sub(r"\s{2,}", " ", re.sub(r"(?<=\S) (?=\S)", "", spaced))
        asked = re.search(r"of the (\w+) door\?", text).group(1)
        label = re.search(r"of the (\w+) door is", text).group(1) if self.wrong else asked
        key = re.search(rf"{label} door is\s*([\d ]+)\.", text).group(1).replace(" ", "")
        new = torch.tensor([self.tokenizer.encode(" " + key + ".", add_special_tokens=False)])
        return torch.cat([input_ids, new[:, :max_new_tokens]], dim=1)


def test_multikey_asks_for_one_of_several_keys():
    tokenizer = build_tiny_tokenizer()
    prompt = multikey_prompt(tokenizer, 400, [("red", "11111", 0.9), ("blue", "22222", 0.1)], "red")
    assert prompt.index("22222") < prompt.index("11111") and prompt.endswith("of the red door is")
    right = passkey_accuracy(_FirstKeyOracle(tokenizer), tokenizer, context_lengths=(300,), depths=(0.2, 0.8),
                             trials=3, keys=4)
    assert right["accuracy"] == 1.0 and right["settings"]["keys"] == 4
    assert set(right["by_context_depth"]) == {"300@0.2", "300@0.8"}
    assert all(len(r["distractors"]) == 3 and r["passkey"] not in r["distractors"] for r in right["trials"])
    # Answering another needle's key is wrong (the asked needle is not always the first one).
    wrong = passkey_accuracy(_FirstKeyOracle(tokenizer, wrong=True), tokenizer, context_lengths=(300,),
                             depths=(0.9,), trials=4, keys=3)
    assert wrong["accuracy"] < 1.0
    with pytest.raises(ValueError, match="keys must lie"):
        passkey_accuracy(_FirstKeyOracle(tokenizer), tokenizer, context_lengths=(300,), keys=9)
