"""Llama-family adapter: Llama, Mistral, Qwen3 (QK-norm), SmolLM (= Llama) — GQA, RoPE, gated MLP.

Layer wiring: ``self_attn.{q,k,v,o}_proj`` (+ Qwen3's ``q_norm``/``k_norm``), ``mlp.{gate,up,down}_proj``,
RMSNorm, rotary embedding at ``model.rotary_emb``. Attention biases follow ``config.attention_bias``.
"""

from __future__ import annotations

from .base import AttentionLayout, ModelAdapter

__all__ = ["LLAMA_ADAPTER", "llama_layout"]


def llama_layout(config, has_bias: bool | None = None) -> AttentionLayout:
    """Head layout from a Llama-style config; ``has_bias`` defaults to ``config.attention_bias``."""
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if has_bias is None:
        has_bias = bool(getattr(config, "attention_bias", False))
    return AttentionLayout(
        hidden_size=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        uses_rope=True,
        has_bias=has_bias,
    )


LLAMA_ADAPTER = ModelAdapter(
    family="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"),
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
    layout_fn=llama_layout,
    final_norm_path="model.norm",
    rotary_path="model.rotary_emb",
    linearizable=True,
    latent_attention=True,
)
