"""Distillation loss (chunked, top-k) against full-logits references, and exact LoRA merges on converted models."""

import pytest
import torch

from retrofitter.config import CompressConfig
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.modules.low_rank_delta import add_low_rank_delta, low_rank_deltas, merge_low_rank_deltas
from retrofitter.pipelines.compress import compress_model
from retrofitter.pipelines.distill import (DistillationLoss, kl_divergence_sum, reference_distillation_loss,
                                           teacher_topk, topk_kl_divergence_sum)
from retrofitter.pipelines.heal import heal_targets

from tiny_models import TINY_VOCAB, build_tiny, strong_tiny


def tokens(n=3, length=17, seed=0):
    return torch.randint(3, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def compressed(family="llama", method="asvd-rootcov", dtype=torch.float64, seed=0):
    model = strong_tiny(family, seed=seed).to(dtype)
    compress_model(model, CompressConfig(ratio=0.3, method=method, batch_size=4), tokens(4, 32, seed=9), progress=False)
    return model


def adapted(model, seed=1):
    """LoRA on every default target, with nonzero random B so the adapters change the model."""
    for target in heal_targets(model):
        add_low_rank_delta(target.module, target.tensor, rank=3, alpha=6.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for delta in low_rank_deltas(model).values():
            delta.lora_B.weight.copy_(0.1 * torch.randn(delta.lora_B.weight.shape, generator=generator,
                                                        dtype=torch.float64))
    return model


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: soft-capped logits go through head_logits
@pytest.mark.parametrize("nll_weight", [0.0, 0.3, 1.0])
def test_chunked_loss_and_gradients_equal_full_logits_reference_float64(family, nll_weight):
    teacher = strong_tiny(family, seed=3).to(torch.float64)
    student = adapted(compressed(family))
    ids = tokens()
    trainable = [p for d in low_rank_deltas(student).values() for p in d.parameters()]
    chunked = DistillationLoss(student, teacher, chunk_tokens=5, nll_weight=nll_weight, temperature=1.5)(ids)
    grads = torch.autograd.grad(chunked, trainable)
    with torch.no_grad():
        teacher_logits = teacher(ids).logits
    reference = reference_distillation_loss(student(ids).logits, teacher_logits, ids, nll_weight, temperature=1.5)
    reference_grads = torch.autograd.grad(reference, trainable)
    torch.testing.assert_close(chunked, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert max(float(g.abs().max()) for g in grads) > 1e-6  # the gradients are not trivially zero


def test_kl_is_zero_for_identical_models_and_matches_the_textbook_formula():
    torch.manual_seed(0)
    s, t = torch.randn(2, 4, 7, dtype=torch.float64), torch.randn(2, 4, 7, dtype=torch.float64)
    p, q = t.softmax(-1), s.softmax(-1)
    torch.testing.assert_close(kl_divergence_sum(s, t), (p * (p.log() - q.log())).sum())
    assert float(kl_divergence_sum(t, t)) == pytest.approx(0.0, abs=1e-12)


def test_topk_kl_with_the_whole_vocabulary_equals_the_full_kl_and_the_cached_loss_too():
    teacher = strong_tiny("llama", seed=3).to(torch.float64)
    student = adapted(compressed())
    ids = tokens()
    values, index = teacher_topk(teacher, ids, k=TINY_VOCAB, chunk_tokens=4)
    assert values.shape == index.shape == (*ids.shape, TINY_VOCAB) and values.dtype == torch.float32
    with torch.no_grad():
        s, t = student(ids).logits, teacher(ids).logits
    torch.testing.assert_close(topk_kl_divergence_sum(s, t.log_softmax(-1).topk(TINY_VOCAB, -1).values,
                                                      t.log_softmax(-1).topk(TINY_VOCAB, -1).indices),
                               kl_divergence_sum(s, t))
    full = DistillationLoss(student, teacher, chunk_tokens=5)(ids)
    cached = DistillationLoss(student, None, chunk_tokens=5)(ids, (values.double(), index))
    torch.testing.assert_close(cached, full, rtol=1e-6, atol=1e-7)  # the cache holds float32 log-probs


@pytest.mark.parametrize("method", ["asvd-rootcov", "latentllm"])  # latentllm: LatentAttention reads up directly
def test_lora_on_latent_linear_factors_merges_exactly_and_keeps_the_layout(method):
    model = compressed(method=method)
    layout = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    pivots = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_index")}
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
        adapted(model)
        adapter_logits = model(ids).logits
    assert (adapter_logits - before).abs().max() > 1e-3  # the adapters change the model
    assert merge_low_rank_deltas(model) == len(heal_targets(model)) > 0
    assert not low_rank_deltas(model)
    with torch.no_grad():
        merged_logits = model(ids).logits
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-13, atol=1e-13)
    state = model.state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == layout  # same keys, shapes: same files
    assert all(torch.equal(state[k], v) for k, v in pivots.items())
    assert all(type(m) in (LatentLinear, torch.nn.Linear) for m in (t.module for t in heal_targets(model)))
    assert not any(getattr(t.module, t.tensor).requires_grad for t in heal_targets(model))  # merged: frozen


def test_default_targets_cover_every_projection_of_a_compressed_model_and_can_be_narrowed():
    model = compressed(dtype=torch.float32)
    targets = heal_targets(model)
    assert len(targets) == 2 * 7 * 2  # 2 layers x q k v o gate up down x (up, mix)
    assert {t.tensor for t in targets} == {"up", "mix"}
    assert {t.short for t in heal_targets(model, ("q", "o"))} == {"self_attn.q_proj.up", "self_attn.q_proj.mix",
                                                                  "self_attn.o_proj.up", "self_attn.o_proj.mix"}
    dense = build_tiny("llama")
    assert {t.tensor for t in heal_targets(dense)} == {"weight"}
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        heal_targets(dense, ("qkv",))
