"""``retrofitter report``: gather results and bench JSONs from run directories into report.md + PNGs.

A file is a *bench* file when it has ``"kind": "bench"`` (written by :func:`bench_models`), a
*results* file when it has ``ppl`` and ``params`` (``eval`` / ``compress`` output, design.md §5);
anything else (``config.json``, ``retrofitter.json`` of saved models, ...) is listed as skipped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .bench import machine_info
from .engine_table import ENGINE_KINDS, engine_section
from .bench_table import format_bench_table
from .plots import PLOTS
from .table import format_results_table

__all__ = ["RunData", "collect_runs", "write_report", "format_cost_table", "format_heal_table", "format_passkey_table"]


@dataclass
class RunData:
    """Loaded JSONs: results dicts, bench dicts (each with ``_source`` = file stem) and skipped files."""

    results: list[dict] = field(default_factory=list)
    benches: list[dict] = field(default_factory=list)
    engines: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def _json_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(path.glob("*.json"))
    raise FileNotFoundError(f"run directory {str(path)!r} does not exist")


def collect_runs(paths) -> RunData:
    """Read every ``*.json`` directly inside each run dir (or a JSON file given itself)."""
    data = RunData()
    for path in map(Path, paths):
        for file in _json_files(path):
            try:
                content = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError) as error:
                data.skipped.append(f"{file}: unreadable ({error})")
                continue
            if isinstance(content, dict) and content.get("kind") == "bench":
                data.benches.append({**content, "_source": file.stem})
            elif isinstance(content, dict) and content.get("kind") in ENGINE_KINDS:
                data.engines.append({**content, "_source": file.stem})
            elif isinstance(content, dict) and "ppl" in content and "params" in content:
                data.results.append({**content, "_source": file.stem})
            else:
                data.skipped.append(f"{file}: neither a results, bench nor engines JSON")
                continue
            data.files.append(str(file))
    return data


def _sort_key(result: dict):
    ratio = result.get("ratio")
    return (str(result.get("model", "")), ratio is not None, str(result.get("method", "")), ratio or 0.0)


def _ratio_text(result: dict) -> str:
    return "-" if result.get("ratio") is None else f"{result['ratio']:g}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_cost_table(results: list[dict]) -> str:
    """Compression cost of every result that has one (``compress --measure-cost``), as Markdown."""
    header = ["model", "method", "ratio", "compress (s)", "calibration forward (s)", "compress / forward",
              "compress peak RSS (MiB)", "peak RSS / fp32 model", "above the import floor / fp32 model"]
    rows = []
    for r in results:
        cost, timings = r.get("cost"), r.get("timings_s", {})
        if not cost:
            continue
        ratio = cost.get("compress_over_calibration_forward")
        over_model = cost.get("peak_rss_over_fp32_model")
        above_floor = cost.get("peak_rss_above_floor_over_fp32_model")
        rows.append([str(r.get("model", "")), str(r.get("method", "")), _ratio_text(r),
                     _seconds(timings.get("compress")), _seconds(timings.get("calibration_forward")),
                     "-" if ratio is None else f"{ratio:.1f}×",
                     "-" if r.get("compress_peak_rss_mb") is None else f"{r['compress_peak_rss_mb']:.0f}",
                     "-" if over_model is None else f"{over_model:.2f}×",
                     "-" if above_floor is None else f"{above_floor:.2f}×"])
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def format_heal_table(results: list[dict]) -> str:
    """Markdown: perplexity of the original, the conversion before and after healing and the control (the
    original healed the same way), each also over the original's, for every results record of a heal."""
    rows = []
    for result in results:
        if "ppl_over_original" not in result:
            continue
        stages = {"original": result["original"], "before": result["before"], "after": result,
                  **({"control": result["control"]} if "control" in result else {})}
        for corpus, reference in result["original"]["ppl"].items():
            cells = [f"{stages[s]['ppl'][corpus]:.2f} ({stages[s]['ppl'][corpus] / reference:.3f}x)"
                     if s in stages else "-" for s in ("original", "before", "after", "control")]
            heal = result.get("heal", {})
            rows.append(f"| {result.get('method', '')} | {_ratio_text(result)} | {corpus} | " + " | ".join(cells)
                        + f" | {heal.get('tokens', '-')} | {_seconds(heal.get('seconds'))} |")
    if not rows:
        return ""
    header = ("| method | ratio | corpus | original | before heal | after heal | control | heal tokens | heal time |\n"
              "|---|---|---|---|---|---|---|---|---|")
    return "\n".join([header, *rows])


