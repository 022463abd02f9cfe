"""Optional downstream tasks through EleutherAI's lm-evaluation-harness (extra ``lm-eval``).

The already-loaded model (original, compressed or linearized; replacement modules included) is
wrapped as-is in lm-eval's ``HFLM`` — nothing is reloaded from disk, so what is scored is exactly
the model in memory. A task is a registered lm-eval task name, or the path of a task YAML file
(its directory is added to lm-eval's include path, its ``task:`` field is the name), which is how
local tasks on local data (``dataset_path: json`` + ``dataset_kwargs.data_files``) run offline.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import nn

__all__ = ["run_lm_eval", "lm_eval_available", "LmEvalMissingError"]


class LmEvalMissingError(ImportError):
    """lm-eval is not installed."""


def lm_eval_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise LmEvalMissingError(
            "downstream tasks need lm-eval: pip install 'retrofitter[lm-eval]' (or pip install lm-eval)") from error
    return lm_eval, HFLM, TaskManager


def _resolve_tasks(tasks: list[str], include_path) -> tuple[list[str], list[str], bool]:
    """(task names, include directories, whether every task is a local YAML file).

    A ``.yaml``/``.yml`` path contributes its directory and its ``task:`` name.
    """
    import yaml

    names, include = [], [str(p) for p in ([] if include_path is None else
                                            [include_path] if isinstance(include_path, (str, Path)) else include_path)]
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise FileNotFoundError(f"lm-eval task file {task!r} does not exist")
            spec = yaml.safe_load(path.read_text())
            if not isinstance(spec, dict) or "task" not in spec:
                raise ValueError(f"lm-eval task file {task!r} has no 'task:' name")
            names.append(str(spec["task"]))
            include.append(str(path.resolve().parent))
        else:
            names.append(task)
    all_local = all(Path(task).suffix in (".yaml", ".yml") for task in tasks)
    return names, sorted(set(include)), all_local


def _clean_metrics(metrics: dict) -> dict:
    """``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}`` -> ``{"acc": 0.5, "acc_stderr": 0.1}``.

    NaN/inf (lm-eval writes ``"N/A"`` or NaN for undefined stderr) become ``None`` so the JSON stays valid.
    """
    cleaned = {}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name, _, filter_name = key.partition(",")
        name = name if filter_name in ("", "none") else f"{name},{filter_name}"
        cleaned[name] = float(value) if math.isfinite(value) else None
    return cleaned


def run_lm_eval(model: nn.Module, tokenizer, tasks: list[str], limit: int | float | None = None,
                batch_size: int = 1, num_fewshot: int | None = None, include_path=None,
                max_length: int | None = None) -> dict:
    """Score ``model`` on lm-eval ``tasks``; returns ``{"tasks": {name: {metric: value}}, "settings": {...}}``.

    ``limit`` caps examples per task (an int, or a fraction < 1). ``include_path``: extra directories
    of task YAMLs. ``max_length`` defaults to the model's ``max_position_embeddings`` (lm-eval's own
    fallback is 2048, which would overflow short-context models).
    """
    if not tasks:
        raise ValueError("run_lm_eval needs at least one task name or task YAML path")
    lm_eval, HFLM, TaskManager = _import_lm_eval()
    names, include, all_local = _resolve_tasks(list(tasks), include_path)
    device = next(model.parameters()).device
    if max_length is None:
        max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device),
                   max_length=max_length)
    # Indexing lm-eval's thousands of built-in task YAMLs takes tens of seconds: skip it when not needed.
    manager = TaskManager(include_path=include or None, include_defaults=not all_local)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; give a registered task name or a task YAML path")
    output = lm_eval.simple_evaluate(model=wrapped, tasks=names, limit=limit, num_fewshot=num_fewshot,
                                     batch_size=batch_size, task_manager=manager, log_samples=False,
                                     bootstrap_iters=0)
    return {
        "tasks": {name: _clean_metrics(metrics) for name, metrics in output["results"].items()},
        "n_samples": {name: counts.get("effective") for name, counts in output.get("n-samples", {}).items()},
        "settings": {"tasks": list(tasks), "limit": limit, "batch_size": batch_size, "num_fewshot": num_fewshot,
                     "max_length": max_length, "lm_eval": getattr(lm_eval, "__version__", None)},
    }
