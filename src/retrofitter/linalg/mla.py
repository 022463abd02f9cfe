"""Conversion of GQA/MHA attention to Multi-head Latent Attention (DeepSeek-V2/V3 layout), training-free.

Setting (one layer, rotate-half RoPE): h query heads, g kv heads, head dim dh, group(i) = i // (h / g).
A head's dims f and f + dh/2 form frequency pair f (f < dh/2), rotated by R_f(pos) at frequency θ_f.
Inputs x̃ = [x; 1] [d + 1] carry the biases as a last column; C̃ = E[x̃ x̃ᵀ].

**Shared rotary slots (TransMLA's RoRoPE).** For a pair f, stack the kv heads' 2-vectors k_{g,f}. An
orthogonal U_f [g, g] mixing the heads, applied alike to both dims of the pair, commutes with R_f:
k'_{c,f} = Σ_g U_f[g, c] k_{g,f} is rotated by R_f too, and with q'_{i,c,f} = U_f[group(i), c] q_{i,f}

    q_{i,f}ᵀ R_f k_{group(i),f} = Σ_c q'_{i,c,f}ᵀ R_f k'_{c,f}           (exact)

so the g·dh/2 *slots* (c, f) are key components shared by every head. U_f diagonalises the pair's key
energy Σ_f[g1, g2] = E[k_{g1,f} · k_{g2,f}] (eigh, descending): the first components carry the most.
``rope_dim`` / 2 slots keep RoPE in the shared key k_pe [rope_dim]; they are ranked by

    score(c, f) = √(E|k'_{c,f}|² · E|q'_{c,f}|²) · (1 − sin(θ_f L) / (θ_f L))

the typical size of the slot's score term times the mean of 1 − cos(θ_f Δ) over distances Δ ∈ [0, L]:
the error of letting that slot go without rotation (``selection="score"``: the m best slots).
``"progression"`` ranks by the same score but keeps one slot at each of the frequencies f = 0, s, 2s, …,
(m−1)s for the step s whose kept score is largest (one s for every layer of a model: pipelines/mla.py sums
the layers' ``progression_totals``): exactly the table θ'_j = base'^(−j/m) of a DeepSeek
rotary key of dim 2m with base' = base^(2sm/dh), so the layer exports to DeepSeek-V3 checkpoints
(``progression_slots``). The alternatives measured
against it: ``"energy"`` (the first factor alone, TransMLA's ranking) and ``"frequency"`` (the highest
frequencies first, each pair's components by key energy, MHA2MLA's high-frequency rule). The other slots
become *no-rotation* dims (the rotation is dropped: exact at distance 0, close for low frequencies). With
``rotation_fit`` (the original attention's statistics, linalg/mla_rotation_fit.py) each query head reads them
through a fitted map M [2, 2] per slot instead of the identity: the least-squares stand-in for the dropped
rotation under the distances that head attends over (free: it folds into q_proj).

**One latent.** The no-rotation key rows W_nope [n_nope, d + 1] and the values W_v [g·dh, d + 1] are fitted
jointly, c = A x̃ [r], [W_nope; W_v] ≈ [W_uk; W_uv] A, by the rootcov weighted SVD
(``svd.output_side_svd``): min E|D (W − B A) x̃|² with D the row weights — key rows by their slot's
query energy, each block scaled to unit energy so keys and values count alike. Then W_uk = Q R (thin QR):
the per-head query's no-rotation part is Qᵀ q'_nope [r' = min(n_nope, r)] and the key up-projection R.

At the full budget (every slot in k_pe, r = g·dh) every step is exact: the original scores and values.
Shapes and float64 throughout; the caller casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mla_rotation_fit import RotationFitStatistics, slot_fit
from .svd import output_side_svd

SLOT_SELECTIONS = ("score", "progression", "energy", "frequency")

__all__ = ["SLOT_SELECTIONS", "MLAFactors", "rotary_slots", "progression_totals", "progression_slots", "slot_scores",
           "mla_factors",
           "augmented_second_moment", "mla_budget"]


@dataclass
class MLAFactors:
    """One layer's MLA weights (float64). Shapes: h heads, r latent, r' = qk_nope_dim, m = rope_dim / 2."""

    q_weight: torch.Tensor        # [h·(r' + 2m), d]  per head [q_nope (r'), q_pe (2m, rotate-half layout)]
    q_bias: torch.Tensor | None   # [h·(r' + 2m)]
    kv_a_weight: torch.Tensor     # [r, d]            c = A x + a
    kv_a_bias: torch.Tensor | None
    k_pe_weight: torch.Tensor     # [2m, d]           shared rotary key before RoPE
    k_pe_bias: torch.Tensor | None
    k_up: torch.Tensor            # [r', r]           k_nope = k_up c
    v_up: torch.Tensor            # [g·dh, r]         v = v_up c
    freq_index: torch.Tensor      # [m] long          the frequency pair of each kept slot
    slot_scores: torch.Tensor     # [g·dh/2]          ranking score of every slot (kept first)
    fit_errors: tuple[float, float] | None = None  # Σ_t Var_p score error of the no-rotation slots: M = I, fitted M


def mla_budget(kv_ratio: float, n_kv_heads: int, head_dim: int, rope_fraction: float) -> tuple[int, int]:
    """(kv_rank r, rope_dim 2m) caching kv_ratio · 2·g·dh numbers per token: 2m ≈ rope_fraction of it (even,
    ≥ 2), r the rest (≥ 1); both at most g·dh."""
    full = 2 * n_kv_heads * head_dim
    budget = int(round(kv_ratio * full))
    if not 0.0 < kv_ratio <= 1.0 or budget < 3:
        raise ValueError(f"kv_ratio must lie in (0, 1] and leave at least 3 cached numbers per token of the "
                         f"{full} a layer caches now; got {kv_ratio}")
    rope_dim = min(n_kv_heads * head_dim, max(2, 2 * int(round(rope_fraction * budget / 2))))
    rank = min(n_kv_heads * head_dim, budget - rope_dim)
    return max(rank, 1), rope_dim


def augmented_second_moment(second_moment: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """C̃ = E[x̃ x̃ᵀ] [d + 1, d + 1] of x̃ = [x; 1] from E[x xᵀ] [d, d] and E[x] [d]."""
    d = second_moment.shape[0]
    out = second_moment.new_zeros(d + 1, d + 1)
    out[:d, :d], out[:d, d], out[d, :d], out[d, d] = second_moment, mean, mean, 1.0
    return out


def _sqrt_psd(matrix: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a PSD matrix, eigenvalues floored at 1e-8 of the largest (invertible)."""
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    values = values.clamp_min(values.max().clamp_min(1e-300) * 1e-8)
    return (vectors * values.sqrt()) @ vectors.T


