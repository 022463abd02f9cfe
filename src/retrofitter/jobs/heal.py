"""``retrofitter heal`` (and ``compress --heal-tokens``): distil the original into a saved conversion.

The stages (``heal_stages``): evaluate the original and the conversion on the same blocks, heal, and with
``control`` give the original the same distillation; ``add_heal_sections`` puts them in the record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..api import evaluate_record, evaluation_blocks, heal, load_model
from ..checkpoint import RETROFITTER_JSON, conversion_metadata, is_retrofitted_dir
from ..config import HealConfig
from ..data.blocks import token_blocks
from ..data.corpora import check_corpus, load_text
from ..eval.accounting import Accounting, account
from ..eval.record import ResultsRecord
from ..preflight import check_teacher, checked_original, eval_lengths, heal_dir
from .scaffold import NO_EVAL, OutputJob, load_checked

__all__ = ["heal_job", "HealStages", "heal_stages", "add_heal_sections"]


def heal_job(model_dir, out, config: HealConfig, eval_config=NO_EVAL, *, teacher: str | None = None,
             train_corpus: str = "wiki-calib", control: bool = False, overwrite: bool = False, dtype="float32",
             device="cpu", progress: bool = True) -> dict:
    """Heal the saved conversion ``model_dir`` by distillation from its original (``teacher``, default: the
    ``source_model`` it was made from) on ``train_corpus``; save to ``out``; the results record with ``before``
    (the conversion), ``original`` and, with ``control``, the original given the same distillation (≈ 1.0x).
    Resumable through ``.OUT.heal`` beside ``out`` (removed once ``out`` is in place). Under ``torchrun`` rank 0
    writes ``out``; the other processes return their rank and heal metadata."""
    out = Path(out)
    if not is_retrofitted_dir(model_dir):
        raise ValueError(f"{model_dir} is not a saved retrofitter model (no {RETROFITTER_JSON}); heal takes the output "
                         f"of compress or linearize")
    given = teacher is not None
    teacher = teacher or checked_original(model_dir)
    check_teacher(model_dir, teacher, f"--teacher {teacher}" if given else f"the source_model {teacher}")
    check_corpus(train_corpus, "--train-corpus")
    job = OutputJob.start(out, overwrite, eval_config,
                          {"MODEL": model_dir, "--teacher": teacher, "--train-corpus": train_corpus},
                          {"the healing directory": heal_dir(out)}, device=device)
    with job.writing():
        info = conversion_metadata(model_dir)
        model, tokenizer = load_checked(model_dir, {"--seq-len": config.seq_len, **eval_lengths(eval_config)},
                                        dtype=dtype, device=device)
        method = info.get("method", "retrofitted")
        healing = heal_stages(model, tokenizer, teacher, config, eval_config, train_corpus, out, progress, dtype,
                              device, name=str(model_dir), method=method, ratio=info.get("ratio"), control=control)
        if not job.writes:
            return job.rank_report(heal=healing.metadata)
        job.save(healing.model, tokenizer, {**info, "heal": healing.metadata}, overwrite)
        record = evaluate_record(healing.model, tokenizer, eval_config, progress=progress, blocks=healing.eval_blocks,
                                 name=str(model_dir), method=f"{method}+heal", ratio=info.get("ratio"),
                                 baseline=healing.baseline)
        record.add_settings(heal_config=config.to_dict(), teacher=teacher, train_corpus=train_corpus)
        add_heal_sections(record, healing)
        return job.results(record)


@dataclass
class HealStages:
    """What ``heal_stages`` measured and made: the healed ``model``, the evaluation blocks
    and baseline shared by every stage, the records of the stages and the heal report."""

    model: object
    eval_blocks: dict
    baseline: Accounting
    original: ResultsRecord
    before: ResultsRecord
    report: dict
    metadata: dict  # what retrofitter.json keeps of the healing
    control: ResultsRecord | None = None


def heal_stages(model, tokenizer, teacher_name, config: HealConfig, eval_config, train_corpus, out: Path, progress,
                dtype, device, *, name, method, ratio, control: bool = False) -> HealStages:
    """Evaluate the original and the conversion, heal (work dir ``.OUT.heal``), and the control when asked."""
    teacher, _ = load_model(teacher_name, dtype=dtype, device=device)
    eval_blocks = {c: evaluation_blocks(tokenizer, c, eval_config.seq_len, eval_config.max_eval_tokens)
                   for c in eval_config.corpora}
    baseline = account(teacher)
    original = evaluate_record(teacher, tokenizer, eval_config, progress=progress, blocks=eval_blocks,
                               name=teacher_name)
    before = evaluate_record(model, tokenizer, eval_config, progress=progress, blocks=eval_blocks, name=name,
                             method=method, ratio=ratio, baseline=baseline)
    max_tokens = config.tokens if config.tokens and not config.minutes else None  # a time budget may loop the text
    blocks = token_blocks(tokenizer, load_text(train_corpus), config.seq_len,
                          max_tokens=max(max_tokens, config.seq_len) if max_tokens else None)
    work_dir = heal_dir(out)
    model, report = heal(model, teacher, blocks, config, progress=progress, work_dir=work_dir)
    stages = HealStages(model, eval_blocks, baseline, original, before, report,
                        metadata={"teacher": teacher_name, "train_corpus": train_corpus, "config": config.to_dict(),
                                  "steps": report["steps"], "tokens": report["tokens"], "seconds": report["seconds"]})
    if control and report["steps"]:
        # The original given the same distillation (the tokens the heal used, no time budget): ≈ 1.0x by construction.
        student, _ = load_model(teacher_name, dtype=dtype, device=device)
        same = dataclasses.replace(config, tokens=report["tokens"], minutes=0.0)
        student, control_report = heal(student, teacher, blocks, same, progress=progress)
        stages.control = evaluate_record(student, tokenizer, eval_config, progress=progress, blocks=eval_blocks,
                                         name=teacher_name, method="original+heal")
        stages.control.add_sections(heal={k: v for k, v in control_report.items() if k != "loss_history"})
    return stages


def add_heal_sections(record: ResultsRecord, healing: HealStages) -> None:
    """``original``, ``before``, ``control`` records, the heal report and ``ppl_over_original`` per stage."""
    record.add_sections(original=healing.original, before=healing.before, heal=healing.report)
    stages = {"before": healing.before, "after": record}
    if healing.control is not None:
        record.add_sections(control=healing.control)
        stages["control"] = healing.control
    reference = healing.original.ppl
    record.add_sections(ppl_over_original={stage: {c: stage_record.ppl[c] / reference[c] for c in reference}
                                           for stage, stage_record in stages.items()})
