"""The CLI's jobs as functions: check → load → convert → save → evaluate, each returning the results record.

``retrofitter compress|mla|linearize|heal|recall|eval|export|sample`` map their flags onto these arguments and
print/write what they return; a script can call them the same way. What every job shares (the processes
of a ``torchrun`` launch, the output lock, the save, the work directories) is in ``scaffold``; the record
is ``eval.record.ResultsRecord``, built by ``api.evaluate_record``. One module per job.
"""

from __future__ import annotations

from ..preflight import original_model_of
from .compress import compress_job, corpus_calibration_blocks
from .evaluation import eval_job
from .export import export_job
from .heal import heal_job
from .linearize import linearize_job
from .mla import mla_job
from .recall import recall_job
from .sample import sample_job
from .scaffold import NO_EVAL, torchrun_rank

__all__ = ["compress_job", "mla_job", "export_job", "linearize_job", "eval_job", "heal_job", "recall_job", "sample_job",
           "original_model_of", "corpus_calibration_blocks", "torchrun_rank", "NO_EVAL"]
