"""Render the report: ``summary.md`` (tables and conclusions for a commit message or a PR) and a self-contained
``report.html`` (the same tables, plots embedded as base64 PNG, inline CSS; one file to mail or attach).

Both come from one list of :class:`Section` objects so they never disagree.
"""

from __future__ import annotations

import base64
import html
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.lab.report.analysis import (
    best_per_cell,
    conclusions,
    fmt_value,
    recommend,
    speedup_over,
)
from ddtree.lab.report.collect import ConfigResult, RunResults
from ddtree.lab.report.latency import describe_slo
from ddtree.lab.report.predicted import Predicted, load_predicted


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]
    align_right: frozenset[int] = frozenset()  # numeric columns


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[tuple[str, Path]] = field(default_factory=list)  # (caption, png)


# ------------------------------------------------------------------------------------------------ numbers
def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _tput_concurrency(results: RunResults) -> int | None:
    """The users' "C=32" column: 32 when measured, else the highest measured concurrency."""
    if not results.concurrency:
        return None
    return 32 if 32 in results.concurrency else max(results.concurrency)


def _gate_text(cfg: ConfigResult) -> str:
    g = cfg.gate
    if g is None:
        return "failed" if "humaneval" in cfg.failures else "-"
    extra = f" ({g.truncated} trunc.)" if g.truncated else ""
    return f"{g.passed}/{g.total}{extra}"


def _lossless_text(cfg: ConfigResult) -> str:
    g = cfg.gate
    if cfg.method == "ar":
        return "reference"
    if g is None or g.lossless is None:
        return "-"
    same = f"{g.lossless_identical}/{g.lossless_compared}"
    return {
        "identical": f"yes {same}",
        "near_ties": f"yes {same}, {g.near_tie} near-tie",
        "failed": f"NO {same}, {g.real} real, {g.near_tie} near-tie",
        "unclassified": f"NO {same} (unclassified)",
    }[g.verdict or "unclassified"]


def users_table(results: RunResults) -> Table:
    """Per config: C=1 tok/s at each context, high-concurrency tok/s, acceptance, speed-up, gate, lossless.

    Sorted by single-request speed at the shortest context (fastest first); configs without it go last."""
    low = min(results.concurrency) if results.concurrency else 1
    high = _tput_concurrency(results)
    short = min(results.contexts) if results.contexts else None
    dims = list(dict.fromkeys(k for c in results.configs for k in c.dims))
    headers = ["config", "method", "budget", "top-k", "block", "window", *dims]
    headers += [f"C={low} ctx {ctx} tok/s" for ctx in results.contexts]
    if high is not None and high != low and short is not None:
        headers.append(f"C={high} ctx {short} tok/s")
    headers += ["accept len", "vs AR (C=1)", "coding", "lossless"]
    rows_keyed = []
    for cfg in results.configs:
        s = cfg.settings
        row = [
            results.label(cfg.config_id),
            cfg.method,
            "-" if s.get("budget") is None else str(s["budget"]),
            "-" if cfg.method != "ddtree" else fmt_value("topk", s.get("topk")),
            "-" if cfg.method == "ar" else fmt_value("block_size", s.get("block_size")),
            "-" if cfg.method == "ar" else fmt_value("draft_window", s.get("draft_window")),
            *[cfg.dims.get(d, "-") for d in dims],
        ]
        row += [_f(cfg.tok_s(ctx, low)) for ctx in results.contexts]
        if high is not None and high != low and short is not None:
            row.append(_f(cfg.tok_s(short, high)))
        vs_ar = speedup_over(results, cfg, "ar", short, low) if short is not None else None
        row += [_f(cfg.accept_length, 2), _x(vs_ar), _gate_text(cfg), _lossless_text(cfg)]
        key = cfg.tok_s(short, low) if short is not None else None
        rows_keyed.append((key is None, -(key or 0.0), row))
    rows = [row for *_, row in sorted(rows_keyed, key=lambda t: (t[0], t[1]))]
    numeric = frozenset({2, *range(6 + len(dims), len(headers) - 2)})  # budget .. vs AR
    return Table(headers, rows, numeric)


