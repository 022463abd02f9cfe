import math

import pytest
import torch

from retrofitter.eval.perplexity import block_nll, block_nll_reference, block_nlls, paired_ratio, perplexity
from tiny_models import TINY_VOCAB, build_tiny, build_tiny_without_adapter


def test_perplexity_matches_hand_computation():
    model = build_tiny("llama")
    blocks = torch.randint(3, TINY_VOCAB, (3, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(blocks).logits.double()
    log_probs = torch.log_softmax(logits, dim=-1)
    total, count = 0.0, 0
    for b in range(3):
        for t in range(1, 10):
            total -= float(log_probs[b, t - 1, blocks[b, t]])
            count += 1
    result = perplexity(model, blocks, batch_size=2, progress=False)
    assert result.tokens == count == 27
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-6)


def test_uniform_model_has_vocab_perplexity():
    model = build_tiny("opt")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits equal -> ppl == vocab size
    blocks = torch.randint(3, TINY_VOCAB, (2, 8))
    assert perplexity(model, blocks, progress=False).ppl == pytest.approx(TINY_VOCAB, rel=1e-5)


def test_rejects_bad_blocks():
    with pytest.raises(ValueError, match="seq_len >= 2"):
        perplexity(build_tiny("llama"), torch.zeros(4, 1, dtype=torch.long), progress=False)


@pytest.mark.parametrize("family", ["llama", "opt", "qwen3"])
def test_chunked_head_equals_full_logits_reference(family):
    """The LM head on chunks of positions (fast path) == full [b, L, vocab] logits, in float64."""
    model = build_tiny(family, dtype=torch.float64)
    blocks = torch.randint(3, TINY_VOCAB, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = block_nll_reference(model, blocks)
        for chunk in (1, 5, 22, 64):  # chunks that do and do not divide L - 1 = 22
            torch.testing.assert_close(block_nll(model, blocks, chunk_tokens=chunk), reference, rtol=1e-12, atol=1e-10)


def test_unsupported_architecture_falls_back_to_full_logits():
    class Wrapper(torch.nn.Module):  # not in the adapter registry
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    inner = build_tiny("llama")
    blocks = torch.randint(3, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block_nll(Wrapper(inner), blocks), block_nll_reference(inner, blocks))


def test_model_without_adapter_gets_its_perplexity_from_full_logits():
    model = build_tiny_without_adapter()  # OLMo: no adapter
    blocks = torch.randint(3, TINY_VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(blocks).logits.double(), dim=-1)
    nll = -log_probs[:, :-1].gather(-1, blocks[:, 1:, None]).sum()
    result = perplexity(model, blocks, batch_size=2, progress=False)
    assert result.tokens == 30
    assert result.ppl == pytest.approx(math.exp(float(nll) / 30), rel=1e-6)


def test_paired_ratio_is_the_perplexity_ratio_with_a_block_interval():
    blocks = torch.randint(3, TINY_VOCAB, (6, 12), generator=torch.Generator().manual_seed(7))
    base, other = build_tiny("llama", dtype=torch.float64), build_tiny("llama", dtype=torch.float64)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    nll_base, nll_other = block_nlls(base, blocks, progress=False), block_nlls(other, blocks, progress=False)
    assert nll_base.shape == (6,)
    ppl_base = perplexity(base, blocks, progress=False).ppl
    ppl_other = perplexity(other, blocks, progress=False).ppl
    paired = paired_ratio(nll_base, nll_other, seq_len=12)
    assert paired.ratio == pytest.approx(ppl_other / ppl_base, rel=1e-12)
    # the interval by hand: per-token differences of the 6 blocks, sample std over sqrt(6)
    d = [(float(nll_other[b]) - float(nll_base[b])) / 11 for b in range(6)]
    mean = sum(d) / 6
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 5) / math.sqrt(6)
    assert paired.log_ratio_se == pytest.approx(se, rel=1e-9) and se > 0
    assert paired.low == pytest.approx(math.exp(mean - 1.959964 * se), rel=1e-9)
    assert paired.low < paired.ratio < paired.high
    same = paired_ratio(nll_base, nll_base.clone(), seq_len=12)
    assert (same.ratio, same.low, same.high, same.log_ratio_se) == (1.0, 1.0, 1.0, 0.0)


def test_paired_ratio_rejects_mismatched_or_single_blocks():
    with pytest.raises(ValueError, match="one shape"):
        paired_ratio(torch.zeros(3), torch.zeros(4), seq_len=8)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        paired_ratio(torch.zeros(1), torch.zeros(1), seq_len=8)
