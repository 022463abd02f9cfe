"""OPT adapter: multi-head attention with biases, ReLU MLP (fc1/fc2), learned positions, LayerNorm."""

from __future__ import annotations

from .base import AttentionLayout, ModelAdapter

__all__ = ["OPT_ADAPTER"]


def _opt_layout(config) -> AttentionLayout:
    return AttentionLayout(
        hidden_size=config.hidden_size,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        uses_rope=False,
        has_bias=bool(getattr(config, "enable_bias", True)),
    )


OPT_ADAPTER = ModelAdapter(
    family="opt",
    architectures=("OPTForCausalLM",),
    decoder_path="model.decoder.layers",
    linear_paths={
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.out_proj",
        "fc1": "fc1",
        "fc2": "fc2",
    },
    linear_groups=(("q", "k", "v"), ("o",), ("fc1",), ("fc2",)),
    attention_path="self_attn",
    mlp_path="",  # OPT has no MLP submodule: fc1/fc2 sit on the layer itself
    mlp_kind="plain",
    activation_path="activation_fn",
    layout_fn=_opt_layout,
    final_norm_path="model.decoder.final_layer_norm",
    rotary_path="",  # learned positions
    linearizable=False,  # HybridSelfAttention needs RoPE attention
    latent_attention=True,  # absorbed (MLA-style) execution
    final_projection_path="model.decoder.project_out",
)
