"""Phi-3 adapter: Llama-like attention and gated MLP computed by two fused projections.

HF's ``Phi3Attention`` computes q, k and v with one ``qkv_proj`` [(h + 2g)·dh, d] (rows [q; k; v]) and
``Phi3MLP`` gate and up with one ``gate_up_proj`` [2·d_ff, d] (rows [gate; up], then
down(up ⊙ silu(gate))). Both are split into their parts (``base.FusedLayout``, done by
``decoder_layers``), so the adapter names them like Llama's: ``self_attn.qkv_proj.{q,k,v}``,
``mlp.gate_up_proj.{gate,up}``; every method (joint QK/VO, the MLP streaming fit, the channel
permutation of the MLP) then applies as for Llama, and the split is saved and rebuilt on load.

RoPE at ``model.rotary_emb`` (partial when ``partial_rotary_factor`` < 1, e.g. Phi-4-mini); a config
``sliding_window`` makes every layer slide (Phi-3-mini: 2047), honoured by both wrappers. No biases.
Capabilities: compress, latent k/v cache, linearize. LongRoPE models switch their rotary table when a
sequence passes ``original_max_position_embeddings``; the latent cache recomputes the keys' rotations
with the table of the current step (HF keeps the rotation a key was cached with), so past that length
the two differ — as HF's own cache does when it re-encodes a prompt.
"""

from __future__ import annotations

import dataclasses

from .base import AttentionLayout, FusedLayout
from .llama import LLAMA_ADAPTER, llama_layout

__all__ = ["PHI3_ADAPTER"]


def _phi3_layout(config) -> AttentionLayout:
    return llama_layout(config, has_bias=False)


def _qkv_widths(config) -> tuple[int, int, int]:
    layout = _phi3_layout(config)
    return (layout.n_heads * layout.head_dim, layout.n_kv_heads * layout.head_dim,
            layout.n_kv_heads * layout.head_dim)


def _gate_up_widths(config) -> tuple[int, int]:
    return (config.intermediate_size, config.intermediate_size)


PHI3_ADAPTER = dataclasses.replace(
    LLAMA_ADAPTER,
    family="phi3",
    architectures=("Phi3ForCausalLM",),
    linear_paths={
        "q": "self_attn.qkv_proj.q",
        "k": "self_attn.qkv_proj.k",
        "v": "self_attn.qkv_proj.v",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_up_proj.gate",
        "up": "mlp.gate_up_proj.up",
        "down": "mlp.down_proj",
    },
    activation_path="mlp.activation_fn",
    layout_fn=_phi3_layout,
    fused=(FusedLayout("self_attn.qkv_proj", ("q", "k", "v"), _qkv_widths),
           FusedLayout("mlp.gate_up_proj", ("gate", "up"), _gate_up_widths)),
)
