"""MLAAttention: Multi-head Latent Attention (DeepSeek-V2/V3 layout) reached by conversion (linalg/mla.py).

Per token and layer the cache holds one latent c = A x [r] and one shared rotary key k_pe = RoPE(W_pe x)
[2m] (already rotated: its position never changes), so it grows by (r + 2m)·dtype bytes, with nothing to
decompress per cached token. Per head i the query is [q_nope (r'), q_pe (2m)] and

    score_ij = q_nope,iᵀ K_up c_j + RoPE(q_pe,i)ᵀ k_pe,j          K_up [r', r]
    out_i    = V_up,group(i) Σ_j p_ij c_j                          V_up [g·dh, r]  (then o_proj)

Three executions of the same function (``MLA_EXECUTIONS``, the attribute ``execution``):

* ``absorbed`` (default): the query's no-rotation part is moved into the latent, q̂_i = K_upᵀ q_nope,i [r], and
  attention runs once over one shared key [c, k_pe] [r + 2m] and value c [r] (multi-query, one kv "head"
  for all h heads, through HF's attention kernel; a decode step hands the kernel its h heads as h query rows
  of one head); V_up is applied to each head's mix before o_proj. Kernels that take a value narrower than
  the key (HF's eager and flex_attention) read the value c [r]; the others (sdpa, flash) read the key
  itself as the value and the mix of its last 2m dims is dropped: SDPA's fused CPU kernel needs equal
  widths (a narrower value sends it to its math path, which materialises the [n, N] scores). A decode step on
  CPU under sdpa (``split_decode``) splits the cached keys into one stretch per thread (ops/decode_attention.py,
  flash-decoding): the fused kernel would run its one head of h rows on one thread.
* ``naive`` (the reference, for tests): keys K_up c and values V_up c decompressed for every cached token,
  softmax written out.
* ``decompressed`` (training: the attention transfer, pipelines/mla_transfer.py): the naive function laid out for
  speed. The key [K_up c, k_pe] [r' + 2m] is shared by every head, so the scores of all h heads are one matmul
  [b, h·n, r' + 2m] x [b, r' + 2m, N]; each kv group's values V_up c [b, g, N, dh] mix its h/g heads in one
  matmul; the softmax runs in the scores' dtype (under bfloat16 autocast no float32 copy of the [h, n, N] scores,
  which dominates the step on CPU). Against SDPA over the absorbed key (value = key, r + 2m wide) it mixes dh
  instead of r + 2m numbers per head. One transfer step (forward, backward, Adam) of SmolLM2-135M's layer 10 at
  KV 0.5×, 4 × 512 tokens, 2 AMD EPYC threads, interleaved: 276 ms absorbed, 254 ms decompressed in float32,
  131 ms in bfloat16 (benchmarks/mla_transfer_step.py; docs/results.md §13d).

Folded up-projections (``fold_up_projections``): where K_up is square (r' = r) the absorbed query needs no K_up at
all, since q̂_i = K_upᵀ W_q,i x = (K_upᵀ W_q,i) x, so K_up is multiplied into q_proj once; where V_up is square
(dh = r), o_proj's block of each head takes W_o,i V_up,group(i) [d, r] in the same way. Both keep every shape
(q_proj [h·(r + 2m), d], o_proj [d, h·dh]), drop h·r'·r and h·dh·r multiply-adds per token from every prefill and
decode step, and leave ``k_up`` / ``v_up`` None (read as the identity by ``naive`` and by the export). SmolLM2-135M
at KV 0.25× (r = r' = dh = 64) folds both; at 0.5× (r = r' = 128) only K_up.

RoPE: the kept slots' frequencies are columns ``freq_index`` [m] of the model's own cos/sin tables
([b, n, dh], rotate-half layout: cos[..., f] = cos(pos·θ_f)), so any rope scaling the model uses carries
over. Biases (Qwen2) are the projections' biases. The cache slot (adapters.latent_cache) stores [c, k_pe]
[r + 2m] as the "key latent" (the tensor attention reads as it is: no copy of the cache per step beyond
the dynamic cache's own append, none with the static cache) and an empty "value latent" [0], positions none.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.decode_attention import split_kv_decode_attention
from ..ops.matvec import plain_float_linear

__all__ = ["MLA_EXECUTIONS", "MLAAttention"]

MLA_EXECUTIONS = ("absorbed", "naive", "decompressed")
# A CPU decode step splits its cache only into stretches of at least this many keys: on 2 AMD EPYC threads two
# stretches cost up to 9 % of the step at 512-2048 keys, broke even at 4096 and saved 12-13 % at 8192 (results.md §13)
MIN_SPLIT_KEYS = 2048


def _rope_slots(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [b, (heads,) n, 2m] with cos/sin [b, n, m] (one frequency per slot)."""
    if x.ndim == 4:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _masked(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """scores [b, h, n, N] under HF's mask (bool: True where allowed; float: added), or causal over the cached
    tokens when there is none; masked entries get the dtype's lowest finite value, as HF's masks, so a fully
    masked (padded) row stays finite."""
    n, total = scores.shape[-2:]
    lowest = torch.finfo(scores.dtype).min
    if attention_mask is None:
        allowed = torch.ones(n, total, dtype=torch.bool, device=scores.device).tril(total - n)
        return scores.masked_fill(~allowed, lowest)
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask[..., :total], lowest)
    # an additive float32 mask's lowest value overflows to -inf in bfloat16: clamp it first
    return scores + attention_mask[..., :total].clamp(min=lowest).to(scores.dtype)


