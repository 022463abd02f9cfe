"""Streaming first and second moments of layer inputs, in float64.

For calibration inputs x_1..x_l in R^d (rows of any leading shape) with weights w_t (1 by default,
0 for padding):

    count          n  = Σ_t w_t
    mean           μ  = Σ_t w_t x_t / n                      [d]
    second moment  C  = Σ_t w_t x_t x_tᵀ / n = E[x xᵀ]        [d, d]   (uncentered)
    covariance     C0 = C − μ μᵀ                              [d, d]   (centered)
    damped         C + λ · mean(diag C) · I

Only the running sums Σ w x and Σ w x xᵀ are kept, so activations are never stored.

Precision: the sums are float64. Each batch's products XᵀX are formed in the inputs' own precision
(at least float32: bf16/fp16 rows are widened first) and then added into the float64 sums, as GPTQ-style
calibration does; a batch of n float32 rows carries a relative rounding error of about √n·2⁻²⁴ (~4e-6
for n = 4096), far below the damping (1e-2 of the mean diagonal), at half the time of float64 products.
``product_dtype=torch.float64`` forms every product in float64 (the reference the tests compare with).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "SecondMomentAccumulator",
    "CrossMomentAccumulator",
    "damped",
    "check_finite_matrix",
    "symmetric_gram",
]


def damped(matrix: torch.Tensor, damping: float) -> torch.Tensor:
    """Return ``matrix + damping · mean(diag(matrix)) · I`` (a new tensor).

    The damping is relative to the average diagonal so that one λ works for every layer whatever the
    activation scale. If the diagonal averages to zero (all-zero inputs) the absolute ``damping · I``
    is used instead so that the result is still positive definite.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"damped() needs a square matrix, got shape {tuple(matrix.shape)}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    if damping == 0:
        return matrix.clone()
    scale = torch.diagonal(matrix).mean()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    eye = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    return matrix + (damping * scale) * eye


