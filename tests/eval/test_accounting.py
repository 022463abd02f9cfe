import torch

from retrofitter.config import CompressConfig
from retrofitter.eval.accounting import account
from retrofitter.pipelines.compress import compress_model
from tiny_models import TINY_VOCAB, build_tiny


def test_llama_accounting_by_hand():
    model = build_tiny("llama")
    acc = account(model)
    d, inter, h, g, dh, layers, vocab = 32, 48, 4, 2, 8, 2, TINY_VOCAB
    per_layer = d * h * dh + 2 * d * g * dh + h * dh * d + 3 * d * inter
    assert acc.params_linear == layers * per_layer
    assert acc.params_embedding == 2 * vocab * d  # untied embeddings + head
    assert acc.params_total == sum(p.numel() for p in model.parameters())
    assert acc.kv_bytes_per_token == layers * 2 * g * dh * 4
    assert acc.macs_per_token == layers * per_layer + vocab * d


def test_tied_embeddings_counted_once_and_bf16_kv_bytes():
    model = build_tiny("llama")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16)
    acc = account(model)
    assert acc.params_embedding == TINY_VOCAB * 32
    assert acc.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2


def test_opt_counts_learned_positions_as_embedding():
    model = build_tiny("opt")
    acc = account(model)
    positions = model.model.decoder.embed_positions.weight.numel()
    assert model.config.tie_word_embeddings  # OPT ties its head to the token embedding
    assert acc.params_embedding == TINY_VOCAB * 32 + positions


def test_compression_reduces_linear_params_and_macs():
    model = build_tiny("llama")
    before = account(model)
    ids = torch.randint(3, TINY_VOCAB, (4, 32))
    compress_model(model, CompressConfig(ratio=0.3), ids, progress=False)
    after = account(model)
    assert after.params_linear <= 0.7 * before.params_linear
    assert after.params_total - after.params_linear == before.params_total - before.params_linear
    assert after.macs_per_token < before.macs_per_token
