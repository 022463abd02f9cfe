"""LoLCATs hybrid attention as an nn.Module: window softmax + linear attention over older keys.

Per query head ``h`` (kv head ``h // (n_heads / n_kv_heads)``), query ``n``, window ``W_n``:

    y_n = (sum_{i in W_n} gamma e^{q_n.k_i/sqrt(d) - c_n} v_i + lam phi_q(q_n)^T S_n)
          / (sum_{i in W_n} gamma e^{q_n.k_i/sqrt(d) - c_n}     + lam phi_q(q_n)^T z_n)

    S_n = sum_{i <= n, i not in W_n} phi_k(k_i) v_i^T,  z_n = sum_{...} phi_k(k_i),
    c_n = max_{i in W_n} q_n.k_i/sqrt(d),  gamma = sigmoid(theta_h),  lam = 1 or 1 - gamma.

Recall beyond the window (``sinks``, ``sparse_cache``; ``ops.hybrid_common``): the first ``sinks``
tokens and, per kv head, the ``sparse_cache`` keys the linear state recalls worst are attended
exactly as well and kept out of ``S, z``; ``linear_weight="zero"`` drops the linear part (a
window + sinks softmax, the training-free ``swa-sinks`` baseline).

``window_kind``: ``sliding`` (``W_n = {n-w+1..n}``) or ``terraced`` (tile ``t = window``: the
query's tile up to ``n`` plus the previous tile); positions count real tokens only (see
``retrofitter.ops.hybrid_common``). The module works on q, k, v *after* projection and RoPE;
the caller applies ``o_proj``. Shapes: q ``[b, h, n, dh]``, k/v ``[b, g, n, dh]``, y ``[b, h, n, dh]``.
Trainable: ``feature_map_q``, ``feature_map_k`` and ``mix_logit`` (theta, ``[h]``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.hybrid_chunked import hybrid_attention_chunked
from ..ops.hybrid_common import RecallSettings, exact_contains, get_linear_weight, get_window_kind
from ..ops.hybrid_naive import hybrid_attention_naive
from ..ops.hybrid_recurrent import HybridRecurrentState, hybrid_recurrent_step
from .feature_maps import build_feature_map

__all__ = ["HybridLinearAttention", "EXECUTIONS"]

# Full-sequence executions; both return (y, state | None) and compute the same function.
EXECUTIONS = {
    "chunked": hybrid_attention_chunked,
    "naive": hybrid_attention_naive,
}


class HybridLinearAttention(nn.Module):
    """Hybrid softmax-window + linear attention core (no projections).

    Args:
        n_heads, n_kv_heads, head_dim: attention geometry (GQA when n_kv_heads < n_heads).
        window: sliding width or terraced tile size.
        window_kind: a name in ``ops.hybrid_common.WINDOW_KINDS`` (``"sliding"``, ``"terraced"``).
        feature_map: name in ``feature_maps.FEATURE_MAPS`` (``hedgehog``, ``t2r``, ``elu``).
        feature_dim: projection width of the feature map (hedgehog gives 2x features).
        mix_init: initial theta; gamma = sigmoid(-2.2) ~ 0.1.
        linear_weight: ``"one"`` or ``"one_minus_gamma"`` (weight of the linear terms).
        execution: ``"chunked"`` (O(n) memory, default) or ``"naive"`` (quadratic reference).
        softmax_scale: defaults to 1/sqrt(head_dim).
        sinks: first tokens always attended exactly (attention sinks); 0 = none.
        sparse_cache: keys per kv head kept for exact attention by recall error (LoLA); 0 = none.
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        window: int = 64,
        window_kind: str = "sliding",
        feature_map: str = "hedgehog",
        feature_dim: int = 64,
        mix_init: float = -2.2,
        linear_weight: str = "one",
        execution: str = "chunked",
        softmax_scale: float | None = None,
        sinks: int = 0,
        sparse_cache: int = 0,
    ):
        super().__init__()
        if n_kv_heads < 1 or n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})")
        if window < 1:
            raise ValueError(f"window must be >= 1; got {window}")
        get_window_kind(window_kind)  # fail early with the list of options
        get_linear_weight(linear_weight)
        if execution not in EXECUTIONS:
            raise ValueError(f"unknown execution {execution!r}; choose one of {sorted(EXECUTIONS)}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.window_kind = window_kind
        self.linear_weight = linear_weight
        self.execution = execution
        self.softmax_scale = softmax_scale
        self.recall = RecallSettings(sinks=int(sinks), sparse_cache=int(sparse_cache))
        self.feature_map_q = build_feature_map(feature_map, n_heads, head_dim, feature_dim)
        self.feature_map_k = build_feature_map(feature_map, n_heads, head_dim, feature_dim)
        self.mix_logit = nn.Parameter(torch.full((n_heads,), float(mix_init)))  # theta

    @property
    def gamma(self) -> torch.Tensor:
        """Softmax-term weight per head, ``[h]``, computed in float32 (or float64) for stability."""
        theta = self.mix_logit
        return torch.sigmoid(theta.to(torch.promote_types(theta.dtype, torch.float32)))

    def set_recall(self, sinks: int, sparse_cache: int) -> None:
        """Change the sinks / sparse-cache sizes (no weights depend on them; a live decode state must be rebuilt)."""
        self.recall = RecallSettings(sinks=int(sinks), sparse_cache=int(sparse_cache))

    def window_and_sinks(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Bool mask (broadcast of ``query_pos`` and ``key_pos``, real-token indices): the keys every query attends
        exactly whatever the sparse cache holds, its window ``W_n`` and the sinks."""
        return exact_contains(get_window_kind(self.window_kind), query_pos, key_pos, self.window, self.recall.sinks)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What attention transfer trains: both feature maps and theta."""
        return [*self.feature_map_q.parameters(), *self.feature_map_k.parameters(), self.mix_logit]

    @property
    def buffer_size(self) -> int:
        """Window ring-buffer length ``s`` of the decode state (``WINDOW_KINDS[window_kind].buffer_size``)."""
        return get_window_kind(self.window_kind).buffer_size(self.window)

    def state_bytes(self, batch_size: int, dtype: torch.dtype) -> int:
        """Bytes of the decode state of ``batch_size`` rows whose k, v come in ``dtype``.

        Exactly the tensors ``init_state`` / the executions build (built on the meta device, so
        nothing is allocated): ring buffer k, v ``[b, g, s, dh]`` in ``dtype``; slot positions
        ``[b, s]`` int64 and validity ``[b, s]`` bool; S ``[b, h, F, dh]`` and z ``[b, h, F]`` in
        ``compute_dtype_for(dtype)`` (float32 for bf16/fp16; width 0 with ``linear_weight="zero"``);
        ``num_tokens`` ``[b]`` int64; sink k, v ``[b, g, S, dh]``; sparse cache k, v ``[b, g, M, dh]``,
        errors ``[b, g, M]`` (compute dtype), positions ``[b, g, M]`` int64 and, when ``M > 0``, the scoring state ``S_all, z_all``.
        """
        return self.init_state(batch_size, dtype, device="meta").nbytes()

    def init_state(
        self, batch_size: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> HybridRecurrentState:
        """Empty decode state (for generating from scratch)."""
        return HybridRecurrentState.init(
            batch_size,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.feature_map_q.output_dim,
            window=self.window,
            window_kind=self.window_kind,
            recall=self.recall,
            dtype=dtype,
            device=device,
            linear_state=self.linear_weight != "zero",
        )

    def _op_kwargs(self) -> dict:
        return dict(
            feature_map_q=self.feature_map_q,
            feature_map_k=self.feature_map_k,
            gamma=self.gamma,
            linear_weight=self.linear_weight,
            softmax_scale=self.softmax_scale,
        )

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        expected_q = (self.n_heads, self.head_dim)
        expected_kv = (self.n_kv_heads, self.head_dim)
        if q.dim() != 4 or (q.shape[1], q.shape[3]) != expected_q:
            raise ValueError(f"q must be [b, {self.n_heads}, n, {self.head_dim}]; got {tuple(q.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[1], t.shape[3]) != expected_kv or t.shape[2] != q.shape[2]:
                expected = f"[b, {self.n_kv_heads}, n={q.shape[2]}, {self.head_dim}]"
                raise ValueError(f"{name} must be {expected}; got {tuple(t.shape)}")

    def step(
        self,
        state: HybridRecurrentState,
        q_t: torch.Tensor,
        k_t: torch.Tensor,
        v_t: torch.Tensor,
        valid_t: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, HybridRecurrentState]:
        """One token: q_t ``[b, h, 1, dh]``, k_t/v_t ``[b, g, 1, dh]``, valid_t ``[b]`` -> (y_t, state)."""
        return hybrid_recurrent_step(state, q_t, k_t, v_t, valid_t, **self._op_kwargs())

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        state: HybridRecurrentState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, HybridRecurrentState | None]:
        """Attention output ``[b, h, n, dh]`` (q's dtype) and the new state.

        Without ``state``: the whole sequence with ``self.execution``; the state after it is
        returned when ``return_state`` (prefill), else None. With ``state``: continue decoding
        token by token (``key_padding_mask [b, n]`` marks which new tokens are real); the new
        state is always returned.
        """
        self._check_shapes(q, k, v)
        if state is None:
            run = EXECUTIONS[self.execution]
            return run(
                q, k, v, window=self.window, window_kind=self.window_kind, key_padding_mask=key_padding_mask,
                return_state=return_state, recall=self.recall, **self._op_kwargs(),
            )
        built = (state.window_kind, state.window, state.sinks, state.sparse_cache)
        if built != (self.window_kind, self.window, self.recall.sinks, self.recall.sparse_cache):
            raise ValueError(
                f"state was built for {state.window_kind} window {state.window}, {state.sinks} sinks, sparse cache "
                f"{state.sparse_cache}; layer uses {self.window_kind} window {self.window}, {self.recall.sinks} sinks, "
                f"sparse cache {self.recall.sparse_cache}"
            )
        if key_padding_mask is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
            # All real (HF passes a mask in every decode step): the step then skips its masking work. Not on
            # an accelerator, where reading the flag would stall the launch queue.
            key_padding_mask = None if bool(key_padding_mask.all()) else key_padding_mask
        outputs = []
        # Continuation is a loop of single steps: decoding adds one token at a time, and the
        # step is the path that is exactly the naive math on the buffered window.
        for t in range(q.shape[2]):
            valid_t = key_padding_mask[:, t] if key_padding_mask is not None else None
            y_t, state = self.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], valid_t)
            outputs.append(y_t)
        return torch.cat(outputs, dim=2), state

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, window={self.window}, "
            f"window_kind={self.window_kind!r}, linear_weight={self.linear_weight!r}, execution={self.execution!r}, "
            f"sinks={self.recall.sinks}, sparse_cache={self.recall.sparse_cache}"
        )
