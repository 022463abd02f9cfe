"""LatentAttention: multi-head attention whose k/v cache holds the shared latents A_k x and A_v x.

After LatentLLM compression every projection is a ``LatentLinear`` y = B (A x) + b with one input
factor A shared by all heads (junction form) and a per-head decompression B (rows of head j =
B[j·dh:(j+1)·dh]). Per token the cache then stores

    z_k = A_k x  [r_k],   z_v = A_v x  [r_v]          (r_k + r_v numbers instead of 2·g·dh)

and attention decompresses per head. Two executions, chosen by the model family:

* RoPE (Llama, Mistral, Qwen2/3): k_g = RoPE_pos(norm(B_{k,g} z_k + b_k)), v_g = B_{v,g} z_v + b_v for every
  cached token (RoPE does not commute with B_k, so decompression comes first); query as usual.
* no RoPE (OPT): absorbed (MLA style). With q_i the head-i query [dh]:
      q_i·k_{g,j} = (B_{k,g}ᵀ q_i)·z_{k,j} + q_i·b_{k,g}     (the last term is constant over keys j: softmax drops it)
      Σ_j p_ij v_{g,j} = B_{v,g} (Σ_j p_ij z_{v,j}) + b_{v,g}  (Σ_j p_ij = 1)
  so attention runs in the latent spaces: queries [b, h, n, r_k], one shared key "head" [b, 1, N, r_k]
  and value "head" [b, 1, N, r_v]; B_v and b_v are applied to the per-head mix before o_proj.

A dense ``nn.Linear`` projection is allowed too: its latent is x itself (r = d) and B = W.

Cache. Per token and layer the module hands its cache slot z_k [r_k], z_v [r_v] (the model's dtype)
and, for RoPE models only, the token's position id as ``position_dtype`` (int32: the rotation of a
cached key is recomputed from it at each step, and with left padding or explicit ``position_ids`` it
is not the token's index). So the cache grows by ``cache_bytes_per_token()`` =
(r_k + r_v)·dtype bytes (+ 4 with RoPE) per token. The HF cache classes live in adapters/
(``adapters.latent_cache``); the adapter passes ``cache_layer(cache, layer_idx) -> slot`` whose slot has
``update_latent(z_k [b, n, r_k], z_v [b, n, r_v], positions [b, n] | None)`` returning everything cached
so far (z_k [b, N, r_k], z_v [b, N, r_v], positions [b, N] | None).

Family features honoured exactly (given by the adapter): the softmax ``scaling`` (Gemma:
query_pre_attn_scalar^-1/2), tanh soft-capping of the scores (``softcap``, Gemma 2: handed to the
kernel, which must support it), a per-layer ``sliding_window`` (the mask carries it; it is handed to
the kernel too), per-head q/k norms (Gemma 3, Qwen3), partial rotary embeddings (GPT-NeoX, Phi:
``cos``/``sin`` narrower than dh rotate the first dims only), and projections that live at nested
paths (``paths``: GPT-NeoX's ``query_key_value.q`` inside a split fused projection).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .latent_linear import LatentLinear

__all__ = ["LatentAttention", "rotate_half_rope"]


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate_half layout: x cos + [−x₂, x₁] sin; x [b, heads, n, dh], cos/sin [b, n, dh_rot].

    Partial rotary (dh_rot < dh, GPT-NeoX / Phi): the first dh_rot dims rotate, the others pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((rotate_half_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _latent(projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """z = A x [..., r] (junction form) for a LatentLinear; x itself for a dense Linear."""
    return projection.latent(x) if isinstance(projection, LatentLinear) else x


def _decompression(projection: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B [d_out, r], bias [d_out] | None) with projection(x) = B z + bias, z = _latent(projection, x)."""
    if isinstance(projection, LatentLinear):
        return projection.up, projection.bias
    return projection.weight, projection.bias


def _latent_width(projection: nn.Module) -> int:
    return projection.rank if isinstance(projection, LatentLinear) else projection.in_features


class _HeadsView:
    """The attributes HF attention kernels read from the module they are given."""

    def __init__(self, num_key_value_groups: int, training: bool, is_causal: bool = True):
        self.num_key_value_groups = num_key_value_groups
        self.training = training
        self.is_causal = is_causal


