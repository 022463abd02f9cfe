"""``retrofitter mla``: attention converted to Multi-head Latent Attention (resumable), saved and evaluated."""

from __future__ import annotations

import time
from pathlib import Path

from ..api import convert_to_mla, evaluate_record
from ..config import MLA_CALIB_SAMPLES, MLA_SEQ_LEN, EvalConfig
from ..data.corpora import check_corpus
from ..eval.accounting import account
from ..preflight import check_mla_memory, eval_lengths, partial_dir
from .compress import corpus_calibration_blocks
from .scaffold import NO_EVAL, OutputJob, load_checked

__all__ = ["mla_job"]


def mla_job(model_name: str, out, config, eval_config: EvalConfig = NO_EVAL, *, calib: str = "wiki-calib",
            calib_samples: int = MLA_CALIB_SAMPLES, seq_len: int = MLA_SEQ_LEN, overwrite: bool = False, dtype="float32",
            device="cpu", progress: bool = True) -> dict:
    """Convert ``model_name``'s attention to MLA (``config``: a ``pipelines.mla.MLAConfig``) on ``calib_samples``
    blocks of ``seq_len`` tokens of ``calib``, save to ``out``, evaluate; the results record. Every argument is
    checked before any work; one run at a time may write ``out``."""
    out = Path(out)
    if calib_samples < 1:
        raise ValueError(f"--calib-samples must be >= 1, got {calib_samples}")
    check_corpus(calib, "--calib")
    job = OutputJob.start(out, overwrite, eval_config, {"MODEL": model_name, "--calib": calib},
                          {"the resume directory": partial_dir(out)}, device=device).one_process("mla")
    with job.writing():
        start = time.perf_counter()
        model, tokenizer = load_checked(model_name, {"--seq-len": seq_len, **eval_lengths(eval_config)},
                                        dtype=dtype, device=device)
        before = account(model)
        calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
        check_mla_memory(config, model, calibration)
        # resumable layer by layer in OUT's partial directory, removed once OUT is saved
        model, report = convert_to_mla(model, config, calibration, progress=progress,
                                       checkpoint_dir=partial_dir(job.out), remove_checkpoint=False)
        metadata = {"method": "mla", "ratio": None, "source_model": model_name, "config": config.to_dict(),
                    "calibration": {"corpus": calib, "blocks": calibration.shape[0], "seq_len": seq_len},
                    "kv_rank": report["kv_rank"], "rope_dim": report["rope_dim"]}
        job.save(model, tokenizer, metadata, overwrite)
        record = evaluate_record(model, tokenizer, eval_config, progress=progress, name=model_name, method="mla",
                                 ratio=None, baseline=before)
        record.add_sections(mla={k: v for k, v in report.items() if k != "layers"}, layers=report["layers"])
        record.add_settings(calib=calib, calib_samples=calibration.shape[0], calib_seq_len=seq_len,
                            mla_config=config.to_dict())
        record.add_timings(total=time.perf_counter() - start, convert=report["timings_s"]["total"])
        return job.results(record)
