"""LatentLLM (design.md §3): the per-layer strategy with joint decompositions, run by pipelines/sequential.py.

Per decoder layer l (statistics from the already compressed layers < l, or from the original model
with ``statistics="teacher"``), each part switchable in ``LatentLLMOptions`` (config/methods.py) for ablations:

 1. pass over the stream → C = E[x xᵀ] of the attention input x;
    q/k: joint QK (``joint_qk``): Tucker-2 of the whitened per-head score maps (JointQKSolver), shared
         input factors A_q, A_k (junction) and per-head decompressions B_q, B_k; else local rootcov;
    v/o: joint VO (``joint_vo``; A_v, B_v, B_o, A_o from C alone) or local rootcov (o on the moments of its
         own input, re-collected with the compressed q/k/v: pass 2);
 2. pass → C of the MLP input (with the compressed attention): gate/up (fc1) local rootcov;
 3. down (fc2): ``joint_mlp`` streaming variant — a pass collecting E[h ĥᵀ], E[ĥ ĥᵀ] with h the original
    and ĥ the compressed intermediate, then W* = W_d E[hĥᵀ]E[ĥĥᵀ]⁻¹ compressed with rootcov on E[ĥĥᵀ]
    (``down_fit``: ``anchored`` damps towards W_d, ``ridge`` towards zero, linalg/joint_mlp.py; ``select``
    fits the anchored map and local rootcov on one half of the calibration batches, scores each by
    E‖W_d h − Ŵ ĥ‖² on the other half and back, and refits the winner on all, in case the regression
    overfits the calibration tokens; measured on SmolLM2-135M it does not beat ``anchored``, docs/results.md §2);
    (``mlp_algorithm="auxiliary"``: the joint auxiliary-variable algorithm on a token subsample instead);
    without ``joint_mlp``: local rootcov on E[ĥ ĥᵀ];

Statistics (``LayerContext.statistics``, pipelines/layer_statistics.py) come in one shape for every
``config.statistics``, so each fit has one code path: ``collect`` gives each input's statistics
(pipelines/input_statistics.py) with the metric C, the target map T and the bias compensation, and
``input_pairs`` the (x_t, x_c) pairs of the MLP input for the down fit. With statistics "compressed" or
"teacher", T = W, C = E[x xᵀ] and x_t = x_c. With teacher targets (``statistics="teacher_target"``, error
feedback as in linalg/teacher_target.py) every statistic pairs the compressed input x_c with the original
model's input x_t of the same token: local fits reproduce W x_t from x_c, the joint QK / VO solvers run on
the target maps T = W̃ = W + W(C_tc − C_cc)(damped C_cc)⁻¹ in the C_cc metric (o keeps W_o on its own
moments: its input is the attention mix), and the down fit uses the teacher's intermediate
h = act(W_g x_t) ⊙ (W_u x_t) against the compressed ĥ.

Biases (OPT, Qwen2 q/k/v): every fit uses centered statistics C0 = C − μμᵀ and the bias is compensated,
b̂ = b + W μ_t − BA μ_c (μ_t = μ_c = μ, the input mean, but with teacher targets; for down:
b̂ = b + W_d μ_h − Ŵ μ_ĥ). The joint QK/VO solvers have no bias terms: they run on the centered moments
and each projection's bias is compensated afterwards (exact for the mean, the solvers' objectives then
concern the fluctuations only). The auxiliary-variable MLP does not support biases and falls back to the
streaming variant (logged).

With several processes (pipelines/distributed.py) every statistic is totalled over them and each process
makes the same joint fits from the same moments (the loop then broadcasts rank 0's layer).

Ranks come from the loop's plan (pipelines/allocation.py: uniform, or global by default). With ``latent_attention`` the attention modules are finally swapped for
``LatentAttention`` (latent k/v cache, r_k + r_v numbers per token and layer).
"""


from __future__ import annotations

import logging
import torch
from torch import nn

from ..adapters.latent_attention import latent_cache_numbers_per_token, to_latent_attention
from ..config import CompressConfig
from ..linalg.joint_mlp import ACTIVATIONS, DownFitMoments, down_fit_error, fit_down_to_compressed, joint_gated_mlp, joint_mlp_relu
from ..linalg.joint_qk import JointQKSolver
from ..linalg.joint_vo import JointVOSolver
from ..linalg.moments import damped
from ..linalg.svd import proxy_error, rootcov_svd
from ..modules.latent_linear import LatentLinear
from .input_statistics import InputMoments, PairedInputMoments
from .local_svd import entry, fit_local
from .sequential import LayerContext

__all__ = ["LatentLLMStrategy", "mlp_intermediate"]

log = logging.getLogger(__name__)


