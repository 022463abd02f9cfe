"""pipelines/sample_text.py: prompt windows over a corpus, and continuations the model samples."""

import pytest
import torch

from retrofitter.config import SampleConfig
from retrofitter.pipelines.sample_text import prompt_windows, sample_batches


def test_prompt_windows_are_spread_evenly_and_keep_the_text():
    ids = list(range(100))
    windows = prompt_windows(ids, count=4, length=10)
    assert windows.tolist() == [list(range(s, s + 10)) for s in (0, 22, 45, 67)]  # ⌊i · 90 / 4⌋
    assert prompt_windows(ids, count=1, length=100).tolist() == [ids]
    with pytest.raises(ValueError, match="fewer than one prompt of 101"):
        prompt_windows(ids, count=1, length=101)


def test_sample_batches_continue_each_prompt_by_exactly_the_new_tokens_and_resume_alike(tiny_llama):
    model = tiny_llama.eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (5, 6), generator=torch.Generator().manual_seed(0))
    config = SampleConfig(samples=5, prompt_tokens=6, new_tokens=7, batch_size=2, seed=3)
    batches = list(sample_batches(model, prompts, config, bos_id=1, pad_id=0))
    assert [first for first, _ in batches] == [0, 2, 4]
    rows = torch.cat([ids for _, ids in batches])
    assert rows.shape == (5, 6 + 7)
    assert rows.dtype == prompts.dtype == torch.long
    assert torch.equal(rows[:, :6], prompts)  # integer ids copied by generate: exact on every CPU
    assert len({tuple(r) for r in rows[:, 6:].tolist()}) == 5  # sampled: no two continuations alike
    # The resume contract, exactly: a batch gets the same seed and the same input ids whether the run starts at 0
    # or resumes at its index (integers, recorded as generate is called).
    model = model.double()
    calls, generate = [], model.generate

    def recording(inputs, **kwargs):
        calls.append((torch.initial_seed(), inputs.tolist()))
        return generate(inputs, **kwargs)

    model.generate = recording
    again = torch.cat([ids for _, ids in sample_batches(model, prompts, config, bos_id=1, pad_id=0)])
    whole_calls, calls[:] = calls[:], []
    resumed = list(sample_batches(model, prompts, config, bos_id=1, pad_id=0, start=2))
    assert [first for first, _ in resumed] == [2, 4]
    assert calls == whole_calls[1:] and [seed for seed, _ in whole_calls] == [3, 5, 7]  # seed + first index
    # The sampled ids then come from the same float64 logits up to the order of roundings (~1e-16 relative): a
    # draw changes only when its uniform number falls that close to a boundary of the cumulative probabilities
    # (≤ 1e-12 per token), while a wrong seed would agree on about 1 token in 50 (top-k 50). 90 %: a tolerance.
    agreement = (torch.cat([ids for _, ids in resumed])[:, 6:] == again[2:, 6:]).double().mean()
    assert agreement >= 0.9, agreement
    with pytest.raises(ValueError, match="not a multiple of the batch size 2"):
        next(sample_batches(model, prompts, config, bos_id=1, pad_id=0, start=1))


def test_sample_batches_at_temperature_near_zero_pick_the_most_likely_token(tiny_llama):
    """At temperature τ a token whose logit is g below the best is drawn with probability ≤ V·exp(−g/τ): at
    τ = 1e-6, V = 96, every drawn token lies within 1e-4 of the best logit (odds below e^-95). Checked in float64
    against a teacher-forced forward (cached and uncached logits agree to ~1e-12 there)."""
    model = tiny_llama.double().eval()
    prompts = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    config = SampleConfig(samples=2, prompt_tokens=5, new_tokens=4, batch_size=2, temperature=1e-6, top_k=0,
                          top_p=1.0)
    (_, rows), = sample_batches(model, prompts, config, bos_id=None, pad_id=0)
    with torch.no_grad():
        logits = model(rows).logits[:, 4:-1]                                          # [2, 4, V]: predicts 5..8
    drawn = logits.gather(-1, rows[:, 5:, None]).squeeze(-1)                          # [2, 4]
    gaps = logits.max(-1).values - drawn
    assert float(gaps.max()) <= 1e-4
    spread = logits.max(-1).values - logits.topk(2, dim=-1).values[..., 1]
    assert float(spread.min()) > 1e-4  # the runner-up is further away: a wrong token would fail the check


@pytest.mark.parametrize("field, value, message", [("samples", 0, "samples must be >= 1"),
                                                   ("temperature", 0.0, "temperature must be > 0"),
                                                   ("top_k", -1, "top_k must be >= 0"),
                                                   ("top_p", 1.5, r"top_p must be in \(0, 1\]")])
def test_sample_config_refuses_bad_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        SampleConfig(**{field: value})
