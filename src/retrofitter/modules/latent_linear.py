"""LatentLinear: a rank-r replacement for nn.Linear, stored in junction (block-identity) form.

Junction form (r(d + d') − r² weights), x [..., d] → y [..., d']:

    z = x[..., piv] + x[..., rest] @ mixᵀ        z [..., r],  mix [r, d − r]
    y = z @ upᵀ + b                               up [d', r],  b [d']

Plain form (r(d + d') weights): z = x @ downᵀ, y = z @ upᵀ + b, down [r, d].

state_dict keys are fixed: ``up``, ``mix``, ``pivot_index``, ``rest_index`` (junction) or ``up``,
``down`` (plain), plus ``bias`` when present. ``LatentLinear(in, out, rank, junction, bias)`` builds an
empty module of the right shapes so a loader can rebuild it and call ``load_state_dict``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..linalg.junction import assemble_down, junction_factor
from ..linalg.svd import bias_compensation, check_rank, weighted_low_rank

__all__ = ["FACTOR_FORMS", "LatentLinear", "factor_form", "with_form"]

# How a rank-r matrix can be executed (issue: realized speed): the same function, different costs.
#   dense:    y = x Wᵀ + b, W = up·down [d', d]         (nn.Linear; d·d' weights, one matmul)
#   plain:    y = (x downᵀ) upᵀ + b                     (r(d + d') weights, two matmuls)
#   junction: y = (x[piv] + x[rest] mixᵀ) upᵀ + b       (r(d + d') − r² weights, two matmuls)
FACTOR_FORMS = ("dense", "plain", "junction")


class LatentLinear(nn.Module):
    """Low-rank linear layer y = up · (down x) + b, with down = [I | mix] permuted in junction form."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        junction: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_rank(rank, out_features, in_features)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.rank = int(rank)
        self.junction = bool(junction)
        factory = {"dtype": dtype, "device": device}
        # Zeros, not random: an empty module is meant to be filled by from_* or load_state_dict.
        if self.junction:
            self.register_buffer("pivot_index", torch.arange(rank, dtype=torch.long, device=device))
            self.register_buffer(
                "rest_index", torch.arange(rank, in_features, dtype=torch.long, device=device)
            )
            self.mix = nn.Parameter(torch.zeros(rank, in_features - rank, **factory))
        else:
            self.down = nn.Parameter(torch.zeros(rank, in_features, **factory))
        self.up = nn.Parameter(torch.zeros(out_features, rank, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._pivots_lead: bool | None = None  # cached pivots_lead(); None = not yet checked
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_layout())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_factors(
        cls,
        B: torch.Tensor,
        A: torch.Tensor,
        bias: torch.Tensor | None = None,
        junction: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        max_condition: float | None = 1e8,
    ) -> "LatentLinear":
        """Module computing x ↦ B (A x) + bias for B [d', r], A [r, d].

        The junction transform is done in float64 before casting to ``dtype`` (default: B's dtype).
        """
        if B.ndim != 2 or A.ndim != 2 or B.shape[1] != A.shape[0]:
            raise ValueError(f"B [d', r] and A [r, d] must share r, got {tuple(B.shape)} and {tuple(A.shape)}")
        out_features, rank = B.shape
        in_features = A.shape[1]
        dtype = dtype if dtype is not None else B.dtype
        device = device if device is not None else B.device
        module = cls(
            in_features, out_features, rank, junction=junction, bias=bias is not None, dtype=dtype, device=device
        )
        with torch.no_grad():
            if junction:
                factors = junction_factor(B, A, max_condition=max_condition)
                module.up.copy_(factors.up)
                module.mix.copy_(factors.mix)
                module.pivot_index.copy_(factors.pivot_index)
                module.rest_index.copy_(factors.rest_index)
                module.refresh_layout()
            else:
                module.up.copy_(B)
                module.down.copy_(A)
            if bias is not None:
                if tuple(bias.shape) != (out_features,):
                    raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
                module.bias.copy_(bias)
        return module

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        second_moment: torch.Tensor | None,
        rank: int,
        preconditioner: str = "rootcov",
        junction: bool = True,
        mean: torch.Tensor | None = None,
        damping: float = 1e-2,
        max_condition: float | None = 1e8,
        name: str = "linear",
    ) -> "LatentLinear":
        """Compress ``linear`` (W [d', d], b) with the activation-aware SVD of rank ``rank``.

        ``second_moment`` is the uncentered C = E[x xᵀ] [d, d]. If ``mean`` μ [d] is given, the factors
        are fitted on the centered C0 = C − μ μᵀ and the bias becomes b̂ = b + (W − BA) μ (a bias is
        added even when ``linear`` had none). Result has ``linear``'s dtype and device. ``name`` (the
        layer's path) labels errors about NaN/Inf statistics.
        """
        weight = linear.weight.detach()
        moment = second_moment
        if mean is not None and second_moment is not None:
            mu = mean.detach().to(device=second_moment.device, dtype=torch.float64)
            moment = second_moment.to(torch.float64) - torch.outer(mu, mu)
        B, A = weighted_low_rank(weight, moment, rank, preconditioner=preconditioner, damping=damping, name=name)
        original_bias = linear.bias.detach() if linear.bias is not None else None
        if mean is not None:
            new_bias = bias_compensation(weight, B, A, original_bias, mean)
        else:
            new_bias = original_bias
        return cls.from_factors(
            B,
            A,
            bias=new_bias,
            junction=junction,
            dtype=weight.dtype,
            device=weight.device,
            max_condition=max_condition,
        )

    # ------------------------------------------------------------------ execution
    def refresh_layout(self) -> None:
        """Forget the cached :meth:`pivots_lead` (call after changing the index buffers in place)."""
        self._pivots_lead = None

    def pivots_lead(self) -> bool:
        """True when pivot_index = 0..r−1 and rest_index = r..d−1 (junction form only).

        Then x splits into two slices x[..., :r], x[..., r:] (views) instead of two gathers, and
        z = x[..., :r] + x[..., r:] mixᵀ is one addmm. ``adapters.mlp_permutation`` arranges this for
        the MLP's down projection by permuting the intermediate channels (an exact reparametrisation).
        """
        if not self.junction:
            return False
        if self._pivots_lead is None:
            rank = self.rank
            self._pivots_lead = bool(
                torch.equal(self.pivot_index.cpu(), torch.arange(rank))
                and torch.equal(self.rest_index.cpu(), torch.arange(rank, self.in_features))
            )
        return self._pivots_lead

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """z = down x  [..., r] (the compressed representation of x [..., d])."""
        if self.junction:
            if self.pivots_lead():
                flat = x.reshape(-1, self.in_features)  # a view for contiguous x
                head, rest = flat[:, : self.rank], flat[:, self.rank :]
                if type(self.mix) is nn.Parameter:
                    z = torch.addmm(head, rest, self.mix.T)
                else:  # a tensor subclass (modules.quantize: int8) computes its own F.linear
                    z = head + F.linear(rest, self.mix)
                return z.reshape(*x.shape[:-1], self.rank)
            return self.latent_gathered(x)
        return F.linear(x, self.down)

    def latent_gathered(self, x: torch.Tensor) -> torch.Tensor:
        """z = x[piv] + mix · x[rest] with explicit gathers: any pivot set (and the reference of the slice path)."""
        pivot_part = x.index_select(-1, self.pivot_index)  # [..., r]
        rest_part = x.index_select(-1, self.rest_index)  # [..., d − r]
        return pivot_part + F.linear(rest_part, self.mix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.latent(x), self.up, self.bias)

    def down_weight(self) -> torch.Tensor:
        """The input factor [r, d] (the explicit [I | mix] permuted in junction form)."""
        if self.junction:
            return assemble_down(self.mix, self.pivot_index, self.rest_index)
        return self.down

    def dense_weight(self) -> torch.Tensor:
        """Equivalent dense W = up · down  [d', d] in the parameters' dtype."""
        return self.up @ self.down_weight()

    def num_weight_params(self) -> int:
        """Stored weights (bias excluded): r(d + d') − r² (junction) or r(d + d') (plain)."""
        size = self.rank * (self.in_features + self.out_features)
        return size - self.rank * self.rank if self.junction else size

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"junction={self.junction}, bias={self.bias is not None}"
        )


