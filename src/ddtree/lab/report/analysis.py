"""Turn a run's numbers into the answers users wrote by hand: winners per workload, margins, what did not matter.

Workloads (each one benchmark cell, all ranked on aggregate output tokens/s):

latency
    one request (the lowest measured concurrency, C=1 in every preset) at the shortest context;
throughput
    the highest measured concurrency at the shortest context (the users' "C=32 with short prompts");
long context
    one request at the longest context.

A winner's margin *exceeds the run-to-run spread* when its slowest repeat is faster than the runner-up's fastest
repeat (the ranges of repeats do not overlap). With one run per cell the spread is unknown, and the report says
so rather than guess: users saw 170 vs 145 tok/s between two runs of the same setting.

Only configs that pass the lossless gate are recommended: a config whose gate found a real divergence from AR's
greedy outputs (or differences that could not be classified, a result from before the divergence classes) is left
out of every ranking of :func:`recommend` and named; differences that are all numeric near-ties pass, with a note
(:mod:`ddtree.lab.humaneval.divergence`). Configs without a compared gate are ranked as before.

A knob *mattered* when changing it alone (every other setting fixed) moved tokens/s by more than the larger of 3%
and the typical run-to-run spread, in the median over all cells and groups.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from ddtree.lab.report.collect import ConfigResult, RunResults

KNOBS: tuple[str, ...] = ("budget", "topk", "block_size", "draft_window")
_KNOB_METHODS = {"budget": ("ddtree",), "topk": ("ddtree",), "block_size": ("ddtree", "dflash"),
                 "draft_window": ("ddtree", "dflash")}
MIN_EFFECT = 0.03  # relative change below which a knob "barely mattered", unless the measured noise is larger


@dataclass(frozen=True)
class WorkloadCell:
    key: str  # "latency" | "throughput" | "long_context"
    title: str
    context: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"ctx {self.context}, C={self.concurrency}"


def workloads(results: RunResults) -> list[WorkloadCell]:
    if not results.contexts or not results.concurrency:
        return []
    short, long_ = min(results.contexts), max(results.contexts)
    low, high = min(results.concurrency), max(results.concurrency)
    out = [
        WorkloadCell("latency", "Latency", short, low),
        WorkloadCell("throughput", "Throughput", short, high),
    ]
    if long_ != short:
        out.append(WorkloadCell("long_context", "Long context", long_, low))
    return out


@dataclass(frozen=True)
class Ranked:
    config: ConfigResult
    tok_s: float
    goodput: float | None = None  # requests/s meeting the SLO, when the run has one

    def value(self, metric: str) -> float:
        return (self.goodput or 0.0) if metric == "goodput" else self.tok_s


@dataclass(frozen=True)
class Recommendation:
    workload: WorkloadCell
    ranking: tuple[Ranked, ...]  # best first, configs with a finished cell only
    spread: str  # "exceeds" | "within" | "unknown" | "no runner-up"
    spread_detail: str
    vs_ar: float | None  # winner / AR (same extra dimensions)
    vs_dflash: float | None  # winner / the best DFlash chain (same extra dimensions)
    metric: str = "tok_s"  # what the ranking is on: "tok_s", or "goodput" when the run has an SLO
    excluded: tuple[str, ...] = ()  # config ids with a finished cell left out: they failed the lossless gate

    @property
    def winner(self) -> Ranked | None:
        return self.ranking[0] if self.ranking else None

    @property
    def runner_up(self) -> Ranked | None:
        return self.ranking[1] if len(self.ranking) > 1 else None

    @property
    def margin(self) -> float | None:
        """Winner minus runner-up, in the ranking's unit (tokens/s, or requests/s of goodput)."""
        if self.winner is None or self.runner_up is None:
            return None
        return self.winner.value(self.metric) - self.runner_up.value(self.metric)

    @property
    def margin_pct(self) -> float | None:
        if self.margin is None or not self.runner_up or self.runner_up.value(self.metric) <= 0:
            return None
        return 100.0 * self.margin / self.runner_up.value(self.metric)


def rank(results: RunResults, context: int, concurrency: int, *, methods: tuple[str, ...] | None = None,
         metric: str = "tok_s") -> list[Ranked]:
    """Configs with a finished cell, best first on ``metric`` (``goodput`` ties are broken by tok/s)."""
    ranked = []
    for c in results.configs:
        cell = c.cell(context, concurrency)
        if (methods is None or c.method in methods) and cell is not None and cell.tok_s is not None:
            ranked.append(Ranked(c, cell.tok_s, cell.goodput.mean if cell.goodput else None))
    # ties keep grid order (baselines first), so equal numbers never crown a tree setting by accident
    if metric == "goodput":
        return sorted(ranked, key=lambda r: (-(r.goodput or 0.0), -r.tok_s))
    return sorted(ranked, key=lambda r: -r.tok_s)


