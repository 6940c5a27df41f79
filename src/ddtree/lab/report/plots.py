"""The report's plots, drawn with matplotlib's Agg backend (no display needed) into PNG files.

* ``throughput_vs_concurrency.png``: output tok/s against concurrency, one panel per context, one line per config
  (error bars: the min..max of repeats);
* ``acceptance_vs_budget.png``: acceptance length against tree budget, one line per (top-k, block size, window)
  group, DFlash chains as dashed horizontal lines, AR at 1;
* ``speedup_vs_context.png``: tok/s over AR (same extra dimensions) against context at the lowest concurrency;
* ``acceptance_by_depth.png``: the fraction of rounds accepting at least d drafts against d, per config, with the
  drafter's trained depth marked;
* ``pareto.png``: per context, total tok/s against tok/s per user, one point per (config, concurrency), and the
  Pareto front over all of them.

With many configs the line plots keep the baselines plus the ``MAX_LINES`` configs fastest at the latency cell,
and say so in the title, because fifty overlapping lines answer nothing.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)

from ddtree.files import atomic_write_bytes  # noqa: E402
from ddtree.lab.report.analysis import rank  # noqa: E402
from ddtree.lab.report.collect import ConfigResult, RunResults  # noqa: E402
from ddtree.lab.report.latency import pareto_front  # noqa: E402

MAX_LINES = 8
_BASELINE_COLORS = ("tab:gray", "tab:brown", "0.55", "sienna", "rosybrown")
_TREE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:pink", "tab:olive", "tab:cyan")


def _series_style(index: int) -> dict[str, str]:
    """The i-th tree series: a colour no baseline uses, then the same colours dash-dotted."""
    return {"color": _TREE_COLORS[index % len(_TREE_COLORS)], "linestyle": "-" if index < len(_TREE_COLORS) else "-."}


def _style(results: RunResults, cfg: ConfigResult) -> dict[str, str]:
    """Baselines stand apart from the tree configs: AR dotted black, DFlash chains dashed in muted colours."""
    if cfg.method == "ar":
        return {"color": "black", "linestyle": ":"}
    if cfg.method == "dflash":
        chains = [c.config_id for c in results.configs if c.method == "dflash"]
        return {"color": _BASELINE_COLORS[chains.index(cfg.config_id) % len(_BASELINE_COLORS)], "linestyle": "--"}
    trees = [c.config_id for c in results.configs if c.method not in ("ar", "dflash")]
    return _series_style(trees.index(cfg.config_id))


def _shown_configs(results: RunResults) -> tuple[list[ConfigResult], bool]:
    """Baselines plus the fastest tree configs at the latency cell; True when some were left out."""
    trees = [c for c in results.configs if c.method == "ddtree"]
    if len(trees) <= MAX_LINES or not results.contexts or not results.concurrency:
        return results.configs, False
    ranked = rank(results, min(results.contexts), min(results.concurrency), methods=("ddtree",))
    keep = {r.config.config_id for r in ranked[:MAX_LINES]}
    return [c for c in results.configs if c.method != "ddtree" or c.config_id in keep], True


def _save(fig: plt.Figure, path: Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def plot_throughput(results: RunResults, path: Path) -> Path:
    shown, trimmed = _shown_configs(results)
    contexts = results.contexts or [0]
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), squeeze=False, sharey=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for cfg in shown:
            pts = sorted((n, cfg.cell(ctx, n)) for n in results.concurrency if cfg.cell(ctx, n) is not None)
            pts = [(n, c) for n, c in pts if c is not None and c.tok_s is not None]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            ys = [c.tok_s for _, c in pts]
            lo = [max(0.0, c.tok_s - (c.tok_s_min if c.tok_s_min is not None else c.tok_s)) for _, c in pts]
            hi = [max(0.0, (c.tok_s_max if c.tok_s_max is not None else c.tok_s) - c.tok_s) for _, c in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=results.label(cfg.config_id),
                        **_style(results, cfg))
        if len(results.concurrency) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(results.concurrency, [str(n) for n in results.concurrency])
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tok/s")
    _legend(fig, axes[0][-1])
    fig.suptitle("Throughput vs concurrency" + (f" (baselines + top {MAX_LINES} at C=1)" if trimmed else ""))
    _save(fig, path)
    return path


def plot_acceptance(results: RunResults, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    groups: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for cfg in results.configs:
        acc = cfg.accept_length
        if cfg.method != "ddtree" or acc is None or not isinstance(cfg.settings.get("budget"), int):  # not "auto"
            continue
        s = cfg.settings
        label = f"k{_v(s.get('topk'))} bs{_v(s.get('block_size'), 'trained')} w{_v(s.get('draft_window'))}"
        label += "".join(f" {k}{v}" for k, v in cfg.dims.items())
        groups[label].append((int(s["budget"]), acc))
    for index, (label, pts) in enumerate(groups.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=f"ddtree {label}", **_series_style(index))
    for cfg in results.configs:
        if cfg.method in ("dflash", "ar") and cfg.accept_length is not None:
            ax.axhline(cfg.accept_length, label=results.label(cfg.config_id), **_style(results, cfg))
    budgets = sorted({b for pts in groups.values() for b, _ in pts})
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget (nodes verified per round)")
    ax.set_ylabel("acceptance length (tokens per round)")
    ax.set_title("Acceptance length vs budget")
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    _save(fig, path)
    return path


def plot_speedup(results: RunResults, path: Path) -> Path:
    shown, trimmed = _shown_configs(results)
    conc = min(results.concurrency) if results.concurrency else 1
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for cfg in shown:
        refs = results.baseline("ar", cfg.dims)
        pts = []
        for ctx in results.contexts:
            mine = cfg.tok_s(ctx, conc)
            ref = max((t for r in refs if (t := r.tok_s(ctx, conc)) is not None), default=None)
            if mine is not None and ref:
                pts.append((ctx, mine / ref))
        if pts:
            ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=results.label(cfg.config_id),
                    **_style(results, cfg))
    if len(results.contexts) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(results.contexts, [str(c) for c in results.contexts])
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel(f"speed-up over AR at C={conc}")
    ax.set_title("Speed-up over AR by context" + (f" (baselines + top {MAX_LINES})" if trimmed else ""))
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    _save(fig, path)
    return path


def plot_depth(results: RunResults, path: Path) -> Path:
    """P(accepted drafts >= d) against d per config, the drafter's trained depth as a vertical line."""
    shown, trimmed = _shown_configs(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    depth = 0
    for cfg in shown:
        curve = cfg.accept_by_depth
        if cfg.method == "ar" or not curve:
            continue
        depth = max(depth, len(curve))
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=results.label(cfg.config_id),
                **_style(results, cfg))
    if results.trained_block_size:
        trained = results.trained_block_size - 1
        ax.axvline(trained, color="red", linestyle=":", linewidth=1.2, label=f"trained depth ({trained})")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("fraction of rounds accepting >= d drafts")
    ax.set_ylim(0, 1.02)
    if depth:
        ax.set_xticks(range(1, depth + 1))
    ax.set_title("Acceptance by depth" + (f" (baselines + top {MAX_LINES})" if trimmed else ""))
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    _save(fig, path)
    return path


