"""Plain-text result tables for the terminal and Markdown reports."""

from __future__ import annotations

__all__ = ["format_results_table"]


def _fmt_ppl(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 1e4 else f"{value:.3g}"


def format_results_table(results: list[dict], markdown: bool = False) -> str:
    """One row per results dict: method, ratio, perplexity per corpus, params, KV bytes/token."""
    corpora = []
    for result in results:
        for corpus in result.get("ppl", {}):
            if corpus not in corpora:
                corpora.append(corpus)
    header = ["model", "method", "ratio", *[f"ppl {c}" for c in corpora], "params (M)", "linear (M)", "KV B/token"]
    rows = []
    for r in results:
        ratio = r.get("ratio")
        rows.append([str(r.get("model", "")), str(r.get("method", "")), "-" if ratio is None else f"{ratio:g}",
                     *[_fmt_ppl(r.get("ppl", {}).get(c)) for c in corpora],
                     f"{r['params']['total'] / 1e6:.2f}", f"{r['params']['linear'] / 1e6:.2f}",
                     str(r.get("kv_bytes_per_token", "-"))])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)])
