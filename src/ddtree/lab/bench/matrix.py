"""The in-process method matrix behind ``benchmarks/gpu.py``: AR, the DFlash chain and DDTree budgets per
(concurrency, context) cell, each cell warmed up, timed through :func:`ddtree.lab.bench.inprocess.run_cell` and
timed again when its timed run met a first-use cost (a graph capture or a Triton compilation).

Prompts are the held-out token windows of :func:`ddtree.lab.bench.workload.prompts_for`, ``salt = context +
concurrency`` per cell; a C = 1 cell runs ``c1_prompts`` one after another, a C > 1 cell ``waves * C`` prompts,
C in flight at a time. Every run is greedy with exactly ``new_tokens`` tokens per request (``ignore_eos``).
The row of a cell, :func:`render_markdown`'s table and :func:`summary_lines` are the report ``gpu.json`` /
``gpu.md`` hold (``benchmarks/gpu_report.py`` merges several).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.engine.api import AUTO_BUDGET, TreeSettings
from ddtree.errors import ConfigError
from ddtree.lab.bench.inprocess import mean_in_flight, run_cell
from ddtree.lab.bench.workload import prompts_for

WARM_UPS = ("cell", "short")


@dataclass(frozen=True)
class MatrixPlan:
    """What the matrix measures. ``warm_up``: ``cell`` runs each cell once untimed (one prompt at C = 1), so every
    graph bucket it reaches exists before the clock starts; ``short`` is the older staggered short prompts (row
    buckets only). ``retime``: a timed run that captured a graph or compiled a kernel runs once more."""

    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    budgets: tuple[int, ...]
    new_tokens: int = 256
    max_verify_tokens: int = 4096
    c1_prompts: int = 3
    waves: int = 4
    warm_up: str = "cell"
    retime: bool = True
    auto: bool = False  # also DDTree with budget "auto" in every cell (ddtree.engine.auto_budget), after the budgets
    chain: bool = True  # the DFlash chain in every cell (off: a device call's time goes to AR and the trees only)

    def validated(self) -> MatrixPlan:
        for name in ("contexts", "concurrency", "budgets"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"--{name} must be positive integers, got {values!r}")
        for name in ("new_tokens", "max_verify_tokens", "c1_prompts", "waves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name in ("auto", "chain"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.warm_up not in WARM_UPS:
            raise ConfigError(f"--warm-up must be one of {', '.join(WARM_UPS)}, got {self.warm_up!r}")
        return self


class CompileLog:
    """Every Triton compilation in this process (``triton.knobs.compilation.listener``): when, which kernel, whether
    the on-disk cache had it, and how long it took. Why: runs 32-35 lost 10-55% of some C >= 8 cells' tok/s in the
    first gpu.py process on a fresh machine, with equal device time per round; a kernel specialization first met
    inside a timed cell (at a cache-length bucket the warm-up never reached: run 37) compiles there, and only the
    first process pays, since the next finds it in Triton's disk cache."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, bool, float]] = []  # (perf_counter, kernel, cache hit, seconds)

    def install(self) -> bool:
        """Listen from now on; False where there is no Triton with ``knobs`` (3.4+): then nothing is recorded."""
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU build), or one older than 3.4
            return False
        knobs.compilation.listener = self
        return True

    def uninstall(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        if knobs.compilation.listener is self:
            knobs.compilation.listener = None

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        spent = times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results
        self.events.append((time.perf_counter(), str(metadata.get("name", "?")), bool(cache_hit), spent / 1e6))

    def between(self, start: float, end: float) -> dict:
        """Compilations in [start, end): count, how many the disk cache served, seconds, kernels compiled."""
        hits = [e for e in self.events if start <= e[0] < end]
        return {"count": len(hits), "disk_hits": sum(e[2] for e in hits), "s": round(sum(e[3] for e in hits), 3),
                "kernels": sorted({e[1] for e in hits if not e[2]})[:12]}


def graph_captures(engine: Any) -> int:
    """Round, prefill and mixed-round graphs captured so far (a capture inside a timed cell is a first-use cost
    too)."""
    mixed = engine.graphs.mixed_captures if engine.graphs is not None else 0
    return mixed + sum(g.captures for g in (engine.graphs, engine.prefill_graphs) if g is not None)


def warm_up_lengths(concurrency: int, longest: int) -> list[int]:
    """New tokens per warm-up prompt: ``concurrency`` prompts whose lengths fall in groups, so that as they finish
    the batch passes through every power-of-two row count the cell's drain will (the round graphs are captured
    per row bucket: C, C/2, ..., 1), then one more prompt, which arrives when the first group finishes (a single
    prompt's prefill while others decode, as in the cell's closed loop) and, as long as the longest, stays to the
    end. Prompt i belongs to group ``i.bit_length()``: after the groups above g finish, 2^g prompts remain with
    the extra one, within the bucket of 2^(g+1) rows, and the extra one alone at last.

    Why: graphs are captured on first use, and a warm-up whose prompts all finish together (the previous one)
    left the smaller buckets to be captured inside the timed cell. Now only ``--warm-up short``: it covers the
    row buckets but not the cache lengths a full batch reaches late, so captures and Triton compilations were
    left inside the timed cells (run 37, docs/benchmarks.md); the default runs the cell itself."""
    if concurrency == 1:
        return [longest]
    groups = (concurrency - 1).bit_length()
    lengths = [longest * (groups - i.bit_length() + 1) // (groups + 1) for i in range(concurrency)]
    return lengths + [longest]


def plan_cells(contexts: Sequence[int], concurrency: Sequence[int], budgets: Sequence[int],
               max_verify_tokens: int, *, auto: bool = False,
               chain: bool = True) -> list[tuple[int, int, list[tuple[str, int | str]]]]:
    """Cells in priority order: the headline (C=1, 1k) first, then the concurrencies and contexts in the order
    given on the command line (so a time-boxed run measures what was listed first). Large budgets only where the
    verify batch ``C * (budget + 1)`` stays within ``max_verify_tokens`` (past that the forward is compute-bound).
    ``auto``: DDTree with budget "auto" last in every cell (the engine keeps its choice within its own limits);
    ``chain``: the DFlash chain after AR in every cell."""
    contexts, concurrency = list(contexts), list(concurrency)
    cells = []
    for conc in concurrency:
        for ctx in contexts:
            methods = [("ar", 0)] + ([("dflash", 0)] if chain else []) + [
                ("ddtree", b) for b in budgets if conc * (b + 1) <= max_verify_tokens
            ] + ([("ddtree", AUTO_BUDGET)] if auto else [])
            cells.append((conc, ctx, methods))
    cells.sort(key=lambda c: (c[0] != 1 or c[1] != 1024, concurrency.index(c[0]), contexts.index(c[1])))
    return cells


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else 0.0


def cell_prompts(stream: list[int], plan: MatrixPlan, context: int, concurrency: int) -> list[list[int]]:
    """The prompts a cell runs: ``c1_prompts`` at C = 1, ``waves * C`` otherwise, salted by the cell (the replay of a
    matrix traces these same windows)."""
    count = plan.c1_prompts if concurrency == 1 else plan.waves * concurrency
    return prompts_for(stream, context, count, salt=context + concurrency)


def run_matrix(engine: Any, stream: list[int], plan: MatrixPlan, report: dict, *, compiles: CompileLog,
               deadline: float, on_row: Callable[[dict], None] = lambda row: None) -> None:
    """Every cell of ``plan`` (priority order) on the started ``engine``: rows appended to ``report["cells"]``,
    cells past ``deadline`` (perf_counter) to ``report["skipped"]``; ``on_row`` after each row."""
    plan = plan.validated()
    device = engine.device
    for conc, ctx, methods in plan_cells(plan.contexts, plan.concurrency, plan.budgets, plan.max_verify_tokens,
                                         auto=plan.auto, chain=plan.chain):
        prompts = cell_prompts(stream, plan, ctx, conc)
        ar_tokens = None
        ar_tok_s = None
        for method, budget in methods:
            auto = budget == AUTO_BUDGET
            name = method if method != "ddtree" else ("ddtree-auto" if auto else f"ddtree-b{budget}")
            if time.perf_counter() > deadline:
                report["skipped"].append({"concurrency": conc, "context": ctx, "method": name})
                continue
            tree = TreeSettings(method=method, budget=budget if auto else max(budget, 1))
            t_warm, captures_before = time.perf_counter(), graph_captures(engine)
            if plan.warm_up == "short":  # staggered short prompts, the row buckets only
                longest = min(plan.new_tokens, max(plan.new_tokens if ctx <= 60 else 24, 16 * conc.bit_length()))
                lengths = warm_up_lengths(conc, longest)
                run_cell(engine, prompts[:len(lengths)], tree, lengths, concurrency=conc)
            else:  # the cell once, untimed: every graph and kernel it will meet exists before the clock starts
                run_cell(engine, prompts[:1] if conc == 1 else prompts, tree, plan.new_tokens, concurrency=conc)
            t_warm_end, captures_warm = time.perf_counter(), graph_captures(engine)
            t_cell, captures_cell = t_warm_end, captures_warm
            _reset_peak(device)
            cell = run_cell(engine, prompts, tree, plan.new_tokens, concurrency=conc)
            t_end = time.perf_counter()
            first_use = {"compiles": compiles.between(t_cell, t_end), "captures": graph_captures(engine) - captures_cell}
            retimed = None
            if plan.retime and (first_use["captures"] or first_use["compiles"]["count"]):
                # The timed run met a graph bucket or kernel specialization its untimed run had not (the closed
                # loop's arrivals differ from run to run, most at a process's first cell): time it once more.
                # Compilations served by the disk cache count too: cheap, but they mark a shape new to the run.
                retimed = {"tok_s": round(cell["tok_s"], 1), "wall_s": round(cell["wall_s"], 4), **first_use}
                t_cell, captures_cell = time.perf_counter(), graph_captures(engine)
                _reset_peak(device)
                cell = run_cell(engine, prompts, tree, plan.new_tokens, concurrency=conc)
                t_end = time.perf_counter()
            if method == "ar":
                ar_tokens, ar_tok_s = cell["tokens"], cell["tok_s"]
            same = [a == b for a, b in zip(ar_tokens or [], cell["tokens"], strict=False)]
            speedup = cell["tok_s"] / ar_tok_s if ar_tok_s else None
            row = {
                "concurrency": conc, "context": ctx, "method": name, "budget": budget,
                "tok_s": round(cell["tok_s"], 1), "accept_length": round(cell["accept_length"], 3),
                "speedup_vs_ar": round(speedup, 3) if speedup else None,
                "efficiency": round(speedup / cell["accept_length"], 3) if speedup else None,
                "decode_tok_s_per_request": round(cell["decode_tok_s_per_request"], 1),
                "decode_tok_s": round(cell["decode_tok_s"], 1), "prompts": len(prompts),
                "ttft_s_mean": round(cell["ttft_s_mean"], 4),
                "stage_ms_per_round": {k: round(v, 3) for k, v in cell["stage_ms_per_round"].items()},
                "round_ms": round(cell["round_ms"], 3),
                "peak_mem_gib": _peak_gib(device),
                "identical_to_ar": sum(same), "compared": len(same), "errors": cell["errors"][:3],
                "wall_s": round(cell["wall_s"], 4), "timeline": cell["timeline"],
                "mean_in_flight": round(mean_in_flight(cell["timeline"], cell["wall_s"]), 2),
                # First-use costs: Triton compilations and graph captures in the warm-up and in the timed cell.
                "compiles": {"warm_up": compiles.between(t_warm, t_warm_end), "cell": compiles.between(t_cell, t_end)},
                "captures": {"warm_up": captures_warm - captures_before,
                             "cell": graph_captures(engine) - captures_cell},
                "retimed": retimed,  # the first timed run, when it met first-use costs and was run again
                "auto_budgets": cell.get("auto_budgets", {}),  # budget "auto": rounds per chosen budget
            }
            report["cells"].append(row)
            on_row(row)


def summary_lines(cells: list[dict]) -> list[str]:
    """Per (C, context): DDTree's best budget against the chain and AR, on tok/s and on decode tok/s (the issue's
    targets: >= 1.3x the chain at C = 1, >= the chain and >= AR at every C)."""
    groups: dict[tuple[int, int], dict[str, dict]] = {}
    for c in cells:
        groups.setdefault((c["concurrency"], c["context"]), {})[c["method"]] = c
    out = ["", "| C | ctx | best DDTree | tok/s vs chain | tok/s vs AR | decode vs chain | decode vs AR |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for (conc, ctx), methods in groups.items():
        trees = [c for name, c in methods.items() if name.startswith("ddtree")]
        if not trees:
            continue
        best = max(trees, key=lambda c: c["tok_s"])
        ratios = []
        for key in ("tok_s", "decode_tok_s"):
            for base in ("dflash", "ar"):
                ref = methods.get(base, {}).get(key)
                ratios.append(f"{best.get(key, 0) / ref:.2f}x" if ref else "-")
        out.append(f"| {conc} | {ctx} | {best['method']} | " + " | ".join(ratios) + " |")
    return out


def _method(cell: dict) -> str:
    """The row's method, with the budgets auto chose (rounds-weighted mean, and the sizes it used)."""
    chosen = {int(k): v for k, v in cell.get("auto_budgets", {}).items()}
    if not chosen:
        return cell["method"]
    mean = sum(k * v for k, v in chosen.items()) / max(sum(chosen.values()), 1)
    return f"{cell['method']} (mean {mean:.1f}; {', '.join(map(str, sorted(chosen)))})"


def render_markdown(report: dict) -> str:
    """``gpu.md``: the header line, the table of every cell, the DDTree summary, first-use costs, skipped cells."""
    lines = [
        f"Device: {report['device']}, torch {report['torch']}, stand-in shape `{report['shape']}` "
        f"(target {report['params_target'] / 1e9:.2f} B params, drafter {report['params_drafter'] / 1e9:.2f} B), "
        f"built in {report['standin_build_s']:.1f} s; graph replay == eager: {report.get('graph_vs_eager_identical')}",
        "",
        "tok/s: all completion tokens over the cell's wall time (prefill included; C in flight); decode tok/s: "
        "a request's tokens after its first over its time after its first (no prefill); in flight: requests in "
        "flight averaged over the cell (below C: filling up and draining).",
        "",
        "| C | ctx | method | tok/s | decode tok/s | accept | speed-up | efficiency | draft / tree / verify / commit ms "
        "| round ms | in flight | peak GiB | =AR |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["cells"]:
        st = c["stage_ms_per_round"]
        split = " / ".join(f"{st.get(k, 0):.2f}" for k in ("draft", "tree", "verify", "commit"))
        lines.append(
            f"| {c['concurrency']} | {c['context']} | {_method(c)} | {c['tok_s']} | {c.get('decode_tok_s', '-')} | "
            f"{c['accept_length']} | "
            f"{c['speedup_vs_ar']} | {c['efficiency']} | {split} | {c.get('round_ms', '-')} | "
            f"{c.get('mean_in_flight', '-')} | {c['peak_mem_gib']} | "
            f"{c['identical_to_ar']}/{c['compared']} |"
        )
    lines += summary_lines(report["cells"])
    first_use = [c for c in report["cells"] if c.get("retimed")
                 or c.get("captures", {}).get("cell") or c.get("compiles", {}).get("cell", {}).get("count")]
    if first_use:
        lines += ["", "First-use costs met by timed runs (Triton compilations, graph captures; a retimed cell's "
                  "table row is its second run):"]
        for c in first_use:
            runs = ([("first run", c["retimed"]["tok_s"], c["retimed"]["compiles"], c["retimed"]["captures"])]
                    if c.get("retimed") else [])
            runs.append(("reported run", c["tok_s"], c["compiles"]["cell"], c["captures"]["cell"]))
            lines.append(f"- C{c['concurrency']}/{c['context']}/{c['method']}: " + "; ".join(
                f"{label} {tok_s} tok/s, {comp['count']} compilations ({comp['disk_hits']} from disk, {comp['s']} s"
                f"{': ' + ', '.join(comp['kernels']) if comp['kernels'] else ''}), {caps} captures"
                for label, tok_s, comp, caps in runs))
    if report.get("skipped"):
        lines += ["", f"Skipped (time box): {len(report['skipped'])} cells: "
                  + ", ".join(f"C{s['concurrency']}/{s['context']}/{s['method']}" for s in report["skipped"][:40])]
    if "hf_generate" in report:
        lines += ["", f"Hugging Face generate (same target, batch 1): {report['hf_generate']}"]
    return "\n".join(lines) + "\n"
