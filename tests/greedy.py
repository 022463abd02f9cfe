"""Greedy decoding compared across two different computations of one model (a padded batch vs each prompt
alone, a latent vs a dense attention, a static vs a dynamic cache, a compiled vs an eager step).

Two different computations of the same logits agree only up to float rounding (other GEMM shapes and
reduction orders, other kernels), so nothing in the code makes their greedy tokens equal: at a step
whose two best logits are closer than that rounding either token may win, on one CPU and not on
another. ``assert_same_greedy`` states the argument that makes equal tokens a consequence instead of an
accident: if at every step the logits agree elementwise within ``atol + rtol · |reference|`` and the
reference's best logit leads its runner-up by more than twice that bound, both computations pick the
same token at that step, hence (by induction over the steps, each from the same prefix) the same
sequence. The margin check only fails for an input whose reference is a near-tie at some step (then
pick another seed: which of two tied tokens wins is not what these tests are about).
"""

from __future__ import annotations

import torch


def greedy_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: how far the best logit leads the second best."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def assert_same_greedy(tokens: torch.Tensor, logits: torch.Tensor, reference_tokens: torch.Tensor,
                       reference_logits: torch.Tensor, *, rtol: float, atol: float) -> None:
    """``tokens`` [b, n], chosen as the argmax of ``logits`` [b, n, V] step by step, equal the reference's.

    ``rtol``/``atol``: how far the two computations' logits may differ by float rounding (give the
    reasoning at the call). Checked in the order of the argument: the reference's margins, the logits,
    then the tokens (which the first two imply)."""
    bound = 2 * (atol + rtol * reference_logits.abs().amax(dim=-1))  # [b, n]
    margin = greedy_margin(reference_logits)
    tight = margin <= bound
    assert not tight.any(), (f"near-tie in the reference's logits at (row, step) {tight.nonzero().tolist()}: margins "
                             f"{margin[tight].tolist()} <= {bound[tight].tolist()}, the rounding allowed; pick another seed")
    torch.testing.assert_close(logits, reference_logits, rtol=rtol, atol=atol)
    assert torch.equal(tokens, reference_tokens)


def generated(out, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, n], logits [b, n, V]) of a ``generate(..., output_logits=True, return_dict_in_generate=True)``
    result (greedy, no logits processors: each token is the argmax of its raw logits)."""
    return out.sequences[:, prompt_length:], torch.stack(out.logits, dim=1)