def spread_verdict(winner: ConfigResult, runner_up: ConfigResult, context: int, concurrency: int,
                   metric: str = "tok_s") -> tuple[str, str]:
    w, r = winner.cell(context, concurrency), runner_up.cell(context, concurrency)
    assert w is not None and r is not None
    if metric == "goodput" and w.goodput is not None and r.goodput is not None:
        if w.runs < 2 or r.runs < 2:
            return "unknown", f"{min(w.runs, r.runs)} run per cell: spread not measured (use --repeats 2 or more)"
        if w.goodput.min > r.goodput.max:
            return "exceeds", (f"slowest winner run {w.goodput.min:.2f} > fastest runner-up run "
                               f"{r.goodput.max:.2f} req/s within the SLO")
        return "within", (f"slowest winner run {w.goodput.min:.2f} <= fastest runner-up run {r.goodput.max:.2f} "
                          "req/s within the SLO")
    if w.runs < 2 or r.runs < 2 or w.tok_s_min is None or r.tok_s_max is None:
        runs = min(w.runs, r.runs)
        return "unknown", f"{runs} run per cell: spread not measured (use --repeats 2 or more)"
    if w.tok_s_min > r.tok_s_max:
        return "exceeds", f"slowest winner run {w.tok_s_min:.1f} > fastest runner-up run {r.tok_s_max:.1f} tok/s"
    return "within", f"slowest winner run {w.tok_s_min:.1f} <= fastest runner-up run {r.tok_s_max:.1f} tok/s"


def speedup_over(results: RunResults, config: ConfigResult, method: str, context: int, concurrency: int) -> float | None:
    """``config``'s tok/s over the best ``method`` config with the same extra dimensions at one cell."""
    mine = config.tok_s(context, concurrency)
    refs = [t for c in results.baseline(method, config.dims) if (t := c.tok_s(context, concurrency)) is not None]
    if mine is None or not refs or max(refs) <= 0:
        return None
    return mine / max(refs)


def recommend(results: RunResults) -> list[Recommendation]:
    out = []
    metric = "goodput" if results.slo else "tok_s"
    failing = {c.config_id for c in results.configs if c.gate is not None and c.gate.passes is False}
    for wl in workloads(results):
        full = rank(results, wl.context, wl.concurrency, metric=metric)
        ranking = [r for r in full if r.config.config_id not in failing]
        excluded = tuple(r.config.config_id for r in full if r.config.config_id in failing)
        if len(ranking) >= 2:
            spread, detail = spread_verdict(ranking[0].config, ranking[1].config, wl.context, wl.concurrency,
                                            metric)
        else:
            spread, detail = "no runner-up", "fewer than two configs measured this cell"
        vs_ar = vs_dflash = None
        if ranking:
            vs_ar = speedup_over(results, ranking[0].config, "ar", wl.context, wl.concurrency)
            vs_dflash = speedup_over(results, ranking[0].config, "dflash", wl.context, wl.concurrency)
        out.append(Recommendation(wl, tuple(ranking), spread, detail, vs_ar, vs_dflash, metric, excluded))
    return out


def best_per_cell(results: RunResults) -> dict[tuple[int, int], Ranked]:
    """The fastest config at every (context, concurrency) cell with at least one finished measurement."""
    best = {}
    for ctx in results.contexts:
        for conc in results.concurrency:
            ranking = rank(results, ctx, conc)
            if ranking:
                best[(ctx, conc)] = ranking[0]
    return best


# ------------------------------------------------------------------------------------------------ knobs
@dataclass(frozen=True)
class KnobEffect:
    knob: str
    values: tuple[Any, ...]
    median_change_pct: float  # median over groups x cells of (max - min) / max tokens/s, in %
    threshold_pct: float
    best_value: Any  # the value most often fastest (ties: the first in grid order)
    best_share: float  # fraction of comparisons it won
    accept_by_value: dict[Any, float]  # mean acceptance length per value
    comparisons: int

    @property
    def mattered(self) -> bool:
        return self.median_change_pct > self.threshold_pct


