"""Gemma 2 and Gemma 3 (text) adapters: wired like Llama, with Gemma's extras.

Layer wiring (both): ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` (GeGLU: down(gelu_tanh(gate x)
⊙ up x), ``mlp.act_fn``), RMSNorm with (1 + w) weights and four norms per layer (input, post-attention,
pre- and post-feedforward; they sit outside the projections, so compression never sees them), the
final ``model.norm`` and the rotary embedding at ``model.rotary_emb``. The embedding is scaled by
√hidden inside HF's embedding module and the LM head is tied to it (large vocabulary): neither is a
target. BOS is expected at the start of every sequence (the tokenizer's job).

What the conversions must honour, and where it is honoured:

* ``config.layer_types``: sliding and global layers get different masks (Gemma 3 also different
  rotary tables): ``capture_first_layer_inputs`` hands each layer its own (``base.PerLayer``).
* ``query_pre_attn_scalar``: the attention's ``scaling``, read from the HF module by both wrappers.
* sliding window per layer (``attention.sliding_window``, None on global layers): latent attention
  keeps it through the mask and a sliding latent cache; linearize's teacher uses it.
* Gemma 2: soft-capping of the attention scores (``attn_logit_softcapping``: latent attention runs
  Gemma's eager kernel, which applies it; the linearize teacher applies it) and of the final logits
  (``logit_softcap_attr``: ``head_logits``).
* Gemma 3: per-head q/k RMSNorms (reused by both wrappers) and one rotary table per layer type
  (``rotary_takes_layer_type``: local base 10k, global 1M with its scaling).

Capabilities: compress (every method), latent k/v cache, linearize. For Gemma 2 the hybrid student's
window softmax has no soft-capping (the teacher has): attention transfer learns around it.
"""

from __future__ import annotations

import dataclasses

from .llama import LLAMA_ADAPTER

__all__ = ["GEMMA2_ADAPTER", "GEMMA3_ADAPTER"]


GEMMA2_ADAPTER = dataclasses.replace(
    LLAMA_ADAPTER,
    family="gemma2",
    architectures=("Gemma2ForCausalLM",),
    logit_softcap_attr="final_logit_softcapping",
)

GEMMA3_ADAPTER = dataclasses.replace(
    LLAMA_ADAPTER,
    family="gemma3",
    architectures=("Gemma3ForCausalLM",),
    rotary_takes_layer_type=True,
    logit_softcap_attr="final_logit_softcapping",  # None in Gemma 3 configs; honoured when set
)
