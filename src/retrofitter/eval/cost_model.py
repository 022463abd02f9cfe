"""A cost model of one matrix's execution time by factor form, fitted from measured timings (eval/form_cost.py).

A matrix W [d', d] at rank r can run as (modules/latent_linear.py ``FACTOR_FORMS``)

    dense      y = x Wᵀ                        T · d · d'          multiply-adds (MACs), T tokens
    plain      y = (x downᵀ) upᵀ               T · r (d + d')
    junction   y = (x[piv] + x[rest] mixᵀ) upᵀ  T · r (d − r + d')  (+ a gather of x unless the pivots lead)

MACs do not predict time alone (two small matmuls pay twice the fixed cost, BLAS efficiency depends
on the shapes), so the model is measured: per shape (d, d') and *kernel* (``KERNELS``: the junction
timed twice, with its columns gathered and with leading pivots, which read two slices), the median
times t_k at a few ranks r_k are interpolated linearly in r, under a non-decreasing envelope
(t(r) = max_{r_k ≤ r} of the interpolant), so a rank step never has a negative price. Dense time
does not depend on r. The model is a pure function of the table: tests give it a synthetic one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["KERNELS", "FormCostModel", "form_macs", "kernel_of", "rank_grid"]

# what is timed: a factor form, and for the junction the layout of its pivots
KERNELS = ("dense", "plain", "junction_gather", "junction_slice")


def kernel_of(form: str, pivots_lead: bool = False) -> str:
    """The timed kernel of a factor form (``junction`` → ``junction_slice`` when its pivots lead)."""
    if form == "junction":
        return "junction_slice" if pivots_lead else "junction_gather"
    if form not in ("dense", "plain"):
        raise ValueError(f"unknown factor form {form!r}; choose from dense, plain, junction")
    return form


def form_macs(d_in: int, d_out: int, rank: int, form: str, tokens: int = 1) -> int:
    """Multiply-adds of y = f(x) for ``tokens`` rows (module docstring)."""
    if form == "dense":
        return tokens * d_in * d_out
    if form == "plain":
        return tokens * rank * (d_in + d_out)
    if form == "junction":
        return tokens * rank * (d_in - rank + d_out)
    raise ValueError(f"unknown factor form {form!r}; choose from dense, plain, junction")


def rank_grid(d_in: int, d_out: int, points: int = 9) -> list[int]:
    """Ranks timed for a shape: 1, min(d, d') − 1 and ``points`` − 2 evenly spaced ones between."""
    top = max(1, min(d_in, d_out) - 1)
    return sorted({1, top, *(max(1, round(top * i / (points - 1))) for i in range(1, points - 1))})


@dataclass
class FormCostModel:
    """Seconds of one matrix's y = f(x) at the table's token count, from ``timings``.

    ``timings``: (d_in, d_out, kernel) -> {rank: median seconds} (dense: any one rank key, e.g. 0).
    """

    timings: dict
    tokens: int = 512
    _curves: dict = field(default_factory=dict, repr=False)

    def has(self, d_in: int, d_out: int, kernel: str) -> bool:
        return (d_in, d_out, kernel) in self.timings

    def _curve(self, d_in: int, d_out: int, kernel: str) -> tuple[list[int], list[float]]:
        key = (d_in, d_out, kernel)
        if key not in self._curves:
            if key not in self.timings or not self.timings[key]:
                raise KeyError(f"no timings of {kernel} for a {d_out}x{d_in} matrix; measure them first "
                               f"(eval.form_cost.measure_timings)")
            ranks = sorted(int(r) for r in self.timings[key])
            times = [float(self.timings[key][r]) for r in ranks]
            for i in range(1, len(times)):  # non-decreasing envelope: a rank step never gets cheaper
                times[i] = max(times[i], times[i - 1])
            self._curves[key] = (ranks, times)
        return self._curves[key]

    def seconds(self, d_in: int, d_out: int, form: str, rank: int = 0, pivots_lead: bool = False) -> float:
        """Modelled seconds of ``form`` at ``rank`` (linear in r between timed ranks, flat beyond them)."""
        kernel = kernel_of(form, pivots_lead)
        ranks, times = self._curve(d_in, d_out, kernel)
        if kernel == "dense" or len(ranks) == 1 or rank <= ranks[0]:
            return times[0]
        if rank >= ranks[-1]:
            return times[-1]
        right = bisect.bisect_right(ranks, rank)
        r0, r1, t0, t1 = ranks[right - 1], ranks[right], times[right - 1], times[right]
        return t0 + (t1 - t0) * (rank - r0) / (r1 - r0)

    def fastest(self, d_in: int, d_out: int, rank: int, forms, pivots_lead: bool = False) -> tuple[str, float]:
        """(form, seconds) of the fastest of ``forms`` at ``rank``; ties go to the earlier form in ``forms``."""
        best = None
        for form in forms:
            seconds = self.seconds(d_in, d_out, form, rank, pivots_lead)
            if best is None or seconds < best[1]:
                best = (form, seconds)
        if best is None:
            raise ValueError("no factor form to choose from")
        return best
