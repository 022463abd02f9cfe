"""token_blocks / calibration_blocks with a tiny fake tokenizer (one id per word)."""

from __future__ import annotations

import pytest
import torch

from retrofitter.data.blocks import calibration_blocks, token_blocks, with_repeated_spans


class WordTokenizer:
    """Token id of a word = 10 + its integer value; ``encode`` ignores special tokens like HF's."""

    def __init__(self, bos_token_id=1):
        self.bos_token_id = bos_token_id
        self.calls = 0

    def encode(self, text, add_special_tokens=True, **kwargs):
        self.calls += 1
        assert add_special_tokens is False
        return [10 + int(word) for word in text.split()]


def _text(count):
    return " ".join(str(index) for index in range(count))


def test_bos_is_prepended_and_windows_do_not_overlap():
    tokenizer = WordTokenizer()
    blocks = token_blocks(tokenizer, _text(23), seq_len=6)
    assert blocks.dtype == torch.long and blocks.shape == (4, 6)  # 23 // 5 text tokens per block
    assert torch.equal(blocks[:, 0], torch.ones(4, dtype=torch.long))
    assert blocks[:, 1:].flatten().tolist() == [10 + index for index in range(20)]
    assert tokenizer.calls == 1  # the text is tokenized once


def test_without_bos_windows_are_full_length():
    for tokenizer, prepend_bos in ((WordTokenizer(bos_token_id=None), True), (WordTokenizer(), False)):
        blocks = token_blocks(tokenizer, _text(23), seq_len=6, prepend_bos=prepend_bos)
        assert blocks.shape == (3, 6)
        assert blocks.flatten().tolist() == [10 + index for index in range(18)]


def test_limits_on_blocks_and_tokens():
    tokenizer = WordTokenizer()
    assert token_blocks(tokenizer, _text(100), seq_len=5, max_blocks=3).shape == (3, 5)
    assert token_blocks(tokenizer, _text(100), seq_len=5, max_tokens=12).shape == (2, 5)
    assert token_blocks(tokenizer, _text(100), seq_len=5, max_blocks=10, max_tokens=1000).shape == (10, 5)


def test_errors_name_the_limits():
    tokenizer = WordTokenizer()
    with pytest.raises(ValueError, match=r"text has 4 tokens, fewer than one block needs \(7 text tokens for seq_len=8\)"):
        token_blocks(tokenizer, _text(4), seq_len=8)
    with pytest.raises(ValueError, match="seq_len=1 leaves no room for text after the BOS token"):
        token_blocks(tokenizer, _text(4), seq_len=1)
    with pytest.raises(ValueError, match="max_tokens=3 is smaller than one block of seq_len=4"):
        token_blocks(tokenizer, _text(40), seq_len=4, max_tokens=3)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        token_blocks(tokenizer, _text(40), seq_len=0)


def test_calibration_blocks_is_strict_about_count():
    tokenizer = WordTokenizer()
    blocks = calibration_blocks(tokenizer, _text(50), seq_len=5, n_blocks=4)
    assert torch.equal(blocks, token_blocks(tokenizer, _text(50), seq_len=5)[:4])
    with pytest.raises(ValueError, match="yields only 12 blocks of seq_len=5, 20 were requested"):
        calibration_blocks(tokenizer, _text(50), seq_len=5, n_blocks=20)


def test_with_repeated_spans_ends_the_chosen_blocks_with_an_earlier_span_of_their_own():
    # token ids: integer tensors, copied by indexing, so torch.equal is exact on every CPU
    blocks = torch.arange(8 * 40).view(8, 40)  # every token distinct, so a span's source is unique
    out = with_repeated_spans(blocks, 0.5, 6, seed=3)
    assert blocks.dtype == out.dtype == torch.long
    changed = [row for row in range(8) if not torch.equal(out[row], blocks[row])]
    assert changed == [0, 2, 5, 7]  # round(linspace(0, 7, 4)): evenly spaced, first and last included
    for row in range(8):
        assert torch.equal(out[row, :34], blocks[row, :34])  # only the last m = 6 tokens may change
    for row in changed:
        start = int(out[row, 34]) - int(blocks[row, 0])
        assert 1 <= start <= 40 - 2 * 6  # never the BOS position; the source ends before the repeat
        assert torch.equal(out[row, 34:], blocks[row, start:start + 6])
    assert torch.equal(out, with_repeated_spans(blocks, 0.5, 6, seed=3))
    assert not torch.equal(out, with_repeated_spans(blocks, 0.5, 6, seed=4))
    assert torch.equal(with_repeated_spans(blocks, 0.5, 100, seed=3)[:, 30:31], blocks[:, 30:31])  # m = 39 // 4 = 9
    assert torch.equal(with_repeated_spans(blocks, 0.0, 6), blocks)
    assert (with_repeated_spans(blocks, 1.0, 6)[:, 34:] != blocks[:, 34:]).any(dim=1).all()


def test_with_repeated_spans_refuses_a_bad_share_and_too_short_blocks():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        with_repeated_spans(torch.zeros(2, 40, dtype=torch.long), 1.5, 6)
    with pytest.raises(ValueError, match="too short"):
        with_repeated_spans(torch.zeros(2, 4, dtype=torch.long), 0.5, 6)
