"""GPT-NeoX / Pythia adapter: fused per-head q/k/v, partial RoPE, parallel residual, biases everywhere.

Layer wiring: ``attention.query_key_value`` [3·d, d] with rows interleaved per head ([q_h; k_h; v_h]
for h = 0..H−1, each dh rows) is split into ``attention.query_key_value.{q,k,v}`` (``base.FusedLayout``
with one group per head, done by ``decoder_layers``; saved and rebuilt on load), ``attention.dense``
(o), ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h`` (fc1 / fc2, GELU: a plain MLP), LayerNorms,
final ``gpt_neox.final_layer_norm``, rotary embedding at ``gpt_neox.rotary_emb``.

* partial rotary (``rotary_pct``: the first rotary_pct·dh dims of each head rotate): the rotary
  tables are that narrow and both wrappers rotate only those dims;
* parallel residual (h + attn(ln1 h) + mlp(ln2 h)): attention and MLP read different norms of the same
  h; the groups stay (q, k, v), (o), (fc1), (fc2) in execution order and only HF's layer forward
  combines them, so no conversion depends on it;
* biases on every projection (compensated by every fit); the decoder layer hands the cache to its
  attention as ``layer_past`` (``cache_kwarg``).

Capabilities: compress (every method), latent k/v cache, linearize.
"""

from __future__ import annotations

from .base import AttentionLayout, FusedLayout, ModelAdapter

__all__ = ["GPT_NEOX_ADAPTER"]


def _neox_layout(config) -> AttentionLayout:
    n_heads = config.num_attention_heads
    return AttentionLayout(
        hidden_size=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=config.hidden_size // n_heads,
        uses_rope=True,
        has_bias=bool(getattr(config, "attention_bias", True)),
    )


def _qkv_widths(config) -> tuple[int, int, int]:
    return (config.hidden_size,) * 3


def _heads(config) -> int:
    return config.num_attention_heads


GPT_NEOX_ADAPTER = ModelAdapter(
    family="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    decoder_path="gpt_neox.layers",
    linear_paths={
        "q": "attention.query_key_value.q",
        "k": "attention.query_key_value.k",
        "v": "attention.query_key_value.v",
        "o": "attention.dense",
        "fc1": "mlp.dense_h_to_4h",
        "fc2": "mlp.dense_4h_to_h",
    },
    linear_groups=(("q", "k", "v"), ("o",), ("fc1",), ("fc2",)),
    attention_path="attention",
    mlp_path="mlp",
    mlp_kind="plain",
    activation_path="mlp.act",
    layout_fn=_neox_layout,
    final_norm_path="gpt_neox.final_layer_norm",
    rotary_path="gpt_neox.rotary_emb",
    linearizable=True,
    latent_attention=True,
    fused=(FusedLayout("attention.query_key_value", ("q", "k", "v"), _qkv_widths, _heads),),
    cache_kwarg="layer_past",
)
