"""PNG plots of results and bench JSONs (matplotlib, Agg backend: no display needed).

Every plot function takes the loaded dicts and an output path, returns the path written, or
``None`` when the inputs hold nothing to plot. ``PLOTS`` is the registry the report walks.

* ``ppl_vs_ratio``  — perplexity (log y) against compression ratio, one line per method, one
  panel per corpus; the original model is a star at ratio 0 and a dashed reference line;
* ``ppl_vs_params`` — perplexity (log y) against total parameters (M), one marker per method;
* ``ppl_vs_kv_bytes`` — perplexity (log y) against KV-cache bytes per token, one line per method and
  ratio (the frontier of ``--kv-ratio``); drawn only when the runs hold at least two KV sizes;
* ``decode_speed``  — decode tokens/s (median, min–max bars) against context, one line per model;
* ``cache_bytes``   — measured cache MiB against context per model (solid), with the accounting
  prediction ``context × kv_bytes_per_token`` dashed.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PLOTS", "is_original_model", "plot_ppl_vs_ratio", "plot_ppl_vs_params", "plot_ppl_vs_kv_bytes",
           "plot_decode_speed", "plot_cache_bytes"]

_MAX_PANELS = 4
_MARKERS = "osD^vP*Xh<>"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _corpora(results: list[dict]) -> list[str]:
    names = []
    for result in results:
        for corpus, value in result.get("ppl", {}).items():
            if value is not None and corpus not in names:
                names.append(corpus)
    return names[:_MAX_PANELS]


def is_original_model(result: dict) -> bool:
    """The unconverted model (``eval`` of a model retrofitter did not make); a linearized model has no ratio either."""
    return result.get("method") in (None, "original")


def _log_y(ax) -> None:
    """Log y axis with plain numbers (``30``, ``40``) instead of ``3×10^1`` tick labels."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _perplexity_panel(ax, corpus: str, xlabel: str) -> None:
    """The finishing touches of one corpus's perplexity panel: log y, labels, grid, legend."""
    _log_y(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"perplexity on {corpus} (log scale)")
    ax.set_title(corpus)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _panels(plt, count: int, title: str):
    fig, axes = plt.subplots(1, count, figsize=(5.2 * count + 0.6, 4.2), squeeze=False)
    fig.suptitle(title, fontsize=12)
    return fig, list(axes[0])


def _save(fig, plt, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ppl_vs_ratio(results: list[dict], benches: list[dict], path) -> Path | None:
    """Perplexity against the compression ratio (fraction of linear parameters removed)."""
    corpora = _corpora(results)
    compressed = [r for r in results if not is_original_model(r) and r.get("ratio") is not None]
    if not corpora or not compressed:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, len(corpora), "Perplexity vs compression ratio")
    methods = sorted({r.get("method", "?") for r in compressed})
    for ax, corpus in zip(axes, corpora):
        originals = [r["ppl"][corpus] for r in results if is_original_model(r) and r.get("ppl", {}).get(corpus)]
        for original in originals[:1]:  # one reference line; several originals would be the same model
            ax.axhline(original, color="grey", linestyle="--", linewidth=1)
            ax.plot([0], [original], marker="*", markersize=12, color="black", linestyle="", label="original")
        for index, method in enumerate(methods):
            points = sorted((r["ratio"], r["ppl"][corpus]) for r in compressed
                            if r.get("method") == method and r.get("ppl", {}).get(corpus) is not None)
            if points:
                ax.plot(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=method)
        _perplexity_panel(ax, corpus, "compression ratio (fraction of linear params removed)")
    return _save(fig, plt, path)


def plot_ppl_vs_params(results: list[dict], benches: list[dict], path) -> Path | None:
    """Perplexity against total parameters (millions), one marker style per method."""
    corpora = _corpora(results)
    if not corpora:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, len(corpora), "Perplexity vs total parameters")
    methods = sorted({"original" if is_original_model(r) else r.get("method", "?") for r in results})
    for ax, corpus in zip(axes, corpora):
        for index, method in enumerate(methods):
            points = sorted((r["params"]["total"] / 1e6, r["ppl"][corpus]) for r in results
                            if ("original" if is_original_model(r) else r.get("method", "?")) == method
                            and r.get("ppl", {}).get(corpus) is not None and "params" in r)
            if points:
                ax.plot(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], linestyle=":", label=method)
        _perplexity_panel(ax, corpus, "total parameters (M)")
    return _save(fig, plt, path)


def _kv_series(result: dict) -> str:
    """The line a result belongs to on the KV frontier: the method at its ratio (the KV budget varies along it)."""
    if is_original_model(result):
        return "original"
    return f"{result.get('method', '?')} {_ratio_label(result.get('ratio'))}"


