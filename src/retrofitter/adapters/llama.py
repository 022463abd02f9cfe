"""Llama-family adapter: Llama, Mistral, Qwen2, Qwen3 (QK-norm), SmolLM — GQA, RoPE, gated MLP."""

from __future__ import annotations

from .base import AttentionLayout, ModelAdapter

__all__ = ["LLAMA_FAMILY_ADAPTER", "LLAMA_FAMILY_CLASSES"]


def _llama_layout(config) -> AttentionLayout:
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return AttentionLayout(
        hidden_size=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        uses_rope=True,
        has_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
    )


LLAMA_FAMILY_ADAPTER = ModelAdapter(
    family="llama",
    decoder_path="model.layers",
    linear_paths={
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    },
    linear_groups=(("q", "k", "v"), ("o",), ("gate", "up"), ("down",)),
    attention_path="self_attn",
    mlp_path="mlp",
    mlp_kind="gated",
    activation_path="mlp.act_fn",
    uses_rope=True,
    layout_fn=_llama_layout,
    final_norm_path="model.norm",
)

# HF causal-LM classes wired exactly like Llama (q/k/v/o, gate/up/down, RMSNorm, RoPE).
LLAMA_FAMILY_CLASSES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
