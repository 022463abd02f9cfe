"""``retrofitter eval``: perplexity and accounting of any causal LM, with passkey retrieval and lm-eval tasks."""

from __future__ import annotations

from ..api import evaluate_record
from ..checkpoint import is_retrofitted_dir, read_retrofitter_json
from ..config import EvalConfig
from ..data.corpora import check_corpus
from ..preflight import eval_lengths
from .scaffold import load_checked

__all__ = ["eval_job"]


def eval_job(model_name: str, eval_config: EvalConfig, *, tasks=(), tasks_limit: float | None = None,
             passkey=(), passkey_trials: int = 2, passkey_depths=(0.1, 0.5, 0.9), passkey_keys: int = 1,
             dtype="float32", device="cpu", quantize: str | None = None, progress: bool = True) -> dict:
    """Perplexity and accounting of any causal LM (and lm-eval ``tasks``, passkey retrieval at the ``passkey``
    prompt lengths when given: ``passkey_trials`` random keys per length and depth; ``passkey_keys`` K > 1 adds
    the multi-key variant, K needles with one asked, as ``results["multikey"]``); the results record.

    ``quantize`` (a scheme of ``api.QUANTIZE_SCHEMES``) quantizes the model after loading."""
    for corpus in eval_config.corpora:
        check_corpus(corpus, "--ppl")
    if passkey_trials < 1:
        raise ValueError(f"--passkey-trials must be >= 1, got {passkey_trials}")
    if not 1 <= passkey_keys <= 8:
        raise ValueError(f"--passkey-keys must lie in 1..8, got {passkey_keys}")
    if any(not 0.0 <= d <= 1.0 for d in passkey_depths) or not passkey_depths:
        raise ValueError(f"--passkey-depths must be fractions in [0, 1], got {list(passkey_depths)}")
    if tasks:
        from ..eval.lm_eval_harness import lm_eval_available

        if not lm_eval_available():  # fail before the (slow) perplexity evaluation
            raise ValueError("--tasks needs lm-eval: pip install 'retrofitter[lm-eval]'")
    lengths = {**eval_lengths(eval_config, "--seq-len"), "--passkey": max(passkey, default=0)}
    model, tokenizer = load_checked(model_name, lengths, dtype=dtype, device=device, quantize=quantize)
    method, ratio = "original", None
    if is_retrofitted_dir(model_name):
        info = read_retrofitter_json(model_name)
        method, ratio = info.get("method", "retrofitted"), info.get("ratio")
    record = evaluate_record(model, tokenizer, eval_config, progress=progress, name=model_name, method=method,
                             ratio=ratio)
    if passkey:
        from ..eval.passkey import passkey_accuracy

        settings = dict(context_lengths=tuple(passkey), depths=tuple(passkey_depths), trials=passkey_trials,
                        progress=progress)
        record.add_sections(passkey=passkey_accuracy(model, tokenizer, **settings))
        if passkey_keys > 1:
            record.add_sections(multikey=passkey_accuracy(model, tokenizer, keys=passkey_keys, seed=1, **settings))
    if tasks:
        from ..eval.lm_eval_harness import run_lm_eval

        limit = tasks_limit if tasks_limit is None or tasks_limit < 1 else int(tasks_limit)
        record.add_sections(lm_eval=run_lm_eval(model, tokenizer, list(tasks), limit=limit))
    return record.to_dict()
