"""The bench results as a table: one row per model and figure, with its spread and its ratio to the first
model (``bench_rows``, ``format_bench_table``), and the notes under it (``bench_notes``)."""

from __future__ import annotations

__all__ = ["bench_notes", "bench_rows", "format_bench_table", "format_bytes"]


def _cell(summary: dict, scale: float, digits: int) -> tuple[str, str]:
    return (f"{summary['median'] * scale:.{digits}f}",
            f"{summary['min'] * scale:.{digits}f}–{summary['max'] * scale:.{digits}f}")


def format_bytes(count: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, three significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:g} B"


def _fmt_ratio(value) -> str:
    return "-" if value is None else f"×{value:.3f}"


def _peak_order(item) -> tuple[int, int]:
    """``prefill`` first, then ``decode_<n>`` by n."""
    where = item[0]
    return (0, 0) if where == "prefill" else (1, int(where.rsplit("_", 1)[-1]))


def bench_rows(bench: dict) -> list[list[str]]:
    """Rows ``[model, measure, median, min–max, vs first]`` of a bench dict."""
    rows = []
    for entry in bench["models"]:
        label, ratios = entry["label"], entry["ratios"]
        if entry["prefill"]:
            median, spread = _cell(entry["prefill"]["latency_s"], 1e3, 1)
            rows.append([label, f"prefill {entry['prefill']['tokens']} tok (ms)", median, spread,
                         _fmt_ratio(ratios.get("prefill_latency"))])
        decodes = sorted(entry["decode"].items(), key=lambda item: int(item[0]))  # JSON round trips sort keys as text
        for n, decode in decodes:
            median, spread = _cell(decode["tokens_per_s"], 1.0, 1)
            rows.append([label, f"decode tok/s @ {n}", median, spread,
                         _fmt_ratio(ratios["decode_tokens_per_s"].get(n))])
        for n, decode in decodes:
            rows.append([label, f"cache bytes @ {n}", format_bytes(decode["cache_bytes"]), "",
                         _fmt_ratio(ratios["cache_bytes"].get(n))])
        kv = entry["kv_bytes_per_token"]
        rows.append([label, "KV B/token (accounting)", "-" if kv is None else str(kv), "",
                     _fmt_ratio(ratios["kv_bytes_per_token"])])
        for where, peak in sorted(entry["peak_memory_mb"].items(), key=_peak_order):
            rows.append([label, f"peak mem MiB ({where})", f"{peak:.1f}", "", ""])
    return rows


def bench_notes(bench: dict) -> list[str]:
    """One line per skipped measurement: which model, which context, why."""
    return [f"{entry['label']}: skipped {where}: {reason}"
            for entry in bench["models"] for where, reason in entry["skipped"].items()]


def format_bench_table(bench: dict, markdown: bool = False) -> str:
    """Median, min–max and ratio vs the first model for every measurement, one row each."""
    header = ["model", "measure", "median", "min–max", "vs first"]
    rows = bench_rows(bench)
    notes = bench_notes(bench)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else []))
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)]
    return "\n".join(lines + notes)
