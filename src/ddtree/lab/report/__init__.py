"""``ddtree report DIR``: the summary table, recommendations per workload, plots and conclusions of a sweep.

Reads only finished files of a run directory (see :mod:`ddtree.lab.sweep.layout`), so it can be run on a sweep
still in progress or one that was interrupted, and again after ``--resume``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddtree.files import atomic_write_text
from ddtree.lab.report.collect import RunResults, load_run


@dataclass(frozen=True)
class ReportPaths:
    summary: Path  # summary.md
    html: Path  # report.html, self-contained
    plots: dict[str, Path]  # caption -> PNG


def write_report(run_dir: str | Path, *, slo: Mapping[str, float] | None = None) -> ReportPaths:
    """Write ``summary.md``, ``report.html`` and ``plots/*.png`` into ``run_dir`` (atomically, file by file);
    ``slo`` overrides the latency limits the sweep stored (goodput, and recommendations ranked on it)."""
    from ddtree.lab.report.plots import write_plots
    from ddtree.lab.report.render import build_sections, render_html, render_markdown

    results = load_run(run_dir, slo=slo)
    plot_dir = results.root / "plots"
    plots = write_plots(results, plot_dir)
    sections = build_sections(results, plots)
    summary = results.root / "summary.md"
    page = results.root / "report.html"
    atomic_write_text(summary, render_markdown(results, sections, plot_dir))
    atomic_write_text(page, render_html(results, sections))
    return ReportPaths(summary, page, plots)


__all__ = ["ReportPaths", "RunResults", "load_run", "write_report"]
