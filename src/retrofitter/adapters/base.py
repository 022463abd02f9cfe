"""Model-family adapters: the only place that knows Hugging Face model internals.

An adapter describes, for one family of decoder-only models, where the pieces of a decoder layer
are and how they are wired, so that pipelines can stay generic (design.md §1, guideline 3):

* ``decoder_layers(model)``: the ``nn.ModuleList`` of decoder layers;
* ``attention_layout(model)``: head counts and sizes (:class:`AttentionLayout`);
* ``linear_groups``: the linear projections of a layer, grouped by the input they read
  (``("q", "k", "v")`` read the normalised attention input, ``("o",)`` the attention mix, ...), in
  execution order — the order in which a sequential pipeline may compress them;
* ``get_linear(layer, name)`` / ``set_linear(layer, name, module)``;
* ``mlp_kind``: ``"gated"`` (down(act(gate x) ⊙ up x)) or ``"plain"`` (fc2(act(fc1 x)))
  and ``mlp_activation(layer)``;
* ``architectures``: the HF causal-LM class names the adapter serves (``adapters.registry`` indexes them);
* ``rotary_path``: where the model keeps its rotary embedding (``rotary_embedding_class(model)``; the
  empty path: no RoPE), ``attention_output_name``: the output projection's name inside the attention
  module (derived from ``linear_paths["o"]``);
* capability flags: ``linearizable`` (hybrid attention, ``adapters.hybrid_attention``) and
  ``latent_attention`` (latent k/v cache, ``adapters.latent_attention``);
* optional family facts (defaults fit Llama): ``fused`` (fused projections such as Phi-3's ``qkv_proj``
  or GPT-NeoX's ``query_key_value``, split into named parts, ``FusedLayout``), ``rotary_takes_layer_type``
  (Gemma 3: one rotary table per layer type), ``logit_softcap_attr`` (Gemma 2: tanh soft-capping of
  the LM-head logits), ``cache_kwarg`` (the name under which the decoder layer hands the cache to its
  attention: ``cache``, GPT-NeoX ``layer_past``), ``auto_class`` (the transformers Auto class that builds the
  model from its config: ``AutoModelForCausalLM``, LLaVA ``AutoModelForImageTextToText``).

Composite models (LLaVA: a vision tower, a projector and a language model) are described by the paths
of their language model; every config fact is read from ``text_config(model)`` (the model's config
itself for a plain causal LM, its ``text_config`` for LLaVA).

Per-layer inputs. Families with several ``config.layer_types`` (Gemma 2/3: sliding and global layers)
give each decoder layer its own mask (and Gemma 3 its own rotary table). ``capture_first_layer_inputs``
then returns those keyword arguments as ``PerLayer`` values and installs on every decoder layer a
forward pre-hook that picks the layer's own value, so ``layer(hidden, **kwargs)`` stays right for any
layer (pipelines/calibration.py calls every layer with the same kwargs); see ``adapters.layer_inputs``.

Fused projections. An adapter with ``fused`` describes the model *after* the split: its linear paths
name the parts (``attention.query_key_value.q``). ``decoder_layers(model)`` performs the split on
first use, in place (``modules.fused_projection.FusedProjection``; bit-identical while the parts are
dense), so every pipeline sees separate q/k/v (gate/up) projections; the split is saved and rebuilt
like any other replacement (``adapters.replacements``).

Adding a model family = one adapter file (a ``ModelAdapter`` instance) + its entry in
``adapters.registry.FAMILY_ADAPTERS`` + one row in the tiny-model test table (tests/tiny_models.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..modules.fused_projection import FusedProjection
from .layer_inputs import PerLayer, capture_layer_inputs

__all__ = ["AttentionLayout", "FusedLayout", "ModelAdapter", "PerLayer", "UnsupportedArchitectureError"]


class UnsupportedArchitectureError(ValueError):
    """The model's class has no adapter, its adapter lacks the capability asked for, or a composite model's
    part is not one the adapter serves (a LLaVA whose language model is not Llama-wired)."""


@dataclass(frozen=True)
class AttentionLayout:
    """Head layout of a model's attention: q has ``n_heads`` heads, k and v ``n_kv_heads`` (GQA)."""

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    uses_rope: bool
    has_bias: bool

    @property
    def kv_group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class FusedLayout:
    """A fused ``nn.Linear`` of every decoder layer, split into named parts (``FusedProjection``).

    ``path``: the fused module inside a layer; ``parts``: the part names, in the fused order;
    ``widths(config)``: each part's output width; ``groups(config)``: interleaved groups (1 = plain
    concatenation [part_1; part_2; ...], GPT-NeoX's per-head [q_h k_h v_h]: the number of heads).
    """

    path: str
    parts: tuple[str, ...]
    widths: Callable[[object], tuple[int, ...]]
    groups: Callable[[object], int] = lambda config: 1


