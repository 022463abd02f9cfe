"""What the benchmark scripts share: evaluation blocks, perplexities and the machine they ran on.

Benchmarks use the public API (``retrofitter.api``) and this module; they import no pipeline internals.
"""

from __future__ import annotations

from pathlib import Path

from retrofitter.api import evaluation_blocks
from retrofitter.eval.bench import machine_info
from retrofitter.eval.perplexity import perplexity

__all__ = ["eval_blocks", "perplexities", "machine_info", "output_path"]


def output_path(prefix: Path, extension: str) -> Path:
    """``prefix`` + ``extension`` (``runs/heal-lr2.5e-4`` -> ``runs/heal-lr2.5e-4.json``): unlike
    ``Path.with_suffix``, a dot inside the prefix (a learning rate, a ratio) is kept."""
    return prefix.with_name(prefix.name + extension)


def eval_blocks(tokenizer, corpora, seq_len: int, max_tokens: int | None) -> dict:
    """corpus -> token blocks [n, seq_len] (the same cut as ``retrofitter eval``)."""
    return {corpus: evaluation_blocks(tokenizer, corpus, seq_len, max_tokens) for corpus in corpora}


def perplexities(model, blocks: dict, batch_size: int = 4) -> dict:
    """corpus -> perplexity of ``model`` on the blocks of ``eval_blocks``."""
    return {name: perplexity(model, corpus_blocks, batch_size=batch_size, progress=False).ppl
            for name, corpus_blocks in blocks.items()}
