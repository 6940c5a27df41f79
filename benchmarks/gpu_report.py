"""Merge the JSON reports of several `benchmarks/gpu.py` runs into the one matrix report issue 9 asks for
(``docs/benchmarks/gpu.md`` and ``docs/benchmarks/gpu.json``).

Why: a device call runs at most 10 minutes, so the matrix (concurrency x context x method) is measured over several
calls (`benchmarks/gpu_session.sh engine`, then `long`), each writing its own report. Merging is by whole
(concurrency, context) group: a later report's group replaces an earlier one's entirely, so the methods of one row
of the matrix always come from one run and their ratios compare like with like; except that a group a later run's
time box cut short (some of its cells skipped) leaves an earlier whole group in place. Every group names its source.

    python benchmarks/gpu_report.py docs/benchmarks/gpu/run15_c1_gpu.json docs/benchmarks/gpu/run15_c8-64_gpu.json \\
        docs/benchmarks/gpu/run18_c1_gpu.json --extra docs/benchmarks/gpu/run20_c1_b512_gpu.json --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.lab.bench.matrix import render_markdown  # the per-run report's table, reused as is


def merge_reports(reports: list[tuple[str, dict]]) -> dict:
    """``[(source name, gpu.py report)]`` in order, later groups winning -> one report with ``sources`` (group ->
    source name) and the cells of every group, ordered by concurrency, then context. A group that its run's time
    box cut short (some of its cells in that run's ``skipped``) replaces only a group that was cut short too; the
    merged ``skipped`` lists what the standing group's own run skipped, and for groups no run measured at all,
    what the latest run to plan them skipped."""
    if not reports:
        raise ValueError("no reports to merge: pass at least one gpu.json")
    # group -> (source, cells, its run's skipped cells of that group: empty when whole)
    groups: dict[tuple[int, int], tuple[str, list[dict], list[dict]]] = {}
    never_measured: dict[tuple[int, int], list[dict]] = {}
    for name, report in reports:
        fresh: dict[tuple[int, int], list[dict]] = {}
        for cell in report["cells"]:
            # Per-request timelines stay in the run's own file: the merged report is the matrix.
            slim = {k: v for k, v in cell.items() if k != "timeline"}
            fresh.setdefault((cell["concurrency"], cell["context"]), []).append({**slim, "source": name})
        skipped: dict[tuple[int, int], list[dict]] = {}
        for entry in report.get("skipped", []):
            skipped.setdefault((entry["concurrency"], entry["context"]), []).append(entry)
        for key, cells in fresh.items():
            standing = groups.get(key)
            if standing is None or key not in skipped or standing[2]:
                groups[key] = (name, cells, skipped.get(key, []))
        for key, entries in skipped.items():
            if key not in fresh:
                never_measured[key] = entries
    last = reports[-1][1]
    merged = {k: last[k] for k in ("device", "torch", "shape", "params_target", "params_drafter", "standin_build_s")}
    merged["graph_vs_eager_identical"] = ", ".join(
        f"{name} {report.get('graph_vs_eager_identical')}" for name, report in reports)
    order = sorted(groups)
    merged["sources"] = {f"C{c} ctx{x}": groups[(c, x)][0] for c, x in order}
    merged["cells"] = [cell for key in order for cell in groups[key][1]]
    merged["skipped"] = [entry for key in order for entry in groups[key][2]] + [
        entry for key in sorted(never_measured) if key not in groups for entry in never_measured[key]]
    return merged


def render(merged: dict) -> str:
    """gpu.py's table, then where each (concurrency, context) group came from; then the further budgets, if any."""
    sources = "; ".join(f"{group}: {name}" for group, name in merged["sources"].items())
    text = render_markdown(merged) + f"\nSources (one run per row group): {sources}.\n"
    if merged.get("extra"):
        text += ("\n## Further budgets\n\nBudgets run apart from the matrix above (each group with its own AR and "
                 "chain, from one run, so its ratios compare like with like; not merged into the groups above, whose "
                 "AR the same cells would not share):\n\n" + render(merged["extra"]))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="gpu.json files, oldest first (later groups replace earlier ones)")
    ap.add_argument("--extra", nargs="+", default=[],
                    help="gpu.json files of further budgets, reported in their own section (merged the same way)")
    ap.add_argument("--out", default="docs/benchmarks", help="directory for gpu.md and gpu.json")
    args = ap.parse_args()
    main_reports, extra_reports = _read(args.reports), _read(args.extra)
    merged = merge_reports(main_reports)
    if extra_reports:
        merged["extra"] = merge_reports(extra_reports)
    hf = [(name, r["hf_generate"]) for name, r in main_reports + extra_reports if "hf_generate" in r]
    if hf:  # the one Hugging Face reference, from the last run that timed it
        merged["hf_generate"] = {**hf[-1][1], "source": hf[-1][0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu.json.tmp"
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(out / "gpu.json")
    (out / "gpu.md").write_text(render(merged))
    print(render(merged))


def _read(paths: list[str]) -> list[tuple[str, dict]]:
    """``[(source name, report)]``; exits naming the first file that cannot be read."""
    reports = []
    for path in paths:
        try:
            reports.append((Path(path).stem.removesuffix("_gpu"), json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            sys.exit(f"gpu_report: cannot read {path}: {exc}")
    return reports


if __name__ == "__main__":
    main()