def _excluded_paragraph(results: RunResults) -> list[str]:
    """The configs left out of the rankings for failing the lossless gate, named (empty when none)."""
    excluded = list(dict.fromkeys(cid for rec in recommend(results) for cid in rec.excluded))
    if not excluded:
        return []
    return ["Not ranked (failed the lossless gate: real or unclassified divergences from AR, see the coding gate): "
            + ", ".join(results.label(cid) for cid in excluded) + "."]


def recommendations_table(results: RunResults) -> Table:
    headers = ["workload", "cell", "winner", "tok/s", "runner-up", "tok/s", "margin", "beyond spread?",
               "vs AR", "vs DFlash"]
    rows = []
    for rec in recommend(results):
        win, run = rec.winner, rec.runner_up
        good = rec.metric == "goodput"
        digits = 2 if good else 1
        pct = "" if rec.margin_pct is None else f" ({rec.margin_pct:+.1f}%)"
        margin = "-" if rec.margin is None else f"{rec.margin:+.{digits}f}{' req/s' if good else ''}{pct}"
        verdict = {"exceeds": "yes", "within": "no", "unknown": "unknown", "no runner-up": "-"}[rec.spread]
        rows.append([
            rec.workload.title,
            rec.workload.label,
            results.label(win.config.config_id) if win else "-",
            _f(win.tok_s if win else None) + (f" ({win.goodput or 0.0:.2f} req/s)" if win and good else ""),
            results.label(run.config.config_id) if run else "-",
            _f(run.tok_s if run else None) + (f" ({run.goodput or 0.0:.2f} req/s)" if run and good else ""),
            margin,
            f"{verdict}: {rec.spread_detail}" if rec.spread in ("exceeds", "within", "unknown") else verdict,
            _x(rec.vs_ar),
            _x(rec.vs_dflash),
        ])
    return Table(headers, rows, frozenset({3, 5, 6, 8, 9}))


def best_table(results: RunResults) -> Table:
    best = best_per_cell(results)
    headers = ["concurrency", *[f"ctx {ctx}" for ctx in results.contexts]]
    rows = []
    for conc in results.concurrency:
        row = [f"C={conc}"]
        for ctx in results.contexts:
            r = best.get((ctx, conc))
            row.append("-" if r is None else f"{results.label(r.config.config_id)} ({r.tok_s:.1f})")
        rows.append(row)
    return Table(headers, rows)


def cells_table(results: RunResults) -> Table:
    """Every cell: tok/s (min..max over repeats) and acceptance, one row per config."""
    cells = [(ctx, conc) for ctx in results.contexts for conc in results.concurrency]
    headers = ["config", *[f"ctx {c} C={n}" for c, n in cells]]
    rows = []
    for cfg in results.configs:
        row = [results.label(cfg.config_id)]
        for ctx, conc in cells:
            cell = cfg.cell(ctx, conc)
            if cell is None or cell.tok_s is None:
                row.append("failed" if f"ctx{ctx}-c{conc}" in cfg.failures else "-")
                continue
            text = f"{cell.tok_s:.1f}"
            if cell.runs >= 2 and cell.tok_s_min is not None and cell.tok_s_max is not None:
                text += f" [{cell.tok_s_min:.1f}..{cell.tok_s_max:.1f}]"
            if cell.accept_length is not None:
                text += f" a{cell.accept_length:.2f}"
            row.append(text)
        rows.append(row)
    return Table(headers, rows, frozenset(range(1, len(headers))))