def noise_pct(results: RunResults) -> float | None:
    """Median relative range of repeats ((max - min) / mean) over cells measured more than once."""
    values = [
        100.0 * (c.tok_s_max - c.tok_s_min) / c.tok_s
        for cfg in results.configs
        for c in cfg.cells.values()
        if c.runs >= 2 and c.tok_s and c.tok_s_max is not None and c.tok_s_min is not None
    ]
    return statistics.median(values) if values else None


def knob_effects(results: RunResults) -> list[KnobEffect]:
    noise = noise_pct(results)
    threshold = max(100.0 * MIN_EFFECT, noise or 0.0)
    effects = []
    for knob in KNOBS:
        configs = [c for c in results.configs if c.method in _KNOB_METHODS[knob]]
        values = list(dict.fromkeys(c.settings.get(knob) for c in configs))
        if len(values) < 2:
            continue
        groups: dict[tuple, list[ConfigResult]] = defaultdict(list)
        for c in configs:
            rest = tuple((k, c.settings.get(k)) for k in ("method", *KNOBS) if k != knob)
            groups[rest + tuple(sorted(c.dims.items()))].append(c)
        changes: list[float] = []
        wins: Counter = Counter()
        for members in groups.values():
            if len({m.settings.get(knob) for m in members}) < 2:
                continue
            for cell in {k for m in members for k in m.cells}:
                speeds = [(m.tok_s(*cell), m.settings.get(knob)) for m in members]
                speeds = [(s, v) for s, v in speeds if s is not None]
                if len(speeds) < 2 or max(s for s, _ in speeds) <= 0:
                    continue
                top = max(s for s, _ in speeds)
                changes.append(100.0 * (top - min(s for s, _ in speeds)) / top)
                wins[next(v for s, v in speeds if s == top)] += 1
        if not changes:
            continue
        accept: dict[Any, list[float]] = defaultdict(list)
        for c in configs:
            if c.accept_length is not None:
                accept[c.settings.get(knob)].append(c.accept_length)
        best_value, best_count = max(wins.items(), key=lambda kv: (kv[1], -values.index(kv[0])))
        effects.append(
            KnobEffect(
                knob=knob,
                values=tuple(values),
                median_change_pct=statistics.median(changes),
                threshold_pct=threshold,
                best_value=best_value,
                best_share=best_count / len(changes),
                accept_by_value={v: statistics.fmean(a) for v, a in accept.items()},
                comparisons=len(changes),
            )
        )
    return effects


def ddtree_vs_dflash(results: RunResults) -> dict[tuple[int, int], float]:
    """Best DDTree over best DFlash chain tokens/s per cell (> 1: the tree pays for itself there)."""
    out = {}
    for ctx in results.contexts:
        for conc in results.concurrency:
            tree = rank(results, ctx, conc, methods=("ddtree",))
            chain = rank(results, ctx, conc, methods=("dflash",))
            if tree and chain and chain[0].tok_s > 0:
                out[(ctx, conc)] = tree[0].tok_s / chain[0].tok_s
    return out


# ------------------------------------------------------------------------------------------------ prose
def fmt_value(knob: str, value: Any) -> str:
    if value is None:
        return {"topk": "none (no cap)", "block_size": "trained", "draft_window": "none"}.get(knob, "none")
    return str(value)


