"""Plain-text result tables for the terminal and Markdown reports."""

from __future__ import annotations

__all__ = ["format_results_table"]


def _fmt_ppl(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 1e4 else f"{value:.3g}"


def _fmt_mb(result: dict) -> str:
    stored = result.get("bytes", {}).get("stored")
    return "-" if stored is None else f"{stored / 2**20:.3g}"


def format_results_table(results: list[dict], markdown: bool = False) -> str:
    """One row per results dict: method (+ quantize scheme), ratio, perplexity per corpus, params, stored
    weight MiB, KV bytes/token."""
    corpora = []
    for result in results:
        for corpus in result.get("ppl", {}):
            if corpus not in corpora:
                corpora.append(corpus)
    header = ["model", "method", "ratio", *[f"ppl {c}" for c in corpora], "params (M)", "linear (M)", "weights (MiB)",
              "KV B/token"]
    rows = []
    for r in results:
        ratio, scheme = r.get("ratio"), r.get("settings", {}).get("quantize")
        method = str(r.get("method", "")) + (f"+{scheme}" if scheme else "")
        rows.append([str(r.get("model", "")), method, "-" if ratio is None else f"{ratio:g}",
                     *[_fmt_ppl(r.get("ppl", {}).get(c)) for c in corpora],
                     f"{r['params']['total'] / 1e6:.2f}", f"{r['params']['linear'] / 1e6:.2f}", _fmt_mb(r),
                     str(r.get("kv_bytes_per_token", "-"))])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)])