@dataclass(frozen=True)
class ModelAdapter:
    """Wiring of one model family. Instances live in ``adapters.registry.ADAPTERS``."""

    family: str
    architectures: tuple[str, ...]  # HF causal-LM class names wired like this
    decoder_path: str  # attribute path from the CausalLM to the decoder-layer ModuleList
    linear_paths: dict[str, str]  # logical name -> attribute path inside a decoder layer
    linear_groups: tuple[tuple[str, ...], ...]  # names grouped by shared input, in execution order
    attention_path: str
    mlp_path: str
    mlp_kind: str  # "gated" | "plain"
    activation_path: str  # attribute path (inside the layer) of the MLP activation callable
    layout_fn: Callable[[object], AttentionLayout]
    final_norm_path: str  # norm applied after the last decoder layer (may resolve to None)
    rotary_path: str  # attribute path from the CausalLM to its rotary embedding; "" = no RoPE
    linearizable: bool  # attention can be swapped for HybridSelfAttention (RoPE, q/k/v/o_proj)
    latent_attention: bool  # attention can be swapped for LatentAttention (latent k/v cache)
    final_projection_path: str = ""  # optional projection after the final norm (OPT's project_out)
    fused: tuple[FusedLayout, ...] = ()  # fused projections split into parts (Phi-3, GPT-NeoX)
    rotary_takes_layer_type: bool = False  # rotary forward(x, position_ids, layer_type) (Gemma 3)
    logit_softcap_attr: str = ""  # config attribute c: logits = c·tanh(logits / c) (Gemma 2)
    cache_kwarg: str = "cache"  # keyword under which the decoder layer passes the cache to attention
    auto_class: str = "AutoModelForCausalLM"  # transformers Auto class building the model from its config

    # ---- family facts -----------------------------------------------------------------------
    @property
    def uses_rope(self) -> bool:
        return bool(self.rotary_path)

    @property
    def attention_output_name(self) -> str:
        """Attribute name of the output projection inside the attention module (``o_proj``, ``out_proj``)."""
        prefix = f"{self.attention_path}."
        path = self.linear_paths["o"]
        if not path.startswith(prefix):
            raise ValueError(f"{self.family}: output projection {path!r} is not inside the attention module")
        return path[len(prefix):]

    def rotary_embedding_class(self, model: nn.Module) -> type | None:
        """Class of the model's own rotary embedding (built as ``cls(config=...)``), None without RoPE.

        Read from the model, so one adapter serves classes whose rotary embeddings differ
        (``LlamaRotaryEmbedding``, ``Qwen3RotaryEmbedding``, ...).
        """
        if not self.rotary_path:
            return None
        return type(_get_path(model, self.rotary_path))

    def attention_relative_path(self, name: str) -> str:
        """Path of projection ``name`` inside the attention module (``q_proj``, ``query_key_value.q``)."""
        prefix = f"{self.attention_path}."
        path = self.linear_paths[name]
        if not path.startswith(prefix):
            raise ValueError(f"{self.family}: projection {name!r} ({path}) is not inside the attention module")
        return path[len(prefix):]

    def sliding_window(self, attention: nn.Module) -> int | None:
        """The attention layer's own sliding window (None: global attention).

        A per-layer ``sliding_window`` attribute (Gemma 2/3, Qwen2/3: None on global layers) wins over
        the config's (Mistral, Phi-3: every layer slides when it is set).
        """
        if hasattr(attention, "sliding_window"):
            window = attention.sliding_window
        else:
            window = getattr(getattr(attention, "config", None), "sliding_window", None)
        return int(window) if window else None

    @staticmethod
    def text_config(model: nn.Module):
        """The language model's config: ``model.config``, or its text part for a composite model (LLaVA)."""
        return model.config.get_text_config()

    # ---- navigation -----------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers; fused projections (``fused``) are split into their parts on first use."""
        layers = _get_path(model, self.decoder_path)
        if self.fused:
            for layer in layers:
                self._split_fused(layer, self.text_config(model))
        return layers

    def _split_fused(self, layer: nn.Module, config) -> None:
        for fused in self.fused:
            module = _get_path(layer, fused.path)
            if isinstance(module, FusedProjection):
                continue
            if type(module) is not nn.Linear:
                raise TypeError(f"{self.family}: {fused.path} is a {type(module).__name__}, expected the fused "
                                f"nn.Linear of the original model")
            widths = dict(zip(fused.parts, fused.widths(config)))
            _set_path(layer, fused.path, FusedProjection.split(module, widths, fused.groups(config)))

    def attention(self, layer: nn.Module) -> nn.Module:
        return _get_path(layer, self.attention_path)

    def set_attention(self, layer: nn.Module, module: nn.Module) -> None:
        """Put ``module`` in place of ``layer``'s attention module."""
        _set_path(layer, self.attention_path, module)

    def attention_path_in_model(self, layer_index: int) -> str:
        """Dotted path of a decoder layer's attention module inside the CausalLM."""
        return f"{self.decoder_path}.{layer_index}.{self.attention_path}"

    def mlp(self, layer: nn.Module) -> nn.Module:
        return _get_path(layer, self.mlp_path)

    def mlp_activation(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return _get_path(layer, self.activation_path)

    def attention_layout(self, model: nn.Module) -> AttentionLayout:
        return self.layout_fn(self.text_config(model))

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(name for group in self.linear_groups for name in group)

    def get_linear(self, layer: nn.Module, name: str) -> nn.Module:
        if name not in self.linear_paths:
            raise KeyError(f"{self.family} layers have no projection {name!r}; they have {sorted(self.linear_paths)}")
        return _get_path(layer, self.linear_paths[name])

    def set_linear(self, layer: nn.Module, name: str, module: nn.Module) -> None:
        parent_path, _, attr = self.linear_paths[name].rpartition(".")
        parent = _get_path(layer, parent_path) if parent_path else layer
        setattr(parent, attr, module)

    def capture_first_layer_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Run the embeddings only and return what the first decoder layer receives.

        Returns ``(hidden_states [b, n, d], layer_kwargs)``; ``layer_kwargs`` (attention mask,
        position embeddings, ...) are what HF passes to every decoder layer, so any layer can be
        called later as ``layer(hidden_states, **layer_kwargs)`` with HF's own forward.
        """
        layers = self.decoder_layers(model)
        per_layer = len(set(getattr(self.text_config(model), "layer_types", None) or ())) > 1
        hidden, kwargs = capture_layer_inputs(model, layers, input_ids, per_layer)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        kwargs["use_cache"] = False
        return hidden, kwargs

    def final_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Apply what follows the last decoder layer, up to (not including) the LM head."""
        norm = _get_path(model, self.final_norm_path)
        if norm is not None:
            hidden = norm(hidden)
        if self.final_projection_path:
            projection = _get_path(model, self.final_projection_path)
            if projection is not None:
                hidden = projection(hidden)
        return hidden

    def head_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [b, n, d] that enter the LM head (final norm/projection applied), no logits.

        The HF decoder (``get_decoder()``: LlamaModel, OPTDecoder, ...) returns exactly these; the
        LM head is ``model.get_output_embeddings()``.
        """
        return model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state

    def head_logits(self, model: nn.Module, head_inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits [b, n, vocab] from the hidden states entering the LM head (``head_inputs``):
        the LM head, then the family's logit soft-capping c·tanh(logits / c) when it has one (Gemma 2)."""
        logits = model.get_output_embeddings()(head_inputs)
        cap = getattr(self.text_config(model), self.logit_softcap_attr, None) if self.logit_softcap_attr else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [b, n, vocab] from the output of the last decoder layer."""
        return self.head_logits(model, self.final_hidden(model, hidden))

    def linear_path_in_model(self, layer_index: int, name: str) -> str:
        """Dotted module path of a projection inside the CausalLM (e.g. for ``get_submodule``)."""
        return f"{self.decoder_path}.{layer_index}.{self.linear_paths[name]}"

    def mlp_intermediate(self) -> tuple[tuple[str, ...], str]:
        """(producers, consumer) of the MLP's intermediate channels: the projections writing them
        (gate/up, fc1: ``linear_groups[-2]``) and the one reading them (down, fc2: ``linear_groups[-1]``).
        Only elementwise operations sit in between, so permuting those channels is exact."""
        return self.linear_groups[-2], self.linear_groups[-1][0]

    def input_embedding(self, model: nn.Module) -> nn.Module:
        """The token embedding module (its output is the residual stream entering layer 0)."""
        return model.get_input_embeddings()

    def embedding_modules(self, model: nn.Module) -> list[nn.Module]:
        """Token (and learned position) embeddings and the LM head, for parameter accounting."""
        modules = [self.input_embedding(model)]
        head = model.get_output_embeddings()
        if head is not None:
            modules.append(head)
        return modules


def _set_path(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = _get_path(root, parent_path) if parent_path else root
    setattr(parent, attr, module)


def _get_path(root: nn.Module, path: str):
    """``root.a.b.0.c`` for path ``"a.b.0.c"``; the empty path is ``root`` itself."""
    obj = root
    if not path:
        return obj
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