class LatentAttention(nn.Module):
    """Attention over latent k/v (see module docstring). Projections are kept under HF's names.

    Args:
        children: attribute name -> module, registered as they are: the projections (LatentLinear or
            nn.Linear) or the modules holding them, under the family's names (``q_proj``, ...,
            ``out_proj`` for OPT; ``query_key_value`` and ``dense`` for GPT-NeoX) so that adapter paths
            and state-dict keys are those of the HF attention module.
        paths: role ``"q"``, ``"k"``, ``"v"``, ``"o"`` -> dotted path of that projection under ``children``.
        n_heads, n_kv_heads, head_dim, layer_idx, scaling: geometry, cache slot and softmax scale.
        attention_resolver: returns the HF attention kernel ``f(module, q, k, v, mask, dropout=, scaling=,
            **kw)`` -> (out [b, n, heads, dv], weights); resolved per call.
        rotary: module with forward(x, position_ids) -> (cos, sin) for RoPE models (None: absorbed path).
        q_norm, k_norm: per-head norms applied before RoPE (Qwen3, Gemma 3), or None.
        cache_layer: ``cache_layer(cache, layer_idx) -> slot`` with ``slot.update_latent`` (module
            docstring); None: the module runs without a cache only.
        softcap: c of the score soft-capping c·tanh(s / c) (Gemma 2), or None.
        sliding_window: the layer's window (the mask already limits the keys; flash kernels read it), or None.
        cache_kwarg: the keyword under which the decoder layer passes the cache (GPT-NeoX: ``layer_past``).
    """

    position_dtype = torch.int32  # cached position ids (RoPE models); exact up to 2**31 tokens

    def __init__(self, children: dict[str, nn.Module], paths: dict[str, str], *,
                 n_heads: int, n_kv_heads: int, head_dim: int, layer_idx: int, scaling: float,
                 attention_resolver: Callable[[], Callable], rotary: nn.Module | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 cache_layer: Callable[[object, int], object] | None = None, softcap: float | None = None,
                 sliding_window: int | None = None, cache_kwarg: str = "cache"):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if sorted(paths) != ["k", "o", "q", "v"]:
            raise ValueError(f"paths must name the q, k, v and o projections; got {sorted(paths)}")
        for name, module in children.items():
            setattr(self, name, module)
        self.paths = dict(paths)
        # The output projection's attribute (OPT: out_proj) when it is a direct child.
        self.output_name = self.paths["o"]
        for role, rows in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
            projection = self.projection(role)
            if projection.out_features != rows * head_dim:
                raise ValueError(f"{self.paths[role]} has {projection.out_features} outputs, expected "
                                 f"{rows}×{head_dim}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx, self.scaling = layer_idx, float(scaling)
        self.rotary, self.q_norm, self.k_norm = rotary, q_norm, k_norm
        self.softcap = float(softcap) if softcap else None
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.cache_kwarg = cache_kwarg
        self._attention_resolver = attention_resolver
        self._cache_layer = cache_layer
        # Absorbed execution drops the key bias's score shift, exact only without soft-capping.
        self.absorbed = rotary is None and q_norm is None and k_norm is None and self.softcap is None

    def projection(self, role: str) -> nn.Module:
        """The ``"q"``, ``"k"``, ``"v"`` or ``"o"`` projection (resolved by path: replacements stay visible)."""
        return self.get_submodule(self.paths[role])

    @property
    def output_projection(self) -> nn.Module:
        return self.projection("o")

    def directly_read_weights(self) -> tuple[torch.Tensor, ...]:
        """Weights this module reshapes itself instead of applying through ``F.linear``: B_k and B_v when
        absorbed (split per head for the latent-space einsums), none otherwise. A weight quantizer must
        leave them plain (``modules.quantize``)."""
        if not self.absorbed:
            return ()
        return tuple(_decompression(self.projection(role))[0] for role in ("k", "v"))

    def cache_numbers_per_token(self) -> int:
        """Cached latent numbers per token in this layer: r_k + r_v (position ids aside)."""
        return _latent_width(self.projection("k")) + _latent_width(self.projection("v"))

    def cache_bytes_per_token(self) -> int:
        """Bytes the cache grows by per token in this layer: (r_k + r_v)·dtype bytes of the latents
        (the projections' dtype) + the position id (``position_dtype``) for RoPE models."""
        latent_bytes = _decompression(self.projection("k"))[0].element_size()
        position_bytes = 0 if self.rotary is None else torch.empty((), dtype=self.position_dtype).element_size()
        return self.cache_numbers_per_token() * latent_bytes + position_bytes

    def _cached_latents(self, x: torch.Tensor, cache, positions: torch.Tensor | None):
        """(z_k [b, N, r_k], z_v [b, N, r_v], positions [b, N] | None): this call's tokens, after the
        cached ones when ``cache`` is given (positions are cached only when given, i.e. for RoPE)."""
        z_k, z_v = _latent(self.projection("k"), x), _latent(self.projection("v"), x)  # [b, n, r_k], [b, n, r_v]
        if cache is None:
            return z_k, z_v, positions
        if self._cache_layer is None:
            raise ValueError("this LatentAttention was built without a cache_layer; run it with use_cache=False")
        if positions is not None:
            positions = positions.to(self.position_dtype)
        return self._cache_layer(cache, self.layer_idx).update_latent(z_k, z_v, positions)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        kwargs.pop("past_key_values", None)
        if self.cache_kwarg != "cache":
            cache = kwargs.pop(self.cache_kwarg, None) if cache is None else cache
        batch, length, _ = hidden_states.shape
        query = self.projection("q")(hidden_states).view(batch, length, self.n_heads, self.head_dim)  # [b, n, h, dh]
        if self.absorbed:
            return self._absorbed(hidden_states, query, attention_mask, cache, kwargs)
        return self._rope(hidden_states, query, position_embeddings, attention_mask, cache, kwargs)

    def _kernel(self, groups: int):
        return _HeadsView(groups, self.training), self._attention_resolver()

    def _kernel_options(self, kwargs: dict) -> dict:
        """The kernel's keyword arguments: the caller's, plus the soft-cap and window when the layer has them."""
        if self.softcap is not None:
            kwargs = {**kwargs, "softcap": self.softcap}
        if self.sliding_window is not None:
            kwargs = {**kwargs, "sliding_window": self.sliding_window}
        return kwargs

    def _rope(self, x, query, position_embeddings, attention_mask, cache, kwargs):
        batch, length = x.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None and cache is not None and self.rotary is not None:
            past = cache.get_seq_length(self.layer_idx) if hasattr(cache, "get_seq_length") else 0
            positions = torch.arange(past, past + length, device=x.device).unsqueeze(0)
        z_k, z_v, cached_positions = self._cached_latents(x, cache, positions if self.rotary is not None else None)
        B_k, b_k = _decompression(self.projection("k"))
        B_v, b_v = _decompression(self.projection("v"))
        total = z_k.shape[1]
        key = F.linear(z_k, B_k, b_k).view(batch, total, self.n_kv_heads, self.head_dim)  # [b, N, g, dh]
        value = F.linear(z_v, B_v, b_v).view(batch, total, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query = self.q_norm(query)
        if self.k_norm is not None:
            key = self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self.rotary is not None:
            cos, sin = position_embeddings
            query = rotate_half_rope(query, cos, sin)
            if cache is not None:  # cached keys need the rotations of their own positions
                cos, sin = self.rotary(value, cached_positions)
            key = rotate_half_rope(key, cos, sin)
        view, kernel = self._kernel(self.n_heads // self.n_kv_heads)
        out, weights = kernel(view, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                              **self._kernel_options(kwargs))
        return self.output_projection(out.reshape(batch, length, -1)), weights

    def _absorbed(self, x, query, attention_mask, cache, kwargs):
        batch, length = x.shape[:2]
        z_k, z_v, _ = self._cached_latents(x, cache, None)
        B_k, _ = _decompression(self.projection("k"))  # the key bias only shifts every score of a query equally
        B_v, b_v = _decompression(self.projection("v"))
        group = self.n_heads // self.n_kv_heads
        key_heads = B_k.view(self.n_kv_heads, self.head_dim, -1).repeat_interleave(group, 0)  # [h, dh, r_k]
        value_heads = B_v.view(self.n_kv_heads, self.head_dim, -1).repeat_interleave(group, 0)  # [h, dh, r_v]
        latent_query = torch.einsum("bnhd,hdr->bhnr", query, key_heads)  # [b, h, n, r_k]
        view, kernel = self._kernel(self.n_heads)  # one shared latent key/value "head"
        mixed, weights = kernel(view, latent_query, z_k.unsqueeze(1), z_v.unsqueeze(1), attention_mask,
                                dropout=0.0, scaling=self.scaling, **self._kernel_options(kwargs))  # [b, n, h, r_v]
        heads = torch.einsum("bnhr,hdr->bnhd", mixed, value_heads)  # [b, n, h, dh]
        if b_v is not None:
            heads = heads + b_v.view(self.n_kv_heads, self.head_dim).repeat_interleave(group, 0)
        return self.output_projection(heads.reshape(batch, length, -1)), weights

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}, cache_numbers_per_token={self.cache_numbers_per_token()}, "
                f"absorbed={self.absorbed}"
                + (f", softcap={self.softcap:g}" if self.softcap is not None else "")
                + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""))
