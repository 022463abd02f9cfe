"""Tiny random HF models of every supported family, built from configs (no download)."""

from __future__ import annotations

import torch
import transformers

TINY_VOCAB = 96


def _common(**kw):
    base = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    base.update(kw)
    return base


def _opt_config():
    return transformers.OPTConfig(vocab_size=TINY_VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, enable_bias=True,
                                  do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0)


def _gemma_common(**kw):
    """Gemma specifics made visible at tiny size: a 6-token window (tests run longer sequences), a score
    scale that is not 1/sqrt(head_dim), soft-caps small enough to bend tiny logits, tied embeddings."""
    return _common(head_dim=8, query_pre_attn_scalar=12, sliding_window=6, tie_word_embeddings=True, **kw)


def _gemma3_config():
    return transformers.Gemma3TextConfig(**_gemma_common(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}))


def _gpt_neox_config():
    return transformers.GPTNeoXConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                                      use_parallel_residual=True, attention_bias=True, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, tie_word_embeddings=False)


IMAGE_TOKEN = TINY_VOCAB - 1  # LLaVA's image placeholder id (inside the vocabulary, as in real checkpoints)
IMAGE_SIZE = 16  # tiny CLIP: 16×16 images, 8×8 patches -> 4 patch features (+ CLS, dropped) per image


def _tiny_clip():
    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8)


def _llava_config():
    """LLaVA-1.5 wiring at tiny size: CLIP tower (second-to-last layer, CLS dropped), GELU projector, Llama text."""
    return transformers.LlavaConfig(vision_config=_tiny_clip(), text_config=transformers.LlamaConfig(**_common()),
                                    image_token_index=IMAGE_TOKEN, image_seq_length=4, projector_hidden_act="gelu")


def _llava_next_config():
    """LLaVA-NeXT (any-resolution tiles + image newline) at tiny size, Mistral text."""
    return transformers.LlavaNextConfig(vision_config=_tiny_clip(),
                                        text_config=transformers.MistralConfig(**_common(sliding_window=None)),
                                        image_token_index=IMAGE_TOKEN, projector_hidden_act="gelu",
                                        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])


# One row per supported model family: name -> tiny config. Adding a family to retrofitter = one adapter
# file + one row here (every adapter/module test is parametrized over these rows).
TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_common(rope_theta=10000.0)),
    "mistral": lambda: transformers.MistralConfig(**_common(sliding_window=None)),
    "qwen2": lambda: transformers.Qwen2Config(**_common()),
    "qwen3": lambda: transformers.Qwen3Config(**_common(head_dim=8)),
    "opt": _opt_config,
    "gemma2": lambda: transformers.Gemma2Config(**_gemma_common(attn_logit_softcapping=2.0,
                                                                final_logit_softcapping=3.0)),
    "gemma3": _gemma3_config,
    "phi3": lambda: transformers.Phi3Config(**_common(sliding_window=8, partial_rotary_factor=0.75)),
    "gpt_neox": _gpt_neox_config,
    "llava": _llava_config,  # vision-language: only the language model is converted (tests/test_llava.py)
    "llava_next": _llava_next_config,
}

FAMILIES = list(TINY_CONFIGS)


def build_tiny(family: str, seed: int = 0, dtype=torch.float32):
    """A tiny random causal LM of ``family`` (a row of ``TINY_CONFIGS``), eval mode."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; rows: {FAMILIES}")
    torch.manual_seed(seed)
    config = TINY_CONFIGS[family]()
    vision_language = hasattr(config, "vision_config")  # LLaVA rows
    auto = transformers.AutoModelForImageTextToText if vision_language else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=dtype)
    # Random init in HF is small; make the biases nonzero so bias handling is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and param.ndim == 1:
                param.normal_(0, 0.02)
    return model.eval()


def build_tiny_without_adapter(seed: int = 0, dtype=torch.float32):
    """A tiny random OLMo causal LM: an architecture retrofitter has no adapter for (generic paths).

    2 layers, 4 heads of 8, untied 96 × 32 embeddings,
    every matrix an nn.Linear."""
    torch.manual_seed(seed)
    config = transformers.OlmoConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def strong_tiny(family: str, seed: int = 0, dtype=torch.float32):
    """A tiny model whose layers matter: HF's 0.02 init makes attention nearly a no-op, so the
    decoder-layer matrices are scaled ×8 (tests of attention/compression need real interactions)."""
    model = build_tiny(family, seed=seed, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and ".layers." in name:
                param.mul_(8)
    return model


def build_tiny_tokenizer():
    """A character-level fast tokenizer (vocab < TINY_VOCAB) with BOS/EOS/PAD, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = " abcdefghijklmnopqrstuvwxyz.,'\n" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789;:!?-()"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    assert len(vocab) <= TINY_VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def save_tiny_model_dir(path, family: str = "llama"):
    """A tiny model + tokenizer saved as an HF directory (safetensors), as a user would have locally."""
    model = build_tiny(family)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


SAMPLE_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on his "
    "first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
    "that he is considered the rightful property of some one or other of their daughters.\n"
) * 12
