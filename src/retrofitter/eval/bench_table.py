"""The bench results as a table: one row per model and figure, with its spread and its ratio to the first
model (``bench_rows``, ``format_bench_table``), and the notes under it (``bench_notes``); the same for the
eager / compiled decode benchmark (``decode_rows``, ``format_decode_table``)."""

from __future__ import annotations

__all__ = ["bench_notes", "bench_rows", "decode_rows", "format_bench_table", "format_bytes", "format_decode_table"]


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


def _matvec_cell(choice: dict) -> str:
    """How a compiled decode step ran its linear maps, with ``choose_matvec``'s two timings where it measured."""
    if choice.get("blas_ms") is None:
        return choice["matvec"]
    return f"{choice['matvec']} (blas {choice['blas_ms']:.2f} / reduction {choice['reduction_ms']:.2f} ms)"


def decode_rows(bench: dict) -> list[list[str]]:
    """Rows ``[mode, batch, model, measure, median, min–max, vs first, net]`` of a ``bench_decode`` dict
    (``net``: the ratio net of the overhead floor, ``(t − t_floor) / (t_first − t_floor)``)."""
    rows = []
    for mode, by_batch in bench["results"].items():
        for batch, entries in by_batch.items():
            for label, entry in entries.items():
                ratios = entry["ratios"]
                if entry["prefill"]:
                    median, spread = _cell(entry["prefill"], 1e3, 1)
                    rows.append([mode, batch, label, f"prefill {bench['settings']['prefill_len']} tok (ms)", median,
                                 spread, _fmt_ratio(ratios.get("prefill")), _fmt_ratio(ratios.get("prefill_net"))])
                if entry.get("matvec"):
                    rows.append([mode, batch, label, "decode linear maps", _matvec_cell(entry["matvec"]), "", "", ""])
                for n, decode in sorted(entry["decode"].items(), key=lambda item: int(item[0])):
                    median, spread = _cell(decode["step_s"], 1e3, 2)
                    step = ratios["decode"][n]
                    rows.append([mode, batch, label, f"decode step @ {n} (ms)", median, spread,
                                 _fmt_ratio(step.get("step")), _fmt_ratio(step.get("step_net"))])
                    median, spread = _cell(decode["tokens_per_s"], 1.0, 1)
                    rows.append([mode, batch, label, f"decode tok/s @ {n}", median, spread, "", ""])
                    rows.append([mode, batch, label, f"cache bytes @ {n}", format_bytes(decode["cache_bytes"]), "",
                                 "", ""])
                    rows.append([mode, batch, label, f"peak mem MiB (decode {n})", f"{decode['peak_mb']:.1f}", "",
                                 "", ""])
    return rows


def format_decode_table(bench: dict, markdown: bool = False) -> str:
    """The ``bench_decode`` results, one row per mode, batch, model and figure (time ratios: below 1 is faster)."""
    header = ["mode", "batch", "model", "measure", "median", "min–max", "vs first", "net of floor"]
    rows = decode_rows(bench)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)])
