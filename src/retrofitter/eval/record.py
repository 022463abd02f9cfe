"""The results record: what ``api.evaluate_record`` measures of a model plus the sections the jobs add.

Every job (``retrofitter compress|mla|linearize|heal|recall|eval``) returns ``record.to_dict()`` on rank 0
and ``--json`` writes it (``demo`` writes one per row); eval/report.py, eval/table.py and the plots read those files. The record's
fields are every key such a file may hold, so a job adds only what this class names (``add_sections``
refuses any other name) and each figure keeps one spelling. A section a job did not add is ``ABSENT``:
left out of ``to_dict`` (``None`` is a value, written as JSON null).

Adding a section: one field below, in the group of the job that adds it, default ``ABSENT``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["ResultsRecord", "ABSENT", "Absent"]


class Absent:
    """The type of ``ABSENT``: a section or optional figure the record does not hold."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent()

# the fields api.evaluate_record fills; everything after them is a section a job adds
MEASURED = ("model", "method", "ratio", "ppl", "params", "bytes", "macs_per_token", "attention_macs_per_token",
            "kv_bytes_per_token", "state_bytes_per_sequence", "settings", "timings_s", "peak_rss_mb",
            "accounting_notes", "params_before", "reduction")


@dataclass(eq=False)
class ResultsRecord:
    """One model's results (design.md §5); ``to_dict()`` is the JSON the jobs write."""

    # --- measured for every model (api.evaluate_record) ---
    model: str
    method: str
    ratio: float | None
    ppl: dict[str, float]  # corpus -> perplexity ({} without evaluation corpora)
    params: dict[str, int]  # total, linear, embedding
    bytes: dict[str, int | None]  # stored, kv_per_token, state_per_sequence
    macs_per_token: int | None
    attention_macs_per_token: int | None
    kv_bytes_per_token: int | None
    state_bytes_per_sequence: int | None
    settings: dict[str, Any]  # evaluation settings; jobs add theirs (add_settings)
    timings_s: dict[str, Any]  # eval_<corpus> seconds; jobs add theirs (add_timings)
    peak_rss_mb: float
    accounting_notes: list[str] | Absent = ABSENT  # why a figure is None or only estimated
    params_before: dict[str, int] | Absent = ABSENT  # the model before conversion (a baseline was given)
    reduction: dict[str, float] | Absent = ABSENT  # 1 - params / params_before, linear and total

    # --- every job that writes a model ---
    out: str | Absent = ABSENT  # the output directory
    # --- compress ---
    processes: int | Absent = ABSENT  # torchrun processes of the calibration
    out_of_core: bool | Absent = ABSENT
    calibration: dict | None | Absent = ABSENT  # calibration diagnostics of the sequential pipeline
    compress_peak_rss_mb: float | Absent = ABSENT
    cost: dict | Absent = ABSENT  # memory and time of the compression against the fp32 model
    allocation: dict | Absent = ABSENT  # the rank plan's report
    layers: list | Absent = ABSENT  # per-layer reports (compress, mla)
    # --- mla ---
    mla: dict | Absent = ABSENT  # the conversion report without its layers
    # --- linearize ---
    linearize_peak_rss_mb: float | Absent = ABSENT
    ppl_original: dict[str, float] | Absent = ABSENT  # --eval-original
    transfer_mse: dict[str, Any] | Absent = ABSENT  # layer -> attention-transfer error
    lora: dict | Absent = ABSENT  # stage-2 report without its loss history
    # --- heal (heal, compress --heal-tokens) and linearize --eval-original ---
    original: ResultsRecord | Absent = ABSENT  # the original model's record
    before: ResultsRecord | Absent = ABSENT  # the conversion before healing
    control: ResultsRecord | Absent = ABSENT  # the original given the same distillation
    heal: dict | Absent = ABSENT  # the healing report
    ppl_over_original: dict[str, dict[str, float]] | Absent = ABSENT  # stage -> corpus -> ppl / original ppl
    # --- eval ---
    passkey: dict | Absent = ABSENT
    multikey: dict | Absent = ABSENT
    lm_eval: dict | Absent = ABSENT
    # --- recall ---
    recall: dict | Absent = ABSENT  # sinks, sparse cache, hybrid and kept-softmax layers
    recall_ranking: dict | Absent = ABSENT  # per-layer recall gains when layers were kept

    @classmethod
    def section_names(cls) -> tuple[str, ...]:
        """The sections a job may add (every field after the measured ones)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in MEASURED)

    def add_settings(self, **settings) -> None:
        """The job's settings beside the evaluation's; a setting already there is refused (one value per key)."""
        _add_new(self.settings, settings, "setting")

    def add_timings(self, **seconds) -> None:
        """The job's timings (seconds, or a breakdown dict) beside the evaluation's; a key already there is refused."""
        _add_new(self.timings_s, seconds, "timing")

    def add_sections(self, **sections) -> None:
        """Sections by name (``section_names``): a name the record does not have, or a section already added,
        is refused."""
        names = self.section_names()
        for name, value in sections.items():
            if name not in names:
                raise ValueError(f"the results record has no section {name!r}; add a field to "
                                 f"eval.record.ResultsRecord (sections: {', '.join(names)})")
            if getattr(self, name) is not ABSENT:
                raise ValueError(f"the results record already holds section {name!r}")
            if value is ABSENT:
                raise ValueError(f"section {name!r}: ABSENT is not a value")
        for name, value in sections.items():
            setattr(self, name, value)

    def to_dict(self) -> dict:
        """The record as the JSON the jobs write: every measured figure, the sections added (nested records
        as dicts), no absent ones."""
        record = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is ABSENT:
                continue
            if isinstance(value, ResultsRecord):
                value = value.to_dict()
            elif field.name in ("settings", "timings_s"):
                value = dict(value)
            record[field.name] = value
        return record


def _add_new(target: dict, entries: dict, what: str) -> None:
    clash = sorted(set(target) & set(entries))
    if clash:
        raise ValueError(f"the results record already holds {what} {', '.join(map(repr, clash))}")
    target.update(entries)
