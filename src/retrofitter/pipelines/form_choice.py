"""Which factor form each compressed matrix runs in (``LocalSVDOptions.factor_forms``, ``budget``: ``config.options``).

``factor_forms="junction"`` (default): every factored matrix in the configured form (``--junction``:
junction, ``--no-junction``: plain), as before. ``"fastest"``: after each layer is fitted, every
``LatentLinear`` is re-expressed (``modules.latent_linear.with_form``, exact) in the fastest *allowed*
form at its rank by the cost model (eval/cost_model.py) timed on this machine:

* ``budget="params"``: only forms storing no more parameters than the plan priced (junction ≤ plain),
  so ``--junction`` keeps the junction and ``--no-junction`` chooses between plain and junction;
* ``budget="latency"``: plain or junction (the planner priced time, not parameters); the planner
  (pipelines/latency_allocation.py) has already left dense the matrices that would run no faster
  factored — they are never fitted and keep their original weights.

A junction whose pivots lead (the MLP's down projection after ``adapters.mlp_permutation``) is timed
as two slices, every other junction with its gathers. Report entries get ``form`` and
``modelled_s`` (seconds of ``latency_tokens`` tokens); a matrix kept dense gets an entry with ``rank``
None and its dense parameters, so the parameter totals stay those of the model's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..eval.cost_model import FormCostModel
from ..eval.form_cost import measure_timings, shape_requests
from ..modules.latent_linear import LatentLinear, factor_form, with_form

__all__ = ["FormChoice", "form_choice_for", "needs_form_choice", "forms_summary"]


def needs_form_choice(config) -> bool:
    """True when the run needs the cost model (``--factor-forms fastest`` or ``--budget latency``)."""
    return config.options.factor_forms == "fastest" or config.options.budget == "latency"


@dataclass
class FormChoice:
    """The cost model and the rules of the form choice (module docstring)."""

    cost_model: FormCostModel
    configured_form: str  # "junction" or "plain": the form of --junction / --no-junction
    factored_forms: tuple[str, ...]  # forms a fitted matrix may take
    lead_names: frozenset = frozenset()  # projections whose junction pivots lead (MLP down)

    @classmethod
    def from_config(cls, config, cost_model: FormCostModel, lead_names=()) -> "FormChoice":
        configured = "junction" if config.junction else "plain"
        if config.options.factor_forms == "junction":
            forms = (configured,)
        elif config.options.budget == "latency" or configured == "plain":
            forms = ("junction", "plain")  # junction first: it stores fewer parameters, so it wins ties
        else:
            forms = ("junction",)  # plain would store r² more parameters than the plan priced
        return cls(cost_model, configured, forms, frozenset(lead_names))

    def pivots_lead(self, name: str) -> bool:
        return name in self.lead_names

    def best_factored(self, name: str, d_in: int, d_out: int, rank: int) -> tuple[str, float]:
        """(form, modelled seconds) of the fastest allowed factored form of projection ``name`` at ``rank``."""
        return self.cost_model.fastest(d_in, d_out, rank, self.factored_forms, self.pivots_lead(name))

    def dense_seconds(self, d_in: int, d_out: int) -> float:
        return self.cost_model.seconds(d_in, d_out, "dense")

    def configured_seconds(self, name: str, d_in: int, d_out: int, rank: int) -> float:
        return self.cost_model.seconds(d_in, d_out, self.configured_form, rank, self.pivots_lead(name))

    @torch.no_grad()
    def apply(self, context) -> None:
        """Re-form the layer's fitted matrices; report entries for the matrices the plan kept dense."""
        for name in context.targets:
            module, key = context.linear(name), (context.index, name)
            if isinstance(module, LatentLinear):
                form, seconds = self.best_factored(name, module.in_features, module.out_features, module.rank)
                if form != factor_form(module):
                    try:
                        module = with_form(module, form)
                    except ValueError:  # an ill-conditioned junction (linalg/junction.py): keep the fitted form
                        form = factor_form(module)
                        seconds = self.cost_model.seconds(module.in_features, module.out_features, form, module.rank,
                                                          self.pivots_lead(name))
                entry = {**context.entries[name], "form": form, "modelled_s": seconds,
                         "params_after": module.num_weight_params()}
                context.replace(name, module, entry)
            elif isinstance(module, nn.Linear) and key not in context.plan:
                count = module.weight.numel()
                context.entries[name] = {"rank": None, "in": module.in_features, "out": module.out_features,
                                         "params_before": count, "params_after": count, "proxy_error": 0.0,
                                         "form": "dense", "modelled_s": self.dense_seconds(module.in_features,
                                                                                           module.out_features)}


def form_choice_for(model: nn.Module, adapter, config, targets: list[str], progress: bool = True) -> FormChoice:
    """Time (or read from the cache) the forms of the targets' distinct shapes on the model's dtype and device."""
    _, consumer = adapter.mlp_intermediate()
    leads = {consumer} & set(targets)
    linears = [(name, adapter.get_linear(layer, name)) for layer in adapter.decoder_layers(model) for name in targets]
    shapes = {(name in leads, m.in_features, m.out_features) for name, m in linears}
    requests = shape_requests([s[1:] for s in shapes if not s[0]], [s[1:] for s in shapes if s[0]])
    weight = linears[0][1].weight
    cost_model = measure_timings(requests, config.options.latency_tokens, weight.dtype, weight.device, progress=progress)
    return FormChoice.from_config(config, cost_model, leads)


def forms_summary(layer_reports: list[dict], forms: FormChoice) -> dict:
    """Counts of each form and the modelled time of the targets, all dense and as compressed."""
    counts: dict = {}
    dense_s = after_s = 0.0
    for report in layer_reports:
        for entry in report["matrices"].values():
            counts[entry.get("form", "?")] = counts.get(entry.get("form", "?"), 0) + 1
            dense_s += forms.dense_seconds(entry["in"], entry["out"])
            after_s += entry.get("modelled_s", 0.0)
    return {"factored_forms": list(forms.factored_forms), "counts": counts, "tokens": forms.cost_model.tokens,
            "modelled_targets_s_dense": dense_s, "modelled_targets_s_after": after_s}