def conclusions(results: RunResults) -> list[str]:
    """A few bullets fit for a commit message: winners and margins, knobs that did or did not matter, anomalies."""
    bullets: list[str] = []
    for rec in recommend(results):
        win, run = rec.winner, rec.runner_up
        if win is None:
            bullets.append(f"{rec.workload.title} ({rec.workload.label}): no finished measurement.")
            continue
        text = f"{rec.workload.title} ({rec.workload.label}): **{results.label(win.config.config_id)}** at {win.tok_s:.1f} tok/s"
        if rec.metric == "goodput":
            text += f", {win.goodput or 0.0:.2f} req/s within the SLO"
        if run is not None and rec.margin_pct is None and rec.metric == "goodput":
            text += f", while {results.label(run.config.config_id)} and the rest met the SLO with no request"
        if run is not None and rec.margin_pct is not None:
            verdict = {
                "exceeds": "beyond the run-to-run spread",
                "within": "within the run-to-run spread, so not a reliable difference",
                "unknown": "spread not measured",
            }[rec.spread]
            unit = "goodput " if rec.metric == "goodput" else ""
            text += f", {unit}{rec.margin_pct:+.1f}% over {results.label(run.config.config_id)} ({verdict})"
        extras = [f"{v:.2f}x {name}" for name, v in (("AR", rec.vs_ar), ("DFlash", rec.vs_dflash)) if v is not None]
        if extras and win.config.method == "ddtree":
            text += f"; {', '.join(extras)}"
        bullets.append(text + ".")
    for eff in knob_effects(results):
        accept = ""
        if len(eff.accept_by_value) >= 2:
            ordered = [(v, eff.accept_by_value[v]) for v in eff.values if v in eff.accept_by_value]
            accept = "; acceptance " + ", ".join(f"{a:.2f} at {fmt_value(eff.knob, v)}" for v, a in ordered)
        if eff.mattered:
            bullets.append(
                f"{eff.knob} mattered: changing it alone moved tok/s by {eff.median_change_pct:.1f}% (median of "
                f"{eff.comparisons} comparisons); {fmt_value(eff.knob, eff.best_value)} was fastest in "
                f"{100 * eff.best_share:.0f}% of them{accept}."
            )
        else:
            bullets.append(
                f"{eff.knob} barely mattered: changing it alone moved tok/s by {eff.median_change_pct:.1f}% "
                f"(median of {eff.comparisons} comparisons, threshold {eff.threshold_pct:.1f}%){accept}."
            )
    ar_wins = []
    for rec in recommend(results):
        if rec.winner is not None and rec.winner.config.method == "ar":
            wl = rec.workload
            spec_ranked = rank(results, wl.context, wl.concurrency, methods=("dflash", "ddtree"))
            if spec_ranked:
                best = spec_ranked[0]
                ratio = best.tok_s / rec.winner.tok_s if rec.winner.tok_s > 0 else 0.0
                cell = best.config.cell(wl.context, wl.concurrency)
                acc = f", acceptance {cell.accept_length:.2f}" if cell and cell.accept_length else ""
                ar_wins.append(f"{wl.label} (best speculative: {results.label(best.config.config_id)}, "
                               f"{ratio:.2f}x AR{acc})")
    if ar_wins:
        bullets.append(
            "Anomaly: no speculative setting beat plain decoding at " + "; ".join(ar_wins)
            + ". Drafting and verifying cost more than the accepted tokens saved on this hardware and drafter."
        )
    losses = {cell: r for cell, r in ddtree_vs_dflash(results).items() if r < 1.0}
    if losses:
        where = ", ".join(f"ctx {c} C={n} ({r:.2f}x)" for (c, n), r in sorted(losses.items()))
        bullets.append(f"Anomaly: the best DDTree setting lost to the DFlash chain at {where}.")
    bullets.extend(depth_bullets(results))
    bullets.extend(_gate_bullets(results))
    failed = [(c.config_id, cell) for c in results.configs for cell in c.failures]
    if failed:
        shown = ", ".join(f"{cid}/{cell}" for cid, cell in failed[:6])
        more = f" and {len(failed) - 6} more" if len(failed) > 6 else ""
        bullets.append(f"{len(failed)} cell(s) failed and are missing from the tables: {shown}{more} (failure.json).")
    return bullets


FLAT_TAIL_SHARE = 0.10  # past the trained depth, less than this share of the accepted drafts counts as flat


def depth_bullets(results: RunResults) -> list[str]:
    """Where acceptance stops growing with depth: a line when the depths past the drafter's trained depth
    (its block size - 1) add less than :data:`FLAT_TAIL_SHARE` of the accepted drafts in every config that
    drafted past it (the user story's block 16 on a drafter trained at 8: acceptance 4.9 -> 5.2)."""
    if results.trained_block_size is None:
        return []
    trained = results.trained_block_size - 1
    deep = [(c, c.accept_by_depth) for c in results.configs if len(c.accept_by_depth) > trained]
    if not deep:
        return []
    tails = [(c, sum(curve[trained:]), sum(curve)) for c, curve in deep if sum(curve) > 0]
    if not tails:
        return []
    worst = max(tails, key=lambda t: t[1] / t[2])
    share = worst[1] / worst[2]
    if share < FLAT_TAIL_SHARE:
        return [
            f"Acceptance past the drafter's trained depth ({trained}) is flat: in the {len(tails)} config(s) that "
            f"drafted deeper, depths {trained + 1}+ added at most {worst[1]:.2f} tokens per round "
            f"({100 * share:.0f}% of the accepted drafts, {results.label(worst[0].config_id)}). The ceiling is the "
            "drafter, not the tree: block sizes past the trained one buy little."
        ]
    return [
        f"Depths past the drafter's trained depth ({trained}) still accepted: up to {worst[1]:.2f} tokens per round "
        f"({100 * share:.0f}% of the accepted drafts, {results.label(worst[0].config_id)})."
    ]