def gate_table(results: RunResults) -> Table | None:
    gated = [c for c in results.configs if c.gate is not None]
    if not gated:
        return None
    rows = []
    for c in gated:
        g = c.gate
        assert g is not None
        rows.append([
            results.label(c.config_id), f"{g.passed}/{g.total}", str(g.truncated), str(g.wrong), str(g.errors),
            ", ".join(g.truncated_tasks) or "-", ", ".join(g.wrong_tasks) or "-", _lossless_text(c),
            "-" if g.near_tie is None else str(g.near_tie), "-" if g.real is None else str(g.real),
            ", ".join(g.real_tasks) or "-", ", ".join(g.near_tie_tasks) or "-",
            ", ".join(t for t in g.differing_tasks if t not in g.real_tasks + g.near_tie_tasks) or "-",
        ])
    return Table(["config", "passed", "truncated", "wrong", "errors", "truncated tasks", "wrong tasks", "lossless",
                  "near-tie", "real", "real divergences", "near-tie tasks", "unclassified differing tasks"], rows)


def failures_table(results: RunResults) -> Table | None:
    rows = []
    for c in results.configs:
        for cell, record in c.failures.items():
            message = str(record.get("error", "")).strip().splitlines()
            rows.append([results.label(c.config_id), cell, str(record.get("kind", "error")), message[0][:160] if message else ""])
    return Table(["config", "cell", "kind", "error"], rows) if rows else None


def launch_table(results: RunResults) -> Table | None:
    rows = [
        [results.label(c.config_id), _f(c.launch.get("load_to_ready_s")), str(c.launch.get("verified") or "-"),
         str(c.launch.get("stop_signal") or "-")]
        for c in results.configs
        if c.launch
    ]
    return Table(["config", "load to ready (s)", "identity check", "stopped by"], rows, frozenset({1})) if rows else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000.0 * value:.1f}"


def latency_table(results: RunResults) -> Table:
    """Per config and cell: TTFT, ITL and end-to-end p50/p90/p99 (ms), and goodput when the run has an SLO."""
    headers = ["config", "cell", *[f"{name} p{q}" for name in ("TTFT", "ITL", "e2e") for q in (50, 90, 99)]]
    if results.slo:
        headers += ["goodput req/s", "met SLO"]
    rows = []
    for cfg in results.configs:
        for (ctx, conc), cell in sorted(cfg.cells.items()):
            row = [results.label(cfg.config_id), f"ctx {ctx} C={conc}"]
            row += [_ms(cell.latency.get(name, {}).get(q)) for name in ("ttft", "itl", "e2e") for q in (50, 90, 99)]
            if results.slo:
                g = cell.goodput
                row += ["-", "-"] if g is None else [f"{g.mean:.2f}", f"{g.met}/{g.total}"]
            rows.append(row)
    return Table(headers, rows, frozenset(range(2, len(headers))))


def acceptance_table(results: RunResults) -> Table:
    """Per config: acceptance length, where it came from, and the fraction of rounds accepting >= d drafts."""
    width = max((len(c.accept_by_depth) for c in results.configs), default=0)
    headers = ["config", "accept len", "source", *[f">={d}" for d in range(1, width + 1)]]
    rows = []
    for cfg in results.configs:
        curve = cfg.accept_by_depth
        rows.append([results.label(cfg.config_id), _f(cfg.accept_length, 2), cfg.accept_sources,
                     *[f"{curve[i]:.2f}" if i < len(curve) else "-" for i in range(width)]])
    return Table(headers, rows, frozenset({1, *range(3, len(headers))}))


def predicted_table(results: RunResults, predicted: Predicted) -> Table:
    """Per config and cell: measured tok/s, replay's predicted tok/s and the error (predicted - measured, %)."""
    rows = []
    for c in predicted.cells:
        err = c.error_pct
        rows.append([results.label(c.config_id), f"ctx {c.context} C={c.concurrency}", _f(c.measured),
                     _f(c.predicted) + ("*" if c.extrapolated else ""), "-" if err is None else f"{err:+.1f}%"])
    return Table(["config", "cell", "measured tok/s", "predicted tok/s", "error"], rows, frozenset({2, 3, 4}))


