"""LLaVA and LLaVA-NeXT adapter: compress the language model of a vision-language model, nothing else.

``LlavaForConditionalGeneration`` / ``LlavaNextForConditionalGeneration`` (transformers 5) hold a vision
tower (``model.vision_tower``, CLIP), a projector (``model.multi_modal_projector``) and a decoder-only
language model (``model.language_model``: a ``LlamaModel``, ``MistralModel`` or ``Qwen2Model``), with the
LM head at ``lm_head``. Every path here points into the language model, so the vision tower and the
projector are never targets and stay dense; the config facts (heads, layer types) come from
``config.text_config`` (``ModelAdapter.text_config``).

Calibration on text: the model's forward with ``input_ids`` only (no ``pixel_values``) embeds the
tokens and runs the language model exactly like its causal LM, so the one sequential loop captures
the first decoder layer's inputs as for any family. With images, the projected image features would
replace the image-token embeddings before layer 0; the loop does not feed them (text is the
calibration here, as in LatentLLM's LLaVA experiment, which calibrates on text).

Saving: ``save_pretrained(save_original_format=False)`` (checkpoint.py) writes the in-memory key
layout (``model.language_model.layers.*``, ``lm_head.weight``) rather than the legacy one
(``language_model.model.layers.*``, ``language_model.lm_head.weight``); the loader builds the model
with ``auto_class`` (``AutoModelForImageTextToText``) and loads those keys strictly, the head included.

Capabilities: compress (every method) and the latent k/v cache (the language model's attention is
Llama's; ``generate`` with ``pixel_values`` fills the latent cache with the image tokens' latents like
any other token's). Linearize is not offered: its training stages read text only, and a hybrid LLaVA
has not been validated on images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from .base import AttentionLayout, ModelAdapter, UnsupportedArchitectureError
from .llama import LLAMA_ADAPTER, llama_layout

__all__ = ["LLAVA_ADAPTER", "LlavaAdapter", "TEXT_BACKBONES"]

LANGUAGE_MODEL = "model.language_model"

# Language-model classes wired like Llama (q/k/v/o_proj, gate/up/down_proj, RMSNorm, RoPE); Qwen2's
# q/k/v always carry a bias (see adapters/qwen2.py).
TEXT_BACKBONES = ("LlamaModel", "MistralModel", "Qwen2Model")


def _llava_layout(text_config) -> AttentionLayout:
    has_bias = True if getattr(text_config, "model_type", "") == "qwen2" else None
    return llama_layout(text_config, has_bias=has_bias)


@dataclass(frozen=True)
class LlavaAdapter(ModelAdapter):
    """A ``ModelAdapter`` whose decoder is the language model of a LLaVA model, checked to be Llama-wired."""

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        backbone = type(model.get_submodule(LANGUAGE_MODEL)).__name__
        if backbone not in TEXT_BACKBONES:
            raise UnsupportedArchitectureError(f"{type(model).__name__} with a {backbone} language model is not "
                                               f"supported; its language model must be one of "
                                               f"{', '.join(TEXT_BACKBONES)} (Llama-wired)")
        return super().decoder_layers(model)


# Llama's wiring inside the language model (dataclasses.replace would keep the class ModelAdapter).
LLAVA_ADAPTER = LlavaAdapter(**{
    **{f.name: getattr(LLAMA_ADAPTER, f.name) for f in dataclasses.fields(LLAMA_ADAPTER)},
    "family": "llava",
    "architectures": ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"),
    "decoder_path": f"{LANGUAGE_MODEL}.layers",
    "final_norm_path": f"{LANGUAGE_MODEL}.norm",
    "rotary_path": f"{LANGUAGE_MODEL}.rotary_emb",
    "layout_fn": _llava_layout,
    "linearizable": False,
    "latent_attention": True,
    "auto_class": "AutoModelForImageTextToText",
})