def factor_form(module: nn.Module) -> str:
    """``"dense"`` (nn.Linear), ``"plain"`` or ``"junction"`` (LatentLinear)."""
    if isinstance(module, LatentLinear):
        return "junction" if module.junction else "plain"
    if isinstance(module, nn.Linear):
        return "dense"
    raise TypeError(f"{type(module).__name__} is neither an nn.Linear nor a LatentLinear")


def with_form(module: nn.Module, form: str, max_condition: float | None = 1e8) -> nn.Module:
    """The same map x ↦ W x + b as ``module`` (nn.Linear or LatentLinear) executed in ``form`` (``FACTOR_FORMS``).

    The factors are transformed in float64 and cast back to the module's dtype; ``module`` itself is
    returned when it already has that form. A dense matrix becomes factored at its numerical rank
    (SVD, exact up to rounding; to lower the rank, compress it). A saved model keeps the form: a dense matrix is an
    ``nn.Linear`` at its path, a factored one a ``LatentLinear`` with its ``junction`` flag.
    """
    if form not in FACTOR_FORMS:
        raise ValueError(f"unknown factor form {form!r}; choose from {', '.join(FACTOR_FORMS)}")
    if factor_form(module) == form:
        return module
    bias = None if module.bias is None else module.bias.detach()
    if isinstance(module, LatentLinear):
        up = module.up.detach().to(torch.float64)
        down = module.down_weight().detach().to(torch.float64)
        dtype, device = module.up.dtype, module.up.device
    else:
        weight = module.weight.detach().to(torch.float64)
        dtype, device = module.weight.dtype, module.weight.device
        rank = int(torch.linalg.matrix_rank(weight))  # W = U_r S_r V_rᵀ exactly at its numerical rank
        left, values, right = torch.linalg.svd(weight, full_matrices=False)
        up, down = left[:, :rank] * values[:rank], right[:rank]
    if form == "dense":
        linear = nn.Linear(down.shape[1], up.shape[0], bias=bias is not None, dtype=dtype, device=device)
        with torch.no_grad():
            linear.weight.copy_(up @ down)
            if bias is not None:
                linear.bias.copy_(bias)
        return linear
    return LatentLinear.from_factors(up, down, bias=bias, junction=form == "junction", dtype=dtype, device=device,
                                     max_condition=max_condition)