def predicted_section(results: RunResults, predicted: Predicted) -> Section:
    curve = predicted.curve
    mean = predicted.mean_abs_error_pct()
    text = (f"`ddtree replay predict --run` from one trace and a cost curve measured on {curve.get('device', '?')} "
            f"for {curve.get('model', '?')} (`{curve.get('path') or '?'}`); error = (predicted - measured) / measured"
            + ("" if mean is None else f", mean |error| {mean:.1f}% over {len(predicted.compared)} cells")
            + ". * = the cost curve was read outside its grid (extrapolated)."
            + ("" if predicted.prefill_modelled else " Prefill time is not modelled (the curve has no prefill points).")
            + f" Model: {predicted.model}.")
    return Section("Predicted vs measured", paragraphs=[text], tables=[predicted_table(results, predicted)])


# ------------------------------------------------------------------------------------------------ sections
def build_sections(results: RunResults, plots: dict[str, Path]) -> list[Section]:
    sections = [
        Section("Conclusions", bullets=conclusions(results)),
        Section(
            "Recommendations",
            paragraphs=[
                "Each workload is one benchmark cell ranked on aggregate output tok/s. A margin is beyond the "
                "run-to-run spread when the winner's slowest repeat beats the runner-up's fastest one.",
                *_excluded_paragraph(results),
            ],
            tables=[recommendations_table(results)],
        ),
        Section("Best setting per concurrency", tables=[best_table(results)]),
        Section("Results", paragraphs=["Sorted by single-request speed at the shortest context."],
                tables=[users_table(results)]),
        Section("All cells", paragraphs=["Output tok/s per cell, [min..max] over repeats, aN = acceptance length."],
                tables=[cells_table(results)]),
        Section("Latency", paragraphs=[
            "Milliseconds, percentiles over every request of the cell's repeats (ITL per token: a round committing "
            "k tokens counts as k gaps)." + (f" Goodput: requests per second within {describe_slo(results.slo)}."
                                            if results.slo else " Give --slo ttft_ms=...,itl_ms=... for goodput.")],
            tables=[latency_table(results)]),
        Section("Acceptance by depth", paragraphs=[
            "Fraction of verify rounds whose first d draft tokens were all accepted (the bonus token not counted); "
            "a row sums to the mean accepted drafts per round (the acceptance length minus one, less a little: the "
            "length also counts the token prefill produced). Source: per_request = the responses' own statistics "
            "(ddtree, SGLang meta_info or sglext), prometheus = counter differences over each run, server_info = "
            "SGLang's running average over a flushed run."
            + (f" The drafter was trained with block size {results.trained_block_size} (depth "
               f"{results.trained_block_size - 1})." if results.trained_block_size else "")],
            tables=[acceptance_table(results)]),
    ]
    predicted = load_predicted(results)
    if predicted is not None and predicted.cells:
        sections.append(predicted_section(results, predicted))
    gate = gate_table(results)
    if gate:
        sections.append(Section("Coding gate", tables=[gate]))
    launch = launch_table(results)
    if launch:
        sections.append(Section("Launches", tables=[launch]))
    failures = failures_table(results)
    if failures:
        sections.append(Section("Failures", paragraphs=["Re-run with `ddtree sweep --resume`."], tables=[failures]))
    sections.append(Section("Plots", images=list(plots.items())))
    return sections