def _pair_rows(head: int, f: int, head_dim: int) -> tuple[int, int]:
    return head * head_dim + f, head * head_dim + f + head_dim // 2


def rotary_slots(key_cov: torch.Tensor, query_cov: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                 inv_freq: torch.Tensor, context: int, selection: str = "score") -> tuple[torch.Tensor, ...]:
    """(U [dh/2, g, g]: per pair the head mixing, columns = components by descending key energy; key energy
    [dh/2, g]; query energy [dh/2, g]; ranking score [dh/2, g]) of the slots (c, f), from the key / query
    output covariances [g·dh, g·dh] / [h·dh, h·dh] (module docstring)."""
    half, group = head_dim // 2, n_heads // n_kv_heads
    U = key_cov.new_zeros(half, n_kv_heads, n_kv_heads)
    key_energy = key_cov.new_zeros(half, n_kv_heads)
    query_energy = key_cov.new_zeros(half, n_kv_heads)
    for f in range(half):
        rows = torch.tensor([_pair_rows(g, f, head_dim) for g in range(n_kv_heads)])  # [g, 2]
        pair = key_cov[rows[:, 0]][:, rows[:, 0]] + key_cov[rows[:, 1]][:, rows[:, 1]]  # Σ_f [g, g]
        values, vectors = torch.linalg.eigh((pair + pair.T) / 2)
        U[f], key_energy[f] = vectors.flip(1), values.flip(0).clamp_min(0.0)
        for i in range(n_heads):
            a, b = _pair_rows(i, f, head_dim)
            query_energy[f] += U[f][i // group] ** 2 * (query_cov[a, a] + query_cov[b, b])
    theta_l = inv_freq.to(key_cov).reshape(half, 1) * float(context)
    unrotated_error = 1.0 - torch.where(theta_l > 0, torch.sin(theta_l) / theta_l.clamp_min(1e-30), 1.0)
    size = (key_energy * query_energy).sqrt()
    if selection in ("score", "progression"):
        score = size * unrotated_error
    elif selection == "energy":
        score = size
    elif selection == "frequency":  # by θ_f, then by key energy within a pair
        score = inv_freq.to(key_cov).reshape(half, 1) * (1 + 1e-6 * key_energy / key_energy.max().clamp_min(1e-30))
    else:
        raise ValueError(f"unknown slot selection {selection!r}; choose one of {SLOT_SELECTIONS}")
    return U, key_energy, query_energy, score


def progression_totals(score: torch.Tensor, m: int) -> dict[int, float]:
    """Step s -> the summed ``score`` [dh/2, g] of the progression f_j = j·s, j < m (each frequency's best
    component), for every step that fits (m − 1)·s < dh/2. Summed over layers, it picks one step for a model."""
    half, _ = score.shape
    if m > half:
        raise ValueError(f"a progression of rotary frequencies holds at most {half} slots (one per frequency "
                         f"pair), {m} asked: lower rope_fraction or use rope_selection='score'")
    steps = range(1, (half - 1) // (m - 1) + 1) if m > 1 else range(1, 2)
    return {step: float(score[torch.arange(m, device=score.device) * step].max(1).values.sum()) for step in steps}


def progression_slots(score: torch.Tensor, m: int, step: int | None = None) -> torch.Tensor:
    """[m] slot ids f·g + c (ascending f) of the progression f_j = j·s, j < m, each frequency's best
    component c; s = ``step``, or the step of the highest summed ``score`` [dh/2, g] (``progression_totals``)."""
    totals = progression_totals(score, m)
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=score.device)
    if step is None or m == 1:  # one slot: frequency 0 whatever the step
        step = max(totals, key=lambda s: (totals[s], -s))
    elif step not in totals:
        raise ValueError(f"rope step {step} does not fit: {m} frequencies j·s need (m - 1)·s < {score.shape[0]}")
    freqs = torch.arange(m, device=score.device) * step
    return freqs * score.shape[1] + score[freqs].argmax(1)


def _with_bias_column(W: torch.Tensor, b: torch.Tensor | None, biased: bool) -> torch.Tensor:
    """[out, d + 1] in float64, the bias (or zeros) as the last column, when ``biased``; else [out, d]."""
    W = W.to(torch.float64)
    if not biased:
        return W
    return torch.cat([W, (b.to(W) if b is not None else W.new_zeros(W.shape[0]))[:, None]], 1)


def slot_scores(W_q, b_q, W_k, b_k, second_moment, mean, *, n_heads: int, n_kv_heads: int, head_dim: int,
                inv_freq: torch.Tensor, context: int = 2048, selection: str = "score") -> torch.Tensor:
    """The ranking score [dh/2, g] of one layer's rotary slots (``rotary_slots``), from its q/k projections and
    input statistics as ``mla_factors`` takes them."""
    f64 = dict(dtype=torch.float64, device=W_q.device)
    biased = b_q is not None or b_k is not None
    C = augmented_second_moment(second_moment.to(**f64), mean.to(**f64)) if biased else second_moment.to(**f64)
    Wq, Wk = _with_bias_column(W_q, b_q, biased), _with_bias_column(W_k, b_k, biased)
    return rotary_slots(Wk @ C @ Wk.T, Wq @ C @ Wq.T, n_heads, n_kv_heads, head_dim, inv_freq, context,
                        selection)[3]


def mla_factors(W_q, b_q, W_k, b_k, W_v, b_v, second_moment, mean, *, n_heads: int, n_kv_heads: int, head_dim: int,
                inv_freq: torch.Tensor, kv_rank: int, rope_dim: int, context: int = 2048,
                damping: float = 1e-6, selection: str = "score", metric: str = "diagonal",
                W_o: torch.Tensor | None = None, rope_step: int | None = None,
                rotation_fit: RotationFitStatistics | None = None) -> MLAFactors:
    """The MLA weights of one layer (module docstring) from its q/k/v projections (weights [out, d], biases
    [out] or None) and the input statistics E[x xᵀ] [d, d], E[x] [d]. ``metric``: how the joint k/v fit
    weighs its rows, ``"diagonal"`` (key rows by their slot's query energy) or ``"output"`` (the score error
    through the queries' covariance, the value error through ``W_o`` [d, h·dh]). ``rotation_fit``: the attention
    statistics of this layer (linalg/mla_rotation_fit.py); with them each head's query part of every slot that
    loses its rotation goes through the fitted map M [2, 2] (without: M = I; the ``"output"`` metric then weighs
    key errors by the mapped queries)."""
    f64 = dict(dtype=torch.float64, device=W_q.device)
    d, group = W_q.shape[1], n_heads // n_kv_heads
    m, slots = rope_dim // 2, n_kv_heads * head_dim // 2
    if rope_dim % 2 or not 0 <= m <= slots:
        raise ValueError(f"rope_dim must be even and at most {2 * slots} (every rotary dimension), got {rope_dim}")
    if not 1 <= kv_rank <= n_kv_heads * head_dim + 2 * (slots - m):
        raise ValueError(f"kv_rank must lie in [1, {n_kv_heads * head_dim + 2 * (slots - m)}], got {kv_rank}")
    biased = any(b is not None for b in (b_q, b_k, b_v))

    Wq, Wk, Wv = (_with_bias_column(W, b, biased) for W, b in ((W_q, b_q), (W_k, b_k), (W_v, b_v)))
    C = augmented_second_moment(second_moment.to(**f64), mean.to(**f64)) if biased else second_moment.to(**f64)
    U, _, query_energy, score = rotary_slots(Wk @ C @ Wk.T, Wq @ C @ Wq.T, n_heads, n_kv_heads, head_dim,
                                             inv_freq, context, selection)
    order = torch.argsort(score.reshape(-1), descending=True, stable=True)  # slot = f·g + c
    if selection == "progression":
        kept = progression_slots(score, m, rope_step)
        chosen = torch.zeros(order.numel(), dtype=torch.bool, device=order.device)
        chosen[kept] = True
        rest = order[~chosen[order]]
        order = torch.cat([kept, rest])
    else:
        kept, rest = order[:m], order[m:]

    def slot_rows(slot_list, for_head=None):
        """Maps head dims to slot dims: [2·len, g·dh] for keys (all kv heads), [2·len, dh] for query head i
        (its coefficient U_f[group(i), c]); rows = the slots' a-dims, then their b-dims (rotate-half)."""
        width = head_dim if for_head is not None else n_kv_heads * head_dim
        T = torch.zeros(2 * len(slot_list), width, **f64)
        for row, slot in enumerate(slot_list.tolist()):
            f, c = divmod(slot, n_kv_heads)
            for g in ([for_head // group] if for_head is not None else range(n_kv_heads)):
                a, b = _pair_rows(0 if for_head is not None else g, f, head_dim)
                T[row, a] = T[len(slot_list) + row, b] = U[f, g, c]
        return T

    k_pe = slot_rows(kept) @ Wk                                # [2m, d(+1)]
    k_nope = slot_rows(rest) @ Wk                              # [n_nope, d(+1)]
    query_nope, fit_errors = [], [0.0, 0.0]                    # per head [n_nope, d(+1)]: a-rows, then b-rows
    for i in range(n_heads):
        q_nope = slot_rows(rest, for_head=i) @ Wq[i * head_dim:(i + 1) * head_dim]
        if rotation_fit is not None and len(rest):
            maps, errors = _unrotated_maps(rotation_fit, i, rest, U, n_kv_heads, group)
            q_nope = maps @ q_nope
            fit_errors = [fit_errors[0] + errors[0], fit_errors[1] + errors[1]]
        query_nope.append(q_nope)
    if metric == "output":  # the errors as the layer sees them: key errors through the queries, values through o_proj
        if W_o is None:
            raise ValueError("metric='output' needs the output projection W_o")
        key_metric = _sqrt_psd(sum(q @ C @ q.T for q in query_nope)) if len(rest) else Wk.new_zeros(0, 0)
        W_o64 = W_o.to(**f64)
        value_metric = torch.block_diag(*[_sqrt_psd(sum(
            W_o64[:, i * head_dim:(i + 1) * head_dim].T @ W_o64[:, i * head_dim:(i + 1) * head_dim]
            for i in range(g * group, (g + 1) * group))) for g in range(n_kv_heads)])
    elif metric == "diagonal":  # key rows by their slot's query energy, values alike
        # (weighing by the energy of the queries after the fitted maps instead scored worse on SmolLM2 at 0.25x:
        # wiki-eval 199 against 185, one run with a patch of this line)
        nope_query = torch.stack([query_energy.reshape(-1)[rest]] * 2, 0).reshape(-1)  # [n_nope]: a-dims, b-dims
        key_metric = torch.diag((nope_query / nope_query.mean().clamp_min(1e-30)).sqrt().clamp_min(1e-6)
                                if len(rest) else nope_query)
        value_metric = torch.eye(Wv.shape[0], **f64)
    else:
        raise ValueError(f"unknown metric {metric!r}; choose 'diagonal' or 'output'")

    def unit(L, W):  # each block scaled to unit weighted energy, so keys and values count alike
        return L * (L @ W @ C @ W.T @ L.T).trace().clamp_min(1e-30).rsqrt() if W.shape[0] else L

    metric_matrix = torch.block_diag(unit(key_metric, k_nope), unit(value_metric, Wv))  # [n_nope + g·dh]²
    svd = output_side_svd(metric_matrix @ torch.cat([k_nope, Wv]), C, damping=damping, name="mla k/v")
    B, A = svd.factors(min(kv_rank, svd.A.shape[0]))
    B = torch.linalg.lstsq(metric_matrix, B).solution  # undo the metric (exact where it is invertible)
    W_uk, W_uv = B[:k_nope.shape[0]], B[k_nope.shape[0]:]      # [n_nope, r], [g·dh, r]
    if W_uk.shape[0]:
        Q, R = torch.linalg.qr(W_uk)                            # Q [n_nope, r'], R [r', r]
    else:
        Q, R = W_uk.new_zeros(0, 0), W_uk.new_zeros(0, A.shape[0])
    heads = []
    for i in range(n_heads):
        heads += [Q.T @ query_nope[i], slot_rows(kept, for_head=i) @ Wq[i * head_dim:(i + 1) * head_dim]]
    q = torch.cat(heads)                                        # [h·(r' + 2m), d(+1)]

    def split(W, has_bias):
        return (W[:, :d], W[:, d]) if biased and has_bias else (W[:, :d], None)

    q_weight, q_bias = split(q, b_q is not None)
    kv_a_weight, kv_a_bias = split(A, True)  # a biased layer's fit may use the constant input (the means)
    k_pe_weight, k_pe_bias = split(k_pe, b_k is not None)
    freq_index = (kept // n_kv_heads).to(torch.long)
    return MLAFactors(q_weight, q_bias, kv_a_weight, kv_a_bias, k_pe_weight, k_pe_bias, R, W_uv, freq_index,
                      score.reshape(-1)[order], tuple(fit_errors) if rotation_fit is not None else None)


def _unrotated_maps(stats: RotationFitStatistics, head: int, rest: torch.Tensor, U: torch.Tensor,
                    n_kv_heads: int, group: int) -> tuple[torch.Tensor, list[float]]:
    """([2n, 2n] block map, [error with M = I, error with M] summed over the slots) on query head ``head``'s
    no-rotation rows (a-rows, then b-rows of the n slots ``rest``): slot j's (a, b) go through its fitted M_j
    (linalg/mla_rotation_fit.py)."""
    n = len(rest)
    maps = stats.gram.new_zeros(2 * n, 2 * n)
    errors = [0.0, 0.0]
    for j, slot in enumerate(rest.tolist()):
        f, c = divmod(slot, n_kv_heads)
        M, before, after = slot_fit(stats, head, f, U[f, :, c])
        weight = float(U[f, head // group, c]) ** 2  # the slot's share of this head's pair f
        errors[0] += weight * before
        errors[1] += weight * after
        for a in range(2):
            for b in range(2):
                maps[a * n + j, b * n + j] = M[a, b]
    return maps, errors
