"""Distillation loss: KL(teacher ‖ student) of the next-token distributions, in position chunks.

For token blocks u [b, n], with the student's and the teacher's LM-head logits s, t [b, n, V] at
temperature τ:

    p = softmax(t / τ),   log q = log_softmax(s / τ)
    KL  = (1 / (b n)) Σ_{i, j} Σ_v p_v (log p_v − log q_v)                      (every position)
    NLL = (1 / (b (n − 1))) Σ_{i, j < n−1} −log softmax(s)[u_{j+1}]
    L   = (1 − λ) τ² KL + λ NLL,      λ = ``nll_weight``

With cached teacher top-k (``topk_logprobs``, ``topk_index`` [b, n, k]: the teacher's k largest
log-probabilities and their token ids) KL runs over those k tokens with the teacher renormalised on
them, p̃ = softmax(top-k log-probs / τ): KL_k = Σ_{v ∈ top-k} p̃_v (log p̃_v − log q_v).

:class:`DistillationLoss` never holds [n, V] logits: each chunk of ``chunk_tokens`` positions
computes the student's (and the teacher's) logits from the hidden states entering the LM head
inside a non-reentrant checkpoint, so backward recomputes them (the teacher's hidden states
[b, n, d] come from one no-grad pass). :func:`reference_distillation_loss` is the same loss from
full logits, the test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import adapter_for

__all__ = ["kl_divergence_sum", "topk_kl_divergence_sum", "reference_distillation_loss", "DistillationLoss",
           "teacher_topk"]


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def kl_divergence_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Σ over positions of KL(softmax(t/τ) ‖ softmax(s/τ)); logits [..., V]."""
    log_q = F.log_softmax(_float(student_logits) / temperature, dim=-1)
    log_p = F.log_softmax(_float(teacher_logits) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum()


def topk_kl_divergence_sum(student_logits: torch.Tensor, topk_logprobs: torch.Tensor, topk_index: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """Σ over positions of KL on the teacher's top-k tokens (teacher renormalised there); [..., V], [..., k]."""
    log_q = F.log_softmax(_float(student_logits) / temperature, dim=-1).gather(-1, topk_index)
    log_p = F.log_softmax(_float(topk_logprobs) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum()


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_float(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def reference_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, input_ids: torch.Tensor,
                                nll_weight: float = 0.0, temperature: float = 1.0) -> torch.Tensor:
    """The loss of the module docstring from full logits [b, n, V] (the reference of :class:`DistillationLoss`)."""
    kl = kl_divergence_sum(student_logits, teacher_logits, temperature) / input_ids.numel()
    loss = (1 - nll_weight) * temperature**2 * kl
    if nll_weight:
        nll = _nll_sum(student_logits[:, :-1], input_ids[:, 1:]) / input_ids[:, 1:].numel()
        loss = loss + nll_weight * nll
    return loss


def _causal_lm(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # a PEFT wrapper
    return get_base() if get_base is not None else model


@torch.no_grad()
def teacher_topk(teacher: nn.Module, input_ids: torch.Tensor, k: int, chunk_tokens: int = 256):
    """(log-probs [b, n, k] float32, token ids [b, n, k] long): the teacher's k most likely next tokens."""
    adapter = adapter_for(teacher)
    hidden = adapter.head_inputs(teacher, input_ids)
    values, indices = [], []
    for start in range(0, hidden.shape[1], chunk_tokens):
        logprobs = F.log_softmax(_float(adapter.head_logits(teacher, hidden[:, start:start + chunk_tokens])), dim=-1)
        top = logprobs.topk(k, dim=-1)
        values.append(top.values.float())
        indices.append(top.indices)
    return torch.cat(values, dim=1), torch.cat(indices, dim=1)


class DistillationLoss(nn.Module):
    """L of the module docstring for ``student`` against ``teacher`` (or cached teacher top-k).

    ``student`` is a submodule (DDP wrapping this module synchronises its trainable parameters); the
    teacher is held outside the module tree (frozen, never wrapped, never saved). ``teacher`` may be
    None when every call passes ``topk`` or when ``nll_weight`` = 1 (next-token loss alone).
    """

    def __init__(self, student: nn.Module, teacher: nn.Module | None = None, chunk_tokens: int = 256,
                 nll_weight: float = 0.0, temperature: float = 1.0):
        super().__init__()
        if not 0.0 <= nll_weight <= 1.0:
            raise ValueError(f"nll_weight must lie in [0, 1], got {nll_weight}")
        self.model = student
        self._teacher = (teacher,)  # a tuple: not registered as a submodule
        self.chunk_tokens = int(chunk_tokens)
        self.nll_weight = float(nll_weight)
        self.temperature = float(temperature)

    @property
    def teacher(self) -> nn.Module | None:
        return self._teacher[0]

    def forward(self, input_ids: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        lm = _causal_lm(self.model)
        adapter = adapter_for(lm)
        hidden = adapter.head_inputs(lm, input_ids)  # [b, n, d]
        use_kl = self.nll_weight < 1.0
        teacher_hidden = None
        if use_kl and topk is None:
            if self.teacher is None:
                raise ValueError("the KL loss needs a teacher model or cached teacher top-k")
            with torch.no_grad():
                teacher_hidden = adapter_for(self.teacher).head_inputs(self.teacher, input_ids)
        targets = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), -100)], dim=1)
        weights = ((1 - self.nll_weight) * self.temperature**2 / input_ids.numel(),
                   self.nll_weight / max(input_ids[:, 1:].numel(), 1))

        def chunk_loss(states, labels, teacher_states, top_values, top_index):
            logits = adapter.head_logits(lm, states)  # [b, c, V]
            total = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
            if use_kl:
                if top_values is not None:
                    kl = topk_kl_divergence_sum(logits, top_values, top_index, self.temperature)
                else:
                    with torch.no_grad():
                        teacher_logits = adapter_for(self.teacher).head_logits(self.teacher, teacher_states)
                    kl = kl_divergence_sum(logits, teacher_logits, self.temperature)
                total = total + weights[0] * kl
            if self.nll_weight:
                logits = _float(logits)
                total = total + weights[1] * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                             reduction="sum", ignore_index=-100)
            return total

        loss = None
        for start in range(0, input_ids.shape[1], self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            teacher_part = teacher_hidden[:, part] if teacher_hidden is not None else None
            top_values, top_index = (topk[0][:, part], topk[1][:, part]) if topk is not None else (None, None)
            value = checkpoint(chunk_loss, hidden[:, part], targets[:, part], teacher_part, top_values, top_index,
                               use_reentrant=False)
            loss = value if loss is None else loss + value
        return loss