def header_lines(results: RunResults) -> list[str]:
    manifest = results.manifest or {}
    grid = manifest.get("grid") or {}
    sessions = manifest.get("sessions") or []
    env = (sessions[-1].get("environment") if sessions else None) or {}
    hw = env.get("hardware") or {}
    versions = env.get("versions") or {}
    git = env.get("git") or {}
    target = manifest.get("target") or {}
    measured = sum(len(c.cells) for c in results.configs)
    lines = [
        f"Sweep `{grid.get('name', results.root.name)}`: {len(results.configs)} configs, {measured} benchmark cells "
        f"measured; contexts {results.contexts}, concurrency {results.concurrency}, "
        f"{grid.get('output_tokens', '?')} output tokens, {grid.get('repeats', '?')} repeat(s) per cell.",
    ]
    if target:
        lines.append(f"Engine: {target.get('mode', '?')} {target.get('description', '')}".rstrip() + ".")
    if results.demo_pair:
        lines.append("Models: the embedded demo pair (too small to solve HumanEval; its coding gate checks that "
                     "greedy outputs equal AR's).")
    if results.slo:
        lines.append(f"SLO: {describe_slo(results.slo)}; recommendations rank on goodput (requests/s within it).")
    if hw or versions:
        gpus = ", ".join(g["name"] for g in hw.get("gpus") or []) or "no GPU"
        lines.append(
            f"Hardware: {hw.get('cpu_model') or hw.get('machine', '?')} x{hw.get('cpu_count', '?')}, {gpus}; "
            f"ddtree {versions.get('ddtree', '?')}, torch {versions.get('torch', '?')}"
            + (f", git {git.get('commit', '')[:10]}{' (dirty)' if git.get('dirty') else ''}" if git else "")
            + "."
        )
    return lines


def render_markdown(results: RunResults, sections: list[Section], plot_dir: Path) -> str:
    out = [f"# Sweep report: {results.root.name}", "", *header_lines(results), ""]
    for sec in sections:
        out += [f"## {sec.title}", ""]
        for p in sec.paragraphs:
            out += [p, ""]
        out += [f"- {b}" for b in sec.bullets] + ([""] if sec.bullets else [])
        for table in sec.tables:
            out += [_md_table(table), ""]
        for caption, path in sec.images:
            out += [f"![{caption}]({path.relative_to(results.root).as_posix()})", ""]
    return "\n".join(out).rstrip() + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(table: Table) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in table.headers) + " |"]
    lines.append("| " + " | ".join("---:" if i in table.align_right else "---" for i in range(len(table.headers))) + " |")
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:1em 0;font-size:13px;display:block;overflow-x:auto}
th,td{border:1px solid #ccc;padding:3px 8px;white-space:nowrap}th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr:nth-child(even){background:#fafafa}
img{max-width:100%;margin:1em 0;border:1px solid #eee}figcaption{color:#666;font-size:13px}
code{background:#f4f4f4;padding:0 3px}
"""


def _inline(text: str) -> str:
    """Markdown ``**bold**`` and backticks to HTML, everything else escaped."""
    out: list[str] = []
    bold = False
    for i, part in enumerate(text.split("`")):
        if i % 2 == 1:
            out.append(f"<code>{html.escape(part)}</code>")
            continue
        pieces = part.split("**")
        for j, piece in enumerate(pieces):
            if j:
                out.append("</b>" if bold else "<b>")
                bold = not bold
            out.append(html.escape(piece))
    if bold:
        out.append("</b>")
    return "".join(out)


def render_html(results: RunResults, sections: list[Section]) -> str:
    body = [f"<h1>Sweep report: {html.escape(results.root.name)}</h1>"]
    body += [f"<p>{_inline(line)}</p>" for line in header_lines(results)]
    for sec in sections:
        body.append(f"<h2>{html.escape(sec.title)}</h2>")
        body += [f"<p>{_inline(p)}</p>" for p in sec.paragraphs]
        if sec.bullets:
            body.append("<ul>" + "".join(f"<li>{_inline(b)}</li>" for b in sec.bullets) + "</ul>")
        for table in sec.tables:
            head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
            rows = "".join(
                "<tr>" + "".join(
                    f'<td class="num">{html.escape(c)}</td>' if i in table.align_right else f"<td>{html.escape(c)}</td>"
                    for i, c in enumerate(row)
                ) + "</tr>"
                for row in table.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        for caption, path in sec.images:
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    body.append(f"<p><small>Written by <code>ddtree report</code> at {stamp}.</small></p>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>Sweep report: {html.escape(results.root.name)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


__all__ = [
    "Section",
    "Table",
    "acceptance_table",
    "latency_table",
    "best_table",
    "build_sections",
    "cells_table",
    "recommendations_table",
    "render_html",
    "render_markdown",
    "users_table",
]