def _ratio_label(ratio) -> str:
    return f"{ratio:g}" if isinstance(ratio, (int, float)) else str(ratio)


def plot_ppl_vs_kv_bytes(results: list[dict], benches: list[dict], path) -> Path | None:
    """Perplexity against KV-cache bytes per token (``kv_bytes_per_token``); one line per method and ratio."""
    corpora = _corpora(results)
    kept = [r for r in results if r.get("kv_bytes_per_token")]
    if not corpora or len({r["kv_bytes_per_token"] for r in kept}) < 2:
        return None  # one KV size: no frontier to draw
    plt = _pyplot()
    fig, axes = _panels(plt, len(corpora), "Perplexity vs KV-cache bytes per token")
    series = sorted({_kv_series(r) for r in kept}, key=lambda name: (name != "original", name))
    for ax, corpus in zip(axes, corpora):
        for index, name in enumerate(series):
            points = sorted((r["kv_bytes_per_token"] / 1024, r["ppl"][corpus]) for r in kept
                            if _kv_series(r) == name and r.get("ppl", {}).get(corpus) is not None)
            if not points:
                continue
            if name == "original":
                ax.plot(*zip(*points), marker="*", markersize=12, color="black", linestyle="", label=name)
            else:
                ax.plot(*zip(*points), marker=_MARKERS[index % len(_MARKERS)], label=name)
        _perplexity_panel(ax, corpus, "KV cache (KiB per token)")
    return _save(fig, plt, path)


def _bench_series(benches: list[dict]):
    """``(label, entry)`` per benched model; the file stem is added when several bench files are shown."""
    for bench in benches:
        for entry in bench.get("models", []):
            suffix = f" [{bench['_source']}]" if len(benches) > 1 and "_source" in bench else ""
            yield entry["label"] + suffix, entry


def _context_axis(ax, contexts: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.set_xticklabels([str(n) for n in contexts])
    ax.set_xlabel("context length (tokens, log scale)")
    ax.grid(True, which="both", alpha=0.3)


def plot_decode_speed(results: list[dict], benches: list[dict], path) -> Path | None:
    """Decode tokens/s against context: median with min–max error bars."""
    series = [(label, entry) for label, entry in _bench_series(benches) if entry.get("decode")]
    if not series:
        return None
    plt = _pyplot()
    fig, (ax,) = _panels(plt, 1, "Decode speed vs context (batch 1, greedy)")
    contexts = set()
    for index, (label, entry) in enumerate(series):
        points = sorted((int(n), d["tokens_per_s"]) for n, d in entry["decode"].items())
        xs = [n for n, _ in points]
        medians = [s["median"] for _, s in points]
        below = [s["median"] - s["min"] for _, s in points]
        above = [s["max"] - s["median"] for _, s in points]
        ax.errorbar(xs, medians, yerr=[below, above], marker=_MARKERS[index % len(_MARKERS)], capsize=3, label=label)
        contexts.update(xs)
    _context_axis(ax, sorted(contexts))
    ax.set_ylabel("decode tokens / s (median, bars: min–max)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_cache_bytes(results: list[dict], benches: list[dict], path) -> Path | None:
    """Measured cache size against context; dashed: ``context × kv_bytes_per_token`` from accounting."""
    series = [(label, entry) for label, entry in _bench_series(benches) if entry.get("decode")]
    if not series:
        return None
    plt = _pyplot()
    fig, (ax,) = _panels(plt, 1, "KV / state cache size vs context")
    contexts = set()
    for index, (label, entry) in enumerate(series):
        points = sorted((int(n), d["cache_bytes"] / 2**20) for n, d in entry["decode"].items())
        xs = [n for n, _ in points]
        line, = ax.plot(xs, [b for _, b in points], marker=_MARKERS[index % len(_MARKERS)], label=f"{label} (measured)")
        if entry.get("kv_bytes_per_token"):
            ax.plot(xs, [n * entry["kv_bytes_per_token"] / 2**20 for n in xs], linestyle="--", color=line.get_color(),
                    alpha=0.7, label=f"{label} (n × KV B/token)")
        contexts.update(xs)
    _context_axis(ax, sorted(contexts))
    _log_y(ax)
    ax.set_ylabel("cache size after prefill (MiB, log scale)")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


# name -> (function, caption); the report embeds each written file under its caption
PLOTS = {
    "ppl_vs_ratio": (plot_ppl_vs_ratio, "Perplexity vs compression ratio"),
    "ppl_vs_params": (plot_ppl_vs_params, "Perplexity vs total parameters"),
    "ppl_vs_kv_bytes": (plot_ppl_vs_kv_bytes, "Perplexity vs KV-cache bytes per token"),
    "decode_speed": (plot_decode_speed, "Decode speed vs context"),
    "cache_bytes": (plot_cache_bytes, "Cache size vs context"),
}
