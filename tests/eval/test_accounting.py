import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from retrofitter.adapters import adapter_for
from retrofitter.adapters.latent_attention import latent_cache_numbers_per_token, to_latent_attention
from retrofitter.checkpoint import save_retrofitted
from retrofitter.config import CompressConfig
from retrofitter.eval.accounting import account
from retrofitter.eval.bench import cache_nbytes
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model
from tiny_models import TINY_VOCAB, build_tiny, build_tiny_without_adapter


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


# ---- every byte figure equals the bytes measured on real tensors ------------------------------------------
def low_rank_latent_model(family, keep=0.5, seed=0):
    """q/k/v/o as random low-rank LatentLinear projections, then LatentAttention (a stand-in compressed model)."""
    model = build_tiny(family, seed=seed)
    adapter = adapter_for(model)
    generator = torch.Generator().manual_seed(seed)
    for layer in adapter.decoder_layers(model):
        for name in ("q", "k", "v", "o"):
            linear = adapter.get_linear(layer, name)
            rank = max(1, int(keep * min(linear.in_features, linear.out_features)))
            moment = torch.randn(linear.in_features, linear.in_features, generator=generator, dtype=torch.float64)
            adapter.set_linear(layer, name, LatentLinear.from_linear(linear, moment @ moment.T, rank))
    return to_latent_attention(model)


def prefill_cache(model, length, batch=1):
    ids = torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        output = model(input_ids=ids, use_cache=True)
    return output["cache"] if "cache" in output else output["past_key_values"]


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_latent_cache_bytes_per_token_are_the_measured_cache_growth(family):
    model = low_rank_latent_model(family)  # float32; llama caches int32 position ids, opt (absorbed) none
    acc = account(model)
    for length in (5, 12):
        assert cache_nbytes(prefill_cache(model, length)) == length * acc.kv_bytes_per_token
    assert acc.state_bytes_per_sequence == 0
    ranks = latent_cache_numbers_per_token(model)
    assert acc.kv_bytes_per_token == ranks * 4 + (2 * 4 if family == "llama" else 0)  # 2 layers × int32


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_stored_bytes_equal_the_saved_safetensors(family, tmp_path):
    model = low_rank_latent_model(family)  # LatentLinear index buffers (int64) are stored too
    if family == "llama":  # tie the head; OPT is tied already
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    save_retrofitted(model, tmp_path / "m", {"method": "test"})
    saved = {}
    for file in (tmp_path / "m").glob("*.safetensors"):
        saved.update(load_file(file))
    acc = account(model)
    assert acc.stored_bytes == sum(t.nbytes for t in saved.values())
    assert acc.stored_bytes > 4 * acc.params_total  # index buffers are in no parameter count
    assert acc.bytes_dict() == {"stored": acc.stored_bytes, "kv_per_token": acc.kv_bytes_per_token,
                                "state_per_sequence": 0}


# ---- architectures without an adapter -----------------------------------------------------------------------
def test_model_without_adapter_is_accounted_from_module_types_and_config():
    model = build_tiny_without_adapter()  # OLMo: no adapter
    acc = account(model)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    assert acc.params_total == sum(p.numel() for p in model.parameters())
    assert acc.params_embedding == 2 * TINY_VOCAB * 32  # untied embed_in + embed_out
    assert acc.params_linear == sum(p.numel() for m in linears for p in m.parameters()) > 0
    assert acc.macs_per_token == sum(m.weight.numel() for m in linears) + TINY_VOCAB * 32
    assert acc.kv_bytes_per_token == 2 * 2 * 4 * 8 * 4  # layers · (k, v) · heads · head_dim · fp32
    assert acc.attention_macs_per_token == 2 * 2 * 4 * 8 * (512 // 2)
    assert acc.state_bytes_per_sequence == 0 and acc.notes
    assert acc.stored_bytes == sum(t.nbytes for t in model.state_dict().values())
    for length in (4, 9):
        assert cache_nbytes(prefill_cache(model, length)) == length * acc.kv_bytes_per_token


def test_unknown_figures_are_none_with_a_note():
    config = transformers.GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()  # Conv1D projections: no nn.Linear to count
    acc = account(model)
    assert acc.macs_per_token is None and any("macs_per_token" in note for note in acc.notes)
    assert acc.kv_bytes_per_token == 2 * 2 * 32 * 4  # attribute_map: n_layer, n_head, n_embd
    model.config.num_attention_heads = None  # a config that cannot say
    acc = account(model)
    assert acc.kv_bytes_per_token is None and acc.state_bytes_per_sequence is None
    assert any("kv_bytes_per_token" in note for note in acc.notes)