def mlp_intermediate(kind: str, activation, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """h from the MLP input projections' outputs: gated act(gate)⊙up, plain act(fc1)."""
    values = list(inputs.values())
    return activation(values[0]) * values[1] if kind == "gated" else activation(values[0])


def _from_factors(linear: nn.Module, B, A, statistics: InputMoments | PairedInputMoments,
                  config: CompressConfig) -> LatentLinear:
    """LatentLinear from float64 factors, its bias compensated for its input's ``statistics``."""
    return LatentLinear.from_factors(B, A, bias=statistics.compensated_bias(linear, B, A), junction=config.junction,
                                     dtype=linear.weight.dtype, device=linear.weight.device)


class LatentLLMStrategy:
    """Per-layer strategy of ``method="latentllm"`` (module docstring); ``finish`` swaps in the latent cache."""

    def __init__(self, config: CompressConfig):
        self.options = config.options  # LatentLLMOptions (config/methods.py)

    def fit_layer(self, context: LayerContext) -> None:
        layer = _LatentLLMLayer(context)
        layer.attention()
        layer.mlp()

    def finish(self, model: nn.Module, targets: list[str]) -> dict:
        if not (self.options.latent_attention and all(n in targets for n in ("k", "v"))):
            return {}
        to_latent_attention(model)
        return {"cache_numbers_per_token": latent_cache_numbers_per_token(model)}


class _LatentLLMLayer:
    """The parts of one layer's LatentLLM fit, in execution order."""

    def __init__(self, context: LayerContext):
        self.context = context
        self.adapter, self.layer, self.index = context.adapter, context.layer, context.index
        self.plan, self.config, self.targets = context.plan, context.config, context.targets
        self.options = context.config.options  # LatentLLMOptions (config/methods.py)
        self.layout = context.adapter.attention_layout(context.model)
        self.extra = context.extra

    # ---------------------------------------------------------------- helpers
    def linear(self, name: str) -> nn.Module:
        return self.context.linear(name)

    def moments(self, leader: str) -> InputMoments:
        """The second moments of ``leader``'s input in this layer (its own outputs are the target)."""
        return self.context.statistics.moments({leader: self.linear(leader)})[leader]

    def statistics(self, leader: str) -> InputMoments | PairedInputMoments:
        """The fit statistics of ``leader``'s input (module docstring): C, the target map T, the bias."""
        return self.context.statistics.collect({leader: self.linear(leader)})[leader]

    def local(self, name: str, statistics: InputMoments | PairedInputMoments) -> None:
        fit_local(self.context, name, statistics, method="local")

    def target(self, linear: nn.Module, statistics: InputMoments | PairedInputMoments, centered: bool) -> torch.Tensor:
        """The map the joint solvers approximate: W, or with teacher targets W̃ = W + W(C_tc − C_cc)C_cc⁻¹
        (``centered``: covariances, for layers with biases)."""
        return statistics.target(linear.weight, centered, self.config.damping)

    def replace(self, name: str, replacement: LatentLinear, moment: torch.Tensor, reference=None, **extra) -> None:
        linear = self.linear(name)
        reference = linear.weight if reference is None else reference
        error = proxy_error(reference, replacement.up.detach(), replacement.down_weight().detach(), moment)
        self.context.replace(name, replacement, entry(linear, replacement, error, **extra))

    # ---------------------------------------------------------------- parts
    def attention(self) -> None:
        wanted = [n for n in ("q", "k", "v") if n in self.targets]
        if not wanted and "o" not in self.targets:
            return
        statistics = self.statistics("q")
        qk_joint = self.options.joint_qk and "q" in wanted and "k" in wanted
        if qk_joint:
            self.joint_qk(statistics)
        vo_joint = self.options.joint_vo and "v" in wanted and "o" in self.targets
        if vo_joint:
            self.joint_vo(statistics)
        for name in wanted:
            if name not in self.context.entries:
                self.local(name, statistics)
        if "o" in self.targets and "o" not in self.context.entries:
            self.local("o", self.statistics("o"))

    def joint_qk(self, statistics) -> None:
        q, k, layout, config = self.linear("q"), self.linear("k"), self.layout, self.config
        has_bias = q.bias is not None or k.bias is not None
        moment = statistics.moment(has_bias)
        W_q, W_k = self.target(q, statistics, has_bias), self.target(k, statistics, has_bias)
        solver = JointQKSolver(W_q, W_k, moment, layout.n_heads, layout.n_kv_heads, layout.head_dim,
                               self.plan[(self.index, "q")], self.plan[(self.index, "k")],
                               iterations=self.options.qk_iterations, damping=config.damping, name=f"layer {self.index}")
        factors = solver.solve()
        score_error = solver.score_error(factors.A_q, factors.B_q, factors.A_k, factors.B_k)
        # The same score error of separate rootcov factors at the same ranks: what joint QK improves on.
        B_q_local, A_q_local = rootcov_svd(W_q, moment, self.plan[(self.index, "q")], config.damping)
        B_k_local, A_k_local = rootcov_svd(W_k, moment, self.plan[(self.index, "k")], config.damping)
        history = [float(v) for v in factors.objective_history]
        self.extra["qk_score_error"] = score_error
        self.extra["qk_score_error_local"] = solver.score_error(A_q_local, B_q_local, A_k_local, B_k_local)
        self.extra["qk_objective"] = history
        for name, linear, W, B, A in (("q", q, W_q, factors.B_q, factors.A_q), ("k", k, W_k, factors.B_k, factors.A_k)):
            self.replace(name, _from_factors(linear, B, A, statistics, config), moment, reference=W,
                         method="joint_qk", score_error=score_error)

    def joint_vo(self, statistics) -> None:
        v, o, layout, config = self.linear("v"), self.linear("o"), self.layout, self.config
        moment = statistics.moment(v.bias is not None)
        W_v = self.target(v, statistics, v.bias is not None)
        solver = JointVOSolver(W_v, o.weight, moment, layout.n_heads, layout.n_kv_heads, layout.head_dim,
                               self.plan[(self.index, "v")], self.plan[(self.index, "o")],
                               iterations=self.options.vo_iterations, damping=config.damping, name=f"layer {self.index}")
        factors = solver.solve()
        map_error = solver.map_error(factors.A_v, factors.B_v, factors.B_o, factors.A_o)
        self.extra["vo_map_error"] = map_error
        self.replace("v", _from_factors(v, factors.B_v, factors.A_v, statistics, config), moment,
                     reference=W_v, method="joint_vo", map_error=map_error)
        # o's input is the attention mix: its bias is compensated with the mix mean, measured after v is set.
        o_statistics = self.moments("o")
        o_moment = o_statistics.moment(o.bias is not None)
        self.replace("o", _from_factors(o, factors.B_o, factors.A_o, o_statistics, config), o_moment,
                     method="joint_vo", map_error=map_error)

    def mlp(self) -> None:
        inputs, (down_name,) = self.adapter.linear_groups[-2], self.adapter.linear_groups[-1]
        wanted = [n for n in inputs if n in self.targets]
        if wanted:
            if (self.options.joint_mlp and self.options.mlp_algorithm == "auxiliary" and down_name in self.targets
                    and len(wanted) == len(inputs) and self._auxiliary(inputs, down_name)):
                return
            statistics = self.statistics(inputs[0])
            for name in wanted:
                self.local(name, statistics)
        if down_name not in self.targets:
            return
        if self.options.joint_mlp:
            self.streaming_down(inputs, down_name)
        else:
            self.local(down_name, self.statistics(down_name))

    def streaming_down(self, inputs, down_name: str) -> None:
        """Down refitted to the compressed intermediate ĥ (``options.down_fit``, module docstring); with
        ``select`` the calibration batches alternate between two folds, each candidate is fitted on one fold
        and scored on the other, and the winner is refitted on both."""
        down = self.linear(down_name)
        originals = {n: self.context.statistics.originals[n] for n in inputs}
        compressed = {n: self.linear(n) for n in inputs}  # already replaced by their local fits
        activation = self.adapter.mlp_activation(self.layer)
        select = self.options.down_fit == "select"
        folds = [DownFitMoments(down.in_features, down.weight.device, keep_target=select)
                 for _ in range(2 if select else 1)]
        mlp_kind = self.adapter.mlp_kind

        def update(batch: int, x_t: torch.Tensor, x_c: torch.Tensor) -> None:
            """h = the original MLP's intermediate of x_t, ĥ = the compressed one's of x_c."""
            h = mlp_intermediate(mlp_kind, activation, {n: m(x_t) for n, m in originals.items()})
            h_hat = mlp_intermediate(mlp_kind, activation, {n: m(x_c) for n, m in compressed.items()})
            folds[batch % len(folds)].update(h, h_hat)

        # x_t: the original model's MLP input of the same token with teacher targets, else x_c itself
        with torch.no_grad():
            leader = {inputs[0]: compressed[inputs[0]]}
            for batch, (inputs_t, inputs_c) in enumerate(self.context.statistics.input_pairs(leader)):
                update(batch, inputs_t[inputs[0]], inputs_c[inputs[0]])
        for fold in folds:  # totals over the processes' calibration shares
            self.context.statistics.synchronize(*fold.accumulators())
        has_bias = down.bias is not None
        rank, damping = self.plan[(self.index, down_name)], self.config.damping
        fits = {"joint": lambda m: fit_down_to_compressed(down.weight, m.cross, m.hat, rank, damping,
                                                          anchored=self.options.down_fit != "ridge"),
                "local": lambda m: rootcov_svd(down.weight, m.hat, rank, damping)}
        extra = {}
        if select and min(fold.count for fold in folds) > 0:
            parts = [fold.moments(has_bias) for fold in folds]
            held_out = {name: sum(down_fit_error(down.weight, *fit(parts[i]), parts[1 - i].target, parts[1 - i].cross,
                                                 parts[1 - i].hat) for i in (0, 1)) / 2 for name, fit in fits.items()}
            chosen_fit = min(held_out, key=held_out.get)
            extra = {"held_out_error": held_out}
            folds[0].merge(folds[1])
        else:
            if select:
                log.info("layer %d: one calibration batch, no held-out half: joint down fit", self.index)
            chosen_fit = "joint"
        total = folds[0]
        total.hat_accumulator.check_finite(f"layer {self.index} compressed MLP intermediate")
        moments = total.moments(has_bias)
        B, A = fits[chosen_fit](moments)
        bias = None
        if has_bias:  # b̂ = b + W_d μ_h − Ŵ μ_ĥ
            weight = down.weight.detach().to(torch.float64)
            bias = down.bias.detach().to(weight) + weight @ moments.mean_h - B @ (A @ moments.mean_hat)
        replacement = LatentLinear.from_factors(B, A, bias=bias, junction=self.config.junction,
                                                dtype=down.weight.dtype, device=down.weight.device)
        # Proxy: E‖W_d h − Ŵ ĥ‖² / E‖W_d h‖² from the moments (h's own second moment is not kept: use Ŵ vs W*).
        target = torch.linalg.solve(damped(moments.hat, damping), moments.cross.T.to(moments.hat)).T
        error = proxy_error(down.weight.detach().to(torch.float64) @ target, B, A, moments.hat)
        method = "joint_mlp_streaming" if chosen_fit == "joint" else "local_by_held_out_error"
        self.context.replace(down_name, replacement, entry(down, replacement, error, method=method, **extra))

    def _auxiliary(self, inputs, down_name: str) -> bool:
        """Joint auxiliary-variable MLP on a token subsample; False (→ streaming) when unsupported."""
        modules = [self.linear(n) for n in (*inputs, down_name)]
        if self.context.parallel.active:
            raise ValueError("mlp_algorithm='auxiliary' fits on a token subsample of one process; with several "
                             "processes use the default --mlp-algorithm streaming")
        if any(m.bias is not None for m in modules):
            log.info("layer %d: auxiliary-variable MLP has no bias support; using the streaming variant", self.index)
            return False
        activation_name = _activation_name(self.adapter.mlp_activation(self.layer))
        if activation_name is None:
            return False
        rows: list[torch.Tensor] = []

        def hook(_module, args, _output):
            rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64))

        handle = modules[0].register_forward_hook(hook)
        try:
            self.context.statistics.run()
        finally:
            handle.remove()
        X = torch.cat(rows)
        generator = torch.Generator().manual_seed(self.index)
        keep = torch.randperm(X.shape[0], generator=generator)[: self.options.mlp_aux_tokens]
        X = X[keep.to(X.device)].T  # [d, l]
        ranks = [self.plan[(self.index, n)] for n in (*inputs, down_name)]
        weights = [m.weight for m in modules]
        if self.adapter.mlp_kind == "gated":
            result = joint_gated_mlp(*weights, X, *ranks, activation=activation_name,
                                     iterations=self.options.mlp_iterations, damping=self.config.damping)
        else:
            result = joint_mlp_relu(*weights, X, *ranks, iterations=self.options.mlp_iterations,
                                    damping=self.config.damping)
        roles = ("gate", "up", "down") if self.adapter.mlp_kind == "gated" else ("up", "down")
        for role, name, module in zip(roles, (*inputs, down_name), modules):
            B, A = result.factors[role]
            replacement = LatentLinear.from_factors(B, A, junction=self.config.junction, dtype=module.weight.dtype,
                                                    device=module.weight.device)
            error = float(result.output_errors[result.best_iteration])
            self.context.replace(name, replacement, entry(module, replacement, error, method="joint_mlp_auxiliary",
                                                          output_errors=result.output_errors))
        return True


def _activation_name(activation) -> str | None:
    """Name in joint_mlp.ACTIVATIONS of an HF activation module (by probing values)."""
    probe = torch.linspace(-3, 3, 13, dtype=torch.float64)
    for name, function in ACTIVATIONS.items():
        try:
            if torch.allclose(activation(probe), function(probe), atol=1e-6):
                return name
        except Exception:  # noqa: BLE001 — an exotic activation simply does not match
            continue
    return None