def plot_pareto(results: RunResults, path: Path) -> Path:
    """Per context: total tok/s against tok/s per user, one point per (config, concurrency), the front drawn."""
    contexts = results.contexts or [0]
    shown, trimmed = _shown_configs(results)
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.4 * len(contexts), 3.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        points: list[tuple[float, float]] = []
        for cfg in shown:
            pts = [(c.decode_tok_s, c.tok_s, n) for n in results.concurrency
                   if (c := cfg.cell(ctx, n)) is not None and c.decode_tok_s is not None and c.tok_s is not None]
            if not pts:
                continue
            style = _style(results, cfg)
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", ms=3, linewidth=0.6,
                    label=results.label(cfg.config_id), **style)
            points += [(x, y) for x, y, _ in pts]
        front = [points[i] for i in pareto_front(points)]
        if front:
            ax.plot([x for x, _ in front], [y for _, y in front], color="black", linewidth=2.2, alpha=0.35,
                    zorder=0, label="Pareto front" if ctx == contexts[-1] else None)
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("tok/s per user (1 / TPOT)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("total output tok/s")
    _legend(fig, axes[0][-1])
    fig.suptitle("Per-user vs total throughput, one point per concurrency"
                 + (f" (baselines + top {MAX_LINES} at C=1)" if trimmed else ""))
    _save(fig, path)
    return path


def _legend(fig: plt.Figure, ax: plt.Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)


def _v(value: object, none: str = "none") -> str:
    return none if value is None else str(value)


def write_plots(results: RunResults, directory: Path) -> dict[str, Path]:
    """All three plots under ``directory``; returns ``{name: path}`` in report order."""
    return {
        "Throughput vs concurrency": plot_throughput(results, directory / "throughput_vs_concurrency.png"),
        "Acceptance length vs budget": plot_acceptance(results, directory / "acceptance_vs_budget.png"),
        "Speed-up over AR by context": plot_speedup(results, directory / "speedup_vs_context.png"),
        "Acceptance by depth": plot_depth(results, directory / "acceptance_by_depth.png"),
        "Per-user vs total throughput (Pareto)": plot_pareto(results, directory / "pareto.png"),
    }


__all__ = ["MAX_LINES", "plot_acceptance", "plot_depth", "plot_pareto", "plot_speedup", "plot_throughput",
           "write_plots"]
