"""Qwen2 adapter: wired exactly like Llama, except that q, k and v always carry a bias (o does not).

HF's ``Qwen2Attention`` builds ``q_proj``/``k_proj``/``v_proj`` with ``bias=True`` whatever the config
says, so the layout's ``has_bias`` is fixed here instead of read from ``config.attention_bias``.
"""

from __future__ import annotations

import dataclasses

from .base import AttentionLayout
from .llama import LLAMA_ADAPTER, llama_layout

__all__ = ["QWEN2_ADAPTER"]


def _qwen2_layout(config) -> AttentionLayout:
    return llama_layout(config, has_bias=True)


QWEN2_ADAPTER = dataclasses.replace(
    LLAMA_ADAPTER, family="qwen2", architectures=("Qwen2ForCausalLM",), layout_fn=_qwen2_layout
)