def format_passkey_table(results: list[dict], key: str = "passkey") -> str:
    """Markdown: passkey retrieval accuracy per prompt length (and per depth, in brackets), for every results
    record that has one; ``key="multikey"`` for the multi-key variant."""
    measured = [r for r in results if r.get(key)]
    contexts = sorted({int(n) for r in measured for n in r[key]["by_context"]})
    if not measured:
        return ""
    header = "| model | method | ratio | " + " | ".join(f"{n} tokens" for n in contexts) + " | trials per length |"
    rows = [header, "|" + "---|" * (len(contexts) + 4)]
    for r in measured:
        by_context, settings = r[key]["by_context"], r[key]["settings"]
        cells = []
        for n in contexts:
            if str(n) not in by_context:
                cells.append("-")
                continue
            depths = r[key].get("by_context_depth", {})
            detail = " / ".join(f"{depths[f'{n}@{d}']:.0%}" for d in settings["depths"] if f"{n}@{d}" in depths)
            cells.append(f"{by_context[str(n)]:.0%}" + (f" ({detail})" if len(settings["depths"]) > 1 and detail else ""))
        rows.append(f"| {r.get('model', '')} | {r.get('method', '')} | {_ratio_text(r)} | " + " | ".join(cells)
                    + f" | {len(settings['depths']) * settings['trials']} |")
    return "\n".join(rows)


def _lm_eval_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for task, metrics in r.get("lm_eval", {}).get("tasks", {}).items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if v is not None and not k.endswith("stderr"))
            rows.append(f"| {r.get('model', '')} | {r.get('method', '')} | {_ratio_text(r)} | {task} | {shown} |")
    if not rows:
        return ""
    return "\n".join(["| model | method | ratio | task | metrics |", "|---|---|---|---|---|", *rows])


def _machine_line(machine: dict) -> str:
    parts = [machine.get("cpu"), f"{machine.get('torch_threads')} torch threads",
             machine.get("accelerator"), f"torch {machine.get('torch')}", f"transformers {machine.get('transformers')}",
             machine.get("platform")]
    return "; ".join(str(p) for p in parts if p)


def _settings_lines(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        settings = {k: v for k, v in r.get("settings", {}).items() if k not in ("compress_config", "eval_tokens")}
        lines.append(f"- **{r.get('model', '')} / {r.get('method', '')} / {_ratio_text(r)}** "
                     f"(`{r['_source']}.json`): `{json.dumps(settings, sort_keys=True)}`")
        if r.get("settings", {}).get("compress_config"):
            lines.append(f"  - compress config: `{json.dumps(r['settings']['compress_config'], sort_keys=True)}`")
    return lines


def _bench_section(bench: dict) -> list[str]:
    settings, machine = bench.get("settings", {}), bench.get("machine", {})
    lines = [f"### `{bench['_source']}.json`", "",
             f"Measured {machine.get('date', '?')} on {_machine_line(machine)}.",
             f"Settings: prefill {settings.get('prefill_len')} tokens; contexts {settings.get('contexts')}; "
             f"{settings.get('decode_tokens')} decode tokens timed after the prefill; "
             f"{settings.get('repeats')} repeats after {settings.get('warmup')} warm-up, models interleaved; "
             f"batch 1; dtype {settings.get('dtype')}; memory: {settings.get('memory_measure')}.",
             "Ratios are value / value of the first model (decode ratio > 1 and latency ratio < 1 mean faster).", "",
             format_bench_table(bench, markdown=True), ""]
    return lines


def write_report(run_dirs, out=None, title: str = "retrofitter report") -> Path:
    """Write ``out/report.md`` and ``out/plots/*.png`` from the JSONs in ``run_dirs``; returns the report path.

    ``out`` defaults to the first run directory.
    """
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise ValueError("give at least one run directory")
    data = collect_runs(run_dirs)
    if not data.results and not data.benches and not data.engines:
        raise ValueError(f"no results, bench or engines JSON files found in {[str(p) for p in run_dirs]}")
    out = Path(out) if out is not None else (run_dirs[0] if run_dirs[0].is_dir() else run_dirs[0].parent)
    _drop_unrenderable(data)
    if not data.results and not data.benches and not data.engines:
        raise ValueError("no results, bench or engines JSON file could be read: " + "; ".join(data.skipped))
    with tempfile.TemporaryDirectory(prefix="retrofitter-report-") as staging:  # nothing in out until it all worked
        lines = _report_lines(data, Path(staging), run_dirs, title)
        (Path(staging) / "report.md").write_text("\n".join(lines))
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(Path(staging).rglob("*")):
            if file.is_file():
                target = out / file.relative_to(staging)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(file), str(target))
    return out / "report.md"


