"""``budget: "auto"``: the tree size of each round chosen for the most committed tokens per second of the batch.

Terms
-----
candidates
    The declared, finite set of budgets auto may choose: ``2^k - 1`` up to the engine's ``max_budget``
    (1, 3, 7, 15, 31, 63 for 64). ``2^k - 1`` verifies exactly ``2^k`` rows with the root (a GEMM and tree-attention
    tile boundary; on the H200 it beat ``2^k`` in every cell measured), and a finite set is what a warm-up plan can
    capture (``ddtree.engine.warmup`` plans these buckets when the default tree is auto). With :data:`ZERO`, a
    round may also take budget 0, no tree (:func:`options`).
no tree
    An auto round at budget 0 verifies each row's root alone, as AR does, and drafts nothing; its verify still
    returns the target's features and the commit appends them, so the drafter's context stays whole and a later
    round drafts from it (``RoundShape.drafts`` against ``keeps_context``). Its objective is the rows' count
    (``E(0) = 1``) over the curve's context points (``CostCurve.context_seconds``: such rounds timed), or on a
    curve without them over its budget-0 point, AR's rounds, which lack that feature copy (on the H200 stand-in
    0.36 ms of a 7 ms round at 64 rows): a few per cent cheap. Why: where no tree earns
    its cost (rows whose drafter is rarely right: sampling at temperature 1, 64 in flight) the smallest tree still
    cost 16 % of AR's tokens per second on the H100 stand-in (docs/benchmarks.md, "No tree as an auto option"). A
    round at 0 observes nothing: its rows keep their observed lengths as they were and count the round
    (:meth:`AutoChooser.read_idle`), and once the rows have run :data:`PROBE_ROUNDS` rounds at 0 on average, one
    round probes a tree (:meth:`AutoChooser.choose`), at least the initial size (:func:`probe_budget`); its read
    ages the rows' evidence from before the idle rounds by their count, so the probe's fresh lengths weigh as a
    round's newest do. Why not the exploration of trees (decayed
    evidence, the next size up, within a slack): decayed to nothing, a row's lengths fall back to the surrogate,
    which undervalues trees, and the next size up from 0, b1, pays a draft and a tree stage for one node, far
    beyond any slack; on the CPU demo pair under the H100's prices that kept greedy code at 0 for two thirds of
    its rows' rounds until the rows finished (accepting 1.5 tokens a round against b7's 2.4).
expected length ``E(n)``
    The expected tokens a round commits with the best tree of ``n`` draft nodes under the drafter's factorised
    surrogate: ``1 + sum of the n largest node probabilities``. DDTree's nodes come in descending-score order, so
    ``E(n) = 1 + cumsum(exp(scores))[n]`` gives it for every ``n`` at once
    (:func:`ddtree.speculative.tree_select.expected_lengths`). ``E(0) = 1``.
curve width ``W``
    How many sizes an auto round reports: the next candidate above the round's node bucket (its own size at the
    top). The tree stage then selects ``W`` nodes, verifies the first ``N - 1`` (the best tree of ``N - 1`` nodes is
    the first ``N - 1`` of the best ``W``: best-first order is prefix-closed) and returns ``E(1 .. W)`` per row in the
    round's result, so auto can look one candidate further than it verified (a round at b7 learns ``E`` up to 15).

The device side (the tree stage of an auto round: the expected lengths and the verified prefix of the wider
selection) is :func:`ddtree.speculative.tree_select.expected_lengths` / :func:`~ddtree.speculative.tree_select.prefix_trees`;
this module is the host side: candidates, the choice, smoothing, calibration and the observed lengths, and the
scheduler's bookkeeping of them (:class:`AutoChooser`); the fallback cost curve is
:func:`ddtree.engine.cost_measure.fallback_curve`.

The choice, per round (the verify is padded to one node count ``N`` for all rows, so a row gains nothing from
fewer nodes than the round verifies: every auto row takes the round's whole budget)::

    B* = argmax over B in {floor} + {c in candidates: c > floor} of  sum_i E_i(min(B, cap_i)) / T(R, B, kv(B))

``floor``: the largest budget of a fixed row (its tree, or a chain's depth, sets the round's width anyway), 0
when no fixed row drafts (with :data:`ZERO` the options then hold 0, no tree, whose ``E`` is 1 for every row);
``cap_i``: a fixed row's own budget (its ``E`` stops growing there), none for auto rows; ``E_i`` beyond the sizes a
row has reported is held at its last value (a lower bound: ``E`` never decreases), so unexplored sizes are never
favoured. ``T`` is the cost curve (:mod:`ddtree.engine.cost_curve`), made non-decreasing in the budget
(:func:`rising`: a noisy curve must not make a larger tree look cheaper). Worked example: one auto row with
``E = (1.8, 2.4, 2.6)`` at b1, b3, b7 (so 1 + p1 = 1.8, ...) and ``T = 10, 12, 20`` ms: 180, 200, 130 tokens/s: b3.

Calibration (a departure from the issue's pure surrogate): the drafter's factorised probabilities can be far
from what the target accepts (the demo drafter's predicted about 1 / 1.3 of the draft tokens its trees got
accepted on a code prompt), which makes auto choose trees that are too small. Each row keeps decayed sums of the
draft tokens its rounds accepted and of those its surrogate predicted for the verified tree (:func:`gain_update`),
and the choice uses ``1 + g (E(n) - 1)`` with ``g`` their ratio (:func:`calibrated`): the drafter sets the curve's
shape, the row's own acceptance its level.

Observed lengths (what the choice uses where it has them): a round that verified ``N`` draft nodes also tells,
exactly for greedy rows, what every smaller tree of the same draft would have committed: best-first order is
prefix-closed, so the tree of the first ``m`` nodes is a subtree of the verified one and its accepted path is the
part of the verified path whose node ranks are at most ``m``. Auto rounds return each row's accepted path (its
node indices), and each row keeps decayed per-size averages of those counterfactual lengths
(:func:`observed_update`); the choice reads them for the sizes the row has verified and adds the calibrated
surrogate's increments only past them (:func:`observed_curve`). Why: on the demo pair the surrogate's shape, not
only its level, is off (its nodes past the first few are undervalued: +0.1-0.2 expected tokens from b7 to b15
against +1.2 accepted from b4 to b16), which no single gain corrects. With :data:`STEPS` (off by default) a row
keeps, per size, the step its lengths take from the size below instead: a size the row no longer verifies then
keeps what it added on top of the sizes below it, read on their fresh lengths, where a kept total falls behind the
fresh lengths below it as acceptance rises and the curve reads flat past the size in use. For sampled rows the
counterfactual is an estimate (a smaller tree changes the sampling walk). The observed lengths are blended with the
calibrated surrogate, which counts as :data:`PRIOR_WEIGHT` rounds, and every size's evidence decays each round; a
size above the best whose evidence has faded is verified again now and then (:class:`AutoChooser`), since a size
that one unlucky round made look poor would otherwise never be tried again.

Prices: the cost curve's time for each option; with :data:`OFFSET`, plus the decayed mean of what the rounds read
took past their price (:meth:`AutoChooser.observe_period`): host work and load the curve, measured with rounds
replayed back to back, does not see, which every option pays alike.

Smoothing: a row's reported curve is averaged with its previous one (weight :data:`SMOOTHING` on the newest), over
the sizes both cover. A row that has not reported yet (its first round) takes the mean curve of the round's rows
that have; a round where no row has takes :func:`initial_budget`. Hysteresis: the round keeps the size of the
previous round unless another beats it by :data:`MARGIN`, so near-ties do not change graphs back and forth (a new
size no longer breaks the overlap of rounds: a follow-up round sets it on the device, ``Scheduler._follow_size``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

log = logging.getLogger("ddtree.engine")

AUTO = "auto"  # TreeSettings.budget of a request whose tree size the engine chooses per round
# The tuning constants below are read when used, never bound as default arguments: benchmarks/auto_ab.py's variants
# set them on the module between runs (a default argument kept the import-time value and ignored them).
SMOOTHING = 0.5  # weight of a row's newest curve against its running one
MARGIN = 0.02  # another size must beat the previous round's by this fraction to replace it
GAIN_DECAY = 0.9  # weight of a row's older rounds in its calibration sums (about the last 10 rounds count)
PRIOR_WEIGHT = 1.0  # the calibrated surrogate counts as this many rounds in a row's observed lengths
# exploration: the next candidate above the best is verified once the rows' evidence on it has decayed below this
# many rounds (0.9^11 = 0.31: about every 11 rounds) and its objective is within EXPLORE_SLACK of the best's.
# An exploring round gives up at most EXPLORE_SLACK of one round's objective every ~11 rounds (less with newcomers,
# whose evidence is 0): 0.25 let a b15 round in about every 9 at 64 in flight (H100, 2026-12-05: 11.6 % of auto's
# row-rounds at b15, its verify 5 % and its round 6 % dearer than b7's for 0.8 % more tokens a round), where a
# 1024-row verify costs nearly twice a 512-row one; 0.10 bounds the loss near 1 % and still lets in a size whose
# cost barely rises (one row, a flat curve: the one-row trap this exists for).
EXPLORE_EVIDENCE = 0.32
EXPLORE_SLACK = 0.10
# observed lengths kept as steps (what each size commits beyond the size below it, over the rounds that verified it),
# so a size the row no longer verifies reads its last steps on top of the fresh lengths below it (observed_update).
# Off (totals per size): on the CPU demo pair the two were within the runs' spread (docs/benchmarks.md, "Budget
# auto's predictions against its rounds"); the GPU A/B is benchmarks/results/auto_trace_2026-12-07/call.sh
STEPS = False
# a round's time beyond what the cost curve prices it at (host work, a curve measured on a quieter machine), a
# decayed mean over the rounds read, added to every option's price (AutoChooser.observe_period). Off: on the CPU demo
# pair it moved auto by -11 % to +7 % against b15 across four cells (docs/benchmarks.md, "Budget auto's predictions
# against its rounds"); the offset is still measured, and traced by auto_ab.py --trace
OFFSET = False
# a round may take budget 0, no tree (module doc): where every tree costs more than it earns, auto runs as AR does
ZERO = True
# rounds at budget 0 the auto rows have run on average (since their last tree or since they joined) after which one
# round probes a tree (probe_budget): about the exploration's pace (0.9^11 = 0.31); each probe gives up the gap
# between no tree's objective and the probed size's, for one round in PROBE_ROUNDS + 1 (where no tree stays right,
# every row sampled at 64 in flight on the H100 stand-in, the probes cost about 11 % of auto's tokens per second)
PROBE_ROUNDS = 11


def candidates(max_budget: int) -> tuple[int, ...]:
    """The budgets auto may choose: ``2^k - 1 <= max_budget`` (at least ``(1,)``)."""
    out = tuple((1 << k) - 1 for k in range(1, 63) if (1 << k) - 1 <= max_budget)
    return out or (1,)


def initial_budget(cands: Sequence[int]) -> int:
    """A round's budget when none of its rows has a curve yet: the largest candidate up to 15 (the H200's best
    fixed budget at one request was 31-63, at 64 in flight 4; 15 sits between and its curve reaches 31)."""
    small = [c for c in cands if c <= 15]
    return max(small) if small else min(cands)


def probe_budget(trees: Sequence[int], values: dict[int, float], cands: Sequence[int]) -> int:
    """The tree size a probe out of no tree verifies: the best tree by ``values`` (the objective), or the initial
    budget where that is larger (a probe verifies what a newcomer's first round does, and observes every size up
    to it). Why not the best tree alone: rows that went to no tree on a few poor rounds have curves near 1 at every
    size, whose best is the smallest tree, and a b1 round observes b1 only; on the CPU demo pair (greedy code,
    replayed over the sweep's prompts: ``ddtree.lab.replay.auto``) probes at b1 kept 60-70 % of the row-rounds at
    no tree where a per-round oracle would use it for 9-19 %, and auto at 0.83-0.88x the best fixed budget at one
    request."""
    best = max(trees, key=lambda b: (values[b], -b))
    first = initial_budget(cands)
    return max(best, first) if first in trees else best


def curve_width(nodes: int, cands: Sequence[int]) -> int:
    """Sizes an auto round whose node bucket is ``nodes`` reports: the next candidate above it, else ``nodes``."""
    above = [c for c in cands if c > nodes]
    return min(above) if above else nodes


# ---- the host side: the choice ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowCurve:
    """One row's part in the choice: its expected lengths and, for a fixed row, the budget its tree stops at."""

    curve: tuple[float, ...]  # [n - 1] = E(n), n = 1 .. len; empty: E = 1 at every size (AR)
    cap: int | None = None  # None: an auto row (takes the round's budget)

    def expected(self, budget: int) -> float:
        b = budget if self.cap is None else min(budget, self.cap)
        if b <= 0 or not self.curve:
            return 1.0
        return self.curve[min(b, len(self.curve)) - 1]


def options(cands: Sequence[int], floor: int, zero: bool = False) -> tuple[int, ...]:
    """The budgets a round may take: the fixed rows' floor (when above 0) and every candidate above it; with
    ``zero`` and no fixed row drafting (``floor`` 0), also 0 (no tree)."""
    return tuple(sorted(({floor} if floor > 0 or zero else set()) | {c for c in cands if c > floor}))


def objective(rows: Sequence[RowCurve], budget: int, cost: Callable[[int], float]) -> float:
    """Expected committed tokens per second of the round at ``budget``."""
    return sum(r.expected(budget) for r in rows) / cost(budget)


def rising(cost: Callable[[int], float], opts: Sequence[int]) -> Callable[[int], float]:
    """``cost`` over ``opts`` made non-decreasing in the budget, each value the smallest at or above it: a bigger tree
    never costs less, so where a smaller tree measured dearer the larger one's time bounds it.

    Why from above and not the largest at or below: a measurement's noise only adds time (load, a slow first
    round), and a budget that measured high lifted every larger one to it, flattening the curve so that large trees
    looked nearly free (the idle-CPU run of 2026-12-01, run 7: b1 at 50.0 ms, b15 at 39.5, b63 at 54.5 read as 50,
    50 and 54.5, and auto chose trees larger than the best fixed budget's)."""
    out, low = {}, math.inf
    for b in sorted(opts, reverse=True):
        low = min(low, cost(b))
        out[b] = low
    return out.__getitem__


def choose_budget(rows: Sequence[RowCurve], opts: Sequence[int], cost: Callable[[int], float], *,
                  previous: int | None = None, margin: float = 0.0) -> int:
    """The argmax of :func:`objective` over ``opts`` (ties: the smaller budget); with ``previous`` in ``opts``, it is
    kept unless the best beats it by more than ``margin`` (a fraction)."""
    if not opts:
        raise ValueError("choose_budget needs at least one option")
    return best_of({b: objective(rows, b, cost) for b in opts}, previous=previous, margin=margin)


def best_of(values: dict[int, float], *, previous: int | None = None, margin: float = 0.0) -> int:
    """:func:`choose_budget`'s pick from the objective's ``values`` by budget."""
    best = max(values, key=lambda b: (values[b], -b))
    if previous is not None and previous in values and values[best] <= values[previous] * (1.0 + margin):
        return previous
    return best


def gain_update(sums: tuple[float, float], committed: int, expected: float,
                decay: float | None = None) -> tuple[float, float]:
    """A row's calibration sums after a round that committed ``committed`` tokens (bonus included) with a tree
    whose surrogate expected length was ``expected``: decayed sums of the draft tokens accepted and predicted."""
    if expected <= 1.0 + 1e-6:  # AR, or a tree the drafter gave no probability: nothing to calibrate against
        return sums
    decay = GAIN_DECAY if decay is None else decay
    return decay * sums[0] + (committed - 1), decay * sums[1] + (expected - 1.0)


def calibrated(curve: Sequence[float], sums: tuple[float, float],
               prior: tuple[float, float] = (0.0, 0.0)) -> tuple[float, ...]:
    """``curve`` with its draft part scaled by the row's measured gain (accepted / predicted draft tokens, clamped
    to [1/20, 20]): ``1 + g (E(n) - 1)``. The drafter's factorised probabilities set the shape (which sizes add
    most), what the row really accepts sets the level. A row whose sums predict less than one draft token yet
    takes the gain of ``prior`` (the engine's sums over every row), 1 when that is empty too."""
    use = sums if sums[1] >= 1.0 else prior
    gain = min(max(use[0] / use[1], 0.05), 20.0) if use[1] > 0 else 1.0
    return tuple(1.0 + gain * (float(v) - 1.0) for v in curve)


def observed_update(seen: Sequence[tuple[float, float]], ranks: Sequence[int], verified: int,
                    decay: float | None = None) -> tuple[tuple[float, float], ...]:
    """A row's observed lengths after a round that verified ``verified`` draft nodes and accepted the nodes of
    ``ranks`` (their indices in best-first order, 1-based, one per depth: increasing, as a node's ancestors precede
    it): per size ``m`` a decayed sum of the tokens a tree of the first ``m`` nodes would have committed,
    ``1 + #{r in ranks: r <= m}`` for ``m <= verified`` (exact for greedy rounds: the smaller tree is a prefix of
    the verified one, and its accepted path the part of this one inside it), and a decayed count of those rounds.
    Every size decays each round, so the evidence on a size the row stopped verifying fades and the prior takes
    over again (:func:`observed_curve`)."""
    decay = GAIN_DECAY if decay is None else decay
    out = [(decay * total, decay * weight) for total, weight in seen]
    accepted = 0  # ranks <= m so far (the ranks increase: one pass)
    for m in range(1, verified + 1):
        before = accepted
        while accepted < len(ranks) and ranks[accepted] <= m:
            accepted += 1
        committed = float(accepted - before) if STEPS else 1.0 + accepted
        if m <= len(out):
            total, weight = out[m - 1]
            out[m - 1] = (total + committed, weight + 1.0)
        else:
            out.append((committed, 1.0))
    return tuple(out)


def observed_curve(seen: Sequence[tuple[float, float]], surrogate: Sequence[float],
                   prior_weight: float | None = None) -> tuple[float, ...]:
    """A row's ``E(1 ..)`` for the choice: at each size its observed lengths (:func:`observed_update`) blended with
    the calibrated surrogate (:func:`calibrated`) counted as ``prior_weight`` rounds, ``(sum + w0 S) / (count +
    w0)``; past the sizes observed, the surrogate's increments; non-decreasing. Why a blend: one unlucky round must
    not fix a size's estimate (a first round that accepted nothing made every size look like AR, and a size that
    is never verified again is never corrected); the surrogate is what is known without a round."""
    if not seen:
        return tuple(surrogate)
    # One pass per row and read round over up to 2 x 31 sizes, on the engine thread: written for the interpreter
    # (no call per size), the values those of the plain loop (tests/engine/test_auto_budget.py keeps it as the oracle).
    n, w0 = len(surrogate), PRIOR_WEIGHT if prior_weight is None else prior_weight
    last = n - 1
    out, top = [], 1.0
    if STEPS:
        below = 1.0  # the surrogate at the size below (E(0) = 1)
        for m, (total, weight) in enumerate(seen):
            prior = float(surrogate[m if m < last else last]) if n else 1.0
            step = (total + w0 * (prior - below)) / (weight + w0)
            below = prior
            if step > 0.0:
                top += step
            out.append(top)
    else:
        for m, (total, weight) in enumerate(seen):
            prior = float(surrogate[m if m < last else last]) if n else 1.0
            value = (total + w0 * prior) / (weight + w0)
            if value > top:
                top = value
            out.append(top)
    if n > len(seen):  # past the observed sizes: the surrogate's increments
        base = float(surrogate[len(seen) - 1])
        for m in range(len(seen), n):
            step = float(surrogate[m]) - base
            out.append(top + step if step > 0.0 else top)
    return tuple(out)


def evidence(seen: Sequence[tuple[float, float]], size: int) -> float:
    """The decayed count of rounds that observed ``size`` (0 for a size never verified)."""
    return seen[size - 1][1] if 0 < size <= len(seen) else 0.0


def smoothed(old: Sequence[float] | None, new: Sequence[float], weight: float | None = None) -> tuple[float, ...]:
    """A row's running curve after a round that reported ``new``: the weighted mean where both cover a size, the
    new values past the old; sizes the new round did not report are dropped (they were measured on older trees)."""
    if not old:
        return tuple(float(v) for v in new)
    weight = SMOOTHING if weight is None else weight
    k = min(len(old), len(new))
    return tuple(weight * float(new[i]) + (1.0 - weight) * float(old[i]) for i in range(k)) + tuple(
        float(v) for v in new[k:])


def mean_curve(curves: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """The elementwise mean over the sizes every curve covers (the prior of a row without one)."""
    curves = [c for c in curves if c]
    if not curves:
        return ()
    k = min(len(c) for c in curves)
    return tuple(sum(c[i] for c in curves) / len(curves) for i in range(k))


# ---- the scheduler's bookkeeping -------------------------------------------------------------------------------

class KeptCurve(NamedTuple):
    """A row's curve as :meth:`AutoChooser.row_curve` computed it, with the inputs it was computed from (the state's
    tuples themselves: they are replaced, never changed, when a round is read)."""

    seen: tuple[tuple[float, float], ...]
    surrogate: tuple[float, ...]
    gain: tuple[float, float]
    prior: tuple[float, float] | None  # the engine's gain, where the row's own sums were too small to be used
    curve: tuple[float, ...]


class AutoChooser:
    """What the scheduler keeps for budget auto across rounds: the candidates, the size of the last auto round
    launched (for the hysteresis) and the engine-wide calibration sums (the prior of a row without its own). Rows
    are :class:`~ddtree.engine.request_state.RequestState` (their ``auto_*`` fields, their tree and stats)."""

    def __init__(self, max_budget: int) -> None:
        self.candidates = candidates(max_budget)
        self.previous: int | None = None
        self.gain = (0.0, 0.0)
        self.overhead = (0.0, 0.0)  # decayed sums of (a round's period - its price) and of their count

    def observe_period(self, wall: float, priced: float, decay: float | None = None) -> None:
        """Account for one auto round read ``wall`` seconds after the round queued before it, which the cost curve
        priced at ``priced``. Why: the choice divides by the curve, measured with rounds replayed back to back; a
        served round also waits on the host's work and on what else loads the machine (the scheduler leaves out
        periods with a prefill step or a prompt chunk in them: ``Scheduler._time_auto_round``). Time the
        curve does not see and that no option changes is shared by every token of the round, so leaving it out
        prices a larger tree too dear against a smaller one (on the 2-core CPU the curve priced one-row b15 rounds
        at 19-26 ms that took 29-44 ms, and auto chose trees smaller than the best fixed budget's). Used only with
        :data:`OFFSET`: an offset alone did not fix that curve, whose slope was off as well."""
        decay = GAIN_DECAY if decay is None else decay
        total, count = self.overhead
        self.overhead = (decay * total + (wall - priced), decay * count + 1.0)

    def offset(self) -> float:
        """Seconds added to every option's price: the decayed mean of the rounds' period past their price (0 before
        any round was timed)."""
        total, count = self.overhead
        return total / count if OFFSET and count > 0 else 0.0

    def read_row(self, state: Any, committed: int, reported: Sequence[float], path: Sequence[int],
                 verified: int) -> None:
        """Account for one row of a read auto round that committed ``committed`` tokens (bonus included):
        ``reported`` its ``E(1 .. W)``, ``path`` its accepted node indices (root first; the first ``committed``
        are real), ``verified`` the draft nodes its tree had. Updates the row's observed lengths, calibration sums
        and smoothed curve, and the engine-wide sums."""
        used = min(verified, len(reported))
        e_used = reported[used - 1] if used else 1.0
        if state.auto_idle:  # a probe after rounds at 0: the evidence before them is as old as those rounds
            age = GAIN_DECAY ** state.auto_idle
            state.auto_seen = tuple((total * age, weight * age) for total, weight in state.auto_seen)
            state.auto_gain = (state.auto_gain[0] * age, state.auto_gain[1] * age)
        state.auto_seen = observed_update(state.auto_seen, path[1:committed], verified)
        state.auto_idle = 0
        state.auto_gain = gain_update(state.auto_gain, committed, e_used)
        self.gain = gain_update(self.gain, committed, e_used, decay=0.99)
        state.auto_curve = smoothed(state.auto_curve, reported)

    @staticmethod
    def read_idle(state: Any) -> None:
        """Account for one row of a read auto round at budget 0 (no tree, nothing observed): its observed lengths
        stay as they were (decayed now, they would fall back to the surrogate, which undervalues trees: module doc)
        and the round is counted, toward the next probe of a tree (:data:`PROBE_ROUNDS`) and as the age of the
        row's evidence, which the probe's read applies (:meth:`read_row`)."""
        state.auto_idle += 1

    def row_curve(self, state: Any) -> tuple[float, ...]:
        """The row's observed and calibrated curve, ``observed_curve(seen, calibrated(curve, gain, prior))``, kept on
        the state (``auto_cached``) until one of its inputs changes. Why: the choice runs when a round is launched
        and again when the next is checked for overlap, a Python pass over every row of the batch (host time the
        device waits for whenever the overlap is broken), while a row's inputs change only when one of its rounds
        is read. The engine's prior gain is an input only for a row whose own sums
        predict less than one draft token (:func:`calibrated`)."""
        prior = self.gain if state.auto_gain[1] < 1.0 else None
        kept = state.auto_cached
        if (kept is not None and kept.seen is state.auto_seen and kept.surrogate is state.auto_curve
                and kept.gain == state.auto_gain and kept.prior == prior):
            return kept.curve
        curve = observed_curve(state.auto_seen, calibrated(state.auto_curve, state.auto_gain, self.gain))
        state.auto_cached = KeptCurve(state.auto_seen, state.auto_curve, state.auto_gain, prior, curve)
        return curve

    def choose(self, states: Sequence[Any], cost: Callable[[int], float], *,
               explore: bool = True) -> tuple[int, int]:
        """The argmax of :func:`objective` over the round's options (:func:`options`: the fixed rows' floor and the
        candidates above it), ``cost`` made non-decreasing (:func:`rising`), with the hysteresis. Auto rows use
        their observed and calibrated curve (:func:`observed_curve`), those without one the mean of those with one
        (no row has one: :func:`initial_budget`); fixed rows count theirs at their own budget (else their
        acceptance so far), AR rows 1. Exploration: when the auto rows' evidence on the next candidate above the
        best has decayed below :data:`EXPLORE_EVIDENCE` and its objective is within :data:`EXPLORE_SLACK` of the
        best's, that candidate runs instead (with ``explore``): one such round tells the observed lengths of every
        size up to it. Where the best is no tree (budget 0), the probe instead: a tree (:func:`probe_budget`) once the
        auto rows have run :data:`PROBE_ROUNDS` rounds at 0 on average. Returns (the size to run, the best size):
        the hysteresis keeps the best, not an exploration, so an explored size is not favoured next round."""
        auto = [s for s in states if s.tree.auto]
        fixed = [s for s in states if not s.tree.auto]
        floor = max((s.budget for s in fixed), default=0)
        opts = options(self.candidates, floor, zero=ZERO)
        curves = {s.request_id: self.row_curve(s) for s in auto}
        have = [c for c in curves.values() if c]
        if not have:
            first = initial_budget(self.candidates)
            first = first if first in opts else opts[0]
            return first, first
        # the prior only where a row needs it: a mean over every row's curve is a Python pass over the whole batch
        prior = mean_curve(have) if len(have) < len(auto) else ()
        rows = [RowCurve(curves[s.request_id] or prior) for s in auto]
        for s in fixed:
            if s.tree.method == "ar":
                rows.append(RowCurve((), cap=0))
            elif s.auto_curve:
                rows.append(RowCurve(self.row_curve(s), cap=s.budget))
            else:
                rows.append(RowCurve((s.stats.accept_length or 1.0,), cap=s.budget))
        rise, off = rising(cost, opts), self.offset()
        up = (lambda b: max(rise(b) + off, 0.5 * rise(b))) if off else rise  # a curve too dear: at most halved
        values = {b: objective(rows, b, up) for b in opts}  # once: the exploration test reads them too
        best = best_of(values, previous=self.previous, margin=MARGIN)
        if best == 0:  # no tree: probe a tree once the rows have run PROBE_ROUNDS at 0 (module doc)
            trees = [b for b in opts if b > 0]
            if explore and trees and sum(s.auto_idle for s in auto) / len(auto) >= PROBE_ROUNDS:
                return probe_budget(trees, values, self.candidates), best
            return best, best
        above = [b for b in opts if b > best]
        if explore and above:
            nxt = above[0]
            stale = sum(evidence(s.auto_seen, nxt) for s in auto) / len(auto) < EXPLORE_EVIDENCE
            if stale and values[nxt] >= (1.0 - EXPLORE_SLACK) * values[best]:
                return nxt, best
        return best, best


__all__ = ["AUTO", "EXPLORE_EVIDENCE", "EXPLORE_SLACK", "GAIN_DECAY", "MARGIN", "OFFSET", "PRIOR_WEIGHT", "SMOOTHING",
           "PROBE_ROUNDS", "STEPS", "ZERO", "AutoChooser", "KeptCurve", "RowCurve", "best_of", "calibrated", "candidates", "choose_budget",
           "curve_width", "evidence", "gain_update", "initial_budget", "mean_curve", "objective", "observed_curve",
           "observed_update", "options", "probe_budget", "rising", "smoothed"]