def demo_bullets(results: RunResults) -> list[str]:
    if not results.demo_pair:
        return []
    return [
        "Measured on the embedded demo pair: its model is far too small to solve HumanEval, so a low coding score "
        "says nothing here. On this pair the coding gate checks losslessness: every speculative config's greedy "
        "outputs must equal AR's, token for token."
    ]


def _gate_bullets(results: RunResults) -> list[str]:
    bullets = demo_bullets(results)
    gated = [c for c in results.configs if c.gate is not None]
    if not gated:
        return bullets
    truncating = [c for c in gated if c.gate and c.gate.truncated]
    if truncating and len(truncating) == len(gated) and len({c.gate.truncated_tasks for c in gated if c.gate}) == 1:
        g = truncating[0].gate
        assert g is not None
        bullets.append(
            f"Coding gate: in every config {g.truncated} answer(s) were truncated at max_tokens "
            f"({', '.join(g.truncated_tasks)}), a harness limit rather than wrong answers (raise the gate's max tokens)."
        )
    else:
        for c in truncating[:3]:
            g = c.gate
            assert g is not None
            bullets.append(
                f"Coding gate: {results.label(c.config_id)} scored {g.passed}/{g.total}; {g.truncated} answer(s) were truncated at "
                f"max_tokens ({', '.join(g.truncated_tasks)}), a harness limit rather than a wrong answer."
            )
        if len(truncating) > 3:
            bullets.append(f"Coding gate: {len(truncating) - 3} more config(s) had truncated answers (see the table).")
    scores = Counter((c.gate.passed, c.gate.total) for c in gated if c.gate)
    if len(scores) == 1:
        (passed, total), _ = scores.most_common(1)[0]
        bullets.append(f"Coding gate: every config scored {passed}/{total}.")
    checked = [c for c in gated if c.gate and c.gate.lossless is not None]
    failed = [c for c in checked if c.gate and c.gate.verdict == "failed"]
    unclassified = [c for c in checked if c.gate and c.gate.verdict == "unclassified"]
    ties = [c for c in checked if c.gate and c.gate.verdict == "near_ties"]
    if failed:
        names = ", ".join(f"{results.label(c.config_id)} ({', '.join(c.gate.real_tasks)})" for c in failed if c.gate)
        bullets.append(f"Lossless check FAILED: real divergences from AR's greedy outputs (a gap no rounding explains) "
                       f"for {names}; left out of the recommendations.")
    if unclassified:
        names = ", ".join(f"{results.label(c.config_id)} ({', '.join(c.gate.differing_tasks)})"
                          for c in unclassified if c.gate)
        bullets.append(f"Lossless check FAILED: greedy outputs differ from AR for {names} (not classified: the "
                       "result has no token log-probs); left out of the recommendations.")
    if ties:
        names = ", ".join(f"{results.label(c.config_id)} ({', '.join(c.gate.near_tie_tasks)})" for c in ties if c.gate)
        margin = next((c.gate.near_tie_margin for c in ties if c.gate and c.gate.near_tie_margin is not None), None)
        within = f" within {margin:g} nats" if margin is not None else ""
        bullets.append(f"Lossless check passed with a note: outputs differ from AR only at numeric near-ties (the two "
                       f"tokens' AR log-probs{within}, what bf16 rounding can flip) for {names}.")
    drifting = [c for c in checked if c.gate and c.gate.drifting_tasks]
    if drifting:
        names = ", ".join(f"{results.label(c.config_id)} ({', '.join(c.gate.drifting_tasks)})"
                          for c in drifting if c.gate)
        bullets.append(f"Log-prob drift: outputs identical to AR's, but the two runs' log-probs of the same tokens "
                       f"differ by more than the near-tie margin for {names}: the verify computes another "
                       "distribution, although no token has flipped on the gate yet.")
    if checked and not (failed or unclassified or ties):
        bullets.append(
            f"Lossless check: all {len(checked)} speculative configs produced byte-identical greedy outputs to AR "
            "on the gate."
        )
    return bullets


__all__ = [
    "KnobEffect",
    "Ranked",
    "Recommendation",
    "WorkloadCell",
    "best_per_cell",
    "conclusions",
    "ddtree_vs_dflash",
    "demo_bullets",
    "depth_bullets",
    "knob_effects",
    "noise_pct",
    "rank",
    "recommend",
    "workloads",
]