def _drop_unrenderable(data: RunData) -> None:
    """Move every results / bench JSON whose fields the tables cannot render (a wrong type, say) to
    ``data.skipped``, naming the file and the error, so that one bad file costs its rows, not the report."""
    for kind, renders in (("results", _render_result), ("benches", _bench_section), ("engines", engine_section)):
        kept = []
        for content in getattr(data, kind):
            try:
                renders(content)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
                data.skipped.append(f"{content['_source']}.json: a field of the wrong type or shape "
                                    f"({type(error).__name__}: {error})")
                data.files = [f for f in data.files if Path(f).stem != content["_source"]]
                continue
            kept.append(content)
        setattr(data, kind, kept)


def _render_result(result: dict) -> None:
    """Every table and line the report makes of one results record (raises what a bad field raises)."""
    format_results_table([result], markdown=True)
    format_cost_table([result])
    format_heal_table([result])
    format_passkey_table([result])
    _lm_eval_table([result])
    _settings_lines([result])
    _timing_lines([result])


def _timing_lines(results: list[dict]) -> list[str]:
    return [f"- {r.get('model', '')} / {r.get('method', '')} / {_ratio_text(r)}: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in r.get("timings_s", {}).items() if isinstance(v, (int, float)))
            + (f"; peak RSS {r['peak_rss_mb']:.0f} MiB" if r.get("peak_rss_mb") else "")
            for r in results]


def _report_lines(data: RunData, out: Path, run_dirs: list[Path], title: str) -> list[str]:
    """The report's markdown lines; its plots are written under ``out / "plots"``."""
    results = sorted(data.results, key=_sort_key)

    lines = [f"# {title}", "",
             f"Generated {machine_info()['date']} on {_machine_line(machine_info())}.", "",
             "Run directories: " + ", ".join(f"`{p}`" for p in run_dirs), ""]
    if results:
        lines += ["## Quality and size", "",
                  "Perplexity per evaluation corpus (lower is better); params in millions; weights: stored "
                  "bytes of the state dict; KV B/token: bytes the decoding cache grows by per token.", "",
                  format_results_table(results, markdown=True), ""]
        cost = format_cost_table(results)
        if cost:
            lines += ["## Compression cost", "",
                      "compress / forward: compression wall time over one plain forward pass over the same "
                      "calibration tokens; peak RSS / fp32 model: the process's peak memory during compression "
                      "over the size of the fp32 model.", "", cost, ""]
        healing = format_heal_table(results)
        if healing:
            lines += ["## Healing", "",
                      "Perplexity (and its ratio to the original's) before and after distillation from the original; "
                      "control: the original given the same distillation (about 1.0x by construction).", "",
                      healing, ""]
        passkey = format_passkey_table(results)
        if passkey:
            lines += ["## Passkey retrieval", "",
                      "Share of pass keys recalled (greedy) from a prompt of about that many tokens, the key hidden "
                      "at the listed depths of the filler (per-depth shares in brackets).", "", passkey, ""]
        multikey = format_passkey_table(results, "multikey")
        if multikey:
            lines += ["### Multi-key passkey", "", "Several labelled keys in the prompt, one asked for; only that key "
                      "counts.", "", multikey, ""]
        downstream = _lm_eval_table(results)
        if downstream:
            lines += ["## Downstream tasks (lm-eval)", "", downstream, ""]
    if data.benches:
        lines += ["## Speed and memory", ""]
        for bench in data.benches:
            lines += _bench_section(bench)
    if data.engines:
        lines += ["## Exported models in other engines", ""]
        for record in data.engines:
            lines += engine_section(record)
    figures = []
    for name, (plot, caption) in PLOTS.items():
        written = plot(results, data.benches, out / "plots" / f"{name}.png")
        if written is not None:
            figures.append(f"### {caption}\n\n![{caption}](plots/{name}.png)\n")
    if figures:
        lines += ["## Plots", "", *figures]
    if results:
        lines += ["## Settings", "", *_settings_lines(results), ""]
        lines += ["Timings:", "", *_timing_lines(results), ""]
    lines += ["## Files", "", *[f"- read `{f}`" for f in data.files], *[f"- skipped {s}" for s in data.skipped], ""]
    return lines