@torch.compiler.assume_constant_result
def _cpu_threads() -> int:
    """``torch.get_num_threads()``, read by torch.compile at trace time as a constant (a plain call returns a
    Python int, which breaks the traced graph in every layer); the thread count only picks how many stretches a
    split decode step runs, not its result."""
    return torch.get_num_threads()


class _HeadsView:
    """The attributes HF attention kernels read from the module they are given."""

    def __init__(self, num_key_value_groups: int, training: bool, is_causal: bool = True):
        self.num_key_value_groups, self.training, self.is_causal = num_key_value_groups, training, is_causal


class MLAAttention(nn.Module):
    """Multi-head latent attention (module docstring). The output projection keeps the HF name (``o_proj``).

    Args:
        hidden_size, n_heads, n_kv_heads, head_dim: geometry of the original attention (values keep g·dh).
        kv_rank (r), rope_dim (2m), qk_nope_dim (r'): the latent, the shared rotary key, the query's
            no-rotation part per head.
        freq_index: [m] the frequency pair of each rotary slot.
        o_proj: the original output projection [d, h·dh].
        layer_idx, scaling: cache slot and the softmax scale of the original attention.
        attention_resolver: () -> HF kernel ``f(module, q, k, v, mask, dropout=, scaling=, **kw)``.
        cache_layer: ``cache_layer(cache, layer_idx) -> slot`` with ``update_latent`` (adapters.latent_cache).
        q_bias, kv_bias, k_pe_bias: whether those projections carry biases.
        sliding_window: the layer's window (handed to the kernel), or None.
        cache_kwarg: the keyword under which the decoder layer passes the cache.
        k_up_folded, v_up_folded: build without K_up / V_up, already folded into q_proj / o_proj (a saved
            model's spec; needs r' = r / dh = r).
        narrow_value: () -> whether the kernel ``attention_resolver`` gives now takes a value narrower than its
            key (then the absorbed value is c [r], else the key [c, k_pe]); None: never.
        split_decode: () -> whether a decode step may run the split-key CPU kernel instead of the resolved one
            (which must then be SDPA: the same function); None: never.
    """

    def __init__(self, *, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_rank: int,
                 rope_dim: int, qk_nope_dim: int, freq_index: torch.Tensor, o_proj: nn.Module, layer_idx: int,
                 scaling: float, attention_resolver: Callable[[], Callable],
                 cache_layer: Callable[[object, int], object] | None = None, q_bias: bool = False,
                 kv_bias: bool = False, k_pe_bias: bool = False, sliding_window: int | None = None,
                 cache_kwarg: str = "cache", k_up_folded: bool = False, v_up_folded: bool = False,
                 narrow_value: Callable[[], bool] | None = None, split_decode: Callable[[], bool] | None = None,
                 dtype=None, device=None):
        super().__init__()
        if n_heads % n_kv_heads or rope_dim % 2 or freq_index.numel() != rope_dim // 2:
            raise ValueError(f"MLA geometry: n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads} and "
                             f"rope_dim {rope_dim} even with one frequency per pair ({freq_index.numel()} given)")
        if (k_up_folded and qk_nope_dim != kv_rank) or (v_up_folded and head_dim != kv_rank):
            raise ValueError(f"MLA geometry: a folded K_up needs qk_nope_dim == kv_rank and a folded V_up head_dim == "
                             f"kv_rank; got qk_nope_dim {qk_nope_dim}, head_dim {head_dim}, kv_rank {kv_rank}")
        kw = dict(dtype=dtype, device=device)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.kv_rank, self.rope_dim, self.qk_nope_dim = kv_rank, rope_dim, qk_nope_dim
        self.q_proj = nn.Linear(hidden_size, n_heads * (qk_nope_dim + rope_dim), bias=q_bias, **kw)
        self.kv_a_proj = nn.Linear(hidden_size, kv_rank, bias=kv_bias, **kw)
        self.k_pe_proj = nn.Linear(hidden_size, rope_dim, bias=k_pe_bias, **kw)
        self.register_parameter("k_up", None if k_up_folded else  # [r', r]
                                nn.Parameter(torch.empty(qk_nope_dim, kv_rank, **kw)))
        self.register_parameter("v_up", None if v_up_folded else  # [g·dh, r]
                                nn.Parameter(torch.empty(n_kv_heads * head_dim, kv_rank, **kw)))
        self.o_proj = o_proj
        self.register_buffer("freq_index", freq_index.to(device=device, dtype=torch.long).clone())
        self.layer_idx, self.scaling = layer_idx, float(scaling)
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.cache_kwarg = cache_kwarg
        self.execution = "absorbed"  # MLA_EXECUTIONS (module docstring)
        self._attention_resolver, self._cache_layer = attention_resolver, cache_layer
        self._narrow_value, self._split_decode = narrow_value, split_decode
        self.split_cpu_decode = True  # off: every decode step runs the resolved kernel (benchmarks compare both)

    def spec(self) -> dict:
        """The shapes ``adapters.mla_attention`` rebuilds an empty module from (retrofitter.json)."""
        return {"kv_rank": self.kv_rank, "rope_dim": self.rope_dim, "qk_nope_dim": self.qk_nope_dim,
                "freq_index": self.freq_index.tolist(), "q_bias": self.q_proj.bias is not None,
                "kv_bias": self.kv_a_proj.bias is not None, "k_pe_bias": self.k_pe_proj.bias is not None,
                "k_up_folded": self.k_up is None, "v_up_folded": self.v_up is None}

    def cache_numbers_per_token(self) -> int:
        return self.kv_rank + self.rope_dim

    def cache_bytes_per_token(self) -> int:
        return self.cache_numbers_per_token() * self.kv_a_proj.weight.element_size()

    def linear_projections(self) -> tuple[nn.Module, ...]:
        """The layer's ``nn.Linear`` projections (for accounting): q, kv_a, k_pe and o."""
        return (self.q_proj, self.kv_a_proj, self.k_pe_proj, self.o_proj)

    def heal_tensors(self) -> list[tuple[str, nn.Module, str]]:
        """(relative module path, module, tensor name) of every 2-D weight LoRA healing adapts: the four
        projections' weights and the up-projections K_up, V_up that are not folded."""
        return [(name, getattr(self, name), "weight") for name in ("q_proj", "kv_a_proj", "k_pe_proj", "o_proj")] + [
            ("", self, name) for name in ("k_up", "v_up") if getattr(self, name) is not None]

    def extra_macs_per_token(self) -> int:
        """Multiply-adds per token outside the projections: the query's absorption through K_up and each
        head's mix through V_up (absorbed execution), each 0 once folded."""
        k_up = self.qk_nope_dim if self.k_up is not None else 0
        v_up = self.head_dim if self.v_up is not None else 0
        return self.n_heads * self.kv_rank * (k_up + v_up)

    def attention_macs_per_token(self, context: int) -> int:
        """q·k and p·v of the absorbed execution for one query over on average context/2 keys, in each of the
        h heads: q·k over the shared key [c, k_pe] of width r + 2m; p·v over the value the kernel resolved now
        reads (module docstring): c [r], or the key itself (its last 2m dims mixed and dropped)."""
        value_width = self.kv_rank if self._takes_narrow_value() else self.kv_rank + self.rope_dim
        return self.n_heads * (self.kv_rank + self.rope_dim + value_width) * (context // 2)

    def _takes_narrow_value(self) -> bool:
        return self._narrow_value is not None and bool(self._narrow_value())

    def _decode_splits(self, query: torch.Tensor, total: int) -> int:
        """Stretches of the cached keys for a CPU decode step (one per thread, each of at least
        ``MIN_SPLIT_KEYS``), or 1: the resolved kernel runs the step."""
        if (not self.split_cpu_decode or self._split_decode is None or self.training or query.device.type != "cpu"
                or not self._split_decode()):
            return 1
        return max(1, min(_cpu_threads(), total // MIN_SPLIT_KEYS))

    def directly_read_weights(self) -> tuple[torch.Tensor, ...]:
        """K_up and V_up (those not folded) are read by einsums, not ``F.linear``: a weight quantizer leaves
        them plain."""
        return tuple(t for t in (self.k_up, self.v_up) if t is not None)

    def fold_up_projections(self) -> dict[str, bool]:
        """Multiply K_up into q_proj where r' = r and V_up into o_proj where dh = r (module docstring), in float64,
        once; shapes unchanged. Returns which of the two are folded now. An up-projection stays where its partner
        is not a plain float ``nn.Linear`` (wrapped by LoRA, compressed or quantized: its weight is not the map)."""
        heads, r = self.n_heads, self.kv_rank
        with torch.no_grad():
            if self.k_up is not None and self.qk_nope_dim == r and plain_float_linear(self.q_proj):
                up = self.k_up.to(torch.float64)                                    # [r', r]
                weight = self.q_proj.weight.view(heads, r + self.rope_dim, -1)       # [h, r' + 2m, d]
                weight[:, :r] = torch.einsum("kr,hkd->hrd", up, weight[:, :r].to(torch.float64)).to(weight.dtype)
                if self.q_proj.bias is not None:
                    bias = self.q_proj.bias.view(heads, r + self.rope_dim)
                    bias[:, :r] = (bias[:, :r].to(torch.float64) @ up).to(bias.dtype)
                self.register_parameter("k_up", None)
            if self.v_up is not None and self.head_dim == r and plain_float_linear(self.o_proj):
                weight = self.o_proj.weight.view(-1, heads, self.head_dim)         # [d, h, dh]
                value = self._value_heads().to(torch.float64)                      # [h, dh, r]
                weight.copy_(torch.einsum("dhk,hkr->dhr", weight.to(torch.float64), value).to(weight.dtype))
                self.register_parameter("v_up", None)
        return {"k_up": self.k_up is None, "v_up": self.v_up is None}

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                **kwargs):
        kwargs.pop("past_key_values", None)
        if self.cache_kwarg != "cache":
            cache = kwargs.pop(self.cache_kwarg, None) if cache is None else cache
        batch, length, _ = hidden_states.shape
        cos, sin = position_embeddings  # [b, n, dh] of the model's rotary embedding
        cos, sin = cos[..., self.freq_index], sin[..., self.freq_index]  # [b, n, m]
        query = self.q_proj(hidden_states).view(batch, length, self.n_heads, -1).transpose(1, 2)  # [b, h, n, r'+2m]
        q_nope, q_pe = query[..., :self.qk_nope_dim], _rope_slots(query[..., self.qk_nope_dim:], cos, sin)
        latent = self.kv_a_proj(hidden_states)                                   # [b, n, r]
        k_pe = _rope_slots(self.k_pe_proj(hidden_states), cos, sin)              # [b, n, 2m]
        # the cached key is one tensor [c, k_pe], read by attention as it is (no concatenation of the whole cache)
        key = torch.cat([latent, k_pe], -1)                                      # [b, n, r + 2m]
        if cache is not None:
            if self._cache_layer is None:
                raise ValueError("this MLAAttention was built without a cache_layer; run it with use_cache=False")
            key, _, _ = self._cache_layer(cache, self.layer_idx).update_latent(key, key[..., :0], None)
        kwargs.pop("position_ids", None)
        if self.execution not in MLA_EXECUTIONS:
            raise ValueError(f"MLAAttention.execution must be one of {MLA_EXECUTIONS}, got {self.execution!r}")
        run = getattr(self, f"_{self.execution}")
        heads, weights = run(q_nope, q_pe, key, attention_mask, kwargs)          # [b, n, h, dh]
        return self.o_proj(heads.reshape(batch, length, -1)), weights

    def _key_up(self) -> torch.Tensor:
        """K_up [r', r], or the identity once folded (the reference's view of a folded module)."""
        if self.k_up is not None:
            return self.k_up
        return torch.eye(self.kv_rank, dtype=self.q_proj.weight.dtype, device=self.q_proj.weight.device)

    def _value_heads(self) -> torch.Tensor:
        """Each head's V_up [h, dh, r] (its group's), or the identity once folded."""
        if self.v_up is None:
            eye = torch.eye(self.kv_rank, dtype=self.q_proj.weight.dtype, device=self.q_proj.weight.device)
            return eye.expand(self.n_heads, -1, -1)
        group = self.n_heads // self.n_kv_heads
        return self.v_up.view(self.n_kv_heads, self.head_dim, -1).repeat_interleave(group, 0)  # [h, dh, r]

    def _absorbed(self, q_nope, q_pe, key, attention_mask, kwargs):
        """Attention in the latent over ``key`` = [c, k_pe] [b, N, r + 2m] of every cached token."""
        q_latent = q_nope if self.k_up is None else q_nope @ self.k_up           # [b, h, n, r]
        query = torch.cat([q_latent, q_pe], -1)                                  # [b, h, n, r + 2m]
        key = key.unsqueeze(1)                                                   # [b, 1, N, r + 2m]
        options = dict(kwargs, sliding_window=self.sliding_window) if self.sliding_window else kwargs
        heads_view = _HeadsView(self.n_heads, self.training)
        # One new token (decode): its h query rows share the one key and one mask row, so they run as h rows of
        # one head, [b, 1, h, r + 2m], and the kernel reads the cache once. As h heads, HF's sdpa kernel expands
        # the shared key to every head under torch.compile (repeat_kv: h copies of the cache per step).
        folded = query.shape[2] == 1 and (attention_mask is None or isinstance(attention_mask, torch.Tensor))
        if folded:
            query, heads_view = query.transpose(1, 2), _HeadsView(1, self.training, is_causal=False)
            splits = self._decode_splits(query, key.shape[2])
            if splits > 1:  # [b, 1, h, r + 2m]: the kernel's layout after its transpose, as below
                mixed = split_kv_decode_attention(query, key, key, attention_mask, self.scaling, splits)
                return self._mixed_to_heads(mixed[..., :self.kv_rank]), None
        # The value: the latent c [r] where the kernel takes a narrower value than its key; else the key itself
        # (FlashMLA's layout), since fused kernels such as SDPA's on CPU need equal q/k/v head sizes (a value
        # of width r sends SDPA to its math path, which materialises the [n, N] scores); the mix of its last
        # 2m dims is then dropped.
        value = key[..., :self.kv_rank] if self._takes_narrow_value() else key  # [b, 1, N, r or r + 2m]
        mixed, weights = self._attention_resolver()(heads_view, query, key, value, attention_mask, dropout=0.0,
                                                    scaling=self.scaling, **options)  # [b, n, h, r or r + 2m]
        if folded:  # the kernel's [b, h, 1, ·] (its query rows were the heads) back to [b, 1, h, ·]
            mixed = mixed.transpose(1, 2)
            weights = None if weights is None else weights.transpose(1, 2)       # [b, h, 1, N]
        return self._mixed_to_heads(mixed[..., :self.kv_rank]), weights

    def _mixed_to_heads(self, mixed: torch.Tensor) -> torch.Tensor:
        """Each head's mix of the latent [b, n, h, r] through its V_up -> [b, n, h, dh] (as is once folded)."""
        if self.v_up is None:  # folded into o_proj: each head's value is the latent itself
            return mixed
        return torch.einsum("bnhr,hdr->bnhd", mixed, self._value_heads())

    def _decompressed(self, q_nope, q_pe, key, attention_mask, kwargs):
        """The naive function as a few large matmuls (module docstring): one shared key for every head, one value
        per kv group; the softmax in the scores' dtype."""
        batch, heads, n, _ = q_nope.shape
        total = key.shape[1]
        latent, k_pe = key[..., :self.kv_rank], key[..., self.kv_rank:]         # [b, N, r], [b, N, 2m]
        keys = torch.cat([latent if self.k_up is None else F.linear(latent, self.k_up), k_pe], -1)  # [b, N, r' + 2m]
        query = torch.cat([q_nope, q_pe], -1) * self.scaling                     # [b, h, n, r' + 2m]
        scores = (query.reshape(batch, heads * n, -1) @ keys.transpose(1, 2)).view(batch, heads, n, total)
        weights = torch.softmax(_masked(scores, attention_mask), -1)             # [b, h, n, N]
        if self.v_up is None:  # folded: every head's value is the latent, one group
            groups, values = 1, latent.unsqueeze(1)                              # [b, 1, N, r = dh]
        else:
            groups = self.n_kv_heads
            values = F.linear(latent, self.v_up).view(batch, total, groups, self.head_dim).transpose(1, 2)
        # heads i·h/g … (i+1)·h/g − 1 read group i (as _value_heads): their rows stack into one matmul per group
        mixed = weights.to(values.dtype).reshape(batch, groups, -1, total) @ values  # [b, g, (h/g)·n, dh]
        return mixed.view(batch, heads, n, self.head_dim).transpose(1, 2), weights

    def _naive(self, q_nope, q_pe, key, attention_mask, kwargs):
        """Keys and values decompressed for every cached token; softmax written out (eager masks only)."""
        latent, k_pe = key[..., :self.kv_rank], key[..., self.kv_rank:]         # [b, N, r], [b, N, 2m]
        keys = F.linear(latent, self._key_up())                                  # [b, N, r']
        values = torch.einsum("bnr,hdr->bhnd", latent, self._value_heads())      # [b, h, N, dh]
        scores = (q_nope @ keys.unsqueeze(1).transpose(-1, -2)
                  + q_pe @ k_pe.unsqueeze(1).transpose(-1, -2)) * self.scaling   # [b, h, n, N]
        scores = _masked(scores, attention_mask)
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1).to(values.dtype)
        return (weights @ values).transpose(1, 2), weights

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, kv_rank={self.kv_rank}, "
                f"rope_dim={self.rope_dim}, qk_nope_dim={self.qk_nope_dim}, layer_idx={self.layer_idx}, "
                f"cache_numbers_per_token={self.cache_numbers_per_token()}, execution={self.execution}")