def check_finite_matrix(matrix: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``matrix`` holds NaN or Inf."""
    if not bool(torch.isfinite(matrix).all()):
        bad = int((~torch.isfinite(matrix)).sum())
        raise ValueError(
            f"{name}: {bad} non-finite value(s) (NaN/Inf) in a statistic of shape {tuple(matrix.shape)}; "
            "the calibration activations overflowed or contain NaN"
        )


def _flatten_rows(x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    if x.shape[-1] != dim:
        raise ValueError(f"{what}: last dimension must be {dim}, got shape {tuple(x.shape)}")
    return x.reshape(-1, dim)


def _product_dtype(x: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    """float64 if asked for or if the rows already are float64, float32 otherwise."""
    return torch.float64 if requested == torch.float64 or x.dtype == torch.float64 else torch.float32


def symmetric_gram(rows: torch.Tensor, blocks: int = 4) -> torch.Tensor:
    """rowsᵀ rows [d, d] for rows [n, d], from the lower block triangle of a ``blocks`` × ``blocks`` split of
    the columns, mirrored: (blocks + 1) / (2 · blocks) of the multiply-adds of one GEMM (5/8 for 4 blocks;
    ~25 % less time for d = 1536 on a CPU) and an exactly symmetric result on every CPU.

    Exact symmetry is by construction, not by the BLAS: a GEMM's (i, j) and (j, i) entries may be summed
    in different orders (MKL on AMD EPYC differs by ~1e-14 in float64), so every diagonal block, and the
    single GEMM of the small-matrix path, keeps its lower triangle and mirrors it (``_mirror_lower``)."""
    d = rows.shape[1]
    if blocks < 2 or d < 64 * blocks:  # small matrices: one GEMM is faster than several tiny ones
        return _mirror_lower(rows.T @ rows)
    edges = [d * i // blocks for i in range(blocks + 1)]
    gram = rows.new_empty(d, d)
    for i in range(blocks):
        rows_i, span_i = rows[:, edges[i]:edges[i + 1]], slice(edges[i], edges[i + 1])
        for j in range(i + 1):
            span_j = slice(edges[j], edges[j + 1])
            block = rows_i.T @ rows[:, span_j]  # [d_i, d_j]
            if i == j:
                gram[span_i, span_j] = _mirror_lower(block)
            else:
                gram[span_i, span_j] = block
                gram[span_j, span_i] = block.T
    return gram


def _mirror_lower(square: torch.Tensor) -> torch.Tensor:
    """The lower triangle of ``square`` [m, m] (diagonal included) mirrored onto the upper: exactly
    symmetric, since each upper entry is a copy of its lower twin plus an exact zero."""
    return torch.tril(square) + torch.tril(square, diagonal=-1).mT


def _row_weights(weights: torch.Tensor | None, x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Flatten ``weights`` [...] to [rows]; ``None`` means every row has weight 1."""
    if weights is None:
        return None
    if tuple(weights.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"weights shape {tuple(weights.shape)} must equal the input's leading shape {tuple(x.shape[:-1])}"
        )
    return weights.reshape(rows)


class SecondMomentAccumulator:
    """Running Σ w x and Σ w x xᵀ of inputs x [..., dim], kept in float64 on ``device``.

    ``update(x, weights=None)`` adds a batch; rows whose weight is 0 (padding) are dropped before any
    arithmetic so that NaN/garbage in padded positions cannot leak in. ``merge(other)`` adds another
    accumulator's sums (e.g. from another process or shard). ``product_dtype``: None (default) forms a
    batch's products in float32 (float64 for float64 rows), ``torch.float64`` always in float64 (module
    docstring).
    """

    def __init__(self, dim: int, device: torch.device | str | None = None, product_dtype: torch.dtype | None = None):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if product_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"product_dtype must be None, torch.float32 or torch.float64, got {product_dtype}")
        self.dim = int(dim)
        self.product_dtype = product_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._weighted_sum = torch.zeros(dim, dtype=torch.float64, device=self.device)  # Σ w x      [d]
        self._weighted_outer = torch.zeros(dim, dim, dtype=torch.float64, device=self.device)  # Σ w x xᵀ [d, d]
        self._count = 0.0  # Σ w

    def update(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add inputs ``x`` [..., dim]; optional ``weights`` [...] (0 = exclude the row)."""
        rows = _flatten_rows(x, self.dim, "SecondMomentAccumulator.update")
        row_weights = _row_weights(weights, x, rows.shape[0])
        dtype = _product_dtype(x, self.product_dtype)
        rows = rows.to(device=self.device, dtype=dtype)
        if row_weights is not None:
            row_weights = row_weights.to(device=self.device, dtype=dtype)
            keep = row_weights != 0
            rows, row_weights = rows[keep], row_weights[keep]
        if rows.shape[0] == 0:
            return
        weighted_rows = rows if row_weights is None else rows * row_weights[:, None]
        self._weighted_sum += weighted_rows.sum(0)  # this batch's sum in the product dtype, added in float64
        if dtype == torch.float64:
            self._weighted_outer.addmm_(weighted_rows.T, rows)
        else:  # this batch's products in float32, added into the float64 sum
            self._weighted_outer += symmetric_gram(rows) if row_weights is None else weighted_rows.T @ rows
        self._count += float(rows.shape[0]) if row_weights is None else float(row_weights.sum(dtype=torch.float64))

    def merge(self, other: "SecondMomentAccumulator") -> "SecondMomentAccumulator":
        """Add ``other``'s sums into this accumulator (in place) and return ``self``."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge accumulators of dim {self.dim} and {other.dim}")
        self._weighted_sum += other._weighted_sum.to(self.device)
        self._weighted_outer += other._weighted_outer.to(self.device)
        self._count += other._count
        return self

    def synchronize(self, all_reduce_sum: Callable[[torch.Tensor], None]) -> "SecondMomentAccumulator":
        """Replace the sums by their totals over processes (data-parallel calibration, each process having
        accumulated its own blocks); ``all_reduce_sum(t)`` sums ``t`` in place across processes
        (``torch.distributed.all_reduce``). Σ over processes of (Σ w x, Σ w x xᵀ, Σ w) = the sums of one
        process over all blocks, up to the order of the float64 additions. Returns ``self``."""
        count = torch.tensor([self._count], dtype=torch.float64, device=self.device)
        for tensor in (self._weighted_sum, self._weighted_outer, count):
            all_reduce_sum(tensor)
        self._count = float(count.item())
        return self

    @property
    def count(self) -> float:
        """Total weight Σ w (the number of rows when unweighted)."""
        return self._count

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The running sums as tensors (float64): ``weighted_sum`` [d], ``weighted_outer`` [d, d], ``count`` [1]."""
        return {"weighted_sum": self._weighted_sum, "weighted_outer": self._weighted_outer,
                "count": torch.tensor([self._count], dtype=torch.float64)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor],
                        device: torch.device | str | None = None) -> "SecondMomentAccumulator":
        """The accumulator whose sums are ``state`` (from :meth:`state_dict`), bit for bit."""
        outer = state["weighted_outer"]
        if outer.ndim != 2 or outer.shape[0] != outer.shape[1] or tuple(state["weighted_sum"].shape) != outer.shape[:1]:
            raise ValueError(f"inconsistent moment state: sum {tuple(state['weighted_sum'].shape)}, "
                             f"outer {tuple(outer.shape)}")
        accumulator = cls(outer.shape[0], device=device)
        accumulator._weighted_sum = state["weighted_sum"].to(accumulator.device, torch.float64).clone()
        accumulator._weighted_outer = outer.to(accumulator.device, torch.float64).clone()
        accumulator._count = float(state["count"].reshape(-1)[0])
        return accumulator

    def _require_data(self) -> None:
        if self._count <= 0:
            raise ValueError("SecondMomentAccumulator is empty: call update() with at least one row first")

    @property
    def mean(self) -> torch.Tensor:
        """μ = E[x] [dim], float64."""
        self._require_data()
        return self._weighted_sum / self._count

    @property
    def second_moment(self) -> torch.Tensor:
        """C = E[x xᵀ] [dim, dim], float64, uncentered, exactly symmetric."""
        self._require_data()
        moment = self._weighted_outer / self._count
        return (moment + moment.T) / 2  # addmm is symmetric only up to rounding

    def covariance(self) -> torch.Tensor:
        """C0 = E[x xᵀ] − μ μᵀ [dim, dim], float64 (centered)."""
        mean = self.mean
        return self.second_moment - torch.outer(mean, mean)

    damped = staticmethod(damped)

    def check_finite(self, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` (the layer/matrix) if the sums hold NaN/Inf."""
        check_finite_matrix(self._weighted_sum, f"{name} (mean)")
        check_finite_matrix(self._weighted_outer, f"{name} (second moment)")


class CrossMomentAccumulator:
    """Running Σ w a bᵀ for paired inputs a [..., dim_a], b [..., dim_b]; ``cross_moment`` = E[a bᵀ].

    Used by the streaming joint-MLP fit (E[h ĥᵀ] between original and compressed intermediates).
    ``product_dtype`` as for :class:`SecondMomentAccumulator` (float64 if either input is float64).
    """

    def __init__(self, dim_a: int, dim_b: int, device: torch.device | str | None = None,
                 product_dtype: torch.dtype | None = None):
        if dim_a < 1 or dim_b < 1:
            raise ValueError(f"dims must be >= 1, got {dim_a}, {dim_b}")
        if product_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"product_dtype must be None, torch.float32 or torch.float64, got {product_dtype}")
        self.dim_a, self.dim_b = int(dim_a), int(dim_b)
        self.product_dtype = product_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._weighted_outer = torch.zeros(dim_a, dim_b, dtype=torch.float64, device=self.device)
        self._count = 0.0

    def update(self, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add pairs a [..., dim_a], b [..., dim_b] (same leading shape); ``weights`` [...] as above."""
        if tuple(a.shape[:-1]) != tuple(b.shape[:-1]):
            raise ValueError(f"paired inputs need the same leading shape, got {tuple(a.shape)} and {tuple(b.shape)}")
        rows_a = _flatten_rows(a, self.dim_a, "CrossMomentAccumulator.update (a)")
        rows_b = _flatten_rows(b, self.dim_b, "CrossMomentAccumulator.update (b)")
        row_weights = _row_weights(weights, a, rows_a.shape[0])
        dtype = torch.float64 if torch.float64 in (_product_dtype(a, self.product_dtype), b.dtype) else torch.float32
        rows_a = rows_a.to(device=self.device, dtype=dtype)
        rows_b = rows_b.to(device=self.device, dtype=dtype)
        if row_weights is not None:
            row_weights = row_weights.to(device=self.device, dtype=dtype)
            keep = row_weights != 0
            rows_a, rows_b, row_weights = rows_a[keep] * row_weights[keep, None], rows_b[keep], row_weights[keep]
            self._count += float(row_weights.sum(dtype=torch.float64))
        else:
            self._count += float(rows_a.shape[0])
        if dtype == torch.float64:
            self._weighted_outer.addmm_(rows_a.T, rows_b)
        else:  # this batch's products in float32, added into the float64 sum
            self._weighted_outer += rows_a.T @ rows_b

    def merge(self, other: "CrossMomentAccumulator") -> "CrossMomentAccumulator":
        if (other.dim_a, other.dim_b) != (self.dim_a, self.dim_b):
            raise ValueError("cannot merge cross-moment accumulators of different shapes")
        self._weighted_outer += other._weighted_outer.to(self.device)
        self._count += other._count
        return self

    def synchronize(self, all_reduce_sum: Callable[[torch.Tensor], None]) -> "CrossMomentAccumulator":
        """Sums totalled over processes, as :meth:`SecondMomentAccumulator.synchronize`; returns ``self``."""
        count = torch.tensor([self._count], dtype=torch.float64, device=self.device)
        for tensor in (self._weighted_outer, count):
            all_reduce_sum(tensor)
        self._count = float(count.item())
        return self

    @property
    def count(self) -> float:
        return self._count

    @property
    def cross_moment(self) -> torch.Tensor:
        """E[a bᵀ] [dim_a, dim_b], float64."""
        if self._count <= 0:
            raise ValueError("CrossMomentAccumulator is empty: call update() first")
        return self._weighted_outer / self._count

    def check_finite(self, name: str) -> None:
        check_finite_matrix(self._weighted_outer, f"{name} (cross moment)")
